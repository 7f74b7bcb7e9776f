"""Train the bundled demo model: a byte-level BPE tokenizer and a small Qwen3 on the stdlib.

No vLLM counterpart (vLLM is inference-only); produces the checkpoint chapter 01 serves.
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m tools.train_demo_model`.

Why it exists: an inference engine needs a model to run, and a reader should be able to see
exactly where that model came from. This script rebuilds it from nothing but the local Python
installation, on one CPU thread. The shipped run (1,000 steps) took 66 minutes on a 2-core
machine busy with other jobs (at nice 10); an idle core needs about half that.

    python -m tools.train_demo_model --out /tmp/demo        # the shipped checkpoint
    python -m tools.train_demo_model --out /tmp/tiny --smoke  # seconds, for tests

Training uses transformers' own `Qwen3ForCausalLM` (nano_v1's engine has no backward pass);
the output is a standard Hugging Face directory that both transformers and nano_v1 load.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from benchmarks import NEEDS_CHECKOUT
from nano_v1.demo_model.corpus import corpus_files, read_sources, split_files, unigram_cross_entropy

EOS_TOKEN = "<|endoftext|>"
# A code model has never seen a dialogue, so the chat template renders one as Python comments
# and leaves the assistant's turn where code would follow.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '# ' + message['role'] + ': ' + message['content'] | replace('\\n', '\\n# ') + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '# assistant:\\n' }}{%- endif %}"
)


@dataclass(slots=True)
class ModelShape:
    """The Qwen3 dimensions that set the model's size and training cost."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


# ~4.2M parameters: 8.4 MB in bfloat16 with the embedding tied to the output layer.
DEMO_SHAPE = ModelShape(4096, 256, 768, 4, 4, 2, 64)
SMOKE_SHAPE = ModelShape(512, 64, 128, 2, 2, 1, 32)


