"""Convert pretrained BERT / GPT-2 checkpoints into Linformer / Performer models.

FAVOR+ approximates the softmax attention a checkpoint was trained with, and Linformer at k = n with E = F = I
*is* that attention, so every pretrained weight carries over; only the new parameters are initialized:
  * Linformer E / F: the identity when k = n (the converted model then equals the original exactly, causal
    included), otherwise mean pooling over windows of n / k positions (each slot starts as the average of its
    window's keys / values);
  * Performer: its random features (a buffer drawn from the config's seed), or a learned feature map
    (``feature_map="hedgehog"``) and per-head window balances at the model's own initialization;
  * local-head relative-position biases: zeros.

The new attention parameters can then be fit to the original's attention (``transfer=``, attention transfer,
see ``transfer.py``) before the model is returned or saved.

    python -m linearformers.conversion.convert bert-folder out-folder --family performer --num_features 256
    python -m linearformers.conversion.convert bert-folder out-folder --feature_map hedgehog --transfer_file text.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import cached_file

from .. import modeling
from ..cli import check_writable, raised_by_linearformers
from ..modeling.base import new_tensors
from ..modeling.registry import FAMILIES, HEADS, Family, Head, get_family
from ..ops._checks import renamed_keywords
from .long_context import (
    POSITION_INITS,
    check_max_length,
    long_attention_transfer,
    long_overrides,
    with_long_positions,
    write_sentence_transformers_files,
)
from .transfer import (
    TransferArguments,
    TransferReport,
    attention_transfer,
    default_block_length,
    text_blocks,
)

# the old names of renamed config fields, which the converters' keywords and the CLI's flags still take
RENAMED_FIELDS = {old: new for family in FAMILIES.values() for old, new in family.config_class.old_names.items()}
# head weights: BERT module -> ours, by head suffix
BERT_HEAD_WEIGHTS = {
    "ForMaskedLM": {
        "cls.predictions.transform.dense": "lm_head.dense",
        "cls.predictions.transform.LayerNorm": "lm_head.LayerNorm",
        "cls.predictions.decoder": "lm_head.decoder",
        "cls.predictions": "lm_head.decoder",  # the separate output bias
    },
    "ForSequenceClassification": {"classifier": "classifier"},
    "ForMultipleChoice": {"classifier": "classifier"},
    "ForTokenClassification": {"classifier": "score"},
    "ForQuestionAnswering": {"qa_outputs": "qa_outputs"},
}
# one BERT layer's modules -> ours
BERT_LAYER = {
    "attention.self.query": "attention.q_proj",
    "attention.self.key": "attention.k_proj",
    "attention.self.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "mlp.up_proj",
    "output.dense": "mlp.down_proj",
    "output.LayerNorm": "mlp_norm",
}
# one GPT-2 block's Conv1D modules -> our nn.Linear modules (c_attn is split into q, k, v separately)
GPT2_LINEAR = {"attn.c_proj": "attention.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
# the files that make a tokenizer: a folder without any of them has none (transformers would build an empty one)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model")


@dataclass
class ConversionReport:
    """What the conversion did: source -> target weights, new parameters initialized, source keys ignored, and the
    attention transfer when one ran (``transfer``)."""

    source: str
    target: str
    mapped: list[tuple[str, str]] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    transfer: TransferReport | None = None

    def __str__(self) -> str:
        lines = [
            f"converted {self.source} -> {self.target}",
            f"  mapped {len(self.mapped)} weights",
            f"  initialized {len(self.initialized)} new tensors: {', '.join(self.initialized) or '-'}",
        ]
        if self.ignored:
            lines.append(f"  ignored {len(self.ignored)} source tensors: {', '.join(self.ignored)}")
        if self.transfer is not None:
            lines.append(str(self.transfer))
        return "\n".join(lines)


@dataclass(frozen=True)
class Copy:
    """One row of a key-mapping table: the source tensor ``source`` becomes our ``target``, through ``take`` (e.g.
    GPT-2's Conv1D weights transposed into nn.Linear layout) when given. ``part`` names the slice ``take`` cuts,
    for the report: ``attn.c_attn.weight[q_proj]``."""

    source: str
    target: str
    take: Callable[[torch.Tensor], torch.Tensor] | None = None
    part: str | None = None

    @property
    def label(self) -> str:
        return self.source if self.part is None else f"{self.source}[{self.part}]"


# what each converter reads: model_type, its name in messages, the architecture when config.json names none
SOURCES = {
    "convert_bert": ("bert", "a BERT checkpoint", "BertModel"),
    "convert_gpt2": ("gpt2", "a GPT-2 checkpoint", "GPT2LMHeadModel"),
}


def _config_dict(source: str | Path, hub: dict) -> dict:
    """The raw config.json of a local folder or a Hub id (resolved through the HF cache, as from_pretrained does)."""
    if Path(source).is_dir():
        if not (Path(source) / "config.json").is_file():
            raise ValueError(f"{str(source)!r} has no config.json; pass a folder written by save_pretrained")
        return json.loads((Path(source) / "config.json").read_text())
    try:
        config, _ = PreTrainedConfig.get_config_dict(str(source), **hub)
    except OSError as error:
        raise ValueError(
            f"{str(source)!r} is not a checkpoint folder (it does not exist) and does not resolve as a Hub model id "
            f"({error}); pass a folder written by save_pretrained or an id such as 'google-bert/bert-base-uncased'"
        ) from None
    return config


def _load(source, converter: str, hub: dict) -> PreTrainedModel:
    if isinstance(source, PreTrainedModel):
        return source
    if isinstance(source, str | Path):
        config = _config_dict(source, hub)
        model_type, wanted, default = SOURCES[converter]
        if config.get("model_type") != model_type:
            others = [name for name, (other, _, _) in SOURCES.items() if other == config.get("model_type")]
            hint = f"; use {others[0]} for it" if others else ""
            if config.get("model_type") in FAMILIES:
                hint = "; it is already converted: load it with the Auto classes after `import linearformers`"
            raise ValueError(
                f"{str(source)!r} holds a checkpoint of model_type {config.get('model_type')!r}, but {converter} "
                f"expects {wanted} (model_type {model_type!r}){hint}"
            )
        architecture = (config.get("architectures") or [default])[0]
        import transformers

        model_class = getattr(transformers, architecture, None)
        if model_class is None:
            raise ValueError(f"{str(source)!r} names architecture {architecture!r}, which transformers does not have")
        return model_class.from_pretrained(source, **hub)
    raise TypeError(f"source must be a folder, a Hub model id or a transformers model, got {type(source).__name__}")


def _source_head(source: PreTrainedModel, heads: dict[str, Head]) -> Head:
    """Our head for the source's class (``heads``: source class name -> head); a ValueError names the classes."""
    name = type(source).__name__
    if name not in heads:
        raise ValueError(f"cannot convert {name}; pass a {' or '.join(sorted(heads))}")
    return heads[name]


def _config_fields(config_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls)} | {"num_labels"}


