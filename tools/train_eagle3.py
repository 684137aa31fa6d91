"""Train an EAGLE-3 head for a target adaspec loads.

    python tools/train_eagle3.py TARGET OUT [--steps 2000] [--unroll 7] [--decay 0.8] [--batch 8]
        [--seq-len 256] [--chains 48] [--lr 6e-4] [--greedy-weight 0] [--taps L1 L2 L3] [--draft-vocab N]
        [--work DIR] [--seed 0] [--device cpu] [--time-budget SECONDS] [--intermediate-size N]
        [--regenerate N [--prompt-len 96] [--regenerate-chunk 64] [--sampled-share 0 [--sample-temperature 0.8]]
         [--keep-outputs N]]
        [--init HEAD]
        [--data FILE_OR_DIR ... [--exclude FOLDER_NAME ...]] [--held-out FILE_OR_DIR ...]

The published recipe, small. The head reads the target's outputs at three layers (by default
SGLang's: the inputs of layers 2, L/2 and L-3). Training-time test: from random chain starts p in
each sequence the head is unrolled --unroll steps as it drafts at inference, step j reading the
embedding of the true token p + j + 1 beside its own output feature of step j - 1 and attending to
the target-fed entries up to p and to its own chain; step j's loss is the KL divergence from the
target's next-token distribution at p + j + 1 (soft targets; with --greedy-weight W, (1 - W)
times that plus W times the cross-entropy of its most likely token), weighted decay^j. AdamW, cosine
schedule. The target's features are computed on the fly each step; with --keep-outputs N (and
--regenerate) they are computed once, by the target as served, and kept in --work: the taps in
bfloat16 and each position's N most likely draft ids with their log-probabilities (the KL is then
taken over those N, renormalized). For a 30-layer target that is most of a step saved.
With --regenerate N the data are N windows of --prompt-len training tokens each followed by the
target's own greedy continuation to --seq-len (what the head meets when the target serves
greedily), and chains start in the continuation; with
--sampled-share S a share S of them are continued by sampling at --sample-temperature instead (what
it meets when requests sample: a head trained on greedy text alone keeps fewer drafts there). With --draft-vocab N
the head drafts only the N tokens most frequent in the training data (a smaller LM head, so a
cheaper step; d2t and t2d map them, as the published heads do), and the target's distribution is
renormalized over them; --init from a head over the whole vocabulary keeps its rows for them, and
from a head with a narrower MLP (--intermediate-size) starts as that head. --device cuda trains on
a GPU (there a --regenerate-chunk of thousands decodes the continuations quickly), and
--time-budget trains for a fixed time with the schedule running on the clock.

Data, resumption and the final report are those of tools/train_dflash.py: the standard library's
.py files by default (its test files held out), a checkpoint in --work every 100 steps, and at the
end the head serves --prompts code prompts cut from the held-out files (or those of --held-out)
at k = --unroll, greedy, batch 1, and the drafts kept per chain position go to
OUT/training_report.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_dflash import (  # noqa: E402  (tools/, beside this script)
    Schedule,
    add_run_options,
    check_run_options,
    finite,
    fits_target,
    frequent_tokens,
    held_out_acceptance,
    kept_outputs,
    lr_at,
    picks,
    resumed,
    run,
    served_length,
    target_continuations,
    training_batch,
    training_data,
)

from control.arguments import above_zero, at_least  # noqa: E402
from engine.checkpoint import load_checkpoint  # noqa: E402
from engine.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from engine.model.config import Eagle3Config, RopeConfig, eagle3_problems, eagle3_taps  # noqa: E402
from engine.model.eagle3 import Eagle3Model, load_eagle3, save_eagle3  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402


def head_config(target: Transformer, args: argparse.Namespace) -> Eagle3Config:
    tc = target.config
    config = Eagle3Config(
        hidden_size=tc.hidden_size,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        intermediate_size=args.intermediate_size or tc.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=args.draft_vocab or tc.vocab_size,
        target_hidden_size=tc.hidden_size,
        target_layer_ids=None,
        rms_norm_eps=tc.rms_norm_eps,
        rope=RopeConfig(theta=tc.rope.theta),
        target=args.target.name,
        # It attends at inference as far back as training showed it, never further.
        sliding_window=args.seq_len,
    )
    taps = tuple(args.taps) if args.taps else eagle3_taps(config, tc)
    return Eagle3Config(**{**config.__dict__, "target_layer_ids": taps})


def chain_attention(
    q: Tensor, keys: Tensor, values: Tensor, starts: Tensor, own: list[tuple[Tensor, Tensor]]
) -> Tensor:
    """Attention of chain queries q [N, S, heads, D] (chain s starts at position starts[n, s]) to
    the target-fed entries up to their start (keys, values [N, P, kv_heads, D]) and to the chain's
    own entries so far (`own`: keys and values [N, S, kv_heads, D] per step). [N, S, heads, D]."""
    heads, kv_heads = q.shape[2], keys.shape[2]
    repeat, scale = heads // kv_heads, q.shape[-1] ** -0.5
    context_k = keys.repeat_interleave(repeat, dim=2)
    context_v = values.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("nshd,nphd->nhsp", q, context_k) * scale
    visible = torch.arange(keys.shape[1], device=keys.device)[None, None, :] <= starts[:, :, None]  # [N, S, P]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if not own:
        return torch.einsum("nhsp,nphd->nshd", torch.softmax(scores, dim=-1), context_v)
    own_k = torch.stack([k for k, _ in own], dim=2).repeat_interleave(repeat, dim=3)  # [N, S, j, heads, D]
    own_v = torch.stack([v for _, v in own], dim=2).repeat_interleave(repeat, dim=3)
    own_scores = torch.einsum("nshd,nsjhd->nhsj", q, own_k) * scale
    weights = torch.softmax(torch.cat((scores, own_scores), dim=-1), dim=-1)
    out = torch.einsum("nhsp,nphd->nshd", weights[..., : keys.shape[1]], context_v)
    return out + torch.einsum("nhsj,nsjhd->nshd", weights[..., keys.shape[1] :], own_v)


def widen_mlp(state: dict[str, Tensor], head: Eagle3Model) -> dict[str, Tensor]:
    """`state` (an --init head's weights) with its MLP widened to `head`'s: the new units' down
    projections start at zero, so the wider head starts as the narrower one and learns from there."""
    prefix = "midlayer.mlp."
    width = head.config.intermediate_size
    old = state[prefix + "gate_proj.weight"].shape[0]
    if old == width:
        return state
    if old > width:
        raise SystemExit(
            f"--init has an MLP of {old} units: it can be widened to --intermediate-size, not cut to {width}"
        )
    fresh = head.state_dict()
    state = dict(state)
    for name in ("gate_proj", "up_proj"):
        key = prefix + name + ".weight"
        state[key] = torch.cat((state[key], fresh[key][old:].to(state[key])))
    key = prefix + "down_proj.weight"
    state[key] = torch.cat((state[key], state[key].new_zeros(state[key].shape[0], width - old)), dim=1)
    return state


def target_outputs(head: Eagle3Model, target: Transformer, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """What the head learns from, for sequences [N, T]: the target's hidden states at the head's
    taps side by side [N, T, 3D] and its next-token log-probabilities over the draft vocabulary."""
    with torch.no_grad():
        logits, taps = target.train_layers(tokens, head.taps)
        assert logits is not None
        log_p = F.log_softmax(logits.float()[..., head.draft_to_target()], dim=-1)
    return torch.cat([taps[i] for i in head.taps], dim=-1).float(), log_p


def dense_log_p(best_ids: Tensor, best_log_p: Tensor, vocab: int) -> Tensor:
    """Kept top ids and log-probabilities [..., top] as log-probabilities over the whole draft
    vocabulary [..., vocab], renormalized over the kept ids; the others get a floor whose
    probability is 0 in float32 (finite, so that 0 times its log stays 0)."""
    kept = best_log_p.float()
    kept = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
    dense = torch.full((*kept.shape[:-1], vocab), -1e4, dtype=torch.float32, device=kept.device)
    return dense.scatter_(-1, best_ids.long(), kept)


def ttt_loss(
    head: Eagle3Model,
    target: Transformer,
    tokens: Tensor,
    taps: Tensor,
    log_p: Tensor,
    chains: int,
    unroll: int,
    decay: float,
    rng: torch.Generator,
    first_chain: int = 0,
    greedy_weight: float = 0.0,
) -> tuple[Tensor, list[float]]:
    """The training-time-test loss of one batch of sequences [N, T] and each step's own loss,
    given the target's taps and log-probabilities for them (`target_outputs`):
    `chains` chain starts per sequence drawn from [first_chain, T - 1 - unroll]. Each step's loss
    is the KL divergence from the target's distribution, or with `greedy_weight` w, (1 - w) times
    that plus w times the cross-entropy of the target's most likely token alone (all that greedy
    verification keeps; a sampled request's rejection rule wants the whole distribution)."""
    batch, length = tokens.shape
    device = tokens.device
    with torch.no_grad():
        embeds = target.embed_tokens(tokens).float()
    features = head.features(taps.float())
    entries = length - 1  # position p reads token p + 1
    _, keys, values = head.qkv(embeds[:, 1:], features[:, :entries], torch.arange(entries, device=device))
    span = length - unroll - first_chain
    starts = torch.stack([torch.randperm(span, generator=rng)[:chains] + first_chain for _ in range(batch)])
    starts = starts.to(device)
    rows = torch.arange(batch, device=device)[:, None]
    feature = features[rows, starts]  # [N, S, H]
    own: list[tuple[Tensor, Tensor]] = []
    total, steps = torch.zeros((), device=device), []
    for j in range(unroll):
        q, k, v = head.qkv(embeds[rows, starts + j + 1], feature, starts + j)
        if j > 0:  # step 0's entry is the target-fed one at the start, already among the keys
            own.append((k, v))
        attended = chain_attention(q, keys, values, starts, own)
        feature = head.finish(attended, feature)
        log_q = F.log_softmax(head.draft_logits(feature).float(), dim=-1)
        label = log_p[rows, starts + j + 1]
        loss = (label.exp() * (label - log_q)).sum(-1).mean() if greedy_weight < 1 else torch.zeros((), device=device)
        if greedy_weight > 0:
            greedy = -log_q.gather(-1, label.argmax(dim=-1, keepdim=True)).mean()
            loss = (1 - greedy_weight) * loss + greedy_weight * greedy
        total = total + decay**j * loss
        steps.append(loss.detach())
    # One read back for the whole unroll: on an accelerator each would wait for the device.
    return total / sum(decay**j for j in range(unroll)), torch.stack(steps).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--steps", type=at_least(0), default=2000, help="0: save the drafter untrained, as --init gives it"
    )
    parser.add_argument(
        "--unroll", type=at_least(1), default=7, help="training-time-test steps (>= the largest k served)"
    )
    parser.add_argument("--decay", type=above_zero, default=0.8)
    parser.add_argument(
        "--greedy-weight",
        type=float,
        default=0.0,
        help="share of each step's loss that is the cross-entropy of the target's argmax (the rest: KL)",
    )
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--seq-len", type=at_least(2), default=256)
    parser.add_argument("--chains", type=at_least(1), default=48, help="chain starts per sequence")
    parser.add_argument("--lr", type=above_zero, default=6e-4)
    parser.add_argument(
        "--taps", type=at_least(0), nargs=3, default=None, help="target layers read (default: SGLang's)"
    )
    parser.add_argument(
        "--draft-vocab", type=at_least(0), default=0, help="draft only the N most frequent tokens (0: all)"
    )
    parser.add_argument("--regenerate", type=at_least(0), default=0)
    parser.add_argument("--prompt-len", type=at_least(1), default=96)
    parser.add_argument("--init", type=Path, default=None, help="start from this head's weights (same shape)")
    add_run_options(parser, "the head")
    parser.add_argument(
        "--intermediate-size", type=at_least(0), default=0, help="the head's MLP width (default: the target's)"
    )
    parser.add_argument("--regenerate-chunk", type=at_least(1), default=64, help="sequences regenerated at a time")
    parser.add_argument(
        "--sampled-share",
        type=float,
        default=0.0,
        help="share of the --regenerate continuations sampled at --sample-temperature (the rest greedy)",
    )
    parser.add_argument("--sample-temperature", type=above_zero, default=0.8)
    parser.add_argument("--exclude", nargs="*", default=[], help="folder names left out of --data (vendored copies)")
    parser.add_argument(
        "--keep-outputs",
        type=at_least(0),
        default=0,
        help="with --regenerate: compute the target's outputs once and keep them in --work, each"
        " position's distribution as its N most likely draft ids (0: compute them every step)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.greedy_weight <= 1:
        parser.error(f"--greedy-weight must be between 0 and 1, not {args.greedy_weight}")
    check_run_options(parser, args)
    if not 0 <= args.sampled_share <= 1:
        parser.error(f"--sampled-share must be between 0 and 1, not {args.sampled_share}")
    if args.seq_len <= args.unroll + 1:
        parser.error(f"--seq-len must be above --unroll + 1 ({args.unroll + 1}), not {args.seq_len}")

    torch.manual_seed(args.seed)
    target, data, held_files = training_data(args, args.device, tuple(args.exclude))
    model = target.model
    config = head_config(model, args)
    fits_target(eagle3_problems(config, model.config))
    assert config.target_layer_ids is not None
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if args.regenerate:
        if not 0 < args.prompt_len < args.seq_len - args.unroll - 1:
            raise SystemExit(
                f"--prompt-len must be between 1 and {args.seq_len - args.unroll - 2} (--seq-len - --unroll - 2)"
            )
        new_tokens = args.seq_len - args.prompt_len
        sampled = round(args.regenerate * args.sampled_share)
        sequences = target_continuations(
            args.target,
            data,
            args.regenerate - sampled,
            args.prompt_len,
            new_tokens,
            work / "greedy.pt",
            args.seed,
            args.device,
            args.regenerate_chunk,
        )
        if sampled:
            more = target_continuations(
                args.target,
                data,
                sampled,
                args.prompt_len,
                new_tokens,
                work / f"sampled-{args.sample_temperature:g}.pt",
                args.seed + 1,  # other windows than the greedy ones
                args.device,
                args.regenerate_chunk,
                args.sample_temperature,
            )
            sequences = torch.cat((sequences, more))
    head = Eagle3Model(config, config.target_layer_ids)
    if config.draft_vocab_size < config.vocab_size:
        ids = frequent_tokens(sequences if args.regenerate else data, config.draft_vocab_size)
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d[ids] = True
    if args.init is not None:
        start = load_eagle3(args.init, model).state_dict()
        if start["lm_head.weight"].shape[0] == config.vocab_size > config.draft_vocab_size:
            start["lm_head.weight"] = start["lm_head.weight"][head.draft_to_target()]  # its rows for our ids
            start.update(d2t=head.d2t, t2d=head.t2d)
        head.load_state_dict(widen_mlp(start, head))
    kept = None
    if args.keep_outputs:
        taps = "-".join(map(str, config.target_layer_ids))
        shape = f"{len(sequences)}x{args.seq_len}-taps{taps}-vocab{config.draft_vocab_size}"
        folder = work / f"outputs-{shape}-top{args.keep_outputs}"
        kept = kept_outputs(
            args.target, sequences, head.taps, folder, args.device, head.draft_to_target(), args.keep_outputs
        )
    head.to(args.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01)
    resume = work / "state.pt"
    step, losses, per_step = 0, [], []
    trained_before = 0.0  # seconds, for --time-budget
    if resume.exists():
        state = torch.load(resume, map_location=args.device, weights_only=False)
        resumed(lambda: (head.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])), resume)
        step, losses, per_step = state["step"], state["losses"], state["per_step"]
        trained_before = state.get("seconds", 0.0)
        print(f"resuming at step {step}", file=sys.stderr)
    rng = random.Random(args.seed * 1000 + step)
    generator = torch.Generator().manual_seed(args.seed * 1000 + step)
    schedule = Schedule(args.steps, args.time_budget, trained_before)
    started = schedule.started
    head.train()
    first_step = step
    finished = schedule.finished(step)
    while not finished:
        if kept is not None:
            pick = picks(args, sequences, rng)
            tokens = sequences[pick].to(args.device)
            taps = kept[0][pick].to(args.device)
            log_p = dense_log_p(kept[1][pick], kept[2][pick], config.draft_vocab_size).to(args.device)
        else:
            tokens = training_batch(args, data, sequences if args.regenerate else None, rng).to(args.device)
            taps, log_p = target_outputs(head, model, tokens)
        # With --regenerate, chains start at the last prompt token or after: the target's own greedy text.
        first_chain = args.prompt_len - 1 if args.regenerate else 0
        for group in optimizer.param_groups:
            group["lr"] = lr_at(*schedule.at(step), args.lr)
        loss, step_losses = ttt_loss(
            head,
            model,
            tokens,
            taps,
            log_p,
            args.chains,
            args.unroll,
            args.decay,
            generator,
            first_chain,
            args.greedy_weight,
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        step += 1
        losses.append(finite(loss.item(), step))
        per_step.append(step_losses)
        finished = schedule.finished(step)
        if step % 10 == 0 or finished:
            rate = (time.time() - started) / (step - first_step)
            recent = sum(losses[-10:]) / len(losses[-10:])
            first, last = (sum(s[j] for s in per_step[-10:]) / len(per_step[-10:]) for j in (0, -1))
            total = "" if args.time_budget else f"/{args.steps}"
            print(
                f"step {step}{total} loss {recent:.3f} (step 0 {first:.3f}, step {args.unroll - 1} {last:.3f};"
                f" {rate:.2f} s a step)",
                file=sys.stderr,
                flush=True,
            )
        if step % 100 == 0 or finished:
            torch.save(
                {
                    "model": head.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "losses": losses,
                    "per_step": per_step,
                    "seconds": schedule.seconds(),
                },
                resume,
            )
    head.cpu().eval().requires_grad_(False)
    save_eagle3(head, args.out, torch.bfloat16)  # as published heads are: the compiled head streams bfloat16 anyway
    recent = per_step[-20:]
    report: dict = {
        "target": str(args.target),
        "steps": step,
        "time_budget": args.time_budget or None,
        "device": args.device,
        "intermediate_size": config.intermediate_size,
        "unroll": args.unroll,
        "decay": args.decay,
        "greedy_weight": args.greedy_weight,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "chains": args.chains,
        "lr": args.lr,
        "taps": list(config.target_layer_ids),
        "training_tokens": len(data),
        "regenerated_sequences": args.regenerate,
        "sampled_share": args.sampled_share,
        "sample_temperature": args.sample_temperature if args.sampled_share else None,
        "prompt_len": args.prompt_len if args.regenerate else None,
        "init": str(args.init) if args.init else None,
        "kept_outputs_top": args.keep_outputs or None,
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "last_loss_per_step": [sum(s[j] for s in recent) / max(1, len(recent)) for j in range(args.unroll)],
        "wall_seconds_this_run": round(time.time() - started, 1),
    }
    if args.prompts and held_files:
        from tools.corpus import code_prompts

        prompts = code_prompts(args.prompts, seed=args.seed + 1, files=held_files)
        if prompts:
            served = load_checkpoint(args.target)
            drafter = Eagle3Drafter(load_eagle3(args.out, served.model), served.model, 1, served_length(served))
            report["held_out"] = held_out_acceptance(served, drafter, args.unroll, prompts)
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    run(main)
