"""Inverse-cloze steps: teach a converted long encoder to embed whole documents, on documents of your own.

A long conversion (``convert_bert(..., max_length=N)``, :mod:`.long_context`) distills the original read chunk by
chunk: at best its embedding of a long document is the original's chunk-averaged one, the parity the long-document
benchmark measures. These steps give the converted model an objective of its own on long inputs, the inverse cloze
task (Lee et al., 2019): from each training document, ``passages`` passages of ``passage_length`` tokens are cut out
from beyond its first ``skip`` tokens, and each passage must retrieve the document it was cut from (the document
without them) among the documents of the step and the embeddings of earlier steps' documents (``queue``), by the
cosine of the mean-pooled embeddings (sentence-transformers' pooling), with an InfoNCE loss at ``temperature``. A
passage shares no tokens with its document, so the model is taught what a whole document is about, which a
chunk-wise teacher cannot teach.

Beside it every step adds stage 2's distillation loss on a batch of short transfer blocks (``short_length`` tokens,
the original reading them whole, the model reading them as saved: exactly, when a long conversion set
``hybrid_exact_length``), weighted by ``short_weight``: the contrastive term alone would pull the short-text
embeddings away from the original's. The report gives both sides of the trade on held-out data: top-1 of the
inverse cloze task on ``eval_documents`` held-out documents, and the distillation loss on held-out short blocks,
before and after.

The training documents must be disjoint from any documents you evaluate on; the documented recipe
(docs/conversion.md) trains on the Python standard library's test modules, which the long-document benchmark
leaves out.

    python -m linearformers.conversion.inverse_cloze outputs/minilm-8k-mixed outputs/minilm-8k-cloze \\
        --original outputs/minilm --short_file train.txt --documents $STDLIB/test/test_*.py
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from ..cli import check_writable, raised_by_linearformers
from ..modeling.base import LinearAttentionPreTrainedModel
from .transfer import (
    _check_int,
    _distillation_loss,
    _mean_distillation_loss,
    _read_as,
    hybrid_at_every_length,
    text_blocks,
    transfer_parameters,
)


@dataclass
class InverseClozeArguments:
    """Settings of :func:`inverse_cloze_finetune`; each is checked at construction (a ValueError names the field).

    Args:
        steps: optimizer steps (default 20).
        length: tokens of each training document, [CLS] and [SEP] included, its first ``length - 2`` tokens after
            the passages are cut out; at most the model's positions (default 2048).
        batch_size: documents per step (default 8).
        passages: passages cut from each document per step, each a query (default 4).
        passage_length: tokens of a passage, without [CLS] / [SEP] (default 64).
        skip: passages come from beyond a document's first ``skip`` tokens (default 512, the original's positions:
            what no single chunk of the original sees with the document's start).
        temperature: of the InfoNCE loss over cosines (default 0.05).
        queue: earlier steps' document embeddings (no gradient) kept as extra negatives (default 0: the step's
            documents only).
        learning_rate: AdamW learning rate of every pretrained weight (default 1e-5).
        new_learning_rate: AdamW learning rate of the new attention parameters (feature maps, window balances,
            scales) (default 1e-12: they stay practically where the distillation left them, which holds the
            short-text fit; docs/conversion.md).
        short_length: tokens of the short transfer blocks of the distillation term (default 256).
        short_weight: weight of the distillation term (default 10).
        eval_documents: documents held out to measure the task before and after (default 32).
        seed: seed of the documents' order and the passages' places; the global RNG is left as it was (default 0).
        progress: show a tqdm progress bar (default True).
    """

    steps: int = 20
    length: int = 2048
    batch_size: int = 8
    passages: int = 4
    passage_length: int = 64
    skip: int = 512
    temperature: float = 0.05
    queue: int = 0
    learning_rate: float = 1e-5
    new_learning_rate: float = 1e-12
    short_length: int = 256
    short_weight: float = 10.0
    eval_documents: int = 32
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name, low in (
            ("steps", 1),
            ("length", 3),
            ("batch_size", 2),
            ("passages", 1),
            ("passage_length", 1),
            ("skip", 0),
            ("queue", 0),
            ("short_length", 3),
            ("eval_documents", 2),
        ):
            _check_int(f"InverseClozeArguments.{name}", getattr(self, name), low)
        _check_int("InverseClozeArguments.seed", self.seed, None)
        for name in ("temperature", "learning_rate", "new_learning_rate", "short_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"InverseClozeArguments.{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "short_weight"):
                low = ">= 0" if name == "short_weight" else "> 0"
                raise ValueError(f"InverseClozeArguments.{name} must be a finite number {low}, got {value}")
        if self.skip >= self.length - 2:
            raise ValueError(
                f"InverseClozeArguments.skip {self.skip} leaves no place for passages in a document of length "
                f"{self.length} ({self.length - 2} tokens without [CLS] / [SEP])"
            )
        if not isinstance(self.progress, bool):
            raise TypeError(f"InverseClozeArguments.progress must be True or False, got {self.progress!r}")

    @property
    def document_tokens(self) -> int:
        """Tokens a training document needs (without special tokens): the kept body plus the cut passages."""
        return self.length - 2 + self.passages * self.passage_length


@dataclass
class InverseClozeReport:
    """What :func:`inverse_cloze_finetune` did: the task's top-1 on the held-out documents (one passage each, cut
    at seeded places) and the distillation loss on the held-out short blocks, before and after; the training
    loss of the first and last steps."""

    steps: int
    seconds: float
    documents: int
    eval_documents: int
    top1_before: float
    top1_after: float
    short_loss_before: float
    short_loss_after: float
    loss_first: float
    loss_last: float
    losses: list[float] = field(default_factory=list, repr=False)
    short_exact_length: int | None = None

    def __str__(self) -> str:
        return "\n".join(
            [
                f"inverse cloze: {self.steps} steps on {self.documents} documents in {self.seconds:.1f} s (training "
                f"loss {self.loss_first:.4g} -> {self.loss_last:.4g})",
                f"  a passage retrieves its document, top-1 on {self.eval_documents} held-out documents: "
                f"{self.top1_before:.3f} -> {self.top1_after:.3f}",
                f"  distillation loss on the held-out short blocks{_read_as(self.short_exact_length)}: "
                f"{self.short_loss_before:.4g} -> "
                f"{self.short_loss_after:.4g}",
            ]
        )


def document_tokens(tokenizer: PreTrainedTokenizerBase, documents: Sequence[str], tokens: int) -> list[list[int]]:
    """The first ``tokens`` tokens (no special tokens) of every document that has that many; shorter ones are left
    out. Only the start of a text is tokenized (16 characters a token is ample for text and source)."""
    if isinstance(documents, str) or not (
        isinstance(documents, Sequence) and all(isinstance(text, str) for text in documents)
    ):
        raise TypeError(f"documents must be a list of strings, got {type(documents).__name__}")
    rows = tokenizer([text[: 16 * tokens] for text in documents], add_special_tokens=False, verbose=False)
    return [row[:tokens] for row in rows["input_ids"] if len(row) >= tokens]


def _cut(row: list[int], args: InverseClozeArguments, rng: random.Random, cls: int, sep: int) -> tuple[list, list]:
    """``args.passages`` non-overlapping passages at random places beyond ``args.skip``, each wrapped in [CLS] /
    [SEP], and the document without them, its first ``length - 2`` tokens wrapped."""
    size, body = args.passage_length, args.length - 2
    # the row holds body + passages x size tokens: laid end to end from skip, the passages leave body - skip tokens
    # of slack; sorted distinct draws less their rank give each passage's share of it, in order, without overlap
    offsets = sorted(rng.sample(range(body - args.skip + args.passages), args.passages))
    starts = [args.skip + offset - i + i * size for i, offset in enumerate(offsets)]
    queries, kept, last = [], [], 0
    for start in starts:
        queries.append([cls, *row[start : start + size], sep])
        kept += row[last:start]
        last = start + size
    kept += row[last:]
    return queries, [cls, *kept[:body], sep]


def _embed(model: PreTrainedModel, rows: list[list[int]]) -> torch.Tensor:
    """(len(rows), hidden) unit-norm mean-pooled last hidden states of rows of one length."""
    device = next(model.parameters()).device
    ids = torch.tensor(rows, dtype=torch.long, device=device)
    hidden = model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    return F.normalize(hidden.float().mean(1), dim=-1)


def _held_out_top1(model, documents: list[list[int]], args: InverseClozeArguments, cls: int, sep: int) -> float:
    """Top-1 of one passage per held-out document (places seeded by ``args.seed``) among those documents."""
    rng = random.Random(args.seed)
    one = replace(args, passages=1, progress=False)
    cuts = [_cut(row, one, rng, cls, sep) for row in documents]
    with torch.no_grad():
        queries = torch.cat([_embed(model, query) for query, _ in cuts])
        kept = torch.cat([_embed(model, [document]) for _, document in cuts])
    return (queries @ kept.T).argmax(1).eq(torch.arange(len(cuts), device=kept.device)).float().mean().item()


def inverse_cloze_finetune(
    model: PreTrainedModel,
    source: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    documents: Sequence[str],
    short_texts: str | Path | Sequence[str],
    args: InverseClozeArguments | None = None,
) -> InverseClozeReport:
    """Train the converted encoder ``model`` (every weight) on the inverse cloze task over ``documents`` (texts,
    each one document with at least ``args.document_tokens`` tokens; shorter ones are left out), plus stage 2's
    distillation from ``source`` (the original BERT) on blocks of ``short_texts`` (a text file's path or a list of
    strings, as :func:`transfer.text_blocks`), tokenized by ``tokenizer``. The first ``args.eval_documents``
    documents and the first batch of short blocks are held out to measure; the module docstring says what is
    taught and why. The model is left in eval mode with its gradients' flags as they were, the source in its mode."""
    args = InverseClozeArguments() if args is None else args
    if not isinstance(args, InverseClozeArguments):
        raise TypeError(f"args must be InverseClozeArguments, got {type(args).__name__}")
    if not isinstance(model, LinearAttentionPreTrainedModel) or model.config.is_decoder:
        raise TypeError(f"model must be a converted linearformers encoder, got {type(model).__name__}")
    if not isinstance(source, PreTrainedModel) or source.config.num_hidden_layers != model.config.num_hidden_layers:
        raise TypeError(
            f"source must be the BERT the model was converted from ({model.config.num_hidden_layers} layers), got "
            f"{type(source).__name__}"
        )
    model.config.check_input_length(args.length)
    source_positions = source.config.max_position_embeddings
    if args.short_length > source_positions:
        raise ValueError(
            f"InverseClozeArguments.short_length {args.short_length} exceeds the source's {source_positions} "
            "positions: the short blocks are read by the original whole"
        )
    if args.passage_length + 2 > source_positions:
        raise ValueError(
            f"InverseClozeArguments.passage_length must leave room for [CLS] / [SEP] in {source_positions}"
        )
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls is None or sep is None:
        raise ValueError(f"{type(tokenizer).__name__} has no [CLS] / [SEP] tokens; pass the BERT's tokenizer")
    rows = document_tokens(tokenizer, documents, args.document_tokens)
    needed = args.eval_documents + args.batch_size
    if len(rows) < needed:
        raise ValueError(
            f"{len(rows)} of {len(documents)} documents have the {args.document_tokens} tokens a training document "
            f"needs (length {args.length} + {args.passages} passages of {args.passage_length}); give at least "
            f"{needed} ({args.eval_documents} held out + a batch of {args.batch_size}) or lower length"
        )
    blocks = text_blocks(tokenizer, short_texts, args.short_length, wrap=True)
    if blocks.shape[0] < 2 * args.batch_size:
        raise ValueError(
            f"short_texts give {blocks.shape[0]} blocks of {args.short_length} tokens; give at least "
            f"{2 * args.batch_size} (a held-out batch and one to train on)"
        )
    held_rows, rows = rows[: args.eval_documents], rows[args.eval_documents :]
    held_short = [(blocks[: args.batch_size], torch.ones_like(blocks[: args.batch_size], dtype=torch.bool))]
    blocks = blocks[args.batch_size :]

    state, source_mode = torch.random.get_rng_state(), source.training
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    new = {id(param) for _, param in transfer_parameters(model)}
    groups = [
        {"params": [p for p in model.parameters() if id(p) in new], "lr": args.new_learning_rate},
        {"params": [p for p in model.parameters() if id(p) not in new], "lr": args.learning_rate},
    ]
    with hybrid_at_every_length(model) as as_saved:  # the steps fit the hybrid, the short term reads as saved
        try:
            model.eval()  # dropout off, as in stage 2: the distillation targets are deterministic
            source.eval()
            top1_before = _held_out_top1(model, held_rows, args, cls, sep)
            with as_saved():
                short_before = _mean_distillation_loss(model, source, held_short)
            for param in model.parameters():
                param.requires_grad_(True)
            optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=0.0)
            schedule = get_cosine_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)
            order = [
                i
                for _ in range(math.ceil(args.steps * args.batch_size / len(rows)))
                for i in rng.sample(range(len(rows)), len(rows))
            ]
            queue = torch.zeros(0, model.config.hidden_size)
            losses = []
            start = time.perf_counter()
            with tqdm(total=args.steps, desc="inverse cloze", disable=not args.progress) as bar:
                for step in range(args.steps):
                    cuts = [
                        _cut(rows[i], args, rng, cls, sep)
                        for i in order[step * args.batch_size : (step + 1) * args.batch_size]
                    ]
                    queries = _embed(model, [query for queries, _ in cuts for query in queries])
                    kept = _embed(model, [document for _, document in cuts])
                    candidates = torch.cat([kept, queue.to(kept.device)])
                    target = torch.arange(len(cuts), device=kept.device).repeat_interleave(args.passages)
                    loss = F.cross_entropy(queries @ candidates.T / args.temperature, target)
                    if args.short_weight:
                        batch = blocks[torch.randint(blocks.shape[0], (args.batch_size,), generator=generator)]
                        with as_saved():
                            short_loss = _distillation_loss(
                                model, source, batch, torch.ones_like(batch, dtype=torch.bool)
                            )
                        loss = loss + args.short_weight * short_loss
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    optimizer.zero_grad(set_to_none=True)
                    queue = torch.cat([kept.detach().cpu(), queue])[: args.queue]
                    losses.append(loss.item())
                    bar.set_postfix(loss=f"{losses[-1]:.4g}")
                    bar.update()
            seconds = time.perf_counter() - start
            top1_after = _held_out_top1(model, held_rows, args, cls, sep)
            with as_saved():
                short_after = _mean_distillation_loss(model, source, held_short)
                exact_length = getattr(model.config, "hybrid_exact_length", None)
        finally:
            for name, param in model.named_parameters():
                param.requires_grad_(flags[name])
            model.eval()
            source.train(source_mode)
            torch.random.set_rng_state(state)
    return InverseClozeReport(
        steps=args.steps,
        seconds=seconds,
        documents=len(rows),
        eval_documents=len(held_rows),
        top1_before=top1_before,
        top1_after=top1_after,
        short_loss_before=short_before,
        short_loss_after=short_after,
        short_exact_length=exact_length,
        loss_first=losses[0],
        loss_last=losses[-1],
        losses=losses,
    )