def _check_overrides(overrides: dict, family: Family) -> None:
    """A ValueError for a name the family's config does not have, naming the other family's config when it has
    it, else close names."""
    known = _config_fields(family.config_class)
    for name in overrides:
        if name in known:
            continue
        message = f"{family.config_class.__name__} has no field {name!r}"
        other = [f for f in FAMILIES.values() if f != family and name in _config_fields(f.config_class)]
        close = difflib.get_close_matches(name, sorted(known), n=3)
        if other:
            message += f"; it is a {other[0].config_class.__name__} field: pass family={other[0].name!r}"
        elif close:
            message += f"; did you mean {' or '.join(repr(c) for c in close)}?"
        raise ValueError(message)


def _attention_fields(max_positions: int, overrides: dict, family: Family) -> dict:
    """The user's attention settings (checked by ``_check_overrides``), with the family's defaults for a model
    converted from ``max_positions`` positions (``conversion_defaults`` of its config)."""
    _check_overrides(overrides, family)
    return family.config_class.conversion_defaults(overrides, max_positions)


def _new_model(family: Family, head: Head, fields: dict, max_positions: int, overrides: dict) -> PreTrainedModel:
    """Our ``head`` model of ``family``, configured with the source's ``fields`` and the user's ``overrides``."""
    config = family.config_class(**fields, **_attention_fields(max_positions, overrides, family))
    return getattr(modeling, family.class_name(head))(config)


