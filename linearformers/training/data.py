"""Data pipelines on `datasets`: local text / csv / json files or a saved dataset directory, tokenized with
`map(batched=True)`, grouped into fixed-length blocks for language modelling."""

from __future__ import annotations

import codecs
import math
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

TASKS = ("mlm", "clm", "classification")
VALIDATION_SPLIT = 0.05  # the share of training rows (or LM blocks) held out when there is no validation data
_BUILDERS = {".txt": "text", ".text": "text", ".csv": "csv", ".json": "json", ".jsonl": "json"}


def load_raw_dataset(
    train_file: str | None = None,
    validation_file: str | None = None,
    dataset_dir: str | None = None,
    validation_split: float = VALIDATION_SPLIT,
    seed: int = 0,
    sample_by: str = "line",
) -> DatasetDict:
    """A DatasetDict with "train" and "validation" from local files or a `save_to_disk` folder.

    Rows of a text file are its lines, or with ``sample_by="paragraph"`` its paragraphs (separated by a blank line;
    line breaks inside a paragraph are kept): the documents a causal LM separates with end-of-text. Without a
    validation file or split, ``validation_split`` of the training rows are held out (seeded); where that would hold
    out every row (a text without blank lines is one paragraph), the DatasetDict has "train" only, and
    ``prepare_dataset`` holds out LM blocks instead. An empty file, or one that is not UTF-8 text, raises a
    ValueError naming it.
    """
    if not 0 < validation_split < 1:
        raise ValueError(
            f"validation_split must be a fraction strictly between 0 and 1, got {validation_split!r} (the share of "
            "training rows held out when there is no validation file)"
        )
    if dataset_dir is not None:
        if not Path(dataset_dir).is_dir():
            raise ValueError(f"dataset_dir {dataset_dir!r} does not exist or is not a folder saved by save_to_disk")
        loaded = load_from_disk(dataset_dir)
        raw = loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})
    else:
        if train_file is None:
            raise ValueError("pass train_file (a .txt, .csv, .json or .jsonl file) or dataset_dir")
        files = {"train": train_file}
        if validation_file is not None:
            files["validation"] = validation_file
        for split, path in files.items():
            if not Path(path).is_file():
                raise ValueError(f"{split} file {path!r} does not exist")
            if Path(path).stat().st_size == 0:
                raise ValueError(f"{split} file {path!r} is empty; pass a file with data in it")
        suffixes = {Path(p).suffix.lower() for p in files.values()}
        if len(suffixes) != 1 or next(iter(suffixes)) not in _BUILDERS:
            raise ValueError(f"data files must share one of the extensions {sorted(_BUILDERS)}, got {sorted(suffixes)}")
        builder = _BUILDERS[suffixes.pop()]
        options = {"sample_by": sample_by} if builder == "text" else {}
        try:
            raw = load_dataset(builder, data_files=files, **options)
        except Exception as error:
            # datasets' own errors (DatasetGenerationError, a bare StopIteration for an empty JSON file) name no file
            for split, path in files.items():
                _check_utf8(split, path)
            if not isinstance(error, (DatasetGenerationError, StopIteration, ValueError)):
                raise
            raise ValueError(
                f"could not read {' and '.join(f'the {s} file {p!r}' for s, p in files.items())} as {builder}: "
                f"{type(error).__name__}: {error}"
            ) from error
    if "train" not in raw:
        raise ValueError(f"the dataset has no 'train' split; it has {list(raw)}")
    if "validation" not in raw and _splittable(len(raw["train"]), validation_split):
        raw = _hold_out(raw["train"], validation_split, seed)
    return raw


def _splittable(rows: int, validation_split: float) -> bool:
    """Whether ``Dataset.train_test_split`` leaves rows on both sides: it holds out ceil(share * rows) and keeps
    floor((1 - share) * rows)."""
    return math.ceil(validation_split * rows) >= 1 and math.floor((1 - validation_split) * rows) >= 1


def _hold_out(dataset: Dataset, validation_split: float, seed: int) -> DatasetDict:
    parts = dataset.train_test_split(test_size=validation_split, seed=seed)
    return DatasetDict({"train": parts["train"], "validation": parts["test"]})


