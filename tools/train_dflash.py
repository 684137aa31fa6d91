"""Train a DFlash block drafter for a target adaspec loads.

    python tools/train_dflash.py TARGET OUT [--steps 1500] [--block 8] [--layers 2] [--taps 2]
        [--batch 4] [--seq-len 256] [--anchors 32] [--lr 6e-4] [--gamma 4] [--work DIR] [--seed 0]
        [--data FILE_OR_DIR ...] [--held-out FILE_OR_DIR ...]

The published recipe, small: each training sequence gets random anchor positions, each starting a
block [token at the anchor, mask x (B-1)] whose queries see the context before the anchor (the
target's tapped hidden states, lagging by one) and their own block only. The loss on block
position j (1..B-1) is the KL divergence from the target's own distribution for that token (the
cross-entropy less the target's entropy), weighted exp(-(j-1)/gamma): what is optimised is
agreement with the target. AdamW with a cosine schedule. The target's features are computed on
the fly: for a target this small that is cheaper than reading them back from disk.

Data: without --data, the standard library's .py files outside test folders (what the default
models were trained on); held out, its test files. Resumable: a checkpoint in --work every 100
steps, picked up by the same command. At the end, the drafter serves the held-out code prompts
at k = B - 1 in the engine, greedy, batch 1, and the drafts kept per block position are
written to OUT/training_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from engine.dflash import DFlashConfig, DFlashDrafter, DFlashModel, default_taps, save_dflash  # noqa: E402
from engine.model import Transformer  # noqa: E402


def text_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def default_data() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, as the default models had them."""
    from train_default_models import stdlib_files  # tools/, beside this script

    return stdlib_files()


def token_stream(target: Checkpoint, files: list[Path]) -> torch.Tensor:
    ids: list[int] = []
    eos = min(target.eos_token_ids) if target.eos_token_ids else 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids.extend(target.tokenizer.encode(text).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


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
    )


def block_loss(
    draft: DFlashModel, target: Transformer, tokens: torch.Tensor, anchors: int, gamma: float, rng: torch.Generator
) -> torch.Tensor:
    """The weighted block loss of one batch of sequences [N, T]."""
    config = draft.config
    size, (batch, length) = config.block_size, tokens.shape
    with torch.no_grad():
        target_logits, taps = target.train_layers(tokens, config.target_layer_ids)
        soft = F.softmax(target_logits.float(), dim=-1)  # [N, T, V]: the target's next-token distribution
    features = draft.features([taps[i] for i in config.target_layer_ids])
    positions = torch.arange(length).expand(batch, length)
    context_k, context_v = draft.context(features, positions)
    # Anchors: block i starts at a_i (its first token has no hidden state: context is < a_i).
    starts = torch.stack([torch.randperm(length - size, generator=rng)[:anchors] + 1 for _ in range(batch)])
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
    logits = draft(block, block_positions, context_k, context_v, mask, target).float()  # [N, A*S, V]
    # Position j of a block predicts the token at a + j: the target's distribution at a + j - 1.
    label_at = (block_positions - 1).clamp(min=0)
    labels = soft[torch.arange(batch)[:, None], label_at]  # [N, A*S, V]
    # KL(target || draft): the cross-entropy less the target's own entropy, which no drafter can
    # go below, so that 0 means the drafter matches the target (same gradients).
    kl = (labels * (labels.clamp_min(1e-12).log() - F.log_softmax(logits, dim=-1))).sum(-1)
    per_position = kl.view(batch, anchors, size)[:, :, 1:]
    weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / gamma)
    return (per_position * weights).sum(-1).mean() / weights.sum()


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, int(0.04 * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.inference_mode()
def held_out_acceptance(target: Checkpoint, draft: DFlashModel, prompts: list[str], tokens: int = 96) -> dict:
    """Serve held-out prompts at k = B - 1, greedy, batch 1: drafts kept per block position."""
    from engine.core import Engine
    from engine.request import Request
    from engine.sampling import SamplingParams

    k = draft.config.block_size - 1
    engine = Engine(target, DFlashDrafter(draft, target.model, 1, 2048), 1, 2048, [k], initial_k=k)
    params = SamplingParams(max_tokens=tokens)
    for prompt in prompts:
        ids = target.tokenizer.encode(prompt).ids[-(2048 - tokens - 8) :]
        engine.run_until_done([Request(tuple(ids), params)])
    stats = engine.state.stats
    return {
        "rounds": stats.rounds,
        "kept_per_round": stats.drafts_accepted / max(stats.rounds, 1),
        "kept_at_position": [a / max(p, 1) for a, p in zip(stats.accepted_at, stats.proposed_at)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--taps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--gamma", type=float, default=4.0)
    parser.add_argument("--mask-token", type=int, default=None, help="default: the last id of the vocabulary")
    parser.add_argument("--data", type=Path, nargs="*", default=None)
    parser.add_argument("--held-out", type=Path, nargs="*", default=None)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts served at the end (0: none)")
    parser.add_argument("--work", type=Path, default=None, help="resumable checkpoints (default: OUT/work)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    target = load_checkpoint(args.target, native_forward=False)
    model = target.model
    train_files, held_files = (text_files(args.data), text_files(args.held_out or [])) if args.data else default_data()
    data = token_stream(target, train_files)
    if len(data) < args.seq_len + 1:
        raise SystemExit(f"only {len(data)} training tokens: need at least --seq-len + 1 = {args.seq_len + 1}")
    draft = DFlashModel(draft_config(model, args))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.01)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    resume = work / "state.pt"
    step, losses = 0, []
    if resume.exists():
        state = torch.load(resume, weights_only=False)
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
        print(f"resuming at step {step}", file=sys.stderr)
    rng = random.Random(args.seed * 1000 + step)
    generator = torch.Generator().manual_seed(args.seed * 1000 + step)
    started = time.time()
    draft.train()
    while step < args.steps:
        starts = [rng.randrange(0, len(data) - args.seq_len) for _ in range(args.batch)]
        tokens = torch.stack([data[s : s + args.seq_len] for s in starts])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        loss = block_loss(draft, model, tokens, min(args.anchors, args.seq_len - args.block), args.gamma, generator)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps:
            rate = (time.time() - started) / max(1, len(losses))
            recent = sum(losses[-10:]) / len(losses[-10:])
            print(f"step {step}/{args.steps} loss {recent:.3f} ({rate:.2f} s a step)", file=sys.stderr, flush=True)
        if step % 100 == 0 or step == args.steps:
            torch.save(
                {"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "losses": losses},
                resume,
            )
    draft.eval().requires_grad_(False)
    save_dflash(draft, args.out)
    report: dict = {
        "target": str(args.target),
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "anchors": args.anchors,
        "lr": args.lr,
        "gamma": args.gamma,
        "training_tokens": len(data),
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "wall_seconds_this_run": round(time.time() - started, 1),
    }
    if args.prompts and held_files:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench.prompts import code_prompts

        prompts = code_prompts(args.prompts, seed=args.seed + 1) if not args.held_out else []
        if prompts:
            served = load_checkpoint(args.target)
            report["held_out"] = held_out_acceptance(served, draft.to(served.model.embed_tokens.weight.device), prompts)
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
