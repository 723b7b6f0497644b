"""Training on transformers' Trainer (`linearformers-train`), data pipelines on `datasets`, metrics as local
`evaluate` modules, checkpoints named once complete."""

from .checkpoint import latest_checkpoint
from .data import check_block_size, load_raw_dataset, prepare_dataset
from .loop import ModelDataArguments, build_model, default_tokenizer, label_fields, new_config, train
from .metrics import load_metric
from .tokenizer import train_bpe_tokenizer

__all__ = [
    "ModelDataArguments",
    "build_model",
    "check_block_size",
    "default_tokenizer",
    "label_fields",
    "latest_checkpoint",
    "load_metric",
    "load_raw_dataset",
    "new_config",
    "prepare_dataset",
    "train",
    "train_bpe_tokenizer",
]
