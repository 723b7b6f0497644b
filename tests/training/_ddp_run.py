"""Run by tests under torchrun (or plain python): train, then dump this rank's losses and FAVOR+ features."""

import sys

import torch
from transformers import HfArgumentParser

from linearformers.training import TrainArguments, train

if __name__ == "__main__":
    dump = sys.argv[1]
    (args,) = HfArgumentParser(TrainArguments).parse_args_into_dataclasses(args=sys.argv[2:])
    out = train(args)
    features = [layer.attention.random_features.clone() for layer in out["model"].model.layers]
    torch.save(
        {
            "features": features,
            "loss": out["train_loss"],
            "state": out["model"].state_dict(),
            "distributed_type": out["distributed_type"],
            "num_processes": out["num_processes"],
        },
        f"{dump}-rank{out['rank']}.pt",
    )
