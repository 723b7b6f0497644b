"""Which files one training forward enters: a tiny hybrid Performer (this package) and a tiny Llama (transformers),
traced the same way (``sys.setprofile``, every call into a file of the package), so that "how many files a reader
crosses" is measured rather than argued (docs/design.md, "A forward a reader can follow").

For each model it prints the files in the order first entered and the number of moves between files. For this
package it also marks the files that hold the forward's own code apart from the leaves every op calls on entry
(argument checks, the autocast guard) and the seed derivation of a redraw.

    python benchmarks/forward_files.py
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import linearformers  # noqa: E402

# the leaves every public op calls on entry, and the one seed derivation: not the forward's own code
LEAVES = ("ops/_checks.py", "ops/_precision.py", "seeds.py")


def trace(run: Callable[[], object], package: str) -> tuple[list[str], int]:
    """The files under ``package`` whose functions ``run`` calls, in the order first entered, and the moves between
    files (a call into a file other than the last one entered)."""
    root = os.path.dirname(package) + os.sep
    files: list[str] = []
    moves = 0
    last = None

    def profile(frame, event, arg):
        nonlocal moves, last
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(root):
            return
        rel = name[len(root) :]
        if rel != last:
            moves += 1
            last = rel
        if rel not in files:
            files.append(rel)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return files, moves


# one tiny shape for both models, so that they differ in code only
SHAPE = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
)


def training_call(model: torch.nn.Module) -> Callable[[], object]:
    """One training forward of ``model`` with labels, called once first (lazy imports, first-call setup)."""
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    model.train()(input_ids=ids, labels=ids)
    return lambda: model(input_ids=ids, labels=ids)


def hybrid_performer(redraw: bool) -> Callable[[], object]:
    torch.manual_seed(0)
    config = linearformers.PerformerConfig(
        **SHAPE, is_decoder=True, hybrid_window=8, feature_redraw_interval=1 if redraw else 0
    )
    return training_call(linearformers.PerformerForCausalLM(config))


def llama() -> Callable[[], object]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, num_key_value_heads=4, attn_implementation="sdpa")
    return training_call(transformers.LlamaForCausalLM(config))


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    package = linearformers.__file__
    rows = [
        ("hybrid Performer, training", trace(hybrid_performer(redraw=False), package), True),
        ("hybrid Performer, training, redraw due", trace(hybrid_performer(redraw=True), package), True),
        (f"Llama (transformers {transformers.__version__}), training", trace(llama(), transformers.__file__), False),
    ]
    for title, (files, moves), ours in rows:
        own = [f for f in files if f not in LEAVES] if ours else files
        line = f"{title}: {len(files)} files entered, {moves} moves"
        if ours:
            line += f"; {len(own)} hold the forward's code"
        print(line)
        for name in files:
            print(f"    {name}{'  (leaf)' if ours and name in LEAVES else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
