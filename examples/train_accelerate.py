"""Train with Accelerate on one CPU/GPU, many GPUs (DDP) or FSDP: a thin wrapper over linearformers-train.

    # one process
    python examples/train_accelerate.py --task mlm --family performer --train_file train.txt --output_dir out/a
    # 8 GPUs, DDP, bf16
    accelerate launch --config_file examples/accelerate_configs/ddp.yaml examples/train_accelerate.py \
        --task clm --family performer --train_file train.txt --output_dir out/ddp --bf16
    # FSDP (full shard; wraps LinearAttentionBlock blocks)
    accelerate launch --config_file examples/accelerate_configs/fsdp.yaml examples/train_accelerate.py ...
    # two CPU processes (gloo), as the tests do
    torchrun --nproc_per_node 2 examples/train_accelerate.py --use_cpu ...
    # resume after an interruption
    python examples/train_accelerate.py ... --resume_from_checkpoint true
"""

import sys

from linearformers.training.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
