"""The CPU forward of engine/kernels.c: compiled once per machine and source, called through ctypes.

A float32 model on a CPU runs every forward (prefill, decode, verify, draft) as one call into
the compiled kernels instead of a few hundred PyTorch operators, and so do a DFlash drafter
(`NativeDFlash`) and an EAGLE-3 head (`NativeEagle3`) beside it. The library is built with the
system's C compiler on first use and kept in the cache directory (`$ADASPEC_CACHE_DIR`, else
`$XDG_CACHE_HOME/adaspec`, else `~/.cache/adaspec`), keyed by the source, the compiler and the
CPU. Where no compiler works, or `ADASPEC_NATIVE=0`, models run on the PyTorch operators instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine.config import DFlashConfig, ModelConfig
    from engine.dflash import DFlashModel
    from engine.eagle3 import Eagle3Model
    from engine.kv_cache import KVCache
    from engine.model import Batch, ForwardOutput, Transformer

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
PANEL = 64  # output columns per weight panel, as in kernels.c
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]

_i32 = ctypes.c_int32
_ptr = ctypes.c_void_p


def _int32_lists(*lists: Sequence[int]) -> tuple[ctypes.Array, list[Any]]:
    """The lists packed into one int32 buffer, and a pointer to each list in it; the caller keeps
    the buffer alive while the kernels read it."""
    buffer = (_i32 * sum(len(values) for values in lists))(*itertools.chain.from_iterable(lists))
    address, pointers = ctypes.addressof(buffer), []
    for values in lists:
        pointers.append(ctypes.cast(address, ctypes.POINTER(_i32)))
        address += ctypes.sizeof(_i32) * len(values)
    return buffer, pointers


class Sampling(NamedTuple):
    """How a compiled chain draws its drafts, row by row: 1 / temperature and top_p [rows]
    (float32), a uniform draw per draft [rows, width] (float64), and where each draft's
    probabilities go [rows, width, vocab] (float32, contiguous)."""

    inv_temperature: Tensor
    top_p: Tensor
    uniforms: Tensor
    probs: Tensor


class _Linear(ctypes.Structure):
    _fields_ = [("panels", _ptr), ("bias", _ptr), ("scale", _ptr), ("n", _i32), ("k", _i32), ("format", _i32)]


# How a Linear's panels are stored (kernels.c's enum): bfloat16 and int8 are widened as they are read.
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("qkv", _Linear),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("o_proj", _Linear),
        ("post_norm", _ptr),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i32),
        ("hidden", _i32),
        ("num_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_dim", _i32),
        ("intermediate", _i32),
        ("vocab", _i32),
        ("sliding_window", _i32),
        ("eps", ctypes.c_float),
        ("embed", _ptr),
        ("embed_bf16", _i32),
        ("norm", _ptr),
        ("rope_cos", _ptr),
        ("rope_sin", _ptr),
        ("lm_head", _Linear),
        ("layers", ctypes.POINTER(_Layer)),
    ]


class _Cache(ctypes.Structure):
    _fields_ = [
        ("k", _ptr),
        ("v", _ptr),
        ("k_layer", ctypes.c_int64),
        ("k_slot", ctypes.c_int64),
        ("positions", ctypes.c_int64),
        ("v_layer", ctypes.c_int64),
        ("v_slot", ctypes.c_int64),
    ]


class _Batch(ctypes.Structure):
    _fields_ = [
        ("rows", _i32),
        ("width", _i32),
        ("tokens", _ptr),
        ("slot", ctypes.POINTER(_i32)),
        ("start", ctypes.POINTER(_i32)),
        ("count", ctypes.POINTER(_i32)),
        ("last_only", _i32),
        ("logits", _ptr),
        ("num_captured", _i32),
        ("captured_layers", ctypes.POINTER(_i32)),
        ("captured", ctypes.POINTER(_ptr)),
        ("threads", _i32),
        ("block", _i32),
        ("out_first", _i32),
        ("out_count", _i32),
        ("captured_stride", ctypes.c_int64),
        ("argmax", _ptr),
    ]


class _Context(ctypes.Structure):
    _fields_ = [("fc", _Linear), ("fc_norm", _ptr), ("kv", ctypes.POINTER(_Linear))]


def cache_dir() -> Path:
    if os.environ.get("ADASPEC_CACHE_DIR"):
        return Path(os.environ["ADASPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaspec"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_problem: str | None = None


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (and `problem()` says why) where they cannot be."""
    global _library, _problem
    with _lock:
        if _library is not None or _problem is not None:
            return _library
        if os.environ.get("ADASPEC_NATIVE", "1") == "0":
            _problem = "disabled by ADASPEC_NATIVE=0"
            return None
        try:
            _library = _load(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            _problem = str(err)
            log.warning("the compiled CPU kernels are unavailable (%s); using PyTorch operators", err)
        return _library


def problem() -> str | None:
    """Why `library()` is None, once it has been asked for."""
    return _problem


def _build(source: Path = SOURCE) -> Path:
    """The kernels compiled from `source`, cached by its text, the compiler and the CPU."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"the C compiler {compiler!r} does not run ({err})") from None
    key = hashlib.sha256("\0".join([source.read_text(), version, " ".join(FLAGS), _cpu_signature()]).encode())
    target = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: a concurrent build never sees half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, str(source), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _load(path: Path) -> ctypes.CDLL:
    # torch has loaded its libgomp already: the kernels link to the same one and share its threads.
    lib = ctypes.CDLL(str(path))
    lib.adaspec_forward.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Cache), ctypes.POINTER(_Batch)]
    lib.adaspec_forward.restype = ctypes.c_int
    lib.adaspec_dflash_context.argtypes = [
        ctypes.POINTER(_Model),
        ctypes.POINTER(_Context),
        ctypes.POINTER(_Cache),
        ctypes.c_int,
        _ptr,
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        ctypes.c_int,
    ]
    lib.adaspec_dflash_context.restype = ctypes.c_int
    lib.adaspec_eagle3_step.argtypes = [
        ctypes.POINTER(_Model),
        _ptr,
        ctypes.c_int,
        ctypes.POINTER(_Linear),
        ctypes.POINTER(_Cache),
        ctypes.c_int,
        _ptr,
        _ptr,
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        ctypes.c_int,
        ctypes.POINTER(_i32),
        _ptr,
        _ptr,
        ctypes.c_int,
    ]
    lib.adaspec_eagle3_step.restype = ctypes.c_int
    lib.adaspec_eagle3_chain.argtypes = [
        ctypes.POINTER(_Model),
        _ptr,
        ctypes.c_int,
        ctypes.POINTER(_Cache),
        ctypes.c_int,
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        _ptr,
        _ptr,
        _ptr,
        ctypes.c_int,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        ctypes.c_float,
        ctypes.POINTER(_i32),
        ctypes.c_int,
    ]
    lib.adaspec_eagle3_chain.restype = ctypes.c_int
    lib.adaspec_nucleus.argtypes = [_ptr, ctypes.c_int, ctypes.c_int, ctypes.c_float, _ptr]
    lib.adaspec_nucleus.restype = ctypes.c_int
    # The step's arguments up to `selected`, then the chains' steps, the vocabulary map, the next
    # features and logits, the drafts and their width, the stop and the counts, and the threads.
    lib.adaspec_eagle3_round.argtypes = [
        *lib.adaspec_eagle3_step.argtypes[:12],
        ctypes.POINTER(_i32),
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.POINTER(_i32),
        ctypes.c_int,
    ]
    lib.adaspec_eagle3_round.restype = ctypes.c_int
    lib.adaspec_greedy_chain.argtypes = [
        ctypes.POINTER(_Model),
        ctypes.POINTER(_Cache),
        ctypes.c_int,
        ctypes.c_int,
        _ptr,
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        ctypes.POINTER(_i32),
        _ptr,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.adaspec_greedy_chain.restype = ctypes.c_int
    return lib


def nucleus(probs: Tensor, top_p: float) -> Tensor | None:
    """engine.sampling's top-p filter of float32 rows on a CPU in the kernels (about 7 times
    faster than its tensor operators on an 8192-token row, bench.sampling); None where they are
    not built."""
    lib = library()
    if lib is None:
        return None
    rows = probs.reshape(-1, probs.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    if lib.adaspec_nucleus(rows.data_ptr(), rows.shape[0], rows.shape[1], top_p, out.data_ptr()):
        raise MemoryError("the compiled top-p filter could not allocate its buckets")
    return out.reshape(probs.shape)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and library() is not None


def panels(weight: Tensor) -> Tensor:
    """[n, k] -> [ceil(n / PANEL), k, PANEL]: each panel's PANEL output columns side by side, in
    the weight's dtype (bfloat16 stays bfloat16: the kernels widen it as they read it)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [n, k] as int8 values and a float32 scale per output row, weight ~ values * scale[:, None]:
    each row's largest magnitude becomes 127 (symmetric, so zero stays exactly zero)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def gate_up_panels(weight: Tensor, inter: int, *vectors: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """The fused [gate; up] weight with gate and up rows alternating PANEL / 2 at a time, each half
    zero-padded to a multiple of PANEL / 2, so that each panel yields finished SiLU(gate) * up
    columns (kernels.c `linear_glu`); returns the panels and `vectors` (a bias, int8 scales: one
    value per output) reordered the same way."""
    half = PANEL // 2
    padded = -(-inter // half) * half

    def interleave(t: Tensor) -> Tensor:
        gate, up = torch.zeros(2, padded, *t.shape[1:], dtype=t.dtype)
        gate[:inter], up[:inter] = t[:inter].detach(), t[inter:].detach()
        return torch.stack((gate.view(-1, half, *t.shape[1:]), up.view(-1, half, *t.shape[1:])), 1).flatten(0, 2)

    return panels(interleave(weight)), [interleave(v).float().contiguous() if v is not None else None for v in vectors]


def _padded_tokens(rows: Sequence[Sequence[int]], width: int) -> ctypes.Array:
    """Each row's tokens right-padded with 0 to `width`, as the kernels' int64 [rows, width]."""
    padded = itertools.chain.from_iterable([*t, *[0] * (width - len(t))] for t in rows)
    return (ctypes.c_int64 * (len(rows) * width))(*padded)


class _Weights:
    """Copies of parameters in the layouts the kernels read, kept alive while structures point into them."""

    def __init__(self, linears: torch.dtype) -> None:
        self.linears = linears  # how linear weights are stored (FORMATS)
        self.kept: list[Tensor] = []

    def keep(self, tensor: Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().to(dtype).contiguous()
        self.kept.append(tensor)
        return tensor.data_ptr()

    def _stored(self, weight: Tensor) -> tuple[Tensor, Tensor | None]:
        """The weight's values as stored, and int8's scales."""
        if self.linears == torch.int8:
            return int8_rows(weight)
        return weight.detach().to(self.linears), None

    def linear(self, weight: Tensor, bias: Tensor | None = None) -> _Linear:
        values, scale = self._stored(weight)
        packed = panels(values)
        self.kept.append(packed)
        n, k = weight.shape
        return _Linear(packed.data_ptr(), self.keep(bias), self.keep(scale), n, k, FORMATS[self.linears])

    def gate_up(self, weight: Tensor, bias: Tensor | None, inter: int) -> _Linear:
        values, scale = self._stored(weight)
        packed, (bias, scale) = gate_up_panels(values, inter, bias, scale)
        self.kept.append(packed)
        n, k = packed.shape[0] * PANEL, weight.shape[1]
        return _Linear(packed.data_ptr(), self.keep(bias), self.keep(scale), n, k, FORMATS[self.linears])


class _CacheStructs:
    """The kernels' view of each KV cache a forward runs on, made once per cache."""

    def __init__(self) -> None:
        self._made: weakref.WeakKeyDictionary[KVCache, _Cache] = weakref.WeakKeyDictionary()

    def __call__(self, cache: KVCache) -> _Cache:
        found = self._made.get(cache)
        if found is None:
            k, v = cache.k, cache.v
            if not cache.transposed_keys or k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("the compiled kernels need a float32 KV cache with transposed keys (model.new_cache)")
            found = _Cache(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.shape[-1], v.stride(0), v.stride(1))
            self._made[cache] = found
        return found


