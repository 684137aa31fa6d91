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
        return _counted(name, "CUDA", torch.cuda.device_count())
    if kind == "npu":
        try:
            import torch_npu
        except ImportError as err:
            raise DeviceError(
                f"device {name!r} needs torch_npu ({err}); install adaspec[npu] on an Ascend host"
            ) from None
        if not torch_npu.npu.is_available():
            raise DeviceError(f"device {name!r} requested but torch_npu finds no usable NPU here")
        return _counted(name, "NPU", torch_npu.npu.device_count())
    raise DeviceError(f"unknown device {name!r}: expected cpu, cuda or npu")


def _counted(name: str, kind: str, count: int) -> torch.device:
    """`name` as a device, its index checked against the devices of its kind that this host has,
    so that a wrong index fails here rather than as a driver error while the weights load."""
    _, _, index = name.partition(":")
    if index and (not index.isdigit() or int(index) >= count):
        raise DeviceError(f"device {name!r} requested but this host has {count} {kind} device(s), numbered from 0")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU by default, bfloat16 on accelerators."""
    if name is None or name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    key = _DTYPE_ALIASES.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(_DTYPES)} or auto")
    return _DTYPES[key]
