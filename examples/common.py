"""Arguments and model set-up shared by the Trainer examples (run_clm.py, run_mlm.py, run_classification.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import AutoConfig, AutoTokenizer

from linearformers.training import check_block_size, default_tokenizer, load_raw_dataset, new_config, prepare_dataset


@dataclass
class ModelArguments:
    family: str = field(default="performer", metadata={"help": "performer or linformer, for a new model"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "a saved or converted model"})
    config_overrides: str | None = field(
        default=None, metadata={"help": "e.g. hidden_size=256,num_hidden_layers=4,num_attention_heads=4"}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "default: MiniLM's WordPiece (offline)"})


@dataclass
class DataArguments:
    train_file: str | None = None
    validation_file: str | None = None
    dataset_dir: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    block_size: int = 128


def load_everything(model_args: ModelArguments, data_args: DataArguments, task: str, auto_class, seed: int):
    """Tokenizer, tokenized datasets and the model (new, or from model_name_or_path)."""
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or default_tokenizer())
    raw = load_raw_dataset(data_args.train_file, data_args.validation_file, data_args.dataset_dir, seed=seed)
    data, labels = prepare_dataset(
        raw, tokenizer, task, data_args.block_size, data_args.text_column, data_args.label_column
    )
    label_fields = {}
    if labels is not None:
        label_fields = {"num_labels": len(labels), "id2label": dict(enumerate(labels))}
        label_fields["label2id"] = {name: i for i, name in enumerate(labels)}
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, **label_fields)
        check_block_size(config, data_args.block_size)
        model = auto_class.from_pretrained(model_args.model_name_or_path, config=config)
    else:
        config = new_config(model_args.family, task, tokenizer, data_args.block_size, model_args.config_overrides)
        for key, value in label_fields.items():
            setattr(config, key, value)
        check_block_size(config, data_args.block_size)
        model = auto_class.from_config(config)
    return tokenizer, data, model