def _init_new(model: nn.Module) -> list[str]:
    """Start the tensors no checkpoint holds, as their modules declare (``layers.NewTensor``); returns their names."""
    initialized = []
    new = new_tensors(model)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in tensors.items():
        if name not in new:
            continue
        if new[name].start == "window_means":
            _pooling_init(tensor, model.config.projection)
        elif new[name].start == "zeros":
            nn.init.zeros_(tensor)
        initialized.append(name)
    return initialized


@torch.no_grad()
def _pooling_init(param: torch.Tensor, projection: str) -> None:
    if projection == "conv":  # (d, d, window): per-channel mean over the window
        window = param.shape[-1]
        param.zero_()
        idx = torch.arange(param.shape[0])
        param[idx, idx, :] = 1.0 / window
        return
    k, n = param.shape[-2:]
    matrix = torch.zeros(k, n)
    for slot in range(k):
        lo, hi = slot * n // k, max((slot + 1) * n // k, slot * n // k + 1)
        matrix[slot, lo:hi] = 1.0 / (hi - lo)
    param.copy_(matrix.expand_as(param))


def _copy_weights(
    model: PreTrainedModel,
    source: PreTrainedModel,
    copies: Sequence[Copy],
    *,
    fresh: Sequence[str] = (),
    tied: Sequence[str] = (),
) -> tuple[PreTrainedModel, ConversionReport]:
    """Load ``source``'s weights into ``model`` by the mapping table ``copies`` and initialize the rest.

    The report lists each tensor mapped (source -> ours), initialized (the new tensors, and ``fresh``: ours that stay
    at their fresh initialization) and ignored (source tensors no row reads, except ``tied``, the source's copies of
    tied weights). A ValueError names a row whose target we lack or whose shapes differ, and any weight of ours
    that is neither mapped nor initialized.
    """
    report = ConversionReport(type(source).__name__, type(model).__name__)
    report.initialized = [*_init_new(model), *fresh]
    state, target = source.state_dict(), model.state_dict()
    loaded = {}
    for copy in copies:
        if copy.target not in target:
            raise ValueError(
                f"conversion maps {copy.label} to {copy.target}, which {type(model).__name__} does not have"
            )
        tensor = state[copy.source] if copy.take is None else copy.take(state[copy.source])
        shape, wanted = tuple(tensor.shape), tuple(target[copy.target].shape)
        if shape != wanted:
            raise ValueError(f"shape mismatch: {copy.label} {shape} vs {copy.target} {wanted}")
        loaded[copy.target] = tensor
        report.mapped.append((copy.label, copy.target))
    model.load_state_dict(loaded, strict=False)
    report.ignored = sorted(set(state) - {copy.source for copy in copies} - set(tied))
    covered = set(loaded) | {name + suffix for name in report.initialized for suffix in ("", ".weight")}
    ours_tied = {k for k in target if k.endswith("lm_head.weight") or k.endswith("lm_head.decoder.weight")}
    missing = sorted(k for k in target if k not in covered and k not in ours_tied)
    if missing:
        raise ValueError(f"conversion left these weights of {type(model).__name__} without a source: {missing}")
    model.tie_weights()
    return model.eval(), report


def _bert_prefixes(head: Head) -> tuple[str, str]:
    """Where the encoder's keys start, in BERT and in ours: the base models hold it at the top, heads under a name."""
    return ("", "") if head.suffix == "Model" else ("bert.", "model.")


