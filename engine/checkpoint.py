"""Load and save Hugging Face checkpoint directories, and load GGUF files.

A checkpoint is `config.json`, `model.safetensors` (or shards with `model.safetensors.index.json`),
`tokenizer.json` and optionally `generation_config.json`; or one GGUF file (engine/gguf.py, which
names its tensors as Hugging Face does). Tensor names are Hugging Face's; the runtime fuses q/k/v
and gate/up projections, so names are mapped here in both directions.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor, nn

from engine.device.resolve import resolve_device, resolve_dtype
from engine.gguf import GROUPED, GGUFCheckpoint, Groups, RawTensor, dequantize, is_gguf, unpack_groups
from engine.model.config import CheckpointError, ModelConfig, read_tokenizer, weight_shapes
from engine.model.layers import can_pack_linears, float_weight
from engine.model.quantize import GroupQuantized, int8_groups, quantize_linears, quantizer, uint4_groups
from engine.model.transformer import Transformer
from engine.native.build import available, library
from engine.native.forward import NativeForward
from engine.native.weights import serve_packed

# Our fused parameter -> the Hugging Face tensors concatenated (in order) along dim 0.
_FUSED = {
    "self_attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Buffers some exporters write that carry nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def device(self) -> torch.device:
        return self.model.device


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face tensor names that make up our parameter `name`."""
    match = _LAYER.match(name)
    if match:
        index, rest = match.groups()
        parts = _FUSED.get(rest, (rest,))
        return tuple(f"model.layers.{index}.{p}" for p in parts)
    if name == "lm_head.weight":
        return (name,)
    return (f"model.{name}",)


def to_hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's tensors under Hugging Face's names; a layer kept only as quantized panels
    dequantized from them."""
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if tensor.is_meta:
            tensor = float_weight(model.get_submodule(name.removesuffix(".weight")))
        parts = hf_names(name)
        if len(parts) == 1:
            out[parts[0]] = tensor.contiguous()
            continue
        sizes = _fused_sizes(model.config, name)
        for part, piece in zip(parts, tensor.split(sizes, dim=0)):
            out[part] = piece.contiguous()
    return out


def _fused_sizes(config: ModelConfig, name: str) -> list[int]:
    if "qkv" in name:
        kv = config.num_kv_heads * config.head_dim
        return [config.num_heads * config.head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.exists():
                raise CheckpointError(f"{index}: shard {file.name} is missing")
        return files
    if single.exists():
        return {name: single for name in weight_shapes(single)}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


_INITIALIZERS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_")


@contextmanager
def uninitialized() -> Iterator[None]:
    """Modules built inside get their parameters uninitialized: the checkpoint's weights replace
    them, and running an initializer on the meta device loads torch's meta kernels, about a
    second of every start. As transformers does when it loads a checkpoint."""
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    for name in _INITIALIZERS:
        setattr(nn.init, name, _leave)
    try:
        yield
    finally:
        for name, initializer in saved.items():
            setattr(nn.init, name, initializer)


def _leave(tensor: Tensor, *args: object, **kwargs: object) -> Tensor:
    return tensor


def stored_dtypes(files: dict[str, Path]) -> set[str]:
    """The dtypes the checkpoint's tensors are stored in, as safetensors names them ("BF16", "F32")."""
    found = set()
    for file in set(files.values()):
        with safe_open(file, framework="pt") as handle:
            found.update(handle.get_slice(name).get_dtype() for name in handle.keys())
    return found