def _model(config: ModelConfig | DFlashConfig, sliding_window: int, *pointers: object) -> _Model:
    """The kernels' model: its shape from `config`, then embed, embed_bf16, norm, rope_cos,
    rope_sin, lm_head and layers."""
    return _Model(
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        sliding_window,
        config.rms_norm_eps,
        *pointers,
    )


def _run(
    lib: ctypes.CDLL,
    model: _Model,
    cache: _Cache,
    tokens: tuple[int, int, int],  # rows, width, address of int64 [rows, width]
    rows_meta: tuple[list[int], list[int], list[int]],  # slot, start, count per row
    logits: Tensor,
    hidden: dict[int, Tensor],
    last_only: bool = False,
    block: bool = False,
    outputs: tuple[int, int] = (0, 0),  # first and count of each row's tokens with logits (count 0: all)
    argmax: Tensor | None = None,  # int64, laid out as logits without its last dimension
) -> None:
    rows, width, address = tokens
    slots, starts, counts = rows_meta
    meta, per_row = _int32_lists(slots, starts, counts)
    layers = (_i32 * len(hidden))(*hidden)
    addresses = (_ptr * len(hidden))(*[t.data_ptr() for t in hidden.values()])
    # Every captured tensor is [rows, width, hidden] with its tokens `stride` floats apart: its own
    # tensor, or a view of one that holds the layers side by side (`Captured`).
    strides = {t.stride(1) for t in hidden.values()}
    if len(strides) > 1 or any(t.stride(2) != 1 or t.stride(0) != width * t.stride(1) for t in hidden.values()):
        raise ValueError("captured hidden states must share one layout, [rows, width, hidden] with tokens evenly apart")
    stride = strides.pop() if strides else 0
    call = _Batch(
        rows,
        width,
        address,
        *per_row,
        int(last_only),
        logits.data_ptr(),
        len(hidden),
        layers,
        addresses,
        torch.get_num_threads(),
        int(block),
        *outputs,
        stride,
        argmax.data_ptr() if argmax is not None else None,
    )
    if lib.adaspec_forward(ctypes.byref(model), ctypes.byref(cache), ctypes.byref(call)):
        raise MemoryError("the compiled forward could not allocate its activations")


