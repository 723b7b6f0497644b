"""Arguments and model set-up shared by the Trainer examples (run_clm.py, run_mlm.py, run_classification.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from linearformers.modeling.registry import FAMILIES
from linearformers.training import (
    check_block_size,
    default_tokenizer,
    label_fields,
    load_raw_dataset,
    new_config,
    prepare_dataset,
    train_bpe_tokenizer,
)


@dataclass
class ModelArguments:
    family: str = field(default="performer", metadata={"help": "attention of a new model", "choices": tuple(FAMILIES)})
    model_name_or_path: str | None = field(default=None, metadata={"help": "a saved or converted model"})
    config_overrides: str | None = field(
        default=None, metadata={"help": "e.g. hidden_size=256,num_hidden_layers=4,num_attention_heads=4"}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "default: for run_clm.py a byte-level BPE trained on train_file (with an end-of-text token that "
            "generation stops at), otherwise MiniLM's WordPiece (offline)"
        },
    )


@dataclass
class DataArguments:
    train_file: str | None = None
    validation_file: str | None = None
    dataset_dir: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    block_size: int = 128


def load_everything(model_args: ModelArguments, data_args: DataArguments, task: str, auto_class, seed: int):
    """Tokenizer, tokenized datasets and the model (new, or from model_name_or_path).

    A new causal LM gets a byte-level BPE trained on its training text, as ``linearformers-train --task clm`` does:
    WordPiece has no end-of-text, so generation would never stop, and it splits code into ``_ _ init _ _``.
    """
    sample_by = "paragraph" if task == "clm" else "line"  # a causal LM's documents end with end-of-text
    raw = load_raw_dataset(
        data_args.train_file, data_args.validation_file, data_args.dataset_dir, seed=seed, sample_by=sample_by
    )
    saved = model_args.model_name_or_path
    if model_args.tokenizer_name:
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    elif saved and (Path(saved) / "tokenizer_config.json").is_file():  # a model saved with its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(saved)
    elif task == "clm" and not saved:
        texts = (str(text) for text in raw["train"][data_args.text_column] if text is not None)
        tokenizer = train_bpe_tokenizer(texts)
    else:
        tokenizer = AutoTokenizer.from_pretrained(default_tokenizer())
    data, labels = prepare_dataset(
        raw, tokenizer, task, data_args.block_size, data_args.text_column, data_args.label_column, seed=seed
    )
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, **label_fields(labels))
        check_block_size(config, data_args.block_size)
        model = auto_class.from_pretrained(model_args.model_name_or_path, config=config)
    else:
        overrides = model_args.config_overrides
        config = new_config(model_args.family, task, tokenizer, data_args.block_size, overrides, labels)
        check_block_size(config, data_args.block_size)
        model = auto_class.from_config(config)
    if task == "clm" and tokenizer.eos_token_id is not None:  # generate() stops at end-of-text and pads with it
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            setattr(model.config, name, getattr(tokenizer, name))
            setattr(model.generation_config, name, getattr(tokenizer, name))
    return tokenizer, data, model
