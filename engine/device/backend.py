"""The device backend seam: what the engine may do on cpu, cuda and Ascend npu.

One `Backend` per engine answers the questions that differ by device: the default dtype, whether
torch.compile may be used (never on NPU: torch_npu's graph capture and Inductor do not mix, which
is why SGLang turns compile off there), how to wait for the device, how much memory is in use, and
how to capture a forward into a graph and replay it. The graph runner (engine/device/graphs.py) only
talks to this seam, so the same capture code serves CUDA graphs and torch_npu's NPUGraph.

Device names are resolved by engine/device/resolve.py alone; torch_npu is imported only for "npu".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from engine.device.resolve import DeviceError, resolve_device, resolve_dtype

T = TypeVar("T")


class Graph(Protocol):
    """A captured sequence of kernels: `replay()` runs it again on the same memory."""

    def replay(self) -> None: ...


class Backend:
    """What an engine may do on its device. The base is eager-only: no graphs, nothing to wait
    for, no device memory to account (reported as 0)."""

    name = "cpu"
    allows_compile = True
    supports_graphs = False
    measures_memory = False  # whether memory_reserved's figures are measured (its 0 here is not)
    # Why prompts are not prefilled through piecewise graphs here (engine/device/prefill.py);
    # None where they are.
    prefill_graphs_off: str | None = "no graphs on this device"
    # Whether sampled drafts and verifications are drawn a batch at a time with device operators
    # (engine/sampling.py `RowSampling`), as a device wants: no read back per token. On a CPU the
    # compiled kernels draw a row at a time, faster than operators over a whole batch.
    samples_on_device = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.default_dtype = resolve_dtype(None, device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device}, graphs={self.supports_graphs}, compile={self.allows_compile})"

    def synchronize(self) -> None:
        pass

    def memory_allocated(self) -> int:
        """Bytes held by live tensors on the device."""
        return 0

    def memory_reserved(self) -> int:
        """Bytes the allocator holds from the device, graph pools included."""
        return 0

    def empty_cache(self) -> None:
        pass

    def graph_pool(self) -> Any:
        return None

    def capture(self, fn: Callable[[], T]) -> tuple[Graph, T]:
        """Capture `fn` (which reads and writes only tensors that outlive it) into a graph; returns
        the graph and `fn`'s outputs, which every replay overwrites in place."""
        raise NotImplementedError(f"the {self.name} backend has no graphs: run eagerly")

    def maybe_compile(self, fn: T, **options: Any) -> T:
        """`torch.compile(fn)` where this backend allows it, else `fn` unchanged: the one place the
        compile policy is decided, for any code that wants compilation."""
        return torch.compile(fn, **options) if self.allows_compile else fn


class CpuBackend(Backend):
    """The CPU: eager, compile allowed; memory accounting reports 0 (host memory is not tracked)."""

    prefill_graphs_off = "on a CPU the compiled forward serves prefill, with no launches to save"


class _GraphBackend(Backend):
    """An accelerator whose torch module mirrors torch.cuda: streams, memory stats, graphs."""

    supports_graphs = True
    measures_memory = True
    prefill_graphs_off = None
    samples_on_device = True
    warmup_runs = 2  # eager runs before each capture, so lazy initialisation never happens inside one

    def __init__(self, device: torch.device, module: Any, graph_class: Any, graph_context: Any) -> None:
        super().__init__(device)
        self._module = module
        self._graph_class = graph_class
        self._graph_context = graph_context
        self._pool: Any = None
        self._stream: Any = None

    def synchronize(self) -> None:
        self._module.synchronize(self.device)

    def memory_allocated(self) -> int:
        return int(self._module.memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(self._module.memory_reserved(self.device))

    def empty_cache(self) -> None:
        self._module.empty_cache()

    def graph_pool(self) -> Any:
        # One pool for every graph of this engine (all states, batch sizes, target and draft): they
        # replay one at a time on one stream, so their intermediates may share blocks, while their
        # static inputs and outputs stay alive and are never handed to another capture.
        if self._pool is None:
            self._pool = self._module.graph_pool_handle()
        return self._pool

    def capture(self, fn: Callable[[], T]) -> tuple[Graph, T]:
        with self._module.device(self.device):
            if self._stream is None:
                # Captures sharing a pool must also share the capture stream (PyTorch's graph docs).
                self._stream = self._module.Stream(self.device)
            stream = self._stream
            # Warm up on the capture stream, as the CUDA graphs docs ask: cuBLAS handles, kernel
            # selection and allocator growth happen here, not inside the capture.
            stream.wait_stream(self._module.current_stream(self.device))
            with self._module.stream(stream):
                for _ in range(self.warmup_runs):
                    fn()
            self._module.current_stream(self.device).wait_stream(stream)
            graph = self._graph_class()
            with self._graph_context(graph, pool=self.graph_pool(), stream=stream):
                outputs = fn()
        return graph, outputs


class CudaBackend(_GraphBackend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, torch.cuda, torch.cuda.CUDAGraph, torch.cuda.graph)
        # cuDNN's attention builds a plan for every new shape, and eager attention changes shape
        # all the time here (each prompt's length, a key length that grows every round): host
        # milliseconds per new shape on an H100 and an H200 (docs/benchmarks.md, "On a GPU").
        # Flash and memory-efficient attention need no plan.
        torch.backends.cuda.enable_cudnn_sdp(False)


class NpuBackend(_GraphBackend):
    """Ascend through torch_npu: NPUGraph capture where this torch_npu has it, torch.compile never."""

    name = "npu"
    allows_compile = False
    # As in the seed PR (26403): piecewise prefill graphs come from splitting a torch.compile'd
    # forward in SGLang, and nothing here is compiled on an NPU; no NPU has checked them here either.
    prefill_graphs_off = "on Ascend prefill stays eager, as the seed PR 26403 keeps it (no torch.compile there)"

    def __init__(self, device: torch.device) -> None:
        import torch_npu  # resolve_device has already checked it imports

        npu = torch_npu.npu
        graph_class, graph_context = getattr(npu, "NPUGraph", None), getattr(npu, "graph", None)
        super().__init__(device, npu, graph_class, graph_context)
        # Older torch_npu releases have no NPUGraph: those run eagerly rather than fail to start.
        self.supports_graphs = graph_class is not None and graph_context is not None


def backend_for(device: torch.device | str) -> Backend:
    """The backend of `device`: unavailable devices (no CUDA, no torch_npu) raise DeviceError."""
    device = resolve_device(str(device))
    if device.type == "cpu":
        return CpuBackend(device)
    if device.type == "cuda":
        return CudaBackend(device)
    if device.type == "npu":
        return NpuBackend(device)
    raise DeviceError(f"no backend for device {device}")