class NativeForward:
    """`Transformer.forward` for a float32 or bfloat16 model on a CPU, through the compiled kernels.

    Holds panel copies of the model's linear weights (in the model's dtype, or as `linears` says:
    int8 for a drafter, whose precision moves only how many drafts are kept) and the addresses of
    its other parameters (float32 copies of a bfloat16 model's small ones: activations are float32
    either way, and stored weights are widened as they are read): the model drops it when its
    parameters move or are loaded (`Transformer._apply`)."""

    def __init__(self, model: Transformer, lib: ctypes.CDLL, linears: torch.dtype | None = None) -> None:
        config = model.config
        self.lib = lib
        self.config = config
        embed_dtype = model.embed_tokens.weight.dtype
        self.weights = weights = _Weights(linears or embed_dtype)
        layers = (_Layer * config.num_layers)()
        for i, block in enumerate(model.layers):
            attention, mlp = block.self_attn, block.mlp
            layers[i] = _Layer(
                weights.keep(block.input_layernorm.weight),
                weights.linear(attention.qkv.weight, attention.qkv.bias),
                weights.keep(attention.q_norm.weight if attention.q_norm is not None else None),
                weights.keep(attention.k_norm.weight if attention.k_norm is not None else None),
                weights.linear(attention.o_proj.weight, attention.o_proj.bias),
                weights.keep(block.post_attention_layernorm.weight),
                weights.gate_up(mlp.gate_up.weight, mlp.gate_up.bias, config.intermediate_size),
                weights.linear(mlp.down_proj.weight, mlp.down_proj.bias),
            )
        self._layers = layers
        self.model = _model(
            config,
            config.sliding_window or 0,
            weights.keep(model.embed_tokens.weight, embed_dtype),
            int(embed_dtype == torch.bfloat16),
            weights.keep(model.norm.weight),
            weights.keep(model.rope_cos),
            weights.keep(model.rope_sin),
            weights.linear(model.lm_head.weight, model.lm_head.bias),
            layers,
        )
        self._cache = _CacheStructs()

    def __call__(
        self, batch: Batch, cache: KVCache, last_only: bool = False, capture: tuple[int, ...] | list[int] = ()
    ) -> ForwardOutput:
        from engine.model import Captured, ForwardOutput, TokenBatch

        if isinstance(batch, TokenBatch):
            slots, counts = batch.slots, [len(t) for t in batch.new_tokens]
            rows, width = len(slots), max(counts)
            tokens: ctypes.Array | Tensor = _padded_tokens(batch.new_tokens, width)  # held until the call returns
            tokens_address = ctypes.addressof(tokens)
        else:
            slots, counts = batch.slot_list, batch.num_new
            rows, width = batch.tokens.shape
            tokens = batch.tokens.contiguous()
            tokens_address = tokens.data_ptr()
        ragged = any(n != width for n in counts)
        new = torch.zeros if ragged else torch.empty  # padded places stay zero, as the PyTorch path leaves them
        vocab, hidden_size = self.config.vocab_size, self.config.hidden_size
        logits = torch.empty(rows, 1, vocab) if last_only else new(rows, width, vocab)
        argmax = torch.zeros(logits.shape[:-1], dtype=torch.long)  # a padded place's zero logits: 0
        hidden = Captured(new(rows, width, len(set(capture)) * hidden_size), capture) if capture else {}
        starts = [cache.lengths[s] for s in slots]
        _run(
            self.lib,
            self.model,
            self._cache(cache),
            (rows, width, tokens_address),
            (slots, starts, counts),
            logits,
            hidden,
            last_only,
            argmax=argmax,
        )
        for slot, n in zip(slots, counts):
            cache.lengths[slot] += n
        return ForwardOutput(logits=logits, hidden=hidden, argmax=argmax)

    def greedy_chain(
        self, cache: KVCache, slots: list[int], inputs: list[list[int]], drafts: list[int]
    ) -> list[list[int]]:
        """Greedy chains in one call: each row feeds `inputs[r]` (what its cache lacks), then its
        drafts but the last, one forward a step, until it has `drafts[r]` (each >= 1). Each row's
        drafts; the caches then hold all the row fed."""
        rows, width = len(slots), max(len(t) for t in inputs)
        tokens = _padded_tokens(inputs, width)
        starts = [cache.lengths[s] for s in slots]
        meta, per_row = _int32_lists(slots, starts, [len(t) for t in inputs], drafts)
        out = torch.zeros(rows, max(drafts), dtype=torch.long)
        failed = self.lib.adaspec_greedy_chain(
            ctypes.byref(self.model),
            ctypes.byref(self._cache(cache)),
            rows,
            width,
            ctypes.addressof(tokens),
            *per_row,
            out.data_ptr(),
            out.shape[1],
            torch.get_num_threads(),
        )
        if failed == -2:
            raise ValueError("a greedy chain needs every row to feed at least one token and draft at least one")
        if failed:
            raise MemoryError("the compiled greedy chain could not allocate its activations")
        for slot, fed, n in zip(slots, inputs, drafts):
            cache.lengths[slot] += len(fed) + n - 1
        return [row[:n] for row, n in zip(out.tolist(), drafts)]