@dataclass(slots=True)
class TrainArgs:
    out: str
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1
    eval_tokens: int = 32_768
    eval_every: int = 250
    max_files: int | None = None
    smoke: bool = False


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE over `texts`, wrapped so `AutoTokenizer.from_pretrained` can load it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every string maps to bytes, so any Python source round-trips exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def save_tokenizer(tokenizer, out: Path) -> None:
    """Save for `AutoTokenizer`, naming the class both transformers 4.x and 5.x resolve."""
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: each document followed by the end-of-text token."""
    eos = tokenizer.eos_token_id
    docs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.fromiter((t for doc in docs for t in (*doc.ids, eos)), dtype=np.int64)


def make_config(shape: ModelShape, eos_token_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        **asdict(shape),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


@torch.no_grad()
def evaluate(model, ids: np.ndarray, seq_len: int, max_tokens: int) -> float:
    """Mean next-token loss (nats) over the first `max_tokens` of `ids`, in independent windows."""
    num_windows = max(1, min(len(ids) - 1, max_tokens) // seq_len)
    windows = torch.from_numpy(ids[: num_windows * seq_len]).view(num_windows, seq_len)  # [windows, seq_len]
    model.eval()
    # Each window has seq_len - 1 targets, so weighting a chunk's mean by its window count is exact.
    total = sum(model(input_ids=chunk, labels=chunk).loss * len(chunk) for chunk in windows.split(8))
    model.train()
    return float(total / num_windows)


def lr_at(step: int, args: TrainArgs) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def train(args: TrainArgs) -> dict:
    """Build the tokenizer, train the model, write the checkpoint directory; return its record."""
    import transformers
    from tqdm import tqdm
    from transformers import GenerationConfig, Qwen3ForCausalLM

    start = time.time()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    shape = SMOKE_SHAPE if args.smoke else DEMO_SHAPE

    files = corpus_files()[: args.max_files]
    train_files, heldout_files = split_files(files)
    if not heldout_files:  # a tiny slice may hold no held-out file; validate on its last one
        train_files, heldout_files = train_files[:-1], train_files[-1:]
    train_texts, heldout_texts = read_sources(train_files), read_sources(heldout_files)
    tokenizer = train_tokenizer(train_texts, shape.vocab_size)
    train_ids = encode_documents(tokenizer, train_texts)
    heldout_ids = encode_documents(tokenizer, heldout_texts)
    baseline = unigram_cross_entropy(train_ids, heldout_ids[: args.eval_tokens], len(tokenizer))
    print(
        f"corpus: {len(train_files)} train files ({len(train_ids):,} tokens), "
        f"{len(heldout_files)} held-out files ({len(heldout_ids):,} tokens); "
        f"unigram baseline {baseline:.3f} nats/token",
        flush=True,
    )

    model = Qwen3ForCausalLM(make_config(shape, tokenizer.eos_token_id)).to(torch.float32).train()
    # Norm weights and biases are not decayed; matrices (and the tied embedding) are.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    losses = []
    progress = tqdm(range(args.steps), desc="train", mininterval=5.0, file=sys.stdout)
    for step in progress:
        # Random windows of seq_len + 1 tokens; the model shifts the labels itself.
        offsets = rng.integers(0, len(train_ids) - args.seq_len - 1, size=args.batch_size)
        batch = torch.from_numpy(np.stack([train_ids[o : o + args.seq_len + 1] for o in offsets]))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(
            loss=f"{np.mean(losses[-20:]):.3f}", lr=f"{lr_at(step, args):.1e}", refresh=False
        )
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            val = evaluate(model, heldout_ids, args.seq_len, args.eval_tokens)
            progress.write(f"step {step + 1}: held-out loss {val:.3f} (unigram baseline {baseline:.3f})")

    heldout_loss = evaluate(model, heldout_ids, args.seq_len, args.eval_tokens)
    train_seconds = time.time() - start
    print(f"held-out loss {heldout_loss:.3f} nats/token vs unigram baseline {baseline:.3f}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    ).save_pretrained(out)
    save_tokenizer(tokenizer, out)
    record = {
        "heldout_loss": heldout_loss,
        "unigram_baseline": baseline,
        "loss_unit": "nats/token",
        "heldout_eval_tokens": min(len(heldout_ids), args.eval_tokens),
        "first_train_loss": float(np.mean(losses[: min(10, len(losses))])),
        "final_train_loss": float(np.mean(losses[-min(10, len(losses)) :])),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_train_files": len(train_files),
        "num_heldout_files": len(heldout_files),
        "num_train_tokens": len(train_ids),
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_seconds": round(train_seconds, 1),
        "args": asdict(args),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def smoke_args(out: str) -> TrainArgs:
    """A tiny model for 30 steps on 40 files: seconds, for tests."""
    return TrainArgs(
        out=out,
        steps=30,
        batch_size=8,
        seq_len=64,
        warmup_steps=5,
        eval_tokens=2048,
        max_files=40,
        smoke=True,
    )


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """Command-line flags on top of the demo (or, with --smoke, the smoke) defaults."""
    parser = argparse.ArgumentParser(prog="python -m tools.train_demo_model", description=__doc__.splitlines()[0],
                                     epilog=NEEDS_CHECKOUT)
    demo = TrainArgs(out="")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--smoke", action="store_true", help=smoke_args.__doc__)
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {demo.steps})")
    parser.add_argument("--batch-size", type=int, help=f"sequences per step (default {demo.batch_size})")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {demo.seq_len})")
    parser.add_argument("--lr", type=float, help=f"peak learning rate (default {demo.lr})")
    parser.add_argument("--seed", type=int, help=f"seed for init and batches (default {demo.seed})")
    parser.add_argument("--threads", type=int, help=f"torch CPU threads (default {demo.threads})")
    parser.add_argument("--max-files", type=int, help="use only the first N corpus files")
    ns = parser.parse_args(argv)
    args = smoke_args(ns.out) if ns.smoke else TrainArgs(out=ns.out)
    for name in ("steps", "batch_size", "seq_len", "lr", "seed", "threads", "max_files"):
        if getattr(ns, name) is not None:
            setattr(args, name, getattr(ns, name))
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        raise ValueError("--steps and --batch-size must be >= 1 and --seq-len >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main()