def _bert_copies(state: dict, head: Head, model_keys: set[str]) -> list[Copy]:
    """The mapping table of a BERT checkpoint with ``state`` into our ``head`` model with ``model_keys``."""
    prefix, ours = _bert_prefixes(head)
    copies = []
    for key in state:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if rest.startswith("embeddings.") and "position_ids" not in rest and "token_type_ids" not in rest:
            copies.append(Copy(key, ours + rest))
        elif rest.startswith("encoder.layer."):
            i, sub = rest[len("encoder.layer.") :].split(".", 1)
            module, param = sub.rsplit(".", 1)
            copies.append(Copy(key, f"{ours}layers.{i}.{BERT_LAYER[module]}.{param}"))
        elif rest.startswith("pooler.") and ours + rest in model_keys:
            copies.append(Copy(key, ours + rest))
    for src_module, dst_module in BERT_HEAD_WEIGHTS.get(head.suffix, {}).items():
        for param in ("weight", "bias"):
            src, dst = f"{src_module}.{param}", f"{dst_module}.{param}"
            if src in state and dst not in {copy.target for copy in copies}:
                copies.append(Copy(src, dst))
    return copies


def _conv1d_as_linear(weight: torch.Tensor, part: int | None = None) -> torch.Tensor:
    """GPT-2's Conv1D weight (in, out) in nn.Linear layout (out, in); ``part``: the q, k or v third of c_attn."""
    weight = weight.T
    return (weight if part is None else weight.chunk(3, dim=0)[part]).contiguous()


def _third(bias: torch.Tensor, part: int) -> torch.Tensor:
    """The q, k or v third of c_attn's bias."""
    return bias.chunk(3)[part].contiguous()


def _gpt2_copies(num_layers: int) -> list[Copy]:
    """The mapping table of a GPT2LMHeadModel with ``num_layers`` blocks into our causal LM."""
    copies = [
        Copy("transformer.wte.weight", "model.embeddings.word_embeddings.weight"),
        Copy("transformer.wpe.weight", "model.embeddings.position_embeddings.weight"),
        *(Copy(f"transformer.ln_f.{p}", f"model.final_norm.{p}") for p in ("weight", "bias")),
    ]
    for i in range(num_layers):
        h, ours = f"transformer.h.{i}.", f"model.layers.{i}."
        for p in ("weight", "bias"):
            copies += [Copy(f"{h}ln_1.{p}", f"{ours}attention_norm.{p}"), Copy(f"{h}ln_2.{p}", f"{ours}mlp_norm.{p}")]
        for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
            weight = functools.partial(_conv1d_as_linear, part=index)
            bias = functools.partial(_third, part=index)
            copies.append(Copy(h + "attn.c_attn.weight", f"{ours}attention.{name}.weight", weight, name))
            copies.append(Copy(h + "attn.c_attn.bias", f"{ours}attention.{name}.bias", bias, name))
        for conv, linear in GPT2_LINEAR.items():
            copies.append(Copy(f"{h}{conv}.weight", f"{ours}{linear}.weight", _conv1d_as_linear))
            copies.append(Copy(f"{h}{conv}.bias", f"{ours}{linear}.bias"))
    return copies