class NativeDFlash:
    """A DFlash drafter's two calls through the compiled kernels: its context (fused taps to each
    draft layer's keys and values) and its block forward (non-causal within the block), with the
    target's embedding and LM head (the target's own `NativeForward`'s copies)."""

    def __init__(
        self, model: DFlashModel, target_model: Transformer, lib: ctypes.CDLL, positions: int, int8: bool = False
    ) -> None:
        config, target = model.config, target_model.native
        assert target is not None
        self.lib, self.config, self.target = lib, config, target  # the target's copies must outlive ours
        self.weights = weights = _Weights(torch.int8 if int8 else model.fc.weight.dtype)
        layers = (_Layer * config.num_layers)()
        kv = (_Linear * config.num_layers)()
        for i, layer in enumerate(model.layers):
            layers[i] = _Layer(
                weights.keep(layer.input_layernorm.weight),
                weights.linear(torch.cat((layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight))),
                weights.keep(layer.q_norm.weight),
                weights.keep(layer.k_norm.weight),
                weights.linear(layer.o_proj.weight),
                weights.keep(layer.post_attention_layernorm.weight),
                weights.gate_up(
                    torch.cat((layer.gate_proj.weight, layer.up_proj.weight)), None, config.intermediate_size
                ),
                weights.linear(layer.down_proj.weight),
            )
            kv[i] = weights.linear(torch.cat((layer.k_proj.weight, layer.v_proj.weight)))
        self._layers, self._kv = layers, kv
        cos, sin = model.rope(torch.arange(positions, device=model.fc.weight.device))
        # The target's LM head, or its rows of the draft vocabulary packed as our own.
        reduced = config.draft_vocab_size < config.vocab_size
        lm_head = weights.linear(model.head(target_model)) if reduced else target.model.lm_head
        self.model = _model(
            replace(config, vocab_size=config.draft_vocab_size),
            config.sliding_window or 0,
            target.model.embed,
            target.model.embed_bf16,
            weights.keep(model.norm.weight),
            weights.keep(cos[:, 0]),
            weights.keep(sin[:, 0]),
            lm_head,
            layers,
        )
        self.context_struct = _Context(weights.linear(model.fc.weight), weights.keep(model.hidden_norm.weight), kv)
        self._cache = _CacheStructs()

    def extend(self, cache: KVCache, slots: list[int], positions: list[int], taps: Tensor) -> None:
        """Token t of `taps` ([tokens, taps * hidden], float32) becomes context of `slots[t]` at `positions[t]`."""
        tokens = len(slots)
        taps = taps.contiguous()
        meta, per_token = _int32_lists(slots, positions)
        failed = self.lib.adaspec_dflash_context(
            ctypes.byref(self.model),
            ctypes.byref(self.context_struct),
            ctypes.byref(self._cache(cache)),
            tokens,
            taps.data_ptr(),
            *per_token,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled DFlash context could not allocate its activations")

    def block(self, cache: KVCache, slots: list[int], block: Tensor, drafts: int) -> Tensor:
        """Logits [rows, drafts, vocab] of block positions 1..drafts; block: int64 [rows, block size],
        placed after each slot's context (its keys and values are written past it and left unread)."""
        rows, size = block.shape
        block = block.contiguous()
        logits = torch.empty(rows, drafts, self.config.draft_vocab_size)
        meta = (slots, [cache.lengths[s] for s in slots], [size] * rows)
        _run(
            self.lib,
            self.model,
            self._cache(cache),
            (rows, size, block.data_ptr()),
            meta,
            logits,
            {},
            block=True,
            outputs=(1, drafts),
        )
        return logits


class NativeEagle3:
    """An EAGLE-3 head's step through the compiled kernels: its linear weights packed as the
    target's are, the target's embedding shared."""

    def __init__(
        self, model: Eagle3Model, target: NativeForward, lib: ctypes.CDLL, positions: int, int8: bool = False
    ) -> None:
        config, layer = model.config, model.midlayer
        attention, mlp = layer.self_attn, layer.mlp
        self.lib, self.target = lib, target  # the target's embedding must outlive our pointer to it
        # Its linear weights in int8 or bfloat16 whatever the target's: fewer bytes a step streams;
        # the drafts' precision moves only how many are kept, never the output.
        self.weights = weights = _Weights(torch.int8 if int8 else torch.bfloat16)
        qkv = torch.cat((attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight))
        self._layer = (_Layer * 1)(
            _Layer(
                weights.keep(layer.input_layernorm.weight),
                weights.linear(qkv),
                None,
                None,
                weights.linear(attention.o_proj.weight),
                weights.keep(layer.post_attention_layernorm.weight),
                weights.gate_up(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), None, config.intermediate_size),
                weights.linear(mlp.down_proj.weight),
            )
        )
        self.hidden_norm = weights.keep(layer.hidden_norm.weight)
        self.norm_before_residual = config.norm_before_residual
        self.fc = weights.linear(model.fc.weight)
        cos, sin = model.rope(torch.arange(positions, device=model.fc.weight.device))
        self.model = _Model(
            1,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.draft_vocab_size,
            config.sliding_window or 0,
            config.rms_norm_eps,
            target.model.embed,
            target.model.embed_bf16,
            weights.keep(model.norm.weight),
            weights.keep(cos[:, 0]),
            weights.keep(sin[:, 0]),
            weights.linear(model.lm_head.weight),
            self._layer,
        )
        self.hidden_size, self.draft_vocab = config.hidden_size, config.draft_vocab_size
        self._cache = _CacheStructs()

    def step(
        self,
        cache: KVCache,
        tokens: list[int],
        features: Tensor,
        slots: list[int],
        positions: list[int],
        selected: list[int],
        taps: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Token t (reading tokens[t] beside features[t], float32 [tokens, hidden]; with `taps`,
        the target's tapped hidden states side by side, which fc fuses) becomes an entry of
        slots[t] at positions[t]; the `selected` tokens finish the layer: their output features
        [outputs, hidden] and draft-vocabulary logits [outputs, draft vocab]."""
        count, outputs = len(tokens), len(selected)
        features = features.float().contiguous()
        ids = (ctypes.c_int64 * count)(*tokens)
        meta, (slot, position, chosen) = _int32_lists(slots, positions, selected)
        out = torch.empty(outputs, self.hidden_size)
        logits = torch.empty(outputs, self.draft_vocab)
        failed = self.lib.adaspec_eagle3_step(
            ctypes.byref(self.model),
            self.hidden_norm,
            int(self.norm_before_residual),
            ctypes.byref(self.fc) if taps else None,
            ctypes.byref(self._cache(cache)),
            count,
            ctypes.addressof(ids),
            features.data_ptr(),
            slot,
            position,
            outputs,
            chosen,
            out.data_ptr(),
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled EAGLE-3 step could not allocate its activations")
        return out, logits

    def chain(
        self,
        cache: KVCache,
        slots: list[int],
        starts: list[int],
        steps: list[int],
        first: list[int],
        features: Tensor,
        draft_ids: Tensor,
        sampling: Sampling | None = None,
        stop_below: float = 0.0,
        first_kept: Sequence[bool] | None = None,
    ) -> list[list[int]]:
        """Chains in one call: row r drafts `steps[r]` tokens after its first draft `first[r]`,
        from its last verified output feature (`features` [rows, hidden]), its entries written at
        starts[r] onwards, each draft id mapped to a target id by `draft_ids` (int64). Greedy, or
        drawn as `sampling` says (its probs filled in past each row's first draft). A greedy row
        stops at a draft of probability below `stop_below`, without it; a row whose `first_kept`
        is False drafts nothing. Each row's drafts, its first included."""
        rows, width = len(slots), max(steps) + 1
        tokens = torch.zeros(rows, width, dtype=torch.long)
        tokens[:, 0] = torch.tensor(first)
        features = features.float().contiguous().clone()  # the kernel overwrites it step by step
        kept = [1] * rows if first_kept is None else [int(k) for k in first_kept]
        meta, (*per_row, drafted) = _int32_lists(slots, starts, steps, kept)
        drawn = (0, 0, 0, 0)
        if sampling is not None:
            assert sampling.uniforms.shape == (rows, width) and sampling.probs.shape[:2] == (rows, width)
            parts = (sampling.inv_temperature, sampling.top_p, sampling.uniforms, sampling.probs)
            drawn = tuple(part.data_ptr() for part in parts)
        failed = self.lib.adaspec_eagle3_chain(
            ctypes.byref(self.model),
            self.hidden_norm,
            int(self.norm_before_residual),
            ctypes.byref(self._cache(cache)),
            rows,
            *per_row,
            draft_ids.contiguous().data_ptr(),
            features.data_ptr(),
            tokens.data_ptr(),
            width,
            *drawn,
            stop_below,
            drafted,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled EAGLE-3 chain could not allocate its activations")
        return [row[: drafted[r]] for r, row in enumerate(tokens.tolist())]

    def round(
        self,
        cache: KVCache,
        tokens: list[int],
        taps: Tensor,
        slots: list[int],
        positions: list[int],
        selected: list[int],
        steps: list[int],
        draft_ids: Tensor,
        next_features: Tensor,
        next_logits: Tensor,
        stop_below: float = 0.0,
    ) -> list[list[int]]:
        """A round's greedy drafting in one call: the draft-extend (`step` with taps), whose
        selected outputs become their slots' rows of `next_features` and `next_logits` (float32,
        by slot), then each selected row's chain as `chain` drafts it, `steps[r]` steps after the
        first draft, stopping where `chain` stops. Each row's drafts, its first included."""
        count, rows, width = len(tokens), len(selected), max(steps) + 1
        taps = taps.float().contiguous()
        ids = (ctypes.c_int64 * count)(*tokens)
        meta, (slot, position, chosen, chain_steps, drafted) = _int32_lists(
            slots, positions, selected, steps, [0] * rows
        )
        drafts = torch.zeros(rows, width, dtype=torch.long)
        failed = self.lib.adaspec_eagle3_round(
            ctypes.byref(self.model),
            self.hidden_norm,
            int(self.norm_before_residual),
            ctypes.byref(self.fc),
            ctypes.byref(self._cache(cache)),
            count,
            ctypes.addressof(ids),
            taps.data_ptr(),
            slot,
            position,
            rows,
            chosen,
            chain_steps,
            draft_ids.contiguous().data_ptr(),
            next_features.data_ptr(),
            next_logits.data_ptr(),
            drafts.data_ptr(),
            width,
            stop_below,
            drafted,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the compiled EAGLE-3 round could not allocate its activations")
        return [row[: drafted[r]] for r, row in enumerate(drafts.tolist())]
