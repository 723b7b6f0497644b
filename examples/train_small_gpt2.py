"""Train a small GPT-2 on the Python standard library's source: a pretrained decoder to convert, made offline.

    python examples/train_small_gpt2.py --output_dir /tmp/small_gpt2

No pretrained GPT-2 can be downloaded here, so the decoder-conversion benchmarks start from this one. Its parts:

- text: every ``*.py`` file of the standard library (``sysconfig.get_paths()["stdlib"]``), less installed
  packages and CPython's own regression suite (half the bytes, and repetitive assertion code), sorted by path;
- splits: each file goes to train / validation / test by a hash of its relative path (80 / 10 / 10), so a file
  stays in its split when files are added. Only train files train the tokenizer and the model; the conversion
  benchmarks leave the test files out of attention transfer too;
- tokenizer: a GPT-2-style byte-level BPE trained on the train files, ``<|endoftext|>`` between documents;
- model: transformers' own ``GPT2LMHeadModel``, trained with ``Trainer`` on blocks of ``--block_size`` tokens;
- evaluation: validation perplexity, exp of the mean next-token loss over validation blocks.

``--output_dir`` receives the model and tokenizer (``save_pretrained``, safetensors), ``splits.json`` (the standard
library's folder, the Python version and each split's file list), ``validation.jsonl`` / ``test.jsonl`` (the held-out
texts, one ``{"path", "text"}`` a line, for machines with another standard library) and ``train_report.json``.
Training stops at ``--max_steps`` or after ``--time_budget`` seconds, whichever comes first; the learning rate
warms up and decays (cosine) over that same progress, so a run cut by the clock still ends its decay.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never ask the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import hashlib
import json
import math
import platform
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from linearformers.training import train_bpe_tokenizer

SPLITS = ("train", "validation", "test")
# folders under the standard library that are not its own source: installed packages, CPython's regression suite
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="where the model, tokenizer and splits are saved")
    parser.add_argument("--max_steps", type=int, default=2000, help="at most this many optimizer steps")
    parser.add_argument("--time_budget", type=float, default=300.0, help="seconds of training at most (0: no limit)")
    parser.add_argument("--block_size", type=int, default=256, help="tokens per training / validation block")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_positions", type=int, default=512)
    parser.add_argument("--eval_blocks", type=int, default=256, help="validation blocks scored (evenly spaced)")
    parser.add_argument("--max_files_per_split", type=int, default=None, help="first files of each split (tests)")
    parser.add_argument(
        "--num_threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is faster on a busy machine",
    )
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    positive = ("max_steps", "block_size", "batch_size", "vocab_size", "n_layer", "n_embd", "n_head", "n_positions")
    for name in (*positive, "eval_blocks"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.max_files_per_split is not None and args.max_files_per_split < 1:
        raise ValueError(f"--max_files_per_split must be at least 1, got {args.max_files_per_split}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num_threads must be at least 1, got {args.num_threads}")
    if args.time_budget < 0 or args.learning_rate <= 0:
        raise ValueError(
            f"--time_budget must be 0 (no limit) or positive and --learning_rate positive, "
            f"got {args.time_budget} and {args.learning_rate}"
        )
    if args.n_embd % args.n_head:
        raise ValueError(f"--n_embd {args.n_embd} is not divisible by --n_head {args.n_head}; pick a multiple")
    if args.block_size > args.n_positions:
        raise ValueError(
            f"--block_size {args.block_size} exceeds --n_positions {args.n_positions}: GPT-2 has no position "
            "embedding past n_positions. Raise --n_positions or lower --block_size."
        )
    # 256 byte symbols and <|endoftext|> come first; a smaller vocabulary would have no merges at all
    if args.vocab_size <= 257:
        raise ValueError(f"--vocab_size must exceed 257 (the byte alphabet and <|endoftext|>), got {args.vocab_size}")


def split_of(relative_path: str) -> str:
    """``"train"``, ``"validation"`` or ``"test"`` (80 / 10 / 10) from a hash of the path, stable across machines."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "big") % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def stdlib_splits(root: Path, max_files_per_split: int | None) -> dict[str, list[str]]:
    """Each split's ``*.py`` files under ``root``, as sorted relative POSIX paths."""
    splits = {name: [] for name in SPLITS}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_FOLDERS.isdisjoint(relative.parent.parts):
            splits[split_of(relative.as_posix())].append(relative.as_posix())
    for name, files in splits.items():
        if not files:
            raise ValueError(f"the {name} split of {root} holds no *.py file")
        splits[name] = files[:max_files_per_split]
    return splits


def read_texts(root: Path, files: list[str]) -> list[str]:
    # a few files declare latin-1; a replaced byte costs nothing here
    return [(root / name).read_bytes().decode("utf-8", errors="replace") for name in files]


def token_blocks(texts: list[str], tokenizer: PreTrainedTokenizerFast, block_size: int, split: str) -> Dataset:
    """The texts joined by end-of-text and cut into blocks of ``block_size`` tokens (the remainder is dropped).

    Returns a Dataset with ``input_ids`` and ``labels``, each (num_blocks, block_size); GPT-2 shifts the labels.
    """
    documents = Dataset.from_dict({"text": texts})
    eos = tokenizer.eos_token_id
    tokenized = documents.map(
        lambda batch: {"input_ids": [[*ids, eos] for ids in tokenizer(batch["text"])["input_ids"]]},
        batched=True,
        remove_columns=["text"],
    )
    stream = np.fromiter((t for ids in tokenized["input_ids"] for t in ids), dtype=np.int64)
    num_blocks = len(stream) // block_size
    if num_blocks == 0:
        raise ValueError(
            f"the {split} split has {len(stream)} tokens, fewer than one block of {block_size}; "
            "use more files or a smaller --block_size"
        )
    blocks = stream[: num_blocks * block_size].reshape(num_blocks, block_size).tolist()
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def evenly_spaced(blocks: Dataset, count: int) -> Dataset:
    """``count`` rows spread evenly over ``blocks`` (all of them if fewer). Not seeded: runs with different seeds
    are scored on the same validation blocks."""
    if count >= len(blocks):
        return blocks
    return blocks.select(np.linspace(0, len(blocks) - 1, count).round().astype(int).tolist())


