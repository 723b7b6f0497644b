"""Attention transfer: fit a converted model's new attention parameters to the softmax attention it replaces.

LoLCATs (Zhang et al. 2024, arXiv 2410.10254), stage 1: with every pretrained weight frozen, train only what the
conversion added (learned feature maps, window balances, Linformer's E / F, local-head biases) so that each layer's
attention output matches the original's,

    min  1/L Σ_i  MSE( attn_i(x_i),  softmax(q_i k_iᵀ / sqrt(d)) v_i W_o )        over the real tokens,

where x_i is the input the *original* model gives layer i (its own hidden states, so every layer trains on the
inputs it will see and no gradient crosses layers), and q_i, k_i, v_i, W_o are the layer's frozen projections. A
converted model copies the original's q / k / v / o and norms, so that softmax term is the original's attention
output, computed here from our layer (:func:`softmax_attention_output`) without reading the source's internals.

Stage 2 (optional) fine-tunes the whole model against the original: for an encoder the hidden states of every
layer, each layer's MSE relative to the original's mean square there (TinyBERT's layer-wise distillation: each
layer is told where it went wrong, not only the last), averaged over the layers; for a decoder the KL divergence
from the original's next-token distribution. All weights train (``"full"``), or LoRA on
q / k / v / o plus the new attention parameters through PEFT (``"lora"``), merged back into plain weights; the new
attention parameters keep their stage-1 learning rates, the rest trains at ``finetune_learning_rate``.

    bert = BertModel.from_pretrained("bert-base-uncased")
    model, _ = convert_bert(bert, "performer", feature_map="hedgehog")
    report = attention_transfer(model, bert, text_blocks(tokenizer, texts, 512, wrap=True))
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from ..modeling.base import LinearAttention, LinearAttentionPreTrainedModel, new_tensors
from ..ops import softmax_attention

FINETUNE_MODES = ("full", "lora")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
DEFAULT_MAX_LENGTH = 512  # block length when neither the arguments nor the model's limit ask for less


@dataclass
class TransferArguments:
    """Settings of :func:`attention_transfer`; each is checked at construction (a ValueError names the field). The
    conversion CLI offers each as a flag: the field's name, or its metadata's ``flag``.

    Args:
        steps: optimizer steps of stage 1, attention transfer (default 200).
        learning_rate: AdamW learning rate of feature maps, window balances and local-head biases, both stages
            (default 1e-2, as LoLCATs).
        projection_learning_rate: AdamW learning rate of Linformer's E / F, both stages (default 1e-3): they start
            as window means of size k / n, which the rate of the maps (1e-2) moves too far: it raised a converted
            BERT's per-layer error where 1e-3 lowered it (docs/conversion.md).
        batch_size: blocks per step, both stages (default 8).
        max_length: tokens per block when texts are tokenized for you (convert_bert / convert_gpt2, the CLI);
            None: the model's longest input, at most 512 (default None).
        eval_batches: batches of blocks held out from training to measure the errors and losses before and after,
            when no evaluation blocks are given (default 1).
        finetune_steps: optimizer steps of stage 2, distillation from the original; 0 skips it (default 0).
        finetune: "full" (every weight trains) or "lora" (LoRA on q_proj, k_proj, v_proj, o_proj through PEFT, and
            the new attention parameters, merged into plain weights afterwards) (default "full").
        finetune_learning_rate: AdamW learning rate of stage 2 for every pretrained weight (or LoRA weight)
            (default 1e-4).
        finetune_new_learning_rate: AdamW learning rate of the new attention parameters in stage 2; None keeps
            their stage-1 rates (default None; e.g. 3e-3: after a stage 1 at 3e-2, maps kept at 3e-2 in stage 2
            raised a converted BERT's held-out distillation loss, where 3e-3 lowered it; docs/conversion.md).
        finetune_long_steps: for a model converted with ``max_length`` (:func:`long_context.long_attention_transfer`)
            whose transfer blocks are shorter: after stage 2, this many steps of stage 2's loss on one block of the
            model's full length, the original reading it chunk by chunk, plus the same loss on a batch of the
            transfer blocks, every weight training at stage 2's rates. The long block teaches the far keys, the
            short batch holds the short-text fit that long blocks alone wear down (docs/conversion.md) (default 0).
        finetune_long_short_weight: the weight of the short batch's loss in each long step, beside the long
            block's at weight 1; the long block's loss is many times the short blocks' after stage 2, so at 1 its
            gradient leads and the short-text fit drifts (default 1.0).
        lora_r: LoRA rank, with lora_alpha = 2 r (default 8).
        choose_local_heads: before stage 1, reorder each layer's heads so that its ``num_local_heads`` local heads
            are those whose original attention stays most inside ``local_window`` (:func:`choose_local_heads`, on
            up to ``eval_batches`` batches of the training blocks); needs a model with local heads (default False).
        calibrate_query_scale: before stage 1, fit a hybrid's learned query scale (``hybrid_query_scale``) by
            least squares on the original's attention (:func:`calibrate_query_scale`, on the same blocks); for
            models without one it does nothing (default True).
        seed: seed of the block order and of LoRA's initialization; the global RNG is left as it was (default 0).
        progress: show tqdm progress bars (default True).
    """

    steps: int = field(default=200, metadata={"flag": "transfer_steps"})
    learning_rate: float = field(default=1e-2, metadata={"flag": "transfer_lr"})
    projection_learning_rate: float = field(default=1e-3, metadata={"flag": "transfer_projection_lr"})
    batch_size: int = field(default=8, metadata={"flag": "transfer_batch_size"})
    max_length: int | None = field(default=None, metadata={"flag": "transfer_length"})
    eval_batches: int = field(default=1, metadata={"flag": "transfer_eval_batches"})
    finetune_steps: int = 0
    finetune: Literal[FINETUNE_MODES] = "full"
    finetune_learning_rate: float = field(default=1e-4, metadata={"flag": "finetune_lr"})
    finetune_new_learning_rate: float | None = field(default=None, metadata={"flag": "finetune_new_lr"})
    finetune_long_steps: int = 0
    finetune_long_short_weight: float = 1.0
    lora_r: int = 8
    choose_local_heads: bool = False
    calibrate_query_scale: bool = True
    seed: int = field(default=0, metadata={"flag": "transfer_seed"})
    progress: bool = True

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("batch_size", 1), ("eval_batches", 1), ("finetune_steps", 0), ("lora_r", 1)):
            _check_int(name, getattr(self, name), low)
        _check_int("finetune_long_steps", self.finetune_long_steps, 0)
        if self.finetune_long_steps and self.finetune != "full":
            raise ValueError(
                f"TransferArguments.finetune_long_steps trains every weight; it takes finetune='full', got "
                f"finetune={self.finetune!r}"
            )
        if self.max_length is not None:
            _check_int("max_length", self.max_length, 1)
        _check_int("seed", self.seed, None)
        rates = ["learning_rate", "projection_learning_rate", "finetune_learning_rate"]
        if self.finetune_new_learning_rate is not None:
            rates.append("finetune_new_learning_rate")
        for name in rates:
            _check_number(name, getattr(self, name), positive=True)
        _check_number("finetune_long_short_weight", self.finetune_long_short_weight, positive=False)
        if self.finetune not in FINETUNE_MODES:
            raise ValueError(
                f"TransferArguments.finetune must be one of {', '.join(map(repr, FINETUNE_MODES))}, got "
                f"{self.finetune!r}"
            )
        for name in ("progress", "choose_local_heads", "calibrate_query_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TransferArguments.{name} must be True or False, got {getattr(self, name)!r}")


def _check_number(name: str, value: object, positive: bool) -> None:
    """A finite int or float, > 0 where ``positive``, else >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"TransferArguments.{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"TransferArguments.{name} must be a finite number {'>' if positive else '>='} 0, got {value}")


def _check_int(name: str, value: object, low: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"TransferArguments.{name} must be an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"TransferArguments.{name} must be >= {low}, got {value}")


@dataclass
class TransferReport:
    """What :func:`attention_transfer` did. ``error_before`` / ``error_after``: per layer, the relative error
    ||attn_i(x_i) - target_i||_F / ||target_i||_F over the real tokens of the evaluation blocks, before and after
    stage 1 (after stage 2 the targets themselves have moved with q / k / v / o, so stage 2 reports its loss).
    With a calibrated query scale, ``error_calibrated`` is that error after calibration, before stage 1, and
    ``query_scale_residual`` the fit's RMS residual per layer (:func:`calibrate_query_scale`)."""

    parameters: list[str]
    error_before: list[float]
    error_after: list[float]
    steps: int
    seconds: float
    loss_first: float
    loss_last: float
    eval_blocks: int
    finetune: str | None = None
    finetune_loss: str | None = None
    finetune_steps: int = 0
    finetune_seconds: float = 0.0
    finetune_loss_before: float | None = None
    finetune_loss_after: float | None = None
    long_finetune_steps: int = 0
    long_finetune_seconds: float = 0.0
    long_finetune_loss_before: float | None = None
    long_finetune_loss_after: float | None = None
    long_finetune_short_loss_before: float | None = None
    long_finetune_short_loss_after: float | None = None
    long_finetune_short_exact_length: int | None = None
    layers: list[int] = field(default_factory=list)
    local_heads: list[list[int]] | None = None
    error_calibrated: list[float] | None = None
    query_scale_residual: list[float] | None = None

    def __str__(self) -> str:
        columns = {"before": self.error_before, "calibrated": self.error_calibrated, "after": self.error_after}
        columns = {name: errors for name, errors in columns.items() if errors is not None}
        lines = [
            f"attention transfer: {len(self.parameters)} new attention tensors trained, {self.steps} steps in "
            f"{self.seconds:.1f} s (training loss {self.loss_first:.4g} -> {self.loss_last:.4g})",
            f"  relative error of each layer's attention output on {self.eval_blocks} held-out blocks:",
            "    layer" + "".join(f"  {name:>10}" for name in columns),
        ]
        for row, layer in enumerate(self.layers):
            lines.append(f"    {layer:5d}" + "".join(f"  {errors[row]:10.4f}" for errors in columns.values()))
        lines.append("     mean" + "".join(f"  {sum(e) / len(e):10.4f}" for e in columns.values()))
        if self.query_scale_residual is not None:
            residual = ", ".join(f"{r:.3f}" for r in self.query_scale_residual)
            lines.append(f"  query scale fitted by least squares, RMS residual per layer (log units): {residual}")
        if self.local_heads is not None:
            chosen = "; ".join(f"{i}: {heads}" for i, heads in enumerate(self.local_heads))
            lines.append(f"  local heads chosen by locality (the original's head numbers, per layer): {chosen}")
        if self.finetune is not None:
            lines.append(
                f"  fine-tune ({self.finetune}): {self.finetune_loss} {self.finetune_loss_before:.4g} -> "
                f"{self.finetune_loss_after:.4g} on the held-out blocks, {self.finetune_steps} steps in "
                f"{self.finetune_seconds:.1f} s"
            )
        if self.long_finetune_steps:
            lines.append(
                f"  long fine-tune: the same loss on the held-out long block {self.long_finetune_loss_before:.4g} -> "
                f"{self.long_finetune_loss_after:.4g}, on the held-out short blocks"
                f"{_read_as(self.long_finetune_short_exact_length)} {self.long_finetune_short_loss_before:.4g} -> "
                f"{self.long_finetune_short_loss_after:.4g}, "
                f"{self.long_finetune_steps} steps in {self.long_finetune_seconds:.1f} s"
            )
        return "\n".join(lines)


def _read_as(exact_length: int | None) -> str:
    """How a report names the short blocks' reading: as saved, which reads up to ``exact_length`` tokens exactly."""
    return "" if exact_length is None else f" (read as saved: exactly up to {exact_length} tokens)"


@contextlib.contextmanager
def hybrid_at_every_length(model: nn.Module) -> Iterator[Callable[[], contextlib.AbstractContextManager]]:
    """Within the block, a model read with ``hybrid_exact_length`` runs its hybrid heads at every length, as if the
    field were None; restored after. Transfer and the steps after it train the linear part, which the exact read of
    short inputs never uses, on blocks that read would cover: they fit the hybrid.
    The block gets a function whose context reads the model as saved (the field restored): the short-text terms of
    the steps after transfer read their blocks under it, as the saved model will read short inputs, so that they
    hold the exact read to the original rather than fit the hybrid at lengths it will never read."""
    config = getattr(model, "config", None)
    limit = getattr(config, "hybrid_exact_length", None)
    if limit is None:
        yield contextlib.nullcontext
        return

    @contextlib.contextmanager
    def as_saved() -> Iterator[None]:
        config.hybrid_exact_length = limit
        try:
            yield
        finally:
            config.hybrid_exact_length = None

    config.hybrid_exact_length = None
    try:
        yield as_saved
    finally:
        config.hybrid_exact_length = limit


def _projections(model: nn.Module) -> set[str]:
    """The names of Linformer's E / F among the model's new tensors (``NewTensor.projection``)."""
    return {name for name, declared in new_tensors(model).items() if declared.projection}


def transfer_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters attention transfer trains: those that the model's modules declare new (``new_tensors``:
    learned feature maps, window balances, query and key scales, Linformer's E / F and shared projection, local-head
    relative biases), shared ones once.
    A ValueError says how to get some when the model has none (a random-feature Performer, a pooling Linformer)."""
    new = new_tensors(model)
    found = [(name, param) for name, param in model.named_parameters() if name in new]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no new attention parameters for attention transfer to train: its "
            "attention is fixed once converted (random FAVOR+ features, or pooling E / F). Convert with "
            "feature_map='hedgehog' (a learned feature map), with hybrid_window=... (sliding-window softmax plus "
            "linear attention, with learned per-head balances), or with family='linformer' (learned E / F)"
        )
    return found


def softmax_attention_output(
    attention: LinearAttention, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The layer's attention with exact softmax on every head (global and local), through its own projections:

        o_proj( softmax(Q Kᵀ / sqrt(head_dim)) V ),   Q, K, V = q_proj(x), k_proj(x), v_proj(x) split into heads,

    causal for a decoder. For a converted model this is the original BERT / GPT-2 attention output of that layer.

    hidden_states: (batch, n, hidden_size), the attention's input (after attention_norm in a pre-LN decoder).
    attention_mask: (batch, n) bool, True for real tokens; None: no padding. Returns (batch, n, hidden_size).
    """
    if attention.config.position_embedding_type == "rotary":
        raise ValueError(
            "softmax_attention_output needs absolute or sinusoidal positions: this model rotates q and k "
            "(position_embedding_type='rotary'), which a converted BERT / GPT-2 never does; attention transfer is "
            "for models made by convert_bert / convert_gpt2"
        )
    b, n, _ = hidden_states.shape
    q, k, v = (attention._split(proj(hidden_states)) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
    out = softmax_attention(q, k, v, causal=attention.causal, key_padding_mask=attention_mask)
    return attention.o_proj(out.transpose(1, 2).reshape(b, n, -1))


def text_blocks(
    tokenizer: PreTrainedTokenizerBase, texts: str | Path | Sequence[str], length: int, *, wrap: bool
) -> torch.Tensor:
    """Token blocks of ``texts`` for :func:`attention_transfer`, (num_blocks, length) int64.

    ``texts``: the path of a UTF-8 text file, or a list of strings. The texts are tokenized without special tokens
    and concatenated (with the tokenizer's eos token between texts when it has one and ``wrap`` is False), then cut
    into blocks; the incomplete last block is dropped. ``wrap=True`` (BERT): each block is [CLS] + length - 2
    tokens + [SEP], the input BERT was trained on; ``wrap=False`` (GPT-2): plain runs of ``length`` tokens.
    """
    if isinstance(texts, str | Path):
        path = Path(texts)
        if not path.is_file():
            raise ValueError(f"{str(texts)!r} is not a file; pass the path of a text file, or a list of strings")
        texts = [path.read_text(encoding="utf-8")]
    elif not (isinstance(texts, Sequence) and all(isinstance(text, str) for text in texts)):
        raise TypeError(f"texts must be a file path or a list of strings, got {type(texts).__name__}")
    elif not texts:  # the tokenizer would fail on it with an IndexError
        raise ValueError("texts is an empty list; pass the texts to fit the attention on, or a text file's path")
    if isinstance(length, bool) or not isinstance(length, int) or length < (3 if wrap else 1):
        raise ValueError(f"block length must be an int >= {3 if wrap else 1}, got {length!r}")
    if wrap and (tokenizer.cls_token_id is None or tokenizer.sep_token_id is None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no [CLS] / [SEP] tokens to wrap BERT blocks with; pass the tokenizer of "
            "the BERT checkpoint"
        )
    ids: list[int] = []
    separator = [] if wrap or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for index, row in enumerate(tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]):
        ids += (separator if index else []) + row
    body = length - 2 if wrap else length
    count = len(ids) // body
    if count == 0:
        raise ValueError(
            f"the texts give {len(ids)} tokens, fewer than one block of {body} (length {length}); give more text "
            "or a shorter block length"
        )
    blocks = torch.tensor(ids[: count * body], dtype=torch.long).view(count, body)
    if wrap:
        cls = torch.full((count, 1), tokenizer.cls_token_id, dtype=torch.long)
        sep = torch.full((count, 1), tokenizer.sep_token_id, dtype=torch.long)
        blocks = torch.cat([cls, blocks, sep], dim=1)
    return blocks


def default_block_length(model: LinearAttentionPreTrainedModel) -> int:
    """The block length used when ``TransferArguments.max_length`` is None: the model's longest input, at most 512."""
    limit = model.config.sequence_limit()
    return DEFAULT_MAX_LENGTH if limit is None else min(DEFAULT_MAX_LENGTH, limit[0])


def _check_pair(model: PreTrainedModel, source: PreTrainedModel) -> None:
    if not isinstance(model, LinearAttentionPreTrainedModel):
        raise TypeError(f"model must be a linearformers model (from convert_bert / convert_gpt2), got {type(model)}")
    if not isinstance(source, PreTrainedModel) and not hasattr(source, "layer_inputs"):  # or a ChunkedTeacher
        raise TypeError(f"source must be the transformers model the model was converted from, got {type(source)}")
    if model.config.position_embedding_type == "rotary":
        raise ValueError(
            f"{type(model).__name__} uses rotary positions; attention transfer fits models made by convert_bert / "
            "convert_gpt2, which keep the original's learned absolute positions"
        )
    layers = len(model.base_model.layers)
    theirs = getattr(source.config, "num_hidden_layers", None)
    if theirs != layers:
        raise ValueError(
            f"{type(model).__name__} has {layers} layers but the source {type(source).__name__} has {theirs}; pass "
            "the model it was converted from"
        )


def _check_blocks(
    name: str, ids: torch.Tensor, mask: torch.Tensor | None, model: PreTrainedModel, source: PreTrainedModel
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked (N, L) ids and their (N, L) bool mask (all True when None)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{name} must be an integer torch.Tensor of token ids (torch.long), got {got}")
    if ids.dim() != 2 or 0 in ids.shape:
        raise ValueError(f"{name} must be shaped (blocks, length) with at least one of each, got {tuple(ids.shape)}")
    model.config.check_input_length(ids.shape[1])
    vocab = min(model.get_input_embeddings().num_embeddings, source.get_input_embeddings().num_embeddings)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"{name} hold {low if low < 0 else high}, outside 0 .. {vocab - 1} of the vocabulary; tokenize with the "
            "tokenizer of the source checkpoint"
        )
    if mask is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"the attention mask of {name} must be a tensor of its shape {tuple(ids.shape)}, got {got}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"the attention mask of {name} must hold 0 (padding) and 1 (token)")
    mask = mask.bool()
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:  # a batch of such rows would have no token to average the loss over
        raise ValueError(
            f"the attention mask of {name} marks every token of block(s) {empty[:5]} as padding; leave them out"
        )
    return ids, mask


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Indices of batches of ``batch_size`` blocks, a fresh shuffle each pass over the ``count`` blocks."""
    while True:
        order = torch.randperm(count, generator=generator)
        yield from order.split(batch_size)


def _masked_mse(output: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the real tokens (mask (batch, n) bool), in float32."""
    return (output.float() - target.float())[mask].pow(2).mean()


def _in_local_window(n: int, window: int, causal: bool, device) -> torch.Tensor:
    """(n, n) bool: key s lies in query t's local window, as the local heads see it (attention.local)."""
    distance = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]  # t - s
    return ((distance >= 0) & (distance < window)) if causal else (distance.abs() <= window // 2)


@torch.no_grad()
def local_head_shares(
    model: PreTrainedModel,
    source: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    batch_size: int = 8,
) -> list[list[float]]:
    """Per layer and head of ``model`` (a conversion of ``source``), the share of the original's softmax attention
    that falls inside ``model.config.local_window`` as a local head would see it, averaged over the real queries of
    ``input_ids`` (blocks, length). Each layer reads the original's own hidden states (as attention transfer does)
    through the model's q / k projections, which are the original's."""
    _check_pair(model, source)
    ids, mask = _check_blocks("input_ids", input_ids, attention_mask, model, source)
    config = model.config
    layers = model.base_model.layers
    total = torch.zeros(len(layers), config.num_attention_heads, dtype=torch.float64)
    n = ids.shape[1]
    window = _in_local_window(n, config.local_window, config.is_decoder, next(model.parameters()).device)
    for batch, i, _, _, scores in _original_scores(model, source, ids, mask, batch_size):
        allowed = batch.mask[:, None, None, :]
        if config.is_decoder:
            allowed = allowed & window.new_ones(n, n).tril()
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        share = (probs * window).sum(-1)  # (b, h, n)
        total[i] += (share * batch.mask[:, None, :]).sum((0, 2)).double().cpu()
    return (total / int(mask.sum())).tolist()


def _original_scores(model, source, ids: torch.Tensor, mask: torch.Tensor, batch_size: int) -> Iterator[tuple]:
    """Per batch of ``ids`` and per layer i: (the :class:`_Batch`, i, q, k, scores), each layer reading the
    original's own hidden states through its q / k projections (the original's): q, k (b, heads, n, head_dim) in
    float32, scores = q kᵀ / sqrt(head_dim) (b, heads, n, n)."""
    for index in torch.arange(ids.shape[0]).split(batch_size):
        batch = _Batch(model, source, ids[index], mask[index], targets=False)
        for i, (layer, x) in enumerate(zip(model.base_model.layers, batch.inputs)):
            attention = layer.attention
            q, k = (attention._split(proj(x)).float() for proj in (attention.q_proj, attention.k_proj))
            yield batch, i, q, k, (q @ k.transpose(-1, -2)) * attention.head_dim**-0.5


def _reorder_heads(attention: LinearAttention, order: list[int]) -> None:
    """Put head order[j] at place j: the rows of q / k / v and the columns of o move together, so the layer
    computes the same sum over heads, each head now meeting the kernel of its new place."""
    d = attention.head_dim
    rows = (torch.tensor(order)[:, None] * d + torch.arange(d)).flatten().to(attention.q_proj.weight.device)
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        proj.weight.copy_(proj.weight[rows])
        if proj.bias is not None:
            proj.bias.copy_(proj.bias[rows])
    attention.o_proj.weight.copy_(attention.o_proj.weight[:, rows])


@torch.no_grad()
def choose_local_heads(
    model: PreTrainedModel,
    source: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    batch_size: int = 8,
) -> list[list[int]]:
    """Make each layer's ``num_local_heads`` local heads (its last heads) the ones whose original attention stays
    most inside ``local_window`` (:func:`local_head_shares` on ``input_ids``), in place: heads move with their
    q / k / v rows and o columns, the other heads keep their order in front and the chosen ones theirs behind.

    A conversion makes the last heads local whatever they attend to; which heads they are matters: a converted
    model loses less of the original when its local heads are the original's most local ones (docs/conversion.md). Call it on a fresh conversion, before attention transfer: the new per-head parameters
    (feature maps, balances, Linformer's E / F, relative biases) start alike for every head and stay in place.
    Returns, per layer, the original head numbers that became the local heads, in their order."""
    _check_pair(model, source)
    count = model.config.num_local_heads
    if not count:
        raise ValueError(
            "choose_local_heads picks which heads become the local heads, and this model has none: convert with "
            "num_local_heads=L (and local_window=W)"
        )
    shares = local_head_shares(model, source, input_ids, attention_mask, batch_size=batch_size)
    chosen = []
    for layer, layer_shares in zip(model.base_model.layers, shares):
        ranked = sorted(range(len(layer_shares)), key=lambda h: layer_shares[h])
        local = sorted(ranked[-count:])
        order = [h for h in range(len(layer_shares)) if h not in local] + local
        _reorder_heads(layer.attention, order)
        chosen.append(local)
    return chosen


def _linear_keys(mask: torch.Tensor, window: int, sinks: int, causal: bool) -> torch.Tensor:
    """(b, 1, n, n) bool: the keys s a hybrid head's query t takes linear scores on (``attention.hybrid``): real,
    seen (causal: s <= t), outside the window, and not one of the first ``sinks`` real tokens of the row."""
    n = mask.shape[1]
    distance = torch.arange(n, device=mask.device)[:, None] - torch.arange(n, device=mask.device)[None, :]  # t - s
    in_window = ((distance >= 0) & (distance < window)) if causal else (distance.abs() < window)
    keys = mask & (mask.long().cumsum(-1) > sinks)  # real, not a sink
    allowed = keys[:, None, :] & ~in_window
    if causal:
        allowed = allowed & (distance >= 0)
    return allowed[:, None]


@torch.no_grad()
def calibrate_query_scale(
    model: PreTrainedModel,
    source: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    batch_size: int = 8,
    ridge: float = 1e-3,
) -> list[float]:
    """Set each hybrid layer's query scale (``PerformerConfig.hybrid_query_scale``) by least squares on the
    original's attention, in place; returns, per layer, the root-mean-square residual of the fit (in log units).

    For each real query t of a global head with linear keys F(t) (``attention.hybrid``: real, seen, outside the
    window, not a sink), the log scale that gives the linear part exactly the original's mass on those keys is

        l*_t = log Σ_{s in F(t)} exp(scale q_t·k_s) - log Σ_{s in F(t)} phi(q_t)·phi(k_s) - l_map,t

    (l_map: the feature map's own log scale, 0 but for the random "softmax" map). Per head, a_h and b_h minimize
    Σ_t (q_t·a_h + b_h - l*_t)² + ridge·N·|a_h|² over the N real queries of ``input_ids`` (blocks, length) with a
    linear key, each layer reading the original's own hidden states through its q / k projections (as attention
    transfer does). A layer's current feature map is used as it is: call it after the map has its initial or
    trained values; attention transfer calls it before stage 1 (``TransferArguments.calibrate_query_scale``)."""
    _check_pair(model, source)
    if not isinstance(ridge, int | float) or isinstance(ridge, bool) or not (math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge!r}")
    config = model.config
    if not getattr(config, "hybrid_query_scale", False):
        raise ValueError(
            "calibrate_query_scale fits the hybrid's learned query scale, and this model has none: convert a "
            "Performer with hybrid_window=W and hybrid_query_scale=True"
        )
    ids, mask = _check_blocks("input_ids", input_ids, attention_mask, model, source)
    layers = model.base_model.layers
    if layers[0].attention.query_scale_weight is None:  # the config asks for a scale, and no head has a linear part
        raise ValueError("calibrate_query_scale: the model has no global heads, whose linear part the scale serves")
    g, d = layers[0].attention.num_global, layers[0].attention.head_dim
    gram = torch.zeros(len(layers), g, d + 1, d + 1, dtype=torch.float64)
    moment = torch.zeros(len(layers), g, d + 1, dtype=torch.float64)
    square = torch.zeros(len(layers), g, dtype=torch.float64)
    count = torch.zeros(len(layers), g, dtype=torch.float64)
    for batch, i, q, k, scores in _original_scores(model, source, ids, mask, batch_size):
        q, k, scores = q[:, :g], k[:, :g], scores[:, :g]  # the global heads, whose linear part the scale serves
        linear = _linear_keys(batch.mask, config.hybrid_window, config.hybrid_sinks, config.is_decoder)
        phi_q, phi_k, own = layers[i].attention.hybrid_features(q, k, batch.key_mask, query_scale=False)
        exact = scores.masked_fill(~linear, float("-inf")).logsumexp(-1)  # (b, h, n)
        mass = ((phi_q @ phi_k.transpose(-1, -2)) * linear).sum(-1)
        target = exact - mass.clamp_min(1e-30).log() - (0.0 if own is None else own.float())
        use = batch.mask[:, None, :] & linear.any(-1) & (mass > 0)  # (b, h, n)
        features = torch.cat([q, torch.ones_like(q[..., :1])], -1).double() * use[..., None]
        target = torch.where(use, target, torch.zeros_like(target)).double()
        gram[i] += torch.einsum("bhne,bhnf->hef", features, features).cpu()
        moment[i] += torch.einsum("bhne,bhn->he", features, target).cpu()
        square[i] += target.pow(2).sum((0, 2)).cpu()
        count[i] += use.sum((0, 2)).double().cpu()
    residuals = []
    for i, layer in enumerate(layers):
        if not bool((count[i] > 0).all()):
            raise ValueError(
                f"layer {layer.attention.layer_idx}: a head has no query with a key outside its window of "
                f"{config.hybrid_window} (and its sinks) in these blocks; calibrate on longer blocks (or skip the fit: "
                "TransferArguments(calibrate_query_scale=False))"
            )
        penalty = torch.diag_embed(torch.cat([torch.full((d,), ridge), torch.zeros(1)]).double())
        solution = torch.linalg.solve(gram[i] + penalty * count[i][:, None, None], moment[i])  # (g, d + 1)
        fitted = torch.einsum("he,hef,hf->h", solution, gram[i], solution) - 2 * (solution * moment[i]).sum(-1)
        residuals.append(((fitted + square[i]).clamp_min(0).sum() / count[i].sum()).sqrt().item())
        attention = layer.attention
        attention.query_scale_weight.copy_(solution[:, :d].to(attention.query_scale_weight))
        attention.query_scale_bias.copy_(solution[:, d].to(attention.query_scale_bias))
    return residuals


def _key_mask(mask: torch.Tensor) -> torch.Tensor | None:
    return None if bool(mask.all()) else mask  # as the model passes it: None when nothing is padded


class _Batch:
    """One batch's per-layer attention inputs x_i and (unless ``targets=False``) softmax targets, from the original's
    hidden states."""

    def __init__(
        self, model: PreTrainedModel, source: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, targets=True
    ):
        layers = model.base_model.layers
        param = next(model.parameters())
        self.mask = mask.to(param.device)
        self.key_mask = _key_mask(self.mask)
        if hasattr(source, "layer_inputs"):  # long_context.ChunkedTeacher: the original read chunk by chunk
            with torch.no_grad():
                self.inputs, self.targets = source.layer_inputs(layers, ids, self.mask, targets, param.dtype)
            return
        with torch.no_grad():
            out = source.base_model(
                input_ids=ids.to(source.device), attention_mask=mask.to(source.device).long(), output_hidden_states=True
            )
            hidden = out.hidden_states
            if hidden is None or len(hidden) != len(layers) + 1:
                raise ValueError(
                    f"{type(source).__name__} returned {0 if hidden is None else len(hidden)} hidden states for "
                    f"{len(layers)} layers; pass the BERT / GPT-2 model the model was converted from"
                )
            self.inputs, self.targets = [], []
            for layer, states in zip(layers, hidden):
                x = states.to(device=param.device, dtype=param.dtype)
                if layer.pre_norm:  # GPT-2: the attention reads ln_1(h), our attention_norm
                    x = layer.attention_norm(x)
                self.inputs.append(x)
                if targets:
                    self.targets.append(softmax_attention_output(layer.attention, x, self.key_mask))

    def outputs(self, model: PreTrainedModel) -> list[torch.Tensor]:
        return [layer.attention(x, self.key_mask) for layer, x in zip(model.base_model.layers, self.inputs)]


@torch.no_grad()
def _relative_errors(model: PreTrainedModel, batches: list[_Batch]) -> list[float]:
    diff = torch.zeros(len(model.base_model.layers), dtype=torch.float64)
    norm = torch.zeros_like(diff)
    for batch in batches:
        for i, (output, target) in enumerate(zip(batch.outputs(model), batch.targets)):
            diff[i] += (output.float() - target.float())[batch.mask].pow(2).sum().item()
            norm[i] += target.float()[batch.mask].pow(2).sum().item()
    return (diff.sqrt() / norm.sqrt().clamp_min(1e-30)).tolist()


def _distillation_loss(
    model: PreTrainedModel, source: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Stage 2 over the real tokens: the mean over layers of each layer's hidden-state MSE divided by the original's
    mean square there (encoder), or KL(original || model) of the next-token distributions (decoder)."""
    device = next(model.parameters()).device
    theirs = dict(input_ids=ids.to(source.device), attention_mask=mask.to(source.device).long())
    ours = dict(input_ids=ids.to(device), attention_mask=mask.to(device).long())
    mask = mask.to(device)
    if model.config.is_decoder:
        with torch.no_grad():
            target = source(**theirs).logits.to(device).float().log_softmax(-1)
        output = model(**ours, use_cache=False).logits.float().log_softmax(-1)
        kl = F.kl_div(output, target, log_target=True, reduction="none").sum(-1)
        return kl[mask].mean()
    with torch.no_grad():
        targets = source.base_model(**theirs, output_hidden_states=True).hidden_states[1:]
    outputs = model.base_model(**ours, output_hidden_states=True).hidden_states[1:]
    if len(outputs) != len(targets):
        raise ValueError(f"the model returned {len(outputs)} layers' hidden states and the source {len(targets)}")
    losses = []
    for output, target in zip(outputs, targets):
        target = target.to(device)
        scale = target.float()[mask].pow(2).mean().clamp_min(1e-30)
        losses.append(_masked_mse(output, target, mask) / scale)
    return torch.stack(losses).mean()


def _mean_distillation_loss(model, source, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        return sum(_distillation_loss(model, source, ids, mask).item() for ids, mask in blocks) / len(blocks)


def _train(groups: list[dict], steps: int, loss_of_step, description: str, progress: bool) -> tuple[list[float], float]:
    """AdamW (no weight decay) over parameter ``groups``, each with its own lr, for ``steps`` steps of
    ``loss_of_step(step)``; the losses, seconds."""
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
    losses = []
    start = time.perf_counter()
    with tqdm(total=steps, desc=description, disable=not progress) as bar:
        for step in range(steps):
            loss = loss_of_step(step)
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
            bar.update()
    return losses, time.perf_counter() - start


def attention_transfer(
    model: PreTrainedModel,
    source: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    args: TransferArguments | None = None,
    *,
    eval_input_ids: torch.Tensor | None = None,
    eval_attention_mask: torch.Tensor | None = None,
) -> TransferReport:
    """Fit ``model``'s new attention parameters to the attention of ``source``, the model it was converted from
    (see the module docstring), in place; then, with ``args.finetune_steps``, distill the whole model from it.

    model: a linearformers model from convert_bert / convert_gpt2 (any head); source: the BertModel / BertFor* /
    GPT2LMHeadModel it came from, on any device. input_ids: (blocks, length) token blocks (:func:`text_blocks`),
    attention_mask: (blocks, length) 1 for real tokens (None: none padded). Without ``eval_input_ids`` the first
    ``args.eval_batches * args.batch_size`` blocks are held out to measure the errors before and after.

    Stage 1 trains :func:`transfer_parameters` only; every other weight and buffer stays bit-identical. Dropout is
    off in both stages (the targets are the original's deterministic outputs). ``requires_grad`` flags and the
    train / eval modes of both models are restored afterwards, and the global RNG is left as it was. With
    ``finetune="lora"`` the LoRA weights are merged: the model keeps its plain modules and state-dict keys.
    """
    args = TransferArguments() if args is None else args
    if not isinstance(args, TransferArguments):
        raise TypeError(f"args must be TransferArguments, got {type(args).__name__}")
    _check_pair(model, source)
    trained = transfer_parameters(model)
    ids, mask = _check_blocks("input_ids", input_ids, attention_mask, model, source)
    if eval_input_ids is None:
        if eval_attention_mask is not None:
            raise ValueError("eval_attention_mask was given without eval_input_ids")
        held_out = args.eval_batches * args.batch_size
        if ids.shape[0] <= held_out:
            raise ValueError(
                f"input_ids holds {ids.shape[0]} blocks; {held_out} are held out for evaluation (eval_batches="
                f"{args.eval_batches} x batch_size={args.batch_size}), which leaves none to train on. Give more "
                "blocks (more text), a smaller batch_size, or eval_input_ids"
            )
        eval_ids, eval_mask, ids, mask = ids[:held_out], mask[:held_out], ids[held_out:], mask[held_out:]
    else:
        eval_ids, eval_mask = _check_blocks("eval_input_ids", eval_input_ids, eval_attention_mask, model, source)
    if args.finetune_steps and model.config.is_decoder:
        for name, m in (("model", model), ("source", source)):
            if m.get_output_embeddings() is None:
                raise ValueError(
                    f"stage 2 distills next-token distributions, and the {name} {type(m).__name__} has no LM head; "
                    "pass the causal LMs (GPT2LMHeadModel and its converted ForCausalLM), or finetune_steps=0"
                )
    eval_blocks = list(zip(eval_ids.split(args.batch_size), eval_mask.split(args.batch_size)))
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    modes = model.training, source.training
    device = next(model.parameters()).device
    # LoRA's initialization draws from the global RNGs of the CPU and the model's GPU: seeded here, restored after
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), hybrid_at_every_length(model):
            torch.random.default_generator.manual_seed(args.seed)
            for index in cuda:
                torch.cuda.default_generators[index].manual_seed(args.seed)
            generator = torch.Generator().manual_seed(args.seed)
            model.eval()
            source.eval()
            return _run(model, source, trained, ids, mask, eval_blocks, args, generator)
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        model.train(modes[0])
        source.train(modes[1])


def _keep_causal_slots(model: PreTrainedModel, trained: list[tuple[str, nn.Parameter]]) -> list:
    """Hooks that train a causal Linformer's E / F on their nonzero entries only.

    Causal Linformer slot j takes part in query t's softmax once some s <= t wrote to it (E[j, s] != 0). Making a
    zero entry nonzero, which any optimizer step does, switches the slot on early: a jump in the output that the
    gradient does not see (window-mean E, k = 8 of n = 32, random q, k, v: noise of std 1e-3 on E took the
    output's squared norm from 70 to 17). Keeping
    the zeros keeps each slot's first position, and the function is smooth in the rest."""
    if not model.config.is_decoder:
        return []
    hooks, projections = [], _projections(model)
    for name, param in trained:
        if name in projections:
            support = (param.detach() != 0).to(param.dtype)
            hooks.append(param.register_hook(lambda grad, support=support: grad * support))
    return hooks


def _run(model, source, trained, ids, mask, eval_blocks, args: TransferArguments, generator) -> TransferReport:
    """Both stages, on checked inputs (see attention_transfer)."""
    hooks = _keep_causal_slots(model, trained)
    try:
        return _stages(model, source, trained, ids, mask, eval_blocks, args, generator)
    finally:
        for hook in hooks:
            hook.remove()


def _stages(model, source, trained, ids, mask, eval_blocks, args: TransferArguments, generator) -> TransferReport:
    local_heads = residual = calibrated = None
    probe = ids[: args.eval_batches * args.batch_size], mask[: args.eval_batches * args.batch_size]
    if args.choose_local_heads:
        local_heads = choose_local_heads(model, source, *probe, batch_size=args.batch_size)
    eval_batches = [_Batch(model, source, *block) for block in eval_blocks]
    before = _relative_errors(model, eval_batches)
    if args.calibrate_query_scale and getattr(model.config, "hybrid_query_scale", False):
        residual = calibrate_query_scale(model, source, *probe, batch_size=args.batch_size)
        calibrated = _relative_errors(model, eval_batches)
    for param in model.parameters():
        param.requires_grad_(False)
    for _, param in trained:
        param.requires_grad_(True)
    order = _batches(ids.shape[0], args.batch_size, generator)

    def transfer_loss(step):
        index = next(order)
        batch = _Batch(model, source, ids[index], mask[index])
        per_layer = [_masked_mse(out, target, batch.mask) for out, target in zip(batch.outputs(model), batch.targets)]
        return torch.stack(per_layer).mean()

    losses, seconds = _train(
        _learning_rate_groups(trained, _projections(model), args),
        args.steps,
        transfer_loss,
        "attention transfer",
        args.progress,
    )
    report = TransferReport(
        parameters=[name for name, _ in trained],
        error_before=before,
        error_after=_relative_errors(model, eval_batches),
        steps=args.steps,
        seconds=seconds,
        loss_first=losses[0],
        loss_last=losses[-1],
        eval_blocks=sum(block[0].shape[0] for block in eval_blocks),
        layers=list(range(len(before))),
        local_heads=local_heads,
        error_calibrated=calibrated,
        query_scale_residual=residual,
    )
    if args.finetune_steps:
        _finetune(model, source, trained, ids, mask, eval_blocks, args, generator, report)
    return report


def _learning_rate_groups(
    named: list[tuple[str, nn.Parameter]], projections: set[str], args: TransferArguments
) -> list[dict]:
    """The new attention parameters' AdamW groups: Linformer's projections (named in ``projections``) at
    ``projection_learning_rate``, the rest at ``learning_rate``; empty groups left out."""
    others = [param for name, param in named if name not in projections]
    chosen = [param for name, param in named if name in projections]
    return [
        {"params": group, "lr": lr}
        for group, lr in ((others, args.learning_rate), (chosen, args.projection_learning_rate))
        if group
    ]


def _finetune_groups(
    params, trained: list[tuple[str, nn.Parameter]], projections: set[str], args: TransferArguments
) -> list[dict]:
    """Stage 2's groups: the new attention parameters at their stage-1 rates (they started from scratch; at
    ``finetune_learning_rate`` they would hardly move) or all at ``finetune_new_learning_rate`` when set, every
    other parameter of ``params`` at ``finetune_learning_rate``."""
    new = {id(param) for _, param in trained}
    rest = [param for param in params if id(param) not in new]
    if args.finetune_new_learning_rate is None:
        groups = _learning_rate_groups(trained, projections, args)
    else:
        groups = [{"params": [param for _, param in trained], "lr": args.finetune_new_learning_rate}]
    return groups + ([{"params": rest, "lr": args.finetune_learning_rate}] if rest else [])


def _finetune(model, source, trained, ids, mask, eval_blocks, args: TransferArguments, generator, report) -> None:
    """Stage 2: distill the model from ``source``, all weights or LoRA + the new attention parameters."""
    report.finetune = args.finetune
    projections = _projections(model)  # by the model's own names, before LoRA wraps it
    report.finetune_loss = "next-token KL" if model.config.is_decoder else "hidden-state MSE / mean square, every layer"
    report.finetune_loss_before = _mean_distillation_loss(model, source, eval_blocks)
    order = _batches(ids.shape[0], args.batch_size, generator)

    def distillation_loss(step):
        index = next(order)
        return _distillation_loss(model, source, ids[index], mask[index])

    description = f"fine-tune ({args.finetune})"
    if args.finetune == "full":
        for param in model.parameters():
            param.requires_grad_(True)
        _, report.finetune_seconds = _train(
            _finetune_groups(model.parameters(), trained, projections, args),
            args.finetune_steps,
            distillation_loss,
            description,
            args.progress,
        )
    else:
        try:
            import peft
        except ImportError as error:
            raise ImportError(
                "finetune='lora' needs PEFT: pip install peft (or finetune='full', which needs nothing)"
            ) from error
        lora = peft.LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS)
        # LoRA is injected into model's own modules (the PeftModel wraps the same object): model's forward trains it
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = peft.get_peft_model(model, lora)
        try:
            for _, param in trained:  # peft froze everything but the LoRA weights
                param.requires_grad_(True)
            params = [param for param in wrapped.parameters() if param.requires_grad]
            _, report.finetune_seconds = _train(
                _finetune_groups(params, trained, projections, args),
                args.finetune_steps,
                distillation_loss,
                description,
                args.progress,
            )
        except BaseException:
            wrapped.unload()  # leave the model as it was given, without LoRA layers
            raise
        wrapped.merge_and_unload()
    report.finetune_steps = args.finetune_steps
    report.finetune_loss_after = _mean_distillation_loss(model, source, eval_blocks)


__all__ = [
    "TransferArguments",
    "TransferReport",
    "attention_transfer",
    "calibrate_query_scale",
    "choose_local_heads",
    "default_block_length",
    "hybrid_at_every_length",
    "local_head_shares",
    "softmax_attention_output",
    "text_blocks",
    "transfer_parameters",
]