def _check_utf8(split: str, path: str) -> None:
    """Raise a ValueError naming ``path`` and the offset of its first byte that is not UTF-8."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                # error.object is the decoder's pending bytes of the previous chunk, then this chunk
                at = offset - (len(error.object) - len(chunk)) + error.start
                raise ValueError(
                    f"{split} file {path!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {at}); "
                    "is it a binary file? Pass a UTF-8 text, csv or json file."
                ) from None
            offset += len(chunk)


def _is_empty(cell) -> bool:
    return (
        cell is None or (isinstance(cell, str) and not cell.strip()) or (isinstance(cell, float) and math.isnan(cell))
    )


def _require_column(dataset: Dataset, column: str, what: str) -> None:
    if column not in dataset.column_names:
        raise ValueError(
            f"the dataset has no {what} column {column!r}; its columns are {dataset.column_names}. "
            f"Pass --{what}_column with the right name."
        )


def prepare_dataset(
    raw: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    block_size: int,
    text_column: str = "text",
    label_column: str = "label",
    validation_split: float = VALIDATION_SPLIT,
    seed: int = 0,
) -> tuple[DatasetDict, list[str] | None]:
    """Tokenize for ``task``. LM tasks concatenate all texts and cut them into blocks of ``block_size``
    tokens (for clm, each text followed by the tokenizer's end-of-text token when it has one, so documents are
    separated in the blocks and the model learns where text ends); classification truncates each text to
    ``block_size``. Returns the datasets and, for classification, the label names (sorted, as found in train).

    ``raw`` without "validation" (too few rows to hold out whole ones, see ``load_raw_dataset``): LM tasks hold out
    ``validation_split`` of the blocks (seeded by ``seed``); too few blocks, or classification, raise a ValueError.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if "validation" not in raw and task == "classification":
        raise ValueError(
            f"the training data has {len(raw['train'])} row(s), too few to hold out a validation share of "
            f"{validation_split}; add rows or pass --validation_file"
        )
    for split in raw.values():
        _require_column(split, text_column, "text")
        if task == "classification":
            _require_column(split, label_column, "label")
    if task == "classification":
        for name, split in raw.items():
            cells = split[label_column]
            empty = [i for i, cell in enumerate(cells) if _is_empty(cell)]
            if empty:
                raise ValueError(
                    f"the {name} split has {len(empty)} empty cell{'s' if len(empty) > 1 else ''} in label column "
                    f"{label_column!r} (the first beside the text {str(split[empty[0]][text_column])[:60]!r}); every "
                    "row needs its class: fill them in or drop those rows"
                )
        labels = sorted({str(x) for x in raw["train"][label_column]})
        if len(labels) < 2:
            raise ValueError(
                f"label column {label_column!r} of the train split holds a single class {labels}; classification needs "
                "at least two (with one, the model would be a regression head and score accuracy 1.0). Check "
                "--label_column and the data."
            )
        index = {name: i for i, name in enumerate(labels)}
        for name, split in raw.items():
            unknown = sorted({str(x) for x in split[label_column]} - set(labels))
            if unknown:
                raise ValueError(
                    f"the {name} split has labels the train split lacks: {unknown[:10]}; the model's classes come "
                    f"from train ({labels[:10]}{', ...' if len(labels) > 10 else ''})"
                )

        def encode(batch):
            enc = tokenizer(batch[text_column], truncation=True, max_length=block_size)
            enc["labels"] = [index[str(x)] for x in batch[label_column]]
            return enc

        columns = raw["train"].column_names
        return raw.map(encode, batched=True, remove_columns=columns), labels

    end = tokenizer.eos_token_id if task == "clm" else None

    def tokenize(batch):
        encoded = tokenizer([str(text) for text in batch[text_column]], add_special_tokens=False)
        if end is not None:
            encoded["input_ids"] = [[*ids, end] for ids in encoded["input_ids"]]
        return {"input_ids": encoded["input_ids"]}

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        usable = (len(ids) // block_size) * block_size
        blocks = [ids[i : i + block_size] for i in range(0, usable, block_size)]
        out = {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks]}
        if task == "clm":
            out["labels"] = [list(b) for b in blocks]
        return out

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    grouped = tokenized.map(group, batched=True, batch_size=1000, remove_columns=tokenized["train"].column_names)
    if "validation" not in grouped:
        blocks = len(grouped["train"])
        if not _splittable(blocks, validation_split):
            raise ValueError(
                f"the training text gives {blocks} block(s) of block_size={block_size} tokens, too few to hold out "
                f"{validation_split} of them for validation and train on the rest (one paragraph cannot be split "
                "by rows). Add text, lower --block_size or pass --validation_file"
            )
        grouped = _hold_out(grouped["train"], validation_split, seed)
    for name, split in grouped.items():
        if len(split) == 0:
            raise ValueError(
                f"the {name} split has fewer than block_size={block_size} tokens; lower block_size or add text"
            )
    return grouped, None


def check_block_size(config: PreTrainedConfig, block_size: int) -> None:
    """Raise a ValueError naming the limit if the model cannot take blocks of ``block_size`` tokens (the config says
    what its longest input is: ``config.sequence_limit()``)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    limit = config.sequence_limit()
    if limit is not None and block_size > limit[0]:
        raise ValueError(
            f"block_size={block_size} is beyond what this model supports: {limit[1]}={limit[0]}. "
            f"Lower --block_size or build the model with a larger {limit[1]}."
        )