class Budget(TrainerCallback):
    """Training progress in [0, 1]: the larger of ``step / max_steps`` and ``seconds / time_budget``.

    The learning-rate schedule follows it and training stops when it reaches 1, so a run that the clock cuts short
    still ends its decay (its learning rates then depend on the machine's speed, not only on the seed).
    """

    def __init__(self, max_steps: int, seconds: float | None):
        self.max_steps = max_steps
        self.seconds = seconds
        self.start: float | None = None
        self.stopped_by_time = False

    def progress(self, step: int) -> float:
        by_time = (
            0.0 if self.seconds is None or self.start is None else (time.perf_counter() - self.start) / self.seconds
        )
        return min(1.0, max(step / self.max_steps, by_time))

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < self.max_steps and self.progress(state.global_step) >= 1.0:
            control.should_training_stop = True
            self.stopped_by_time = True


def lr_multiplier(progress: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over the first 5 % of training, then cosine decay to 10 % of the peak, as in nanoGPT."""
    if progress < warmup:
        return progress / warmup
    decay = (progress - warmup) / (1 - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * decay))


def optimizer_and_schedule(
    model: GPT2LMHeadModel, learning_rate: float, budget: Budget
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    # matrices and embeddings are decayed, biases and LayerNorm gains are not (nanoGPT's rule)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(budget.progress(step)))
    return optimizer, schedule


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    set_seed(args.seed)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    # --- data: the standard library's source, split by file ---
    root = Path(sysconfig.get_paths()["stdlib"])
    splits = stdlib_splits(root, args.max_files_per_split)
    texts = {name: read_texts(root, files) for name, files in splits.items()}
    tokenizer = train_bpe_tokenizer(texts["train"], vocab_size=args.vocab_size)
    train_blocks = token_blocks(texts["train"], tokenizer, args.block_size, "train")
    validation_blocks = token_blocks(texts["validation"], tokenizer, args.block_size, "validation")
    validation_blocks = evenly_spaced(validation_blocks, args.eval_blocks)

    # --- model: GPT-2 as transformers builds it ---
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,  # end-of-text, as in the tokenizer: generate() pads a batch with it
    )
    model = GPT2LMHeadModel(config)
    # Trainer divides the summed loss by the count of labels[..., 1:] only for models whose loss_type is ForCausalLM;
    # GPT2LMHeadModel's name leaves it None (transformers 5.23), so the mean would count one token per block too many
    # and the validation perplexity would come out low by a factor exp(loss / block_size).
    model.loss_type = "ForCausalLM"

    # --- training ---
    training_args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",  # one save, after evaluation, below
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
    )
    budget = Budget(args.max_steps, args.time_budget or None)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=validation_blocks,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        optimizers=optimizer_and_schedule(model, args.learning_rate, budget),
        callbacks=[budget],
    )
    start = time.perf_counter()
    train_output = trainer.train()
    train_seconds = time.perf_counter() - start

    # --- evaluation: every block has block_size - 1 targets, so the mean over blocks is the mean over tokens ---
    eval_loss = trainer.evaluate()["eval_loss"]
    report = {
        "steps": trainer.state.global_step,
        "stopped_by_time_budget": budget.stopped_by_time,
        "train_seconds": round(train_seconds, 1),
        "train_loss": train_output.training_loss,
        # Trainer logs the mean loss of the steps since its last log, every 10 steps
        "last_logged_train_loss": next(
            (log["loss"] for log in reversed(trainer.state.log_history) if "loss" in log), None
        ),
        "validation_loss": eval_loss,
        "validation_perplexity": math.exp(eval_loss),
        "validation_blocks": len(validation_blocks),
        "train_blocks": len(train_blocks),
        "block_size": args.block_size,
        "parameters": model.num_parameters(),
        "files": {name: len(files) for name, files in splits.items()},
        "args": vars(args),
    }

    # --- save: model and tokenizer, and the splits so that later benchmarks hold out the same text ---
    trainer.save_model()
    (output_dir / "splits.json").write_text(
        json.dumps({"stdlib": str(root), "python_version": platform.python_version(), **splits}, indent=1)
    )
    for name in ("validation", "test"):
        with open(output_dir / f"{name}.jsonl", "w") as f:
            for path, text in zip(splits[name], texts[name]):
                f.write(json.dumps({"path": path, "text": text}) + "\n")
    (output_dir / "train_report.json").write_text(json.dumps(report, indent=1))

    last = report["last_logged_train_loss"]
    print(
        f"trained {report['parameters']:,} parameters for {report['steps']} steps in {train_seconds:.0f} s"
        + (" (time budget reached)" if budget.stopped_by_time else "")
        + f"; {report['train_blocks']} train blocks of {args.block_size} tokens\n"
        f"train loss {report['train_loss']:.3f} (mean over the run)"
        + ("" if last is None else f", {last:.3f} (last 10 steps)")
        + f"\nvalidation perplexity {report['validation_perplexity']:.2f} on {report['validation_blocks']} blocks\n"
        f"saved to {output_dir}"
    )
    return report


if __name__ == "__main__":
    main()
