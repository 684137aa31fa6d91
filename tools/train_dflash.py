"""Train a DFlash block drafter for a target adaspec loads.

    python tools/train_dflash.py TARGET OUT [--steps 1500] [--block 8] [--layers 2] [--taps 2]
        [--batch 4] [--seq-len 256] [--anchors 32] [--lr 6e-4] [--gamma 4] [--work DIR] [--seed 0]
        [--regenerate N [--prompt-len 96] [--keep-outputs]] [--init DRAFTER] [--draft-vocab N]
        [--short-blocks P] [--save-dtype float32|bfloat16] [--device cpu] [--time-budget SECONDS]
        [--data FILE_OR_DIR ...] [--held-out FILE_OR_DIR ...]

The published recipe, small: each training sequence gets random anchor positions, each starting a
block [token at the anchor, mask x (B-1)] whose queries see the context before the anchor (the
target's tapped hidden states, lagging by one) and their own block only. The loss on block
position j (1..B-1) is weighted exp(-(j-1)/gamma). What is optimised is agreement with the target:
on the data as it is, the KL divergence from the target's own next-token distribution; with
--regenerate N, the data are N windows of --prompt-len training tokens each followed by the
target's own greedy continuation to --seq-len (what the drafter meets when the target serves
greedily; the published recipe regenerates its responses with the target), blocks start in the
continuation and the loss is the cross-entropy of the target's greedy tokens. AdamW with a cosine
schedule. The target's features are computed on the fly each step; with --keep-outputs (and
--regenerate) they are computed once, by the target as served, and kept in --work in bfloat16: for
a 30-layer target that is most of a step saved. --time-budget trains for a fixed time with the
schedule running on the clock; --device cuda trains on a GPU.

Data: without --data, the standard library's .py files outside test folders (what the default
models were trained on); held out, its test files. Resumable: a checkpoint in --work every 100
steps, and the regenerated sequences chunk by chunk, picked up by the same command. --init starts
from a drafter of the same shape (over the whole vocabulary, or --draft-vocab's), or a shallower
one: each layer --layers adds starts as the identity, after the others. --draft-vocab N
gives the drafter a vocabulary of its own, the N ids most frequent in the training sequences (the
target's LM head rows of those ids: a cheaper head; a label outside it counts for nothing).
--short-blocks P trains a share P of the steps on shorter blocks, so that the drafter serves a
draft of k with a block of k + 1 positions rather than a whole one (cheaper at small k). At the
end, the drafter serves --prompts code prompts cut from the held-out files (the standard
library's tests, or those of --held-out) at k = B - 1 in the engine, greedy, batch 1, and the
drafts kept per block position are written to OUT/training_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control.arguments import above_zero, at_least  # noqa: E402
from engine.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from engine.device.resolve import DeviceError  # noqa: E402
from engine.drafters.base import Drafter  # noqa: E402
from engine.drafters.dflash import DFlashDrafter  # noqa: E402
from engine.model.config import (  # noqa: E402
    CheckpointError,
    DFlashConfig,  # noqa: E402
    dflash_problems,
)
from engine.model.dflash import DFlashModel, default_taps, load_dflash, save_dflash  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402


def fits_target(problems: list[str]) -> None:
    """Stop before training a drafter whose options do not fit the target (what the loader checks)."""
    if problems:
        raise SystemExit("the options give a drafter that does not fit the target: " + "; ".join(problems))


def finite(loss: float, step: int) -> float:
    """`loss`, or a stop before a drafter of NaN weights is saved."""
    if not math.isfinite(loss):
        raise SystemExit(
            f"the loss is {loss} at step {step}: nothing is saved past the last checkpoint; try a lower --lr"
        )
    return loss


def resumed(load: Callable[[], None], resume: Path) -> None:
    """Load a checkpoint of --work, or stop with what to do where an earlier run with other
    options left it."""
    try:
        load()
    except (RuntimeError, ValueError, KeyError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [repr(err)]
        first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]  # torch's heading, then the detail
        raise SystemExit(
            f"{resume}: left by a run with other options ({first}); delete {resume.parent} or pass another --work"
        ) from None


def run(main: Callable[[], None]) -> None:
    """`main`, what stops it said in a line instead of a traceback: a checkpoint or device that
    cannot serve, a path that cannot be read or written, an interrupt (the same command resumes)."""
    name = Path(sys.argv[0]).name
    try:
        main()
    except KeyboardInterrupt:
        print(f"{name}: interrupted; the same command resumes from the last checkpoint in --work", file=sys.stderr)
        raise SystemExit(130) from None
    except (CheckpointError, DeviceError, OSError) as err:
        raise SystemExit(f"{name}: {err}") from None


def text_files(paths: list[Path], exclude: tuple[str, ...] = ()) -> list[Path]:
    """The .py files of `paths` (files or folders), leaving out those under a folder named in
    `exclude` (a package's vendored copies of others, say)."""
    files: list[Path] = []
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path}: no such file or folder")
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        files.extend(f for f in found if not exclude or not set(f.relative_to(path).parts[:-1]) & set(exclude))
    return files