def _source_tokenizer(source: PreTrainedModel | str | Path, **hub) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved with ``source`` (a folder or Hub id, or a model loaded from one: its ``name_or_path``),
    loaded with AutoTokenizer and ``hub`` (revision, cache_dir, ...); None when it has no tokenizer files."""
    where = getattr(source, "name_or_path", "") if isinstance(source, PreTrainedModel) else str(source)
    if not where:
        return None
    found = (cached_file(where, name, _raise_exceptions_for_missing_entries=False, **hub) for name in TOKENIZER_FILES)
    if not any(found):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(where, **hub)


def _check_transfer_request(transfer, transfer_texts, tokenizer) -> None:
    """Fail before any loading on a transfer request that cannot run."""
    if transfer is None:
        if transfer_texts is not None or tokenizer is not None:
            raise ValueError(
                "transfer_texts and tokenizer are for attention transfer: pass transfer=TransferArguments(...) too"
            )
        return
    if not isinstance(transfer, TransferArguments):
        raise TypeError(f"transfer must be TransferArguments, got {type(transfer).__name__}")
    if transfer_texts is None:
        raise ValueError(
            "transfer=TransferArguments(...) needs transfer_texts: the path of a text file or a list of strings to "
            "fit the attention on"
        )
    if isinstance(transfer_texts, list | tuple) and not transfer_texts:
        raise ValueError(
            "transfer_texts is empty; pass a list of strings to fit the attention on, or the path of a text file"
        )


def _transfer(
    model: PreTrainedModel,
    source: PreTrainedModel,
    given: PreTrainedModel | str | Path,
    report: ConversionReport,
    transfer: TransferArguments | None,
    transfer_texts,
    tokenizer: PreTrainedTokenizerBase | None,
    hub: dict,
    wrap: bool,
    max_length: int | None = None,
) -> None:
    """Run attention transfer on the converted ``model`` when asked; its report goes to ``report.transfer``. A model
    converted to ``max_length`` tokens trains on blocks of that length, the source reading them chunk by chunk."""
    if transfer is None:
        return
    if tokenizer is None:
        tokenizer = _source_tokenizer(given, **hub)
    if tokenizer is None:
        where = given if isinstance(given, str | Path) else type(given).__name__
        raise ValueError(
            f"attention transfer tokenizes transfer_texts, and {str(where)!r} comes with no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); pass tokenizer=AutoTokenizer.from_pretrained(...) of the checkpoint"
        )
    length = transfer.max_length or max_length or default_block_length(model)
    ids = text_blocks(tokenizer, transfer_texts, length, wrap=wrap)
    if max_length is None:
        report.transfer = attention_transfer(model, source, ids, args=transfer)
        return
    # the long steps' blocks: the model's full length, from the same texts
    long_ids = text_blocks(tokenizer, transfer_texts, max_length, wrap=wrap) if transfer.finetune_long_steps else None
    report.transfer = long_attention_transfer(model, source, ids, args=transfer, long_input_ids=long_ids)


@renamed_keywords("0.3.0", **RENAMED_FIELDS)
def convert_bert(
    source: PreTrainedModel | str | Path,
    family: str = "performer",
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    transfer: TransferArguments | None = None,
    transfer_texts: str | Path | Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    long_positions: typing.Literal[POSITION_INITS] = "tile",
    **config_overrides,
) -> tuple[PreTrainedModel, ConversionReport]:
    """Convert a ``BertModel`` / ``BertFor*`` into the matching ``Linformer*`` / ``Performer*``.

    ``source`` is a model, a folder, or a Hub id (``"google-bert/bert-base-uncased"``), loaded as
    ``from_pretrained`` loads it, with ``revision``, ``cache_dir``, ``token`` and ``local_files_only`` passed on.
    ``config_overrides`` set fields of the family's config, typically the attention's (e.g.
    ``num_features=256``, ``feature_redraw_interval=None``, ``feature_map="hedgehog"`` or
    ``projected_length=128``); a name the config does not have raises a ValueError naming close matches.

    ``transfer``: run attention transfer (``linearformers.conversion.transfer``) on the converted model, fitting its
    new attention parameters to BERT's attention on ``transfer_texts`` (a text file's path or a list of strings),
    tokenized by ``tokenizer`` (default: the one saved with ``source``) into [CLS] ... [SEP] blocks of
    ``transfer.max_length`` tokens. Returns ``(model, ConversionReport)``; the report's ``transfer`` holds the
    TransferReport.

    ``max_length``: build a model that reads ``max_length`` tokens, beyond the source's positions
    (``linearformers.conversion.long_context``): the position table extended by ``long_positions`` ("tile" or
    "interpolate"), a Linformer's E / F built for that length, and the transfer on blocks of that length with the
    source as a chunk-wise teacher.
    """
    _check_transfer_request(transfer, transfer_texts, tokenizer)
    check_max_length(max_length, long_positions)
    if transfer is not None and transfer.finetune_long_steps and max_length is None:
        raise ValueError(
            "transfer.finetune_long_steps trains on blocks of a long conversion's full length: pass max_length too "
            "(or finetune_long_steps=0)"
        )
    target = get_family(family)
    hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    bert = _load(source, "convert_bert", hub)
    head = _source_head(bert, {h.bert_class: h for h in HEADS.values() if h.bert_class})
    bc = bert.config
    fields = dict(
        vocab_size=bc.vocab_size,
        hidden_size=bc.hidden_size,
        num_hidden_layers=bc.num_hidden_layers,
        num_attention_heads=bc.num_attention_heads,
        intermediate_size=bc.intermediate_size,
        hidden_act=bc.hidden_act,
        hidden_dropout_prob=bc.hidden_dropout_prob,
        attention_probs_dropout_prob=bc.attention_probs_dropout_prob,
        max_position_embeddings=bc.max_position_embeddings,
        type_vocab_size=bc.type_vocab_size,
        layer_norm_eps=bc.layer_norm_eps,
        initializer_range=bc.initializer_range,
        pad_token_id=bc.pad_token_id,
        num_labels=bc.num_labels,
        id2label=bc.id2label,
        label2id=bc.label2id,
        problem_type=bc.problem_type,
    )
    if max_length is not None:
        config_overrides = long_overrides(target.config_class, config_overrides, max_length, bc.max_position_embeddings)
        fields["max_position_embeddings"] = max_length
    model = _new_model(target, head, fields, fields["max_position_embeddings"], config_overrides)
    theirs, ours = _bert_prefixes(head)
    state, model_keys = bert.state_dict(), list(model.state_dict())
    fresh = []
    if not any(key.startswith(theirs + "pooler.") for key in state):
        # a BERT saved without its pooler (BertModel(add_pooling_layer=False)) into a stack that has one: the
        # pooler stays at its fresh initialization (token classification, QA and masked LM have none)
        fresh = [key for key in model_keys if key.startswith(ours + "pooler.")]
    copies = _bert_copies(state, head, set(model_keys))
    if max_length is not None:
        copies = with_long_positions(copies, max_length, long_positions)
    model, report = _copy_weights(model, bert, copies, fresh=fresh)
    _transfer(model, bert, source, report, transfer, transfer_texts, tokenizer, hub, wrap=True, max_length=max_length)
    return model, report


@renamed_keywords("0.3.0", **RENAMED_FIELDS)
def convert_gpt2(
    source: PreTrainedModel | str | Path,
    family: str = "performer",
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    transfer: TransferArguments | None = None,
    transfer_texts: str | Path | Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **config_overrides,
) -> tuple[PreTrainedModel, ConversionReport]:
    """Convert a ``GPT2LMHeadModel`` into ``LinformerForCausalLM`` / ``PerformerForCausalLM``.

    ``source`` and the Hub arguments as for :func:`convert_bert`. GPT-2's Conv1D weights are transposed into
    nn.Linear layout and ``c_attn`` is split into q, k, v. ``config_overrides`` and ``transfer``,
    ``transfer_texts``, ``tokenizer`` as for :func:`convert_bert`, with plain blocks of tokens (no special tokens;
    the eos token between texts). Returns ``(model, ConversionReport)``.
    """
    _check_transfer_request(transfer, transfer_texts, tokenizer)
    if transfer is not None and transfer.finetune_long_steps:
        raise ValueError(
            "transfer.finetune_long_steps is for a BERT converted to a longer max_length; a GPT-2 keeps its "
            "positions (finetune_long_steps=0)"
        )
    target = get_family(family)
    hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    gpt2 = _load(source, "convert_gpt2", hub)
    head = _source_head(gpt2, {h.gpt2_class: h for h in HEADS.values() if h.gpt2_class})
    gc = gpt2.config
    fields = dict(
        vocab_size=gc.vocab_size,
        hidden_size=gc.n_embd,
        num_hidden_layers=gc.n_layer,
        num_attention_heads=gc.n_head,
        intermediate_size=gc.n_inner or 4 * gc.n_embd,
        hidden_act=gc.activation_function,
        hidden_dropout_prob=gc.resid_pdrop,
        attention_probs_dropout_prob=gc.attn_pdrop,
        max_position_embeddings=gc.n_positions,
        layer_norm_eps=gc.layer_norm_epsilon,
        initializer_range=gc.initializer_range,
        is_decoder=True,
        type_vocab_size=0,
        bos_token_id=gc.bos_token_id,
        eos_token_id=gc.eos_token_id,
        pad_token_id=None,
    )
    model = _new_model(target, head, fields, gc.n_positions, config_overrides)
    # lm_head.weight is GPT-2's copy of the tied word embeddings
    model, report = _copy_weights(model, gpt2, _gpt2_copies(gc.n_layer), tied=("lm_head.weight",))
    _transfer(model, gpt2, source, report, transfer, transfer_texts, tokenizer, hub, wrap=False)
    return model, report


def _flag(name: str, kind, default, text: str, default_text: str | None = None) -> tuple[str, dict]:
    """The option string and argparse keywords of a dataclass field ``name`` of type ``kind``: a bool is a switch
    (``--name`` sets True, or ``--no_name`` sets False where the default is True), a Literal offers its choices, a
    list takes one or more values. Absent, a flag is None, so that only given flags reach the dataclass."""
    kinds = [k for k in typing.get_args(kind) if k is not type(None)] if _is_union(kind) else [kind]
    if kinds == [bool]:
        if default is True:
            return f"--no_{name}", dict(dest=name, action="store_const", const=False, help=f"{text} = False")
        return f"--{name}", dict(action="store_const", const=True, help=f"{text} = True")
    help_text = f"{text} (default: {default if default_text is None else default_text})"
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is typing.Literal:
        choices = typing.get_args(kinds[0])
        return f"--{name}", dict(type=type(choices[0]), choices=choices, help=help_text)
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is list:
        return f"--{name}", dict(type=typing.get_args(kinds[0])[0], nargs="+", metavar=name.upper(), help=help_text)
    if set(kinds) == {int, float}:
        kinds = [float]
    if len(kinds) != 1 or kinds[0] not in (int, float, str):
        raise TypeError(f"no command-line form for field {name!r} of type {kind}; give it one in convert._flag")
    return f"--{name}", dict(type=kinds[0], metavar=name.upper(), help=help_text)


def _is_union(kind) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _config_flags() -> dict[str, tuple[str, dict]]:
    """Field name -> flag of every family's attention fields (``attention_fields`` of its config; a name two families
    share is one flag, whose default is each family's own)."""
    flags = {}
    for family in FAMILIES.values():
        for f in family.config_class.attention_fields():  # the configs' annotations are types, not strings
            flags.setdefault(f.name, _flag(f.name, f.type, f.default, f"the config's {f.name}", "the family's"))
    return flags


