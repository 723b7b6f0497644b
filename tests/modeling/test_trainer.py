"""Trainer runs every head unchanged, and the loss falls on a tiny learnable dataset."""

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Trainer,
    TrainingArguments,
)

from tests.conftest import FAMILIES, tiny_config


def _dataset(head: str) -> Dataset:
    g = torch.Generator().manual_seed(0)
    n, length = 16, 10
    ids = torch.randint(3, 99, (n, length), generator=g)
    rows = {"input_ids": ids.tolist(), "attention_mask": torch.ones(n, length, dtype=torch.long).tolist()}
    if head in ("mlm", "clm"):
        rows["labels"] = ids.tolist()
    elif head == "seq":
        rows["labels"] = (ids[:, 0] % 2).tolist()  # the label is a function of the first token
    elif head == "tok":
        rows["labels"] = (ids % 2).tolist()
    elif head == "qa":
        rows["start_positions"] = (ids[:, 0] % length).tolist()
        rows["end_positions"] = (ids[:, 1] % length).tolist()
    elif head == "mc":
        choices = torch.randint(3, 99, (n, 2, length), generator=g)
        rows = {
            "input_ids": choices.tolist(),
            "attention_mask": torch.ones(n, 2, length, dtype=torch.long).tolist(),
            "labels": (choices[:, 0, 0] > choices[:, 1, 0]).long().tolist(),
        }
    return Dataset.from_dict(rows)


HEADS = {
    "mlm": AutoModelForMaskedLM,
    "clm": AutoModelForCausalLM,
    "seq": AutoModelForSequenceClassification,
    "tok": AutoModelForTokenClassification,
    "qa": AutoModelForQuestionAnswering,
    "mc": AutoModelForMultipleChoice,
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", list(HEADS))
def test_trainer_trains_every_head_and_the_loss_falls(family, head, tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(family, is_decoder=head == "clm", num_labels=2)
    model = HEADS[head].from_config(cfg)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        num_train_epochs=12,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(head))
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 24
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.85 * first, f"loss did not fall: {losses}"


def _one_step_update(head, batch_size, accumulation, tmp_path):
    torch.manual_seed(0)
    model = HEADS[head].from_config(tiny_config("performer", is_decoder=head == "clm", num_labels=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=str(tmp_path / f"{batch_size}x{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=_dataset(head).select(range(4))).train()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("head", list(HEADS))
def test_gradient_accumulation_gives_the_update_of_the_whole_batch(head, tmp_path):
    """Batch 4 in one step and 2 x 2 accumulated give the same update: every head's loss either normalises by
    Trainer's num_items_in_batch or tells Trainer it does not (accepts_loss_kwargs), so Trainer scales it."""
    whole = _one_step_update(head, 4, 1, tmp_path)
    accumulated = _one_step_update(head, 2, 2, tmp_path)
    for name, update in whole.items():
        torch.testing.assert_close(accumulated[name], update, rtol=1e-4, atol=1e-6, msg=name)
