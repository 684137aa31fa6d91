"""Train adaspec's embedded default pair: a code target and a draft distilled from it.

    python tools/train_default_models.py --out models

Data: the Python standard library of the running interpreter (PSF licence). Every `test/` and
`tests/` folder is held out. Steps:
  1. a byte-level BPE tokenizer (8192 entries) on the training files;
  2. the target (8 layers, d=384, grouped-query attention, ~16M parameters) on next-token loss;
  3. the draft (2 layers, d=256, ~3.7M parameters) on the target's distribution (KL divergence),
     so that it is right where the target is confident.
Seeds are fixed; checkpoints under --work are resumed from automatically. Runs on CPU by default
(about an hour on 2 cores) and on CUDA when it is available.
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
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint import save_checkpoint  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402
from tools.corpus import stdlib_files  # noqa: E402

EOS = "<|endoftext|>"
VOCAB_SIZE = 8192
SEQ_LEN = 512
MAX_POSITIONS = 2048

TARGET_SHAPE = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2
)
DRAFT_SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def hf_config(shape: dict, eos_id: int) -> dict:
    heads = shape["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "head_dim": shape["hidden_size"] // heads,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        **shape,
    }


def batches(data: torch.Tensor, batch_size: int, rng: random.Random):
    while True:
        starts = [rng.randrange(0, len(data) - SEQ_LEN - 1) for _ in range(batch_size)]
        chunk = torch.stack([data[s : s + SEQ_LEN + 1] for s in starts]).long()
        yield chunk[:, :-1], chunk[:, 1:]


def held_out_windows(data: torch.Tensor, count: int = 48) -> torch.Tensor:
    rng = random.Random(1234)
    starts = [rng.randrange(0, len(data) - SEQ_LEN - 1) for _ in range(count)]
    return torch.stack([data[s : s + SEQ_LEN + 1] for s in starts]).long()


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model: Transformer, windows: torch.Tensor, device: torch.device, autocast: bool) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(windows), 8):
        chunk = windows[i : i + 8].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model.forward_train(chunk[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()).item() * len(chunk)
    model.train()
    return total / len(windows)


def progress(label: str, step: int, steps: int, loss: float, started: float) -> None:
    done = step / steps
    bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
    elapsed = time.time() - started
    eta = elapsed / max(done, 1e-9) - elapsed
    print(
        f"\r{label} [{bar}] {step}/{steps} loss {loss:.3f} eta {eta / 60:.1f} min", end="", file=sys.stderr, flush=True
    )


def train(
    label: str,
    model: Transformer,
    data: torch.Tensor,
    held_out: torch.Tensor,
    steps: int,
    batch_size: int,
    peak_lr: float,
    work: Path,
    device: torch.device,
    teacher: Transformer | None = None,
) -> float:
    """Train `model` on next-token loss, or on `teacher`'s distribution when one is given."""
    autocast = device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    state_file = work / f"{label}.pt"
    step = 0
    rng = random.Random(f"{label}-data")
    if state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        rng.setstate(state["rng"])
        print(f"{label}: resumed at step {step}", file=sys.stderr)

    def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model.forward_train(inputs).float()
            if teacher is None:
                return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher.forward_train(inputs).float(), dim=-1)
        draft_logp = F.log_softmax(logits, dim=-1)
        return F.kl_div(draft_logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean")

    compiled = torch.compile(loss_fn)
    stream = batches(data, batch_size, rng)
    started = time.time()
    model.train()
    start_step = step
    smoothed = float("nan")
    while step < steps:
        inputs, targets = next(stream)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = compiled(inputs.to(device), targets.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        progress(label, step - start_step, steps - start_step, smoothed, started)
        if step % 200 == 0 or step == steps:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "rng": rng.getstate()},
                state_file,
            )
    print(file=sys.stderr)
    loss = held_out_loss(model, held_out, device, autocast)
    print(
        f"{label}: held-out next-token loss {loss:.4f} after {steps} steps, {time.time() - started:.0f} s",
        file=sys.stderr,
    )
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--work", type=Path, default=Path("runs/default_models"), help="resumable checkpoints")
    parser.add_argument("--target-steps", type=int, default=1700)
    parser.add_argument("--draft-steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    train_files, held_out_files = stdlib_files()
    train_texts, held_out_texts = read_texts(train_files), read_texts(held_out_files)
    tokenizer_file = args.work / "tokenizer.json"
    if tokenizer_file.exists():
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    else:
        tokenizer = train_tokenizer(train_texts)
        tokenizer.save(str(tokenizer_file))
    eos_id = tokenizer.token_to_id(EOS)
    train_data, held_out_data = encode(tokenizer, train_texts), encode(tokenizer, held_out_texts)
    print(
        f"corpus: {len(train_texts)} training files ({len(train_data)} tokens), "
        f"{len(held_out_texts)} held-out files ({len(held_out_data)} tokens)",
        file=sys.stderr,
    )
    held_out = held_out_windows(held_out_data)

    def build(shape: dict) -> tuple[Transformer, dict]:
        config = hf_config(shape, eos_id)
        model = Transformer(ModelConfig.from_hf(config), max_positions=MAX_POSITIONS)
        for name, param in model.named_parameters():
            if param.dim() == 2:
                torch.nn.init.normal_(param, std=0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.data /= math.sqrt(2 * config["num_hidden_layers"])
        return model.to(device), config

    target, target_config = build(TARGET_SHAPE)
    target_loss = train(
        "target", target, train_data, held_out, args.target_steps, args.batch_size, 1.5e-3, args.work, device
    )
    target.eval().requires_grad_(False)
    draft, draft_config = build(DRAFT_SHAPE)
    draft_loss = train(
        "draft", draft, train_data, held_out, args.draft_steps, args.batch_size, 2e-3, args.work, device, teacher=target
    )

    generation = {"eos_token_id": eos_id, "bos_token_id": eos_id, "do_sample": False}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": EOS,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    report = {
        "device": str(device),
        "seconds": round(time.time() - started),
        "train_tokens": len(train_data),
        "held_out_tokens": len(held_out_data),
        "target": {
            "parameters": sum(p.numel() for p in target.parameters()),
            "held_out_loss": target_loss,
            "steps": args.target_steps,
        },
        "draft": {
            "parameters": sum(p.numel() for p in draft.parameters()),
            "held_out_loss": draft_loss,
            "steps": args.draft_steps,
        },
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
    }
    for name, model, config in (("target", target, target_config), ("draft", draft, draft_config)):
        out = args.out / name
        save_checkpoint(model, out, config, tokenizer, torch.bfloat16, generation)
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
