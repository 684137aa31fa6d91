"""The compiled CPU forward: engine/native/kernels.c, called through ctypes.

A float32 or bfloat16 model on a CPU runs every forward (prefill, decode, verify, draft) as one
call into the compiled kernels instead of a few hundred PyTorch operators, and so do a DFlash
drafter and an EAGLE-3 head beside it.

- `build.py`: compiling the kernels once per machine and source, and loading them;
- `kernels.h` and `abi.py`: the C interface, declared once and read by both sides;
- `weights.py`: parameters packed as the kernels read them, and the forward call;
- `forward.py`: the target's forward (`NativeForward`) and the top-p filter;
- `eagle3.py`, `dflash.py`: each feature drafter's calls.
"""
