"""Run by tests under torchrun (or plain python): train, then dump this rank's losses and FAVOR+ features."""

import sys

import torch

from linearformers.training import train
from linearformers.training.__main__ import parse_arguments

if __name__ == "__main__":
    dump = sys.argv[1]
    out = train(*parse_arguments(sys.argv[2:]))
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