def load_checkpoint(
    path: str | Path,
    device: str = "cpu",
    dtype: str | None = None,
    max_positions: int | None = None,
    native_forward: bool = True,
    weights: str = "as_loaded",
) -> Checkpoint:
    """The checkpoint at `path` (a directory or a GGUF file) on `device`, in `dtype` (None: float32
    on a CPU, bfloat16 on an accelerator). "auto" is that too, but for a checkpoint stored in
    bfloat16 on a CPU where the compiled forward serves it: bfloat16, which the kernels widen to
    float32 exactly as they read it, so the logits are float32's bit for bit at half the bytes to
    stream.

    `weights` "int8" or "int4" quantizes the linear layers in groups once loaded
    (engine/model/quantize.py); the model is then float32, the values those groups stand for.

    Where the compiled CPU forward serves the model (`native_forward`, a CPU, a C compiler), its
    quantized weights are kept only as the kernels' panels (`serve_packed`): a GGUF's Q8_0, Q4_0,
    Q4_1, Q4_K and Q6_K matrices go from their blocks straight into them, and engine.weights'
    groups too; no float copy of those weights is held, and a tied embedding is read from the lm
    head's panels. Everywhere else (an accelerator, no compiler, native_forward=False) every
    tensor is dequantized to float32 and served as a float checkpoint is. A GGUF's other types
    (F32, F16, BF16, Q5_K, ...) are dequantized to float32 either way."""
    path = Path(path)
    gguf = GGUFCheckpoint(path) if is_gguf(path) else None
    if gguf is not None:
        config = gguf.config
        raw = dict(gguf.raw_tensors())
        files = {name: path for name in raw}

        def read(name: str) -> Tensor:
            return torch.from_numpy(dequantize(raw[name]))

        stored = gguf.stored_types
    elif path.is_dir():
        config = ModelConfig.from_file(path / "config.json")
        files = _tensor_files(path)
        handles = {file: safe_open(file, framework="pt") for file in set(files.values())}

        def read(name: str) -> Tensor:
            return handles[files[name]].get_tensor(name)

        def stored() -> set[str]:
            return stored_dtypes(files)
    else:
        raise CheckpointError(f"{path}: not a checkpoint directory or GGUF file")
    torch_device = resolve_device(device)
    torch_dtype = torch.float32 if weights != "as_loaded" else resolve_dtype(dtype, torch_device)
    if (
        weights == "as_loaded"
        and dtype == "auto"
        and native_forward
        and available(torch_device, torch.bfloat16)
        and stored() == {"BF16"}
    ):
        torch_dtype = torch.bfloat16
    packed = native_forward and torch_dtype == torch.float32 and available(torch_device, torch_dtype)

    with torch.device("meta"), uninitialized():
        model = Transformer(config, max_positions=max_positions)
    expected = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        expected[name] = param.shape

    wanted = {hf: name for name in expected for hf in hf_names(name)}
    unexpected = sorted(n for n in files if n not in wanted and not _IGNORED.search(n))
    if unexpected:
        raise CheckpointError(
            f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    missing = sorted(n for n in wanted if n not in files)
    if missing:
        raise CheckpointError(
            f"{path}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )

    # A GGUF's grouped matrices, served from their blocks alone: never read as float32.
    grouped = {n for n in expected if packed and gguf is not None and _grouped(n, raw)}
    state: dict[str, Tensor] = {}
    for name, shape in expected.items():
        if name in grouped:
            continue
        pieces = []
        for part, want in _part_shapes(config, name, shape):
            tensor = read(part)
            _check_shape(files[part], part, tensor.shape, want)
            pieces.append(tensor)
        state[name] = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(torch_device, torch_dtype)

    # The loaded tensors become the parameters (nothing is allocated twice, and no operator runs
    # on the meta device, which would load torch's meta kernels: most of a start's second).
    model.load_state_dict(state, strict=False, assign=True)
    del state
    for name in grouped:
        _serve_blocks(model, name, raw, files)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        model.lm_head.quantized = model.embed_tokens.quantized
    model.build_rope()  # not built on the meta device
    served = {name.removesuffix(".weight") for name in grouped}  # their weights stay on meta
    tensors = [*model.named_parameters(), *model.named_buffers()]
    left = [name for name, tensor in tensors if tensor.is_meta and name.removesuffix(".weight") not in served]
    if left:
        raise CheckpointError(f"{path}: no weights for {left[0]!r}")
    model.eval().requires_grad_(False)
    if weights != "as_loaded" and packed:
        _quantize_packed(model, weights)
    elif weights != "as_loaded":
        quantize_linears(model, weights)
    if not (native_forward and use_native(model)) and can_pack_linears(torch_device, torch_dtype):
        model.pack_linears()

    if gguf is not None:
        loaded = Checkpoint(path, config, model, gguf.tokenizer(), gguf.eos_token_ids())
        del gguf, raw, read, stored, grouped  # the reader and the file's mapping, freed before the trim
        _return_freed_memory()
        return loaded
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.exists():
        raise CheckpointError(f"{tokenizer_path}: not found")
    tokenizer = read_tokenizer(tokenizer_path)
    return Checkpoint(path, config, model, tokenizer, _eos_ids(path))


def _return_freed_memory() -> None:
    """Hand back to the system what unpacking a file's blocks freed: glibc's malloc keeps freed
    pages of its heap (and, having freed a large block, serves blocks below that size from the
    heap), so a load's transient copies would stay resident beside the panels, a third again."""
    gc.collect()  # the file's mapping and its reader's cycles
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, or nothing that can
        pass


def _quantize_packed(model: Transformer, kind: str) -> None:
    """engine.weights' groups served by the compiled forward alone (`serve_packed`): no float copy
    of a quantized layer is kept, and a tied embedding is read from the lm head's panels."""
    quantize = quantizer(kind)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not module.weight.is_meta:  # meta: served from a file's blocks
            serve_packed(module, quantize(module.weight), _gate_up(model, name))
    if model.config.tie_word_embeddings:  # the embedding is the lm head's panels too
        model.embed_tokens.weight, model.embed_tokens.quantized = model.lm_head.weight, model.lm_head.quantized


def _gate_up(model: Transformer, name: str) -> int | None:
    """The intermediate size where our layer `name` is the fused gate/up projection."""
    return model.config.intermediate_size if name.removesuffix(".weight").endswith("gate_up") else None


def _grouped(name: str, raw: dict[str, RawTensor]) -> bool:
    """Whether the file stores every tensor of our matrix `name` in groups (GROUPED): a projection
    with one part in another type is dequantized whole."""
    return all(raw[p].type in GROUPED for p in hf_names(name))


def _part_shapes(config: ModelConfig, name: str, shape: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """The file's tensors our tensor `name` of `shape` is made of, each with the shape it must have
    (fused parts stacked along the rows)."""
    parts = hf_names(name)
    sizes = _fused_sizes(config, name) if len(parts) > 1 else [shape[0]]
    return [(part, (rows, *shape[1:])) for part, rows in zip(parts, sizes)]


def _check_shape(file: Path, part: str, shape: Sequence[int], want: tuple[int, ...]) -> None:
    if tuple(shape) != want:
        raise CheckpointError(f"{file}: tensor {part!r} has shape {tuple(shape)}, expected {want}")


def _serve_blocks(model: Transformer, name: str, raw: dict[str, RawTensor], files: dict[str, Path]) -> None:
    """Our matrix `name` served from its parts' blocks: unpacked into groups, stacked row-wise
    where fused, packed into the kernels' panels (`serve_packed`)."""
    groups = []
    for part, want in _part_shapes(model.config, name, model.get_parameter(name).shape):
        _check_shape(files[part], part, raw[part].shape, want)
        groups.append(unpack_groups(raw[part]))
    serve_packed(model.get_submodule(name.removesuffix(".weight")), _stacked(groups), _gate_up(model, name))


def _stacked(groups: list[Groups]) -> GroupQuantized:
    """Groups of fused parts as one weight's: where their formats differ (a Q4_K_M file's q and k
    in Q4_K beside v in Q6_K), in the wider one, int8 in the smallest group, scales repeated and a
    missing min 0: the same values, each still q * scale + min with an exact product."""
    group = min(g.group for g in groups)
    uint4 = all(g.uint4 for g in groups)

    def per_group(t: np.ndarray | None, g: Groups) -> np.ndarray:
        t = np.zeros_like(g.scales) if t is None else t
        return np.repeat(t, g.group // group, axis=1) if g.group != group else t

    values = np.concatenate([g.values if uint4 else g.values.astype(np.int8) for g in groups])
    scales = torch.from_numpy(np.concatenate([per_group(g.scales, g) for g in groups]))
    has_mins = any(g.mins is not None for g in groups)
    mins = torch.from_numpy(np.concatenate([per_group(g.mins, g) for g in groups])) if has_mins else None
    pack = uint4_groups if uint4 else int8_groups
    return pack(torch.from_numpy(values), scales, mins, group)


def _eos_ids(path: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.exists():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
        if ids:
            break
    return frozenset(ids)


def save_checkpoint(
    model: Transformer,
    path: str | Path,
    hf_config: dict,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype = torch.bfloat16,
    generation_config: dict | None = None,
) -> None:
    """Write `model` as a Hugging Face checkpoint directory loadable here and by transformers."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in to_hf_state_dict(model).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(
        json.dumps({**hf_config, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n"
    )
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def use_native(model: Transformer) -> bool:
    """Run every forward of `model` through the compiled CPU kernels where they can serve it:
    float32 or bfloat16 weights on a CPU, with a C compiler. Moving or loading the parameters
    afterwards turns them off again. Returns whether they are on."""
    if model.native is None and available(model.device, model.norm.weight.dtype):
        lib = library()
        assert lib is not None
        model.native = NativeForward(model, lib)
    return model.native is not None
