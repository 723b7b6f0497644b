"""linearformers-train: `accelerate launch -m linearformers.training --task clm --train_file data.txt ...`

The arguments are ours (``ModelDataArguments``: task, model, data) plus transformers' own ``TrainingArguments``,
parsed with ``HfArgumentParser`` as the Trainer examples do. Exits 0 on success; bad input exits 2 with a one-line
``linearformers-train: error: ...`` on stderr.
"""

from __future__ import annotations

import errno
import sys
import traceback
from pathlib import Path

from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import HfArgumentParser, TrainingArguments

from .loop import ModelDataArguments, train

PROG = "linearformers-train"
PACKAGE = Path(__file__).resolve().parents[1]  # linearformers/


def parse_arguments(argv: list[str] | None = None) -> tuple[ModelDataArguments, TrainingArguments]:
    """The command line (``sys.argv[1:]`` by default) as our arguments and transformers' ``TrainingArguments``."""
    parser = HfArgumentParser((ModelDataArguments, TrainingArguments), prog=PROG)
    args, training_args = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    return args, training_args


def _summary(out: dict) -> str:
    results = ", ".join(f"{name} {value:.4g}" for name, value in out["results"].items())
    losses = out["train_loss"]
    final = out["final_dir"]
    return (
        f"trained {out['steps']} steps: train loss {losses[0]:.4g} → {losses[-1]:.4g}; eval: {results}\n"
        f"model and tokenizer: {final}\n"
        f"losses and eval metrics: {out['results_file']}\n"
        f"load with: from transformers import {out['auto_class']}, AutoTokenizer; import linearformers; "
        f'model = {out["auto_class"]}.from_pretrained("{final}"); tokenizer = AutoTokenizer.from_pretrained("{final}")'
    )


def _raised_by_linearformers(error: BaseException) -> bool:
    """Whether ``error`` was raised in this package's own code: its ValueErrors are the checks of arguments, data,
    checkpoints and output_dir, each naming the problem, which the user fixes, so one line says it all."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE)


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
        if not _raised_by_linearformers(error):  # a bug or a library's failure mid-run: keep its traceback
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
    if out["rank"] == 0 and out["train_loss"]:
        print(_summary(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
