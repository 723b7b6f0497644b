"""Training with Accelerate (`linearformers-train`), data pipelines on `datasets`, metrics as local `evaluate`
modules, atomic checkpoints."""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import check_block_size, load_raw_dataset, prepare_dataset
from .loop import (
    ModelDataArguments,
    build_model,
    default_tokenizer,
    evaluate_model,
    label_fields,
    new_config,
    train,
)
from .metrics import load_metric
from .tokenizer import train_bpe_tokenizer

__all__ = [
    "ModelDataArguments",
    "build_model",
    "check_block_size",
    "default_tokenizer",
    "evaluate_model",
    "label_fields",
    "latest_checkpoint",
    "load_checkpoint",
    "load_metric",
    "load_raw_dataset",
    "new_config",
    "prepare_dataset",
    "save_checkpoint",
    "train",
    "train_bpe_tokenizer",
]
