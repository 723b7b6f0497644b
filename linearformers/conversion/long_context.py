"""Conversion to a target length: a BERT of 512 positions into a linear-attention encoder that reads N tokens.

A converted model's attention is linear in the length, but what it inherits is not: BERT's learned position table
has 512 rows, and Linformer's E / F are k x n. ``convert_bert(..., max_length=N)`` builds both for N and teaches the
new model with the original as a *chunk-wise* teacher, since the original cannot see N tokens:

* **Positions** (:func:`extend_positions`): ``"tile"`` (the default) keeps the original's rows for the first 512
  positions, so an input of up to 512 tokens gets exactly the original's embeddings, and gives position p >= 512 the
  row of its place inside its teacher chunk, 1 + (p - 1) mod 510 (each chunk is [CLS] + 510 tokens + [SEP]): the
  student's embeddings of a long input are then those the teacher computed its chunks from. The rows stay
  trainable (stage 2 distillation trains them). Local order is carried by the position rows inside a chunk and by
  the exact window of the hybrid heads across chunk borders. ``"interpolate"`` stretches the table linearly over N
  rows instead (every position distinct, short inputs no longer exact), to compare against.
* **The teacher** (:class:`ChunkedTeacher`): a block of N tokens [CLS] t_1 ... t_{N-2} [SEP] is cut into chunks
  [CLS] + 510 tokens + [SEP] that the original reads one by one. Each token of the block takes the original's hidden
  states of its chunk, at every layer; stage 1 (attention transfer) fits each layer's attention on those inputs to
  the original's attention output inside the chunk, and stage 2 fits every layer's hidden states to the chunks'.
  The student's mean-pooled last hidden states then aim at the mean of the chunks' token states: the original's
  chunk-averaged sentence embedding, each chunk weighted by its tokens.
* **Linformer** E / F are built k x N (``max_seq_length=N``) and start as window means (pooling over N / k tokens per
  slot), with k = the original's 512 positions unless ``projected_length`` is given.

The query-scale calibration and the choice of local heads fit the original's attention, so they run on the chunks
(at most 512 tokens, where that attention is defined) before the long transfer (:func:`long_attention_transfer`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .transfer import (
    TransferArguments,
    TransferReport,
    _batches,
    _distillation_loss,
    _finetune_groups,
    _mean_distillation_loss,
    _projections,
    _train,
    attention_transfer,
    calibrate_query_scale,
    choose_local_heads,
    hybrid_at_every_length,
    softmax_attention_output,
    transfer_parameters,
)

POSITION_INITS = ("tile", "interpolate")
POSITION_KEY = "embeddings.position_embeddings.weight"


def check_max_length(max_length: object, positions: Literal[POSITION_INITS]) -> None:
    """A TypeError / ValueError naming the value unless ``max_length`` is None (no long conversion, and ``positions``
    left at "tile") or an int >= 3 and ``positions`` a known initialization of the extended position rows."""
    if max_length is None:
        if positions != "tile":
            raise ValueError(f"long_positions={positions!r} sets the rows of a long conversion: pass max_length too")
        return
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length must be an int (the longest input of the converted model), got {max_length!r}")
    if max_length < 3:
        raise ValueError(f"max_length must be >= 3 ([CLS], a token, [SEP]), got {max_length}")
    if positions not in POSITION_INITS:
        raise ValueError(f"long_positions must be one of {', '.join(map(repr, POSITION_INITS))}, got {positions!r}")


def long_overrides(config_class: type, overrides: dict, max_length: int, source_positions: int) -> dict:
    """The user's config ``overrides`` for a model of ``max_length`` tokens: a family whose attention is sized by the
    length (Linformer's ``max_seq_length``) gets N, and k = the source's positions unless given (k = N would make E /
    F N x N). A ValueError when the user asked for another length. Past the source's positions the feed-forward
    runs the source's positions at a time (``chunk_size_feed_forward``, unless given): the same outputs, with its
    (n, intermediate) temporaries cut to what the original made at once, which on a CPU stay in the heap instead of
    being mapped and faulted in again at every layer. A hybrid reads inputs of up to the source's positions with
    exact softmax (``hybrid_exact_length``, unless given): there it costs what the original costs, and it is what
    the transfer imitates."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    overrides = dict(overrides)
    if max_length > source_positions:
        overrides.setdefault("chunk_size_feed_forward", source_positions)
        if "hybrid_exact_length" in fields and overrides.get("hybrid_window"):
            overrides.setdefault("hybrid_exact_length", source_positions)
    if "max_seq_length" in fields:
        given = overrides.get("max_seq_length")
        if given is not None and given != max_length:
            raise ValueError(
                f"max_seq_length={given} and max_length={max_length} disagree; max_length sets the Linformer's "
                "max_seq_length: leave max_seq_length out"
            )
        overrides["max_seq_length"] = max_length
        overrides.setdefault("projected_length", min(max_length, source_positions))
    return overrides


def extend_positions(table: torch.Tensor, max_length: int, method: Literal[POSITION_INITS] = "tile") -> torch.Tensor:
    """A position table of ``max_length`` rows from a BERT's (P, hidden) ``table`` (see the module docstring).

    ``"tile"``: rows 0 .. P - 1 are the original's, row p >= P is row 1 + (p - 1) mod (P - 2), the place of position
    p inside its chunk [CLS] + P - 2 tokens + [SEP]. ``"interpolate"``: the P rows stretched linearly over
    ``max_length`` (first and last rows kept). ``max_length`` <= P: the first ``max_length`` rows, either way.
    Returns (max_length, hidden)."""
    rows = table.shape[0]
    if max_length <= rows:
        return table[:max_length].clone()
    if method == "interpolate":
        return F.interpolate(table.T[None].float(), size=max_length, mode="linear", align_corners=True)[0].T.to(table)
    if rows < 3:
        raise ValueError(f"tiling needs a position table of at least 3 rows ([CLS], a token, [SEP]), got {rows}")
    index = torch.arange(max_length)
    index[rows:] = 1 + (index[rows:] - 1) % (rows - 2)
    return table[index].clone()


def with_long_positions(copies: Sequence, max_length: int, method: Literal[POSITION_INITS]) -> list:
    """The conversion's mapping table (``convert.Copy`` rows) with the position table extended to ``max_length``
    rows on its way into the model."""
    return [
        dataclasses.replace(copy, take=lambda table: extend_positions(table, max_length, method), part="extended")
        if copy.source.endswith(POSITION_KEY)
        else copy
        for copy in copies
    ]


@dataclasses.dataclass
class ChunkLayout:
    """Where each token of a batch of long blocks sits in the teacher's chunks.

    ids, mask: (chunks, C) the chunks the original reads (mask: True for real tokens; the last chunk of a block can
    be shorter). index: (batch, n) the flat position (chunk * C + place) of each token of the blocks in the chunks;
    padding points at 0 (its value is masked out)."""

    ids: torch.Tensor
    mask: torch.Tensor
    index: torch.Tensor

    def gather(self, chunked: torch.Tensor) -> torch.Tensor:
        """(chunks, C, hidden) chunk states -> (batch, n, hidden) states of the blocks' tokens."""
        return chunked.reshape(-1, chunked.shape[-1])[self.index]


def chunk_layout(ids: torch.Tensor, mask: torch.Tensor, chunk_length: int) -> ChunkLayout:
    """The teacher's chunks of ``ids`` (batch, n) with real tokens ``mask`` (batch, n) bool: a row of at most
    ``chunk_length`` real tokens is one chunk, as it is; a longer row [first] t_1 ... t_r [last] becomes chunks
    [first] + chunk_length - 2 tokens + [last] (for BERT: [CLS] ... [SEP], the input it was trained on)."""
    body = chunk_length - 2
    chunks, places = [], []
    for row, real in zip(ids, mask):
        tokens = row[real]
        count = tokens.shape[0]
        if count <= chunk_length:
            places.append(torch.stack([torch.full((count,), len(chunks)), torch.arange(count)], 1))
            chunks.append(tokens)
            continue
        first, inner, last = tokens[:1], tokens[1:-1], tokens[-1:]
        start = len(chunks)
        pieces = inner.split(body)
        chunks += [torch.cat([first, piece, last]) for piece in pieces]
        inner_index = torch.arange(inner.shape[0])
        row_places = [
            torch.tensor([[start, 0]]),
            torch.stack([start + inner_index // body, 1 + inner_index % body], 1),
            torch.tensor([[start + len(pieces) - 1, pieces[-1].shape[0] + 1]]),
        ]
        places.append(torch.cat(row_places))
    width = max(chunk.shape[0] for chunk in chunks)
    chunk_ids = torch.zeros(len(chunks), width, dtype=ids.dtype)
    chunk_mask = torch.zeros(len(chunks), width, dtype=torch.bool)
    for i, chunk in enumerate(chunks):
        chunk_ids[i, : chunk.shape[0]] = chunk
        chunk_mask[i, : chunk.shape[0]] = True
    index = torch.zeros(ids.shape, dtype=torch.long)
    for b, (real, place) in enumerate(zip(mask, places)):
        index[b, real] = place[:, 0] * width + place[:, 1]
    return ChunkLayout(chunk_ids.to(ids.device), chunk_mask.to(ids.device), index.to(ids.device))


class ChunkedTeacher(nn.Module):
    """The original BERT read chunk by chunk (:func:`chunk_layout`), as attention transfer's ``source`` for blocks
    longer than it accepts: its forward returns, for every token of the blocks, the hidden states of its chunk at
    every layer, and :meth:`layer_inputs` the per-layer attention inputs and targets inside each chunk."""

    def __init__(self, source: PreTrainedModel, chunk_length: int | None = None):
        super().__init__()
        if getattr(source.config, "is_decoder", False) or source.config.model_type != "bert":
            raise ValueError(
                f"ChunkedTeacher reads a BERT encoder chunk by chunk, got {type(source).__name__}; a long conversion "
                "is for convert_bert"
            )
        limit = source.config.max_position_embeddings
        chunk_length = limit if chunk_length is None else chunk_length
        if isinstance(chunk_length, bool) or not isinstance(chunk_length, int) or not 3 <= chunk_length <= limit:
            raise ValueError(
                f"chunk_length must be an int in 3 .. {limit} (the source's positions), got {chunk_length}"
            )
        self.source = source
        self.chunk_length = chunk_length
        self.training = source.training  # its mode is the source's: restoring it must not switch the source

    @property
    def config(self) -> PreTrainedConfig:
        return self.source.config

    @property
    def device(self) -> torch.device:
        return self.source.device

    @property
    def base_model(self) -> ChunkedTeacher:
        return self

    def get_input_embeddings(self) -> nn.Module:
        return self.source.get_input_embeddings()

    def _chunk_states(self, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[ChunkLayout, tuple]:
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        layout = chunk_layout(ids, mask, self.chunk_length)
        out = self.source.base_model(input_ids=layout.ids, attention_mask=layout.mask.long(), output_hidden_states=True)
        return layout, out.hidden_states

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, output_hidden_states: bool = True
    ) -> BaseModelOutput:
        """The original's hidden states of each token, read in its chunk: hidden_states, (layers + 1) x (batch, n,
        hidden)."""
        layout, hidden = self._chunk_states(input_ids, attention_mask)
        states = tuple(layout.gather(h) for h in hidden)
        return BaseModelOutput(last_hidden_state=states[-1], hidden_states=states)

    def layer_inputs(
        self, layers: nn.ModuleList, ids: torch.Tensor, mask: torch.Tensor, targets: bool, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer of the converted model (``layers``): the original's input to that layer for each token of the
        blocks (batch, n, hidden), and, with ``targets``, the original's attention output there, computed inside
        the token's chunk (the layer's softmax twin, :func:`transfer.softmax_attention_output`)."""
        device = mask.device  # the converted model's
        layout, hidden = self._chunk_states(ids.to(self.device), mask.to(self.device))
        layout = ChunkLayout(layout.ids.to(device), layout.mask.to(device), layout.index.to(device))
        key_mask = None if bool(layout.mask.all()) else layout.mask
        inputs, outputs = [], []
        for layer, states in zip(layers, hidden):
            states = states.to(device=device, dtype=dtype)
            inputs.append(layout.gather(states))
            if targets:
                outputs.append(layout.gather(softmax_attention_output(layer.attention, states, key_mask)))
        return inputs, outputs


def long_attention_transfer(
    model: PreTrainedModel,
    source: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    args: TransferArguments | None = None,
    *,
    chunk_length: int | None = None,
    long_input_ids: torch.Tensor | None = None,
) -> TransferReport:
    """:func:`transfer.attention_transfer` of ``model`` (converted with ``max_length``) on blocks ``input_ids``
    (blocks, n) longer than ``source`` reads, with ``source`` as a :class:`ChunkedTeacher` of ``chunk_length``
    tokens (default: its positions). The local heads' choice and the query-scale fit run first on the teacher's
    chunks of the blocks that stage 1 probes (the first training batch), so the report's "before" errors are
    after them and it has no "calibrated" column.

    With ``args.finetune_long_steps``, ``long_input_ids`` (blocks, N) are blocks of the model's full length (no
    padding), at least two: after stage 2, each step's loss is stage 2's on one of them plus
    ``args.finetune_long_short_weight`` times stage 2's on a batch of ``input_ids``. The first long block and the
    blocks stage 2 holds out measure that loss before and after."""
    args = TransferArguments() if args is None else args
    if not isinstance(args, TransferArguments):
        raise TypeError(f"args must be TransferArguments, got {type(args).__name__}")
    if args.finetune_long_steps:
        _check_long_blocks(model, long_input_ids, attention_mask)
    teacher = ChunkedTeacher(source, chunk_length)
    held_out = args.eval_batches * args.batch_size
    probe = input_ids[held_out : 2 * held_out]
    probe_mask = None if attention_mask is None else attention_mask[held_out : 2 * held_out].bool()
    calibrate = args.calibrate_query_scale and getattr(model.config, "hybrid_query_scale", False)
    local_heads = residual = None
    if (args.choose_local_heads or calibrate) and probe.shape[0]:
        mask = torch.ones_like(probe, dtype=torch.bool) if probe_mask is None else probe_mask
        layout = chunk_layout(probe, mask, teacher.chunk_length)
        if args.choose_local_heads:
            local_heads = choose_local_heads(model, source, layout.ids, layout.mask, batch_size=args.batch_size)
        if calibrate:
            residual = calibrate_query_scale(model, source, layout.ids, layout.mask, batch_size=args.batch_size)
    chunked_args = dataclasses.replace(args, choose_local_heads=False, calibrate_query_scale=False)
    report = attention_transfer(model, teacher, input_ids, attention_mask, chunked_args)
    report.local_heads, report.query_scale_residual = local_heads, residual
    if args.finetune_long_steps:
        with hybrid_at_every_length(model) as as_saved:
            _long_finetune(
                model, teacher, long_input_ids, input_ids[:held_out], input_ids[held_out:], args, report, as_saved
            )
    return report


def _check_long_blocks(model: PreTrainedModel, ids: object, attention_mask: torch.Tensor | None) -> None:
    """A ValueError / TypeError naming the problem unless ``ids`` holds at least two blocks of the model's length."""
    if ids is None:
        raise ValueError(
            "args.finetune_long_steps needs long_input_ids: blocks of the model's max_position_embeddings tokens "
            "(text_blocks(tokenizer, texts, max_length, wrap=True)), one held out"
        )
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"long_input_ids must be a (blocks, length) integer tensor, got {ids!r:.80}")
    length = model.config.max_position_embeddings
    if ids.shape[1] != length or ids.shape[0] < 2:
        raise ValueError(
            f"long_input_ids must hold at least 2 blocks of the model's {length} tokens (one is held out), got "
            f"{tuple(ids.shape)}; give more text or a shorter max_length"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("finetune_long_steps pairs long blocks with unpadded transfer blocks; pass no padding")


def _long_finetune(
    model, teacher, long_ids, eval_ids, ids, args: TransferArguments, report: TransferReport, as_saved
) -> None:
    """The long steps of :func:`long_attention_transfer`: every weight trains on stage 2's loss over one long block
    plus ``args.finetune_long_short_weight`` times the loss over a batch of ``ids``, at stage 2's rates; the report
    gets the loss on the first long block and on the held-out short blocks ``eval_ids``, before and after. The long
    block reads with the hybrid, the short ones under ``as_saved`` (:func:`transfer.hybrid_at_every_length`), as
    the saved model reads them. Flags, modes and the global RNG are left as they were."""
    device = next(model.parameters()).device
    long_ids, eval_ids, ids = (x.to(device) for x in (long_ids, eval_ids, ids))
    held_long = [(long_ids[:1], torch.ones_like(long_ids[:1], dtype=torch.bool))]
    held_short = [(x, torch.ones_like(x, dtype=torch.bool)) for x in eval_ids.split(args.batch_size)]
    long_ids = long_ids[1:]
    trained = transfer_parameters(model)
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    modes = model.training, teacher.training
    generator = torch.Generator().manual_seed(args.seed)
    long_order, short_order = (
        _batches(long_ids.shape[0], 1, generator),
        _batches(ids.shape[0], args.batch_size, generator),
    )

    weight = args.finetune_long_short_weight

    def loss_of_step(step):
        index, batch = next(long_order), next(short_order)
        long, short = long_ids[index], ids[batch]
        loss = _distillation_loss(model, teacher, long, torch.ones_like(long, dtype=torch.bool))
        if weight:
            with as_saved():
                short_loss = _distillation_loss(model, teacher, short, torch.ones_like(short, dtype=torch.bool))
            loss = loss + weight * short_loss
        return loss

    try:
        model.eval()  # dropout off: the targets are the original's deterministic outputs
        teacher.eval()
        report.long_finetune_loss_before = _mean_distillation_loss(model, teacher, held_long)
        with as_saved():
            report.long_finetune_short_loss_before = _mean_distillation_loss(model, teacher, held_short)
        for param in model.parameters():
            param.requires_grad_(True)
        groups = _finetune_groups(model.parameters(), trained, _projections(model), args)
        _, report.long_finetune_seconds = _train(
            groups, args.finetune_long_steps, loss_of_step, "long fine-tune", args.progress
        )
        report.long_finetune_steps = args.finetune_long_steps
        report.long_finetune_loss_after = _mean_distillation_loss(model, teacher, held_long)
        with as_saved():
            report.long_finetune_short_loss_after = _mean_distillation_loss(model, teacher, held_short)
            report.long_finetune_short_exact_length = getattr(model.config, "hybrid_exact_length", None)
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        model.train(modes[0])
        teacher.train(modes[1])


def write_sentence_transformers_files(folder: str | Path, hidden_size: int, max_length: int) -> None:
    """Make a saved encoder folder load as ``SentenceTransformer(folder)``: the transformer with ``max_seq_length =
    max_length`` then mean pooling, the pooling all-MiniLM-L6-v2 and the other sentence-transformers BERTs use."""
    folder = Path(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}, indent=2))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


__all__ = [
    "POSITION_INITS",
    "ChunkLayout",
    "ChunkedTeacher",
    "chunk_layout",
    "extend_positions",
    "long_attention_transfer",
    "long_overrides",
    "write_sentence_transformers_files",
]
