"""linearformers-train: `accelerate launch -m linearformers.training --task clm --train_file data.txt ...`

The arguments are ours (``ModelDataArguments``: task, model, data) plus transformers' own ``TrainingArguments``,
parsed with ``HfArgumentParser`` as the Trainer examples do. Exits 0 on success; bad input exits 2 with a one-line
``linearformers-train: error: ...`` on stderr.
"""

from __future__ import annotations

import errno
import sys
import textwrap
from argparse import ArgumentDefaultsHelpFormatter, RawDescriptionHelpFormatter

from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import HfArgumentParser, TrainingArguments

from ..cli import raised_by_linearformers
from .data import TASKS
from .loop import ModelDataArguments, train

PROG = "linearformers-train"
USAGE = f"{PROG} --task {{{','.join(TASKS)}}} (--train_file FILE | --dataset_dir DIR) --output_dir DIR [options]"
EXAMPLE = f"""\
example (a small causal LM on a text file, evaluated every 200 steps):
  {PROG} --task clm --train_file train.txt --output_dir out/run \\
      --config_overrides hidden_size=256,num_hidden_layers=4,num_attention_heads=4 --block_size 512 \\
      --per_device_train_batch_size 8 --max_steps 1000 --eval_strategy steps --eval_steps 200
"""
# the flags this command had before it took TrainingArguments' names -> what to pass now
REMOVED_FLAGS = {
    "tokenizer": "--tokenizer_name",
    "lr_scheduler": "--lr_scheduler_type",
    "keep_checkpoints": "--save_total_limit",
    "cpu": "--use_cpu",
    "per_device_batch_size": "--per_device_train_batch_size (and --per_device_eval_batch_size)",
    "eval_every": "--eval_strategy steps --eval_steps N",
    "save_every": "--save_steps N (--save_strategy no: never)",
    "resume": "--resume_from_checkpoint true (or a checkpoint folder)",
    "mixed_precision": "--bf16 or --fp16",
    "progress_bar": "--disable_tqdm true to hide the progress bar",
}


def description() -> str:
    """The top of ``--help``: what the command does and an example."""
    what = (
        "Train a Performer or Linformer (masked LM, causal LM or classifier) with transformers' Trainer on local "
        ".txt, .csv or .json(l) files or a save_to_disk folder. Checkpoints go to OUTPUT_DIR/checkpoint-N, the model "
        "and tokenizer to OUTPUT_DIR/final, the losses and evaluations to OUTPUT_DIR/results.json. The options are "
        "ours (--task to --overwrite_output_dir), then transformers' TrainingArguments, each with Trainer's meaning."
    )
    return f"{textwrap.fill(what, 100)}\n\n{EXAMPLE}"


class _HelpFormatter(ArgumentDefaultsHelpFormatter, RawDescriptionHelpFormatter):
    """Each option's default (as HfArgumentParser shows it), and the description as written."""


def _check_removed_flags(argv: list[str]) -> None:
    for token in argv:
        name = token[2:].partition("=")[0].replace("-", "_") if token.startswith("--") else None
        if name in REMOVED_FLAGS:
            raise ValueError(f"--{name} was removed; pass {REMOVED_FLAGS[name]} (transformers' TrainingArguments name)")


def build_parser() -> HfArgumentParser:
    """The command line: ``ModelDataArguments`` then ``TrainingArguments``, under ``description()``."""
    return HfArgumentParser(
        (ModelDataArguments, TrainingArguments),
        prog=PROG,
        usage=USAGE,
        description=description(),
        formatter_class=_HelpFormatter,
    )


def parse_arguments(argv: list[str] | None = None) -> tuple[ModelDataArguments, TrainingArguments]:
    """The command line (``sys.argv[1:]`` by default) as our arguments and transformers' ``TrainingArguments``; a
    ValueError names a flag this command no longer has and the one that replaced it."""
    argv = sys.argv[1:] if argv is None else argv
    _check_removed_flags(argv)
    args, training_args = build_parser().parse_args_into_dataclasses(args=argv)
    return args, training_args


def _summary(out: dict) -> str:
    results = ", ".join(f"{name} {value:.4g}" for name, value in out["results"].items())
    losses = out["train_loss"]  # those logged at --logging_steps
    trend = f"{losses[0]:.4g} → {losses[-1]:.4g}" if len(losses) > 1 else f"{out['mean_train_loss']:.4g} (mean)"
    final = out["final_dir"]
    return (
        f"trained {out['steps']} steps: train loss {trend}; eval: {results}\n"
        f"model and tokenizer: {final}\n"
        f"losses and eval metrics: {out['results_file']}\n"
        f"load with: from transformers import {out['auto_class']}, AutoTokenizer; import linearformers; "
        f'model = {out["auto_class"]}.from_pretrained("{final}"); tokenizer = AutoTokenizer.from_pretrained("{final}")'
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``linearformers-train``; returns the exit status (the console script and ``python -m`` exit with it)."""
    try:  # TrainingArguments checks its own values (e.g. --bf16 on a machine without bf16)
        arguments = parse_arguments(argv)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    try:
        out = train(*arguments)
    except ValueError as error:
        if not raised_by_linearformers(error):  # a bug or a library's failure mid-run: keep its traceback
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except StrictDataclassFieldValidationError as error:  # a config field's value (--config_overrides) refused
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        print(f"{PROG}: error: {error.strerror}", file=sys.stderr)
        return 1
    if out["rank"] == 0:
        print(_summary(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
