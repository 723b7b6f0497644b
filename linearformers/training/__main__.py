"""linearformers-train: `accelerate launch -m linearformers.training --task clm --train_file data.txt ...`"""

from __future__ import annotations

import sys

from transformers import HfArgumentParser

from .loop import TrainArguments, train


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser(TrainArguments)
    (args,) = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    return train(args)


if __name__ == "__main__":
    main()
