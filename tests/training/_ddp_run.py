"""Run by tests under torchrun (or plain python): train, then dump this rank's losses, its initial and final
weights and, for a random-feature Performer, its FAVOR+ features."""

import sys

import torch

from linearformers.training import loop, train
from linearformers.training.__main__ import parse_arguments

initial = {}
build_model = loop.build_model


def _recording_build_model(*args, **kwargs):
    # the weights as built (after the run's set_seed), before any step: lets a test prove that they trained
    model = build_model(*args, **kwargs)
    initial.update({key: value.detach().clone() for key, value in model.state_dict().items()})
    return model


if __name__ == "__main__":
    loop.build_model = _recording_build_model
    dump = sys.argv[1]
    out = train(*parse_arguments(sys.argv[2:]))
    # learned feature maps (feature_map="hedgehog") have no random features: the buffer is None there
    features = [
        layer.attention.random_features.clone()
        for layer in out["model"].model.layers
        if layer.attention.random_features is not None
    ]
    torch.save(
        {
            "features": features,
            "loss": out["train_loss"],
            "initial": initial,
            "state": out["model"].state_dict(),
            "distributed_type": out["distributed_type"],
            "num_processes": out["num_processes"],
        },
        f"{dump}-rank{out['rank']}.pt",
    )