def _transfer_flags() -> dict[str, tuple[str, dict]]:
    """TransferArguments field name -> its flag (named by the field's metadata ``flag``, else the field)."""
    hints = typing.get_type_hints(TransferArguments)  # transfer.py's annotations are strings
    flags = {}
    for f in dataclasses.fields(TransferArguments):
        option, kwargs = _flag(f.metadata.get("flag", f.name), hints[f.name], f.default, f"TransferArguments.{f.name}")
        flags[f.name] = option, {**kwargs, "dest": f"transfer.{f.name}"}
    return flags


def main(argv: list[str] | None = None) -> None:
    """The conversion CLI. Bad input (a flag of the other family, an unwritable output folder, a source of another
    model type, ...) exits 2 with one ``error:`` line after the usage, the output folder checked before any work."""
    parser = argparse.ArgumentParser(
        prog="python -m linearformers.conversion.convert",
        description="Convert a BERT / GPT-2 checkpoint to Linformer / Performer",
    )
    parser.add_argument("source", help="folder or Hub id of a BertModel / BertFor* / GPT2LMHeadModel checkpoint")
    parser.add_argument("output", help="folder to save the converted model (and the tokenizer, if any)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="performer")
    config_flags = _config_flags()
    for option, kwargs in config_flags.values():
        parser.add_argument(option, **kwargs)
    for old, new in RENAMED_FIELDS.items():  # hidden: --help shows the new names only
        value_kwargs = {key: value for key, value in config_flags[new][1].items() if key in ("type", "choices")}
        parser.add_argument(f"--{old}", help=argparse.SUPPRESS, metavar=new.upper(), **value_kwargs)
    parser.add_argument(
        "--max_length",
        type=int,
        metavar="N",
        help="BERT only: convert to a model that reads N tokens, past the source's positions (positions extended, "
        "Linformer E / F built for N, the transfer on N-token blocks with the source as a chunk-wise teacher); the "
        "tokenizer is saved with model_max_length N and, for a BertModel, the folder loads as a SentenceTransformer "
        "(mean pooling, max_seq_length N)",
    )
    parser.add_argument(
        "--long_positions",
        choices=POSITION_INITS,
        help="with --max_length: how the position rows past the source's start (default: tile)",
    )
    parser.add_argument("--revision", help="branch, tag or commit of a Hub id")
    parser.add_argument("--cache_dir", help="Hugging Face cache folder (default: the usual HF cache)")
    group = parser.add_argument_group(
        "attention transfer", "fit the new attention parameters to the original's attention before saving"
    )
    group.add_argument("--transfer_file", help="UTF-8 text file to fit on; needs a tokenizer saved with the source")
    transfer_flags = _transfer_flags()
    for option, kwargs in transfer_flags.values():
        group.add_argument(option, **kwargs)
    args = parser.parse_args(argv)
    for old, new in RENAMED_FIELDS.items():
        if getattr(args, old) is None:
            continue
        if getattr(args, new) is not None:
            parser.error(f"--{old} and --{new} both given; pass only --{new} (the new name of --{old})")
        print(
            f"{parser.prog}: warning: --{old} is renamed --{new}; --{old} goes away in linearformers 0.3.0",
            file=sys.stderr,
        )
        setattr(args, new, getattr(args, old))
    hub = dict(revision=args.revision, cache_dir=args.cache_dir)
    given = {
        name: getattr(args, kwargs["dest"])
        for name, (_, kwargs) in transfer_flags.items()
        if getattr(args, kwargs["dest"]) is not None
    }
    transfer = None
    if args.transfer_file is not None:
        try:
            transfer = TransferArguments(**given)
        except (TypeError, ValueError) as error:
            parser.error(str(error))
    elif given:
        parser.error(
            f"{transfer_flags[next(iter(given))][0]} is a setting of attention transfer, which needs --transfer_file"
        )
    overrides = {k: getattr(args, k) for k in config_flags if getattr(args, k) is not None}  # None: not given
    try:
        _check_overrides(overrides, get_family(args.family))
        # before the conversion and its attention transfer (minutes), not after them
        check_writable(args.output, "output folder", "the converted model")
        convert = convert_gpt2 if _config_dict(args.source, hub).get("model_type") == "gpt2" else convert_bert
        if args.max_length is not None:
            if convert is convert_gpt2:
                raise ValueError("--max_length converts BERT encoders; a GPT-2 source keeps its positions")
            overrides.update(max_length=args.max_length, long_positions=args.long_positions or "tile")
        elif args.long_positions is not None:
            raise ValueError("--long_positions sets the position rows of a long conversion: give --max_length too")
        # copy the tokenizer only where the checkpoint has one: for a folder without vocabulary files transformers
        # builds an empty tokenizer of the model type, which would be saved as if it were real
        tokenizer = _source_tokenizer(args.source, **hub)
        if transfer is not None:
            overrides.update(transfer=transfer, transfer_texts=args.transfer_file, tokenizer=tokenizer)
        # the transfer runs inside convert, before anything is written: a failed run leaves the folder empty
        model, report = convert(args.source, args.family, **hub, **overrides)
    except ValueError as error:
        if not raised_by_linearformers(error):  # a bug or a library's failure: keep its traceback
            raise
        parser.error(" ".join(str(error).split()))
    model.save_pretrained(args.output)
    if tokenizer is not None:
        if args.max_length is not None:
            tokenizer.model_max_length = args.max_length
        tokenizer.save_pretrained(args.output)
        if args.max_length is not None and model.base_model is model:
            write_sentence_transformers_files(args.output, model.config.hidden_size, args.max_length)
    print(report)


__all__ = ["ConversionReport", "TransferArguments", "convert_bert", "convert_gpt2"]

if __name__ == "__main__":
    main()