def main(argv: list[str] | None = None) -> None:
    """The command line: a converted long encoder's folder in, the trained copy's folder out (every other file of
    the input folder, tokenizer and sentence-transformers files, copied with it). Bad input exits 2 with one
    ``error:`` line, the output folder checked before any work."""
    parser = argparse.ArgumentParser(
        prog="python -m linearformers.conversion.inverse_cloze",
        description="Inverse-cloze steps on a converted long encoder (module docstring)",
    )
    parser.add_argument("model", help="folder of an encoder converted with --max_length (the conversion CLI's output)")
    parser.add_argument("output", help="folder to save the trained model in; not the input folder")
    parser.add_argument("--original", required=True, help="folder or Hub id of the BERT the model was converted from")
    parser.add_argument("--short_file", required=True, help="UTF-8 text file of the distillation term's short blocks")
    parser.add_argument(
        "--documents", required=True, nargs="+", metavar="FILE", help="UTF-8 text files, one document each"
    )
    for f in fields(InverseClozeArguments):
        if f.name == "progress":
            parser.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
            continue
        kind = type(f.default)
        parser.add_argument(
            f"--{f.name}", type=kind, default=f.default, metavar=f.name.upper(), help=f"(default {f.default})"
        )
    args = parser.parse_args(argv)
    from transformers import AutoModel, AutoTokenizer

    try:
        settings = InverseClozeArguments(**{f.name: getattr(args, f.name) for f in fields(InverseClozeArguments)})
        if Path(args.output).resolve() == Path(args.model).resolve():
            raise ValueError(f"output {args.output!r} is the input folder; give a new folder (the input is kept)")
        if not Path(args.model, "config.json").is_file():
            raise ValueError(f"{args.model!r} holds no config.json; give the folder the conversion CLI wrote")
        missing = [name for name in args.documents if not Path(name).is_file()]
        if missing:
            raise ValueError(f"--documents: {missing[0]!r} is not a file ({len(missing)} of {len(args.documents)})")
        check_writable(args.output, "output", "the trained model")
        texts = [Path(name).read_text(encoding="utf-8", errors="replace") for name in args.documents]
        model = AutoModel.from_pretrained(args.model)
        source = AutoModel.from_pretrained(args.original)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        report = inverse_cloze_finetune(model, source, tokenizer, texts, args.short_file, settings)
    except (TypeError, ValueError) as error:
        if not raised_by_linearformers(error):
            raise
        parser.error(" ".join(str(error).split()))
    shutil.copytree(args.model, args.output, dirs_exist_ok=True)
    model.save_pretrained(args.output)
    print(report)


__all__ = ["InverseClozeArguments", "InverseClozeReport", "document_tokens", "inverse_cloze_finetune"]

if __name__ == "__main__":
    main()
