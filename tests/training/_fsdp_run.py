"""Run by tests: train a tiny Performer LM for a few steps, plainly or sharded with FSDP2 (``fully_shard``) over
gloo under torchrun, then dump the losses, the FAVOR+ features and the full (gathered) weights, and save the model
with ``save_pretrained`` from the gathered state dict, as Accelerate does for FSDP2 at the end of training."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from linearformers import PerformerConfig, PerformerForCausalLM

if __name__ == "__main__":
    dump, folder = sys.argv[1], sys.argv[2]
    sharded = "RANK" in os.environ
    rank, world = 0, 1
    if sharded:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = PerformerConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        is_decoder=True,
        num_features=16,
        feature_redraw_interval=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = PerformerForCausalLM(config)
    if sharded:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 120, (5, 8, 24), generator=torch.Generator().manual_seed(1))  # 5 global batches of 8
    per_rank = data.shape[1] // world
    losses = []
    for batch in data:
        ids = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # FSDP averages the gradients over ranks: the gradient of the global batch's mean loss
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if sharded:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    features = [layer.attention.random_features.clone() for layer in model.model.layers]
    torch.save(
        {"loss": losses, "features": features, "state": full, "sharded": sharded, "world": world},
        f"{dump}-rank{rank}.pt",
    )
    if rank == 0:
        model.save_pretrained(folder, state_dict=full)
    if sharded:
        # rank 1 must not tear gloo down while rank 0 is still saving (an abort, "terminate called without an
        # active exception", seen once under load)
        dist.barrier()
        dist.destroy_process_group()