def default_data() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, as the default models had them."""
    from tools.corpus import stdlib_files

    return stdlib_files()


def token_stream(target: Checkpoint, files: list[Path], group: int = 256) -> torch.Tensor:
    """Every readable file's tokens followed by EOS, in order; files are encoded `group` at a time
    (the tokenizer spreads a batch over the cores)."""
    ids: list[int] = []
    eos = min(target.eos_token_ids) if target.eos_token_ids else 0
    for first in range(0, len(files), group):
        texts = []
        for path in files[first : first + group]:
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        for encoding in target.tokenizer.encode_batch(texts):
            ids.extend(encoding.ids)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def training_data(
    args: argparse.Namespace, device: str = "cpu", exclude: tuple[str, ...] = ()
) -> tuple[Checkpoint, torch.Tensor, list[Path]]:
    """The target on PyTorch operators (they have a backward) in float32 on `device`, the
    training tokens of --data (or the standard library's; folders named in `exclude` left out),
    and the held-out files."""
    target = load_checkpoint(args.target, device, "float32", native_forward=False)
    if args.data:
        train_files, held_files = text_files(args.data, exclude), text_files(args.held_out or [])
    else:
        train_files, held_files = default_data()
        if args.held_out:  # the standard library's training files, held out files of the user's
            held_files = text_files(args.held_out)
    data = token_stream(target, train_files)
    if len(data) < args.seq_len + 1:
        raise SystemExit(f"only {len(data)} training tokens: need at least --seq-len + 1 = {args.seq_len + 1}")
    return target, data, held_files


def frequent_tokens(tokens: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` ids most frequent in `tokens`, ascending."""
    return torch.bincount(tokens.flatten(), minlength=count).topk(count).indices.sort().values


def picks(args: argparse.Namespace, sequences: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """--batch indices of regenerated sequences, drawn at random (what was kept of them is read
    at the same indices)."""
    return torch.tensor([rng.randrange(len(sequences)) for _ in range(args.batch)])


def training_batch(
    args: argparse.Namespace, data: torch.Tensor, sequences: torch.Tensor | None, rng: random.Random
) -> torch.Tensor:
    """--batch sequences [batch, --seq-len]: regenerated ones drawn at random, or, without them,
    windows of the training tokens."""
    if sequences is not None:
        return sequences[picks(args, sequences, rng)]
    starts = [rng.randrange(0, len(data) - args.seq_len) for _ in range(args.batch)]
    return torch.stack([data[s : s + args.seq_len] for s in starts])


def draft_config(target: Transformer, args: argparse.Namespace) -> DFlashConfig:
    tc = target.config
    heads = max(1, tc.hidden_size // 64)
    return DFlashConfig(
        hidden_size=tc.hidden_size,
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 3) if heads % 3 == 0 else heads,
        head_dim=tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        vocab_size=tc.vocab_size,
        block_size=args.block,
        target_layer_ids=default_taps(tc.num_layers, args.taps),
        mask_token_id=args.mask_token if args.mask_token is not None else tc.vocab_size - 1,
        rms_norm_eps=tc.rms_norm_eps,
        target=args.target.name,
        draft_vocab_size=args.draft_vocab,
        short_blocks=args.short_blocks > 0,
        # It attends at inference as far back as training showed it, never further.
        sliding_window=args.seq_len,
    )


def block_loss(
    draft: DFlashModel,
    target: Transformer,
    tokens: torch.Tensor,
    anchors: int,
    gamma: float,
    rng: torch.Generator,
    first_anchor: int = 1,
    greedy_labels: bool = False,
    size: int | None = None,
    kept_taps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weighted block loss of one batch of sequences [N, T], anchors drawn from
    [first_anchor, T - B], in blocks of `size` positions (default: the drafter's block size).
    With `greedy_labels` the tokens after each anchor are the target's own greedy choices and
    are the labels (cross-entropy); otherwise the labels are the target's next-token
    distributions (KL divergence). `kept_taps`: the target's tapped hidden states side by side
    ([N, T, taps * D], `kept_outputs`), where they were kept (greedy labels only)."""
    config = draft.config
    size, (batch, length) = size or config.block_size, tokens.shape
    if kept_taps is not None:
        assert greedy_labels, "kept taps carry no distributions"
        target_logits, layers = None, kept_taps.float().chunk(len(config.target_layer_ids), dim=-1)
    else:
        with torch.no_grad():
            target_logits, taps = target.train_layers(tokens, config.target_layer_ids, logits=not greedy_labels)
        layers = tuple(taps[i] for i in config.target_layer_ids)
    features = draft.features(list(layers))
    positions = torch.arange(length).expand(batch, length)
    context_k, context_v = draft.context(features, positions)
    # Anchors: block i starts at a_i (its first token has no hidden state: context is < a_i).
    span = length - size - first_anchor + 1
    starts = torch.stack([torch.randperm(span, generator=rng)[:anchors] + first_anchor for _ in range(batch)])
    anchors = starts.shape[1]
    offsets = torch.arange(size)
    block_positions = (starts[:, :, None] + offsets).flatten(1)  # [N, A*S]
    block = torch.full_like(block_positions, config.mask_token_id)
    block[:, ::size] = tokens.gather(1, starts)
    sees_context = torch.arange(length)[None, None, :] < starts[:, :, None]  # [N, A, T]
    which = torch.arange(anchors).repeat_interleave(size)
    sees_block = which[:, None] == which[None, :]  # [A*S, A*S]: own block only
    mask = torch.cat((sees_context.repeat_interleave(size, dim=1), sees_block.expand(batch, -1, -1)), dim=2)[
        :, None
    ]  # [N, 1, A*S, T + A*S]
    logits = draft(block, block_positions, context_k, context_v, mask, target).float()  # [N, A*S, draft vocab]
    log_q = F.log_softmax(logits, dim=-1)
    ids = draft.draft_to_target()
    if greedy_labels:  # position j of a block predicts the token at a + j; one outside the draft vocabulary, nothing
        draft_id = torch.full((config.vocab_size,), -1, dtype=torch.long).index_copy(0, ids, torch.arange(len(ids)))
        labels = draft_id[tokens.gather(1, block_positions)]
        loss = -log_q.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)
    else:  # the target's distribution at a + j - 1 over the draft vocabulary, less its entropy
        assert target_logits is not None
        labels = F.softmax(target_logits.float(), dim=-1)[
            torch.arange(batch)[:, None], (block_positions - 1).clamp(min=0)
        ][..., ids]  # [N, A*S, draft vocab]
        loss = (labels * (labels.clamp_min(1e-12).log() - log_q)).sum(-1)
    per_position = loss.view(batch, anchors, size)[:, :, 1:]
    weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / gamma)
    return (per_position * weights).sum(-1).mean() / weights.sum()


@torch.inference_mode()
def target_continuations(
    target_path: Path,
    data: torch.Tensor,
    count: int,
    prompt_len: int,
    new_tokens: int,
    path: Path,
    seed: int,
    device: str = "cpu",
    chunk: int = 64,
    temperature: float = 0.0,
) -> torch.Tensor:
    """`count` sequences of `prompt_len` training tokens each followed by the target's own
    continuation of `new_tokens`, greedy or sampled at `temperature`: the text a drafter meets
    when the target serves (the published recipe regenerates its responses with the target).
    Decoded `chunk` sequences at a time on `device` and kept in `path` chunk by chunk, so an
    interrupted run picks up where it stopped."""
    done = torch.load(path) if path.exists() else torch.empty(0, prompt_len + new_tokens, dtype=torch.long)
    if done.shape[1] != prompt_len + new_tokens:
        raise SystemExit(
            f"{path}: holds sequences of {done.shape[1]} tokens, not --seq-len {prompt_len + new_tokens}; "
            f"delete it or pass another --work"
        )
    if len(done) >= count:
        return done[:count]
    served = load_checkpoint(target_path, device)  # as served: the compiled forward on a CPU
    model = served.model
    rng = random.Random(seed * 7919 + len(done))
    draws = torch.Generator().manual_seed(seed * 7919 + len(done))
    started, before = time.time(), len(done)
    while len(done) < count:
        rows = min(chunk, count - len(done))
        starts = [rng.randrange(0, len(data) - prompt_len) for _ in range(rows)]
        prompts = torch.stack([data[s : s + prompt_len] for s in starts])
        # To a fixed length: the whole chunk decodes in step, one argmax or draw a step for all of it.
        cache = model.new_cache(rows, prompt_len + new_tokens)
        slots = [cache.allocate() for _ in range(rows)]
        pending, generated = prompts.tolist(), []
        for _ in range(new_tokens):
            logits = model(model.batch(cache, slots, pending), cache, last_only=True).logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits.cpu() / temperature, dim=-1)
                pending = torch.multinomial(probs, 1, generator=draws).tolist()
            else:
                pending = logits.argmax(dim=-1, keepdim=True).tolist()
            generated.append(pending)
        done = torch.cat((done, torch.cat((prompts, torch.tensor(generated).squeeze(-1).T), dim=1)))
        torch.save(done, path)
        rate = (len(done) - before) * new_tokens / max(time.time() - started, 1e-9)
        print(f"regenerated {len(done)}/{count} sequences ({rate:.0f} tokens/s)", file=sys.stderr, flush=True)
    return done


@torch.inference_mode()
def kept_outputs(
    target_path: Path,
    sequences: torch.Tensor,
    taps: tuple[int, ...],
    folder: Path,
    device: str = "cpu",
    ids: torch.Tensor | None = None,
    top: int = 0,
    chunk: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target's outputs for every sequence [N, T], computed once by the target as served (the
    compiled forward on a CPU, a file's weights as stored) and kept: the hidden states at `taps`
    side by side in bfloat16 [N, T, len(taps) * D], and with `top` each position's `top` most
    likely ids among `ids` (indices into `ids`) with their log-probabilities over `ids` (else
    None). A 30-layer target's forward costs several times a drafter's training step; read back,
    it costs nothing. Kept in `folder` a part at a time, so an interrupted run picks up there."""
    folder.mkdir(parents=True, exist_ok=True)
    part_size, parts, served = 64, [], None
    started = time.time()
    for first in range(0, len(sequences), part_size):
        path = folder / f"part-{first // part_size:05d}.pt"
        if path.exists():
            parts.append(torch.load(path))
            continue
        if served is None:
            served = load_checkpoint(target_path, device).model
        pieces: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
        for at in range(first, min(first + part_size, len(sequences)), chunk):
            rows = sequences[at : at + chunk]
            cache = served.new_cache(len(rows), rows.shape[1])
            slots = [cache.allocate() for _ in range(len(rows))]
            out = served(served.batch(cache, slots, rows.tolist()), cache, last_only=not top, capture=taps)
            pieces[0].append(torch.cat([out.hidden[i] for i in taps], dim=-1).to(torch.bfloat16).cpu())
            if top:
                assert ids is not None
                best = F.log_softmax(out.logits.float()[..., ids.to(out.logits.device)], dim=-1).topk(top, dim=-1)
                pieces[1].append(best.indices.to(torch.int32).cpu())
                pieces[2].append(best.values.to(torch.float16).cpu())
        part = tuple(torch.cat(p) if p else None for p in pieces)
        torch.save(part, path)
        parts.append(part)
        done = min(first + part_size, len(sequences))
        rate = done * sequences.shape[1] / max(time.time() - started, 1e-9)
        print(f"target outputs kept for {done}/{len(sequences)} sequences ({rate:.0f} tokens/s)", file=sys.stderr)
    joined = [torch.cat([part[i] for part in parts]) if parts[0][i] is not None else None for i in range(3)]
    return joined[0], joined[1], joined[2]


def add_run_options(parser: argparse.ArgumentParser, trains: str) -> None:
    """The options every training script takes: its data, the held-out prompts served at the
    end, where it resumes from, its seed, device and time budget."""
    parser.add_argument("--data", type=Path, nargs="*", default=None)
    parser.add_argument("--held-out", type=Path, nargs="*", default=None)
    parser.add_argument("--prompts", type=at_least(0), default=8, help="held-out prompts served at the end (0: none)")
    parser.add_argument("--work", type=Path, default=None, help="resumable checkpoints (default: OUT/work)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help=f"where the target and {trains} train (cpu, cuda, npu)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="train for this many seconds, the schedule running on the clock, instead of --steps",
    )


def check_run_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.time_budget < math.inf:  # NaN too
        parser.error(f"--time-budget must be 0 (train --steps) or a number of seconds, not {args.time_budget}")
    if getattr(args, "keep_outputs", 0) and not args.regenerate:
        parser.error("--keep-outputs needs --regenerate (the outputs of a fixed set of sequences are kept)")


class Schedule:
    """Where training stands and where it ends: steps, or seconds with --time-budget (counting
    the seconds of the runs it resumes)."""

    def __init__(self, steps: int, time_budget: float, trained_before: float = 0.0) -> None:
        self.steps, self.time_budget, self.trained_before = steps, time_budget, trained_before
        self.started = time.time()

    def seconds(self) -> float:
        """Seconds trained, this run's and those before it."""
        return self.trained_before + time.time() - self.started

    def at(self, step: int) -> tuple[float, float]:
        return (self.seconds(), self.time_budget) if self.time_budget else (step, self.steps)

    def finished(self, step: int) -> bool:
        now, end = self.at(step)
        return now >= end


def lr_at(step: float, steps: float, peak: float) -> float:
    """Linear warm-up over the first 4% of `steps`, then cosine decay; `step` may be seconds of a time budget."""
    warmup = max(1, int(0.04 * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def served_length(target: Checkpoint) -> int:
    """The longest sequence the held-out prompts are served at: 2048 tokens, or the target's
    positions where it has fewer."""
    return min(2048, target.model.config.max_position_embeddings)


@torch.inference_mode()
def held_out_acceptance(target: Checkpoint, drafter: Drafter, k: int, prompts: list[str], tokens: int = 96) -> dict:
    """Serve held-out prompts at k, greedy, batch 1 (the drafter made for batch 1 and
    `served_length` positions): the drafts kept per round and per draft position."""
    from engine.core import Engine
    from engine.request import Request
    from engine.sampling import SamplingParams

    length = served_length(target)
    engine = Engine(target, drafter, 1, length, [k])
    params = SamplingParams(max_tokens=tokens)
    for prompt in prompts:
        ids = target.tokenizer.encode(prompt).ids[-(length - tokens - 8) :]
        engine.run_until_done([Request(tuple(ids), params)])
    stats = engine.states[k].stats
    return {
        "rounds": stats.rounds,
        "kept_per_round": stats.drafts_accepted / max(stats.rounds, 1),
        "kept_at_position": [a / max(p, 1) for a, p in zip(stats.accepted_at, stats.proposed_at)],
    }


def deepened(start: dict[str, torch.Tensor], draft: DFlashModel) -> dict[str, torch.Tensor]:
    """`start`, a drafter's weights, for `draft`, which may have more layers: each added layer
    comes after the others and starts as the identity (its attention and MLP outputs zeroed), so
    the deeper drafter begins by drafting exactly what `start` drafts."""
    state = draft.state_dict()
    unknown = sorted(set(start) - set(state))
    if unknown:
        raise SystemExit(f"--init has weights this drafter lacks: {unknown[:3]}")
    depth = len({name.split(".")[1] for name in start if name.startswith("layers.")})
    for name, tensor in state.items():
        parts = name.split(".")
        if name in start:
            if start[name].shape != tensor.shape:
                shapes = f"{tuple(start[name].shape)}, expected {tuple(tensor.shape)}"
                raise SystemExit(f"--init's {name} has shape {shapes}")
            tensor.copy_(start[name])
        elif parts[0] != "layers" or int(parts[1]) < depth:
            raise SystemExit(f"--init lacks {name}")
        elif parts[2] in ("o_proj", "down_proj"):
            tensor.zero_()
    return state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--steps", type=at_least(0), default=1500, help="0: save the drafter untrained, as --init gives it"
    )
    parser.add_argument("--block", type=at_least(2), default=8)
    parser.add_argument("--layers", type=at_least(1), default=2)
    parser.add_argument("--taps", type=at_least(1), default=2)
    parser.add_argument("--batch", type=at_least(1), default=4)
    parser.add_argument("--seq-len", type=at_least(2), default=256)
    parser.add_argument("--anchors", type=at_least(1), default=32)
    parser.add_argument("--lr", type=above_zero, default=6e-4)
    parser.add_argument("--gamma", type=above_zero, default=4.0)
    parser.add_argument(
        "--regenerate",
        type=at_least(0),
        default=0,
        help="train on this many sequences of a --prompt-len window followed by the target's greedy continuation "
        "to --seq-len (0: on the data as it is)",
    )
    parser.add_argument("--prompt-len", type=at_least(1), default=96)
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this drafter's weights (the same shape, or fewer layers)"
    )
    parser.add_argument(
        "--save-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the dtype of the saved weights (bfloat16: half the bytes; the loader casts them back)",
    )
    parser.add_argument("--mask-token", type=at_least(0), default=None, help="default: the last id of the vocabulary")
    parser.add_argument(
        "--short-blocks",
        type=float,
        default=0.0,
        help="the share of steps whose blocks are shorter than --block (2 to --block - 1 positions, drawn "
        "evenly); when above 0 the drafter serves a draft of k with a block of k + 1",
    )
    parser.add_argument(
        "--draft-vocab",
        type=at_least(0),
        default=0,
        help="draft only the N ids most frequent in the training sequences (0: the whole vocabulary)",
    )
    add_run_options(parser, "the drafter")
    parser.add_argument(
        "--keep-outputs",
        action="store_true",
        help="with --regenerate: compute the target's tapped hidden states once and keep them in --work",
    )
    args = parser.parse_args(argv)
    check_run_options(parser, args)
    if not 0 <= args.short_blocks <= 1:
        parser.error(f"--short-blocks must be between 0 and 1, not {args.short_blocks}")
    if args.seq_len <= args.block:
        parser.error(f"--seq-len must be above --block ({args.block}), not {args.seq_len}")

    torch.manual_seed(args.seed)
    target, data, held_files = training_data(args, args.device)
    model = target.model
    if args.taps > model.config.num_layers:
        raise SystemExit(f"--taps {args.taps}: the target has {model.config.num_layers} layers to tap")
    config = draft_config(model, args)
    fits_target(dflash_problems(config, model.config))
    draft = DFlashModel(config)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    sequences = None
    if args.regenerate:
        if not 0 < args.prompt_len < args.seq_len - args.block:
            raise SystemExit(f"--prompt-len must be between 1 and --seq-len - --block ({args.seq_len - args.block})")
        sequences = target_continuations(
            args.target,
            data,
            args.regenerate,
            args.prompt_len,
            args.seq_len - args.prompt_len,
            work / "greedy.pt",
            args.seed,
            args.device,
        )
    reduced = draft.config.draft_vocab_size < model.config.vocab_size
    if reduced:
        ids = frequent_tokens(sequences if sequences is not None else data, draft.config.draft_vocab_size)
        draft.d2t.copy_(ids - torch.arange(len(ids)))
    if args.init is not None:
        start = load_dflash(args.init, model).state_dict()
        if reduced:
            start.setdefault("d2t", draft.d2t)  # a drafter over the whole vocabulary keeps its weights
        draft.load_state_dict(deepened(start, draft))
    kept = None
    if args.keep_outputs:
        assert sequences is not None
        taps = "-".join(map(str, config.target_layer_ids))
        folder = work / f"outputs-{len(sequences)}x{args.seq_len}-taps{taps}"
        kept, _, _ = kept_outputs(args.target, sequences, config.target_layer_ids, folder, args.device)
    draft.to(args.device)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.01)
    resume = work / "state.pt"
    step, losses = 0, []
    trained_before = 0.0  # seconds, for --time-budget
    if resume.exists():
        state = torch.load(resume, map_location=args.device, weights_only=False)
        resumed(lambda: (draft.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])), resume)
        step, losses = state["step"], state["losses"]
        trained_before = state.get("seconds", 0.0)
        print(f"resuming at step {step}", file=sys.stderr)
    first_step = step
    rng = random.Random(args.seed * 1000 + step)
    generator = torch.Generator().manual_seed(args.seed * 1000 + step)
    schedule = Schedule(args.steps, args.time_budget, trained_before)
    started = schedule.started
    draft.train()
    finished = schedule.finished(step)
    while not finished:
        if kept is not None:
            assert sequences is not None
            pick = picks(args, sequences, rng)
            tokens, kept_taps = sequences[pick], kept[pick].to(args.device)
        else:
            tokens, kept_taps = training_batch(args, data, sequences, rng), None
        tokens = tokens.to(args.device)
        # With --regenerate, blocks start at the last prompt token or after: their labels are the target's.
        first_anchor = args.prompt_len - 1 if args.regenerate else 1
        for group in optimizer.param_groups:
            group["lr"] = lr_at(*schedule.at(step), args.lr)
        short = args.block > 2 and rng.random() < args.short_blocks
        size = rng.randint(2, args.block - 1) if short else args.block
        loss = block_loss(
            draft,
            model,
            tokens,
            args.anchors,
            args.gamma,
            generator,
            first_anchor,
            args.regenerate > 0,
            size,
            kept_taps,
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        losses.append(finite(loss.item(), step))
        finished = schedule.finished(step)
        if step % 10 == 0 or finished:
            rate = (time.time() - started) / (step - first_step)
            recent = sum(losses[-10:]) / len(losses[-10:])
            total = "" if args.time_budget else f"/{args.steps}"
            print(f"step {step}{total} loss {recent:.3f} ({rate:.2f} s a step)", file=sys.stderr, flush=True)
        if step % 100 == 0 or finished:
            state = {"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "losses": losses}
            torch.save({**state, "seconds": schedule.seconds()}, resume)
    draft.cpu().eval().requires_grad_(False)
    save_dflash(draft, args.out, getattr(torch, args.save_dtype))
    report: dict = {
        "target": str(args.target),
        "steps": step,
        "time_budget": args.time_budget or None,
        "device": args.device,
        "kept_outputs": args.keep_outputs,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "anchors": args.anchors,
        "lr": args.lr,
        "gamma": args.gamma,
        "training_tokens": len(data),
        "regenerated_sequences": args.regenerate,
        "draft_vocab": draft.config.draft_vocab_size,
        "short_blocks": args.short_blocks,
        "prompt_len": args.prompt_len if args.regenerate else None,
        "init": str(args.init) if args.init else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "wall_seconds_this_run": round(time.time() - started, 1),
    }
    if args.prompts and held_files:
        from tools.corpus import code_prompts

        prompts = code_prompts(args.prompts, seed=args.seed + 1, files=held_files)
        if prompts:
            served = load_checkpoint(args.target)
            drafter = DFlashDrafter(draft.to(served.model.device), served.model, 1, served_length(served))
            report["held_out"] = held_out_acceptance(served, drafter, args.block - 1, prompts)
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    run(main)
