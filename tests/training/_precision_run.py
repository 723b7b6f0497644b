"""Run by tests: the training CLI's parsing and train() for each argument list (separated by "---"; one process, so one
mixed precision), with a hook that records the dtypes nn.Linear layers compute in. Dumps them with the losses as
JSON, one entry per run."""

import json
import sys

import torch

from linearformers.training import train
from linearformers.training.__main__ import parse_arguments

if __name__ == "__main__":
    dump, runs, dtypes = sys.argv[1], [], set()

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear) and torch.is_tensor(output):
            dtypes.add(str(output.dtype))

    torch.nn.modules.module.register_module_forward_hook(record)
    argv = sys.argv[2:]
    while argv:
        end = argv.index("---")
        dtypes.clear()
        out = train(*parse_arguments(argv[:end]))
        runs.append(
            {"dtypes": sorted(dtypes), "train_loss": out["train_loss"], "eval_loss": out["results"]["eval_loss"]}
        )
        argv = argv[end + 1 :]
    with open(dump, "w") as handle:
        json.dump(runs, handle)
