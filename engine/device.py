"""Device and dtype selection: cpu, cuda, or Ascend npu (torch_npu is imported only when asked for)."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class DeviceError(RuntimeError):
    """The requested device is not usable here."""


def resolve_device(name: str) -> torch.device:
    kind = name.split(":")[0]
    if kind == "cpu":
        return torch.device(name)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} requested but CUDA is not available")
        return torch.device(name)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as err:
            raise DeviceError(
                f"device {name!r} needs torch_npu ({err}); install adaspec[npu] on an Ascend host"
            ) from None
        return torch.device(name)
    raise DeviceError(f"unknown device {name!r}: expected cpu, cuda or npu")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU by default, bfloat16 on accelerators."""
    if name is None or name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    key = _DTYPE_ALIASES.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(_DTYPES)} or auto")
    return _DTYPES[key]
