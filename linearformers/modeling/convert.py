"""Convert pretrained BERT / GPT-2 checkpoints into Linformer / Performer models.

FAVOR+ approximates the softmax attention a checkpoint was trained with, and Linformer at k = n with E = F = I
*is* that attention, so every pretrained weight carries over; only the new parameters are initialized:
  * Linformer E / F: the identity when k = n (the converted model then equals the original exactly, causal
    included), otherwise mean pooling over windows of n / k positions (each slot starts as the average of its
    window's keys / values);
  * Performer: its random features (a buffer drawn from the config's seed);
  * local-head relative-position biases: zeros.

    python -m linearformers.modeling.convert bert-folder out-folder --family performer --num_random_features 256
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import cached_file

from ..configuration import LinformerConfig, PerformerConfig
from . import linformer as linformer_models
from . import performer as performer_models
from .base import LinearAttentionModel
from .layers import LinformerAttention

FAMILIES = {"linformer": (LinformerConfig, linformer_models), "performer": (PerformerConfig, performer_models)}
BERT_HEADS = {
    "BertModel": "Model",
    "BertForMaskedLM": "ForMaskedLM",
    "BertForSequenceClassification": "ForSequenceClassification",
    "BertForTokenClassification": "ForTokenClassification",
    "BertForQuestionAnswering": "ForQuestionAnswering",
    "BertForMultipleChoice": "ForMultipleChoice",
}
# head weights: BERT name -> ours
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


@dataclass
class ConversionReport:
    """What the conversion did: source -> target weights, new parameters initialized, source keys ignored."""

    source: str
    target: str
    mapped: list[tuple[str, str]] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"converted {self.source} -> {self.target}",
            f"  mapped {len(self.mapped)} weights",
            f"  initialized {len(self.initialized)} new tensors: {', '.join(self.initialized) or '-'}",
        ]
        if self.ignored:
            lines.append(f"  ignored {len(self.ignored)} source tensors: {', '.join(self.ignored)}")
        return "\n".join(lines)


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


def _config_fields(config_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls)} | {"num_labels"}


def _attention_fields(max_positions: int, overrides: dict, family: str) -> dict:
    """The user's attention settings; a Linformer defaults to n = max positions and k = n (exact at start).

    None is a value (``feature_redraw_interval=None``: never redraw), except for Linformer's ``max_seq_length``,
    whose None means its default here too. A name the family's config does not have raises, naming close ones.
    """
    config_cls = FAMILIES[family][0]
    known = _config_fields(config_cls)
    for name in overrides:
        if name in known:
            continue
        message = f"{config_cls.__name__} has no field {name!r}"
        other = [f for f, (cls, _) in FAMILIES.items() if f != family and name in _config_fields(cls)]
        close = difflib.get_close_matches(name, sorted(known), n=3)
        if other:
            message += f"; it is a {FAMILIES[other[0]][0].__name__} field: pass family={other[0]!r}"
        elif close:
            message += f"; did you mean {' or '.join(repr(c) for c in close)}?"
        raise ValueError(message)
    fields = dict(overrides)
    if family == "linformer":
        if fields.get("max_seq_length") is None:
            fields["max_seq_length"] = max_positions
        fields.setdefault("projected_length", fields["max_seq_length"])
    return fields


def _init_new(model: nn.Module, report: ConversionReport) -> None:
    """Identity (k = n) or window-mean pooling for Linformer E / F; Performer features are already drawn."""
    for name, module in model.named_modules():
        if isinstance(module, LinformerAttention):
            for attr in ("e_proj", "f_proj"):
                param = getattr(module, attr)
                if param is not None:
                    _pooling_init(param, module.config.projection)
                    report.initialized.append(f"{name}.{attr}")
        if isinstance(module, LinearAttentionModel) and module.shared_projection is not None:
            _pooling_init(module.shared_projection, "learned")
            report.initialized.append(f"{name}.shared_projection".lstrip("."))
        if getattr(module, "relative_bias", None) is not None:
            nn.init.zeros_(module.relative_bias)
            report.initialized.append(f"{name}.relative_bias")
        if hasattr(module, "random_features"):
            report.initialized.append(f"{name}.random_features")


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


def _apply(model: nn.Module, state: dict, mapping: list[tuple[str, str]], report: ConversionReport) -> None:
    target = model.state_dict()
    used = set()
    new_state = {}
    for src, dst in mapping:
        if dst not in target:
            raise ValueError(f"conversion maps {src} to {dst}, which {type(model).__name__} does not have")
        if tuple(state[src].shape) != tuple(target[dst].shape):
            raise ValueError(f"shape mismatch: {src} {tuple(state[src].shape)} vs {dst} {tuple(target[dst].shape)}")
        new_state[dst] = state[src]
        used.add(src)
        report.mapped.append((src, dst))
    model.load_state_dict(new_state, strict=False)
    report.ignored = sorted(set(state) - used)
    covered = set(new_state) | {name + suffix for name in report.initialized for suffix in ("", ".weight")}
    tied = {k for k in target if k.endswith("lm_head.weight") or k.endswith("lm_head.decoder.weight")}
    missing = sorted(k for k in target if k not in covered and k not in tied and not k.endswith("feature_redraws"))
    if missing:
        raise ValueError(f"conversion left these weights of {type(model).__name__} without a source: {missing}")


def convert_bert(
    source: PreTrainedModel | str | Path,
    family: str = "performer",
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    **config_overrides,
) -> tuple[PreTrainedModel, ConversionReport]:
    """Convert a ``BertModel`` / ``BertFor*`` into the matching ``Linformer*`` / ``Performer*``.

    ``source`` is a model, a folder, or a Hub id (``"google-bert/bert-base-uncased"``), loaded as
    ``from_pretrained`` loads it, with ``revision``, ``cache_dir``, ``token`` and ``local_files_only`` passed on.
    ``config_overrides`` set fields of the family's config, typically the attention's (e.g.
    ``num_random_features=256``, ``feature_redraw_interval=None`` or ``projected_length=128``); a name the config
    does not have raises a ValueError naming close matches. Returns ``(model, ConversionReport)``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    bert = _load(source, "convert_bert", hub)
    head = BERT_HEADS.get(type(bert).__name__)
    if head is None:
        raise ValueError(f"cannot convert {type(bert).__name__}; supported: {sorted(BERT_HEADS)}")
    bc = bert.config
    config_cls, models = FAMILIES[family]
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
    fields.update(_attention_fields(bc.max_position_embeddings, config_overrides, family))
    config = config_cls(**fields)
    model = getattr(models, config_cls.__name__.removesuffix("Config") + head)(config)
    state = bert.state_dict()
    prefix = "" if head == "Model" else "bert."
    ours = "" if head == "Model" else "model."
    mapping = []
    for key in state:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if rest.startswith("embeddings.") and "position_ids" not in rest and "token_type_ids" not in rest:
            mapping.append((key, ours + rest))
        elif rest.startswith("encoder.layer."):
            i, sub = rest[len("encoder.layer.") :].split(".", 1)
            module, param = sub.rsplit(".", 1)
            mapping.append((key, f"{ours}layers.{i}.{BERT_LAYER[module]}.{param}"))
        elif rest.startswith("pooler.") and ours + rest in model.state_dict():
            mapping.append((key, ours + rest))
    for src_module, dst_module in BERT_HEAD_WEIGHTS.get(head, {}).items():
        for param in ("weight", "bias"):
            src = f"{src_module}.{param}"
            dst = f"{dst_module}.{param}"
            if src in state and dst not in {d for _, d in mapping}:
                mapping.append((src, dst))
    report = ConversionReport(type(bert).__name__, type(model).__name__)
    _init_new(model, report)
    if not any(src.startswith(prefix + "pooler.") for src in state):
        # a BERT saved without its pooler (BertModel(add_pooling_layer=False)) into a stack that has one: the
        # pooler stays at its fresh initialization (token classification, QA and masked LM have none)
        report.initialized += [k for k in model.state_dict() if k.startswith(ours + "pooler.")]
    _apply(model, state, mapping, report)
    model.tie_weights()
    return model.eval(), report


def convert_gpt2(
    source: PreTrainedModel | str | Path,
    family: str = "performer",
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    **config_overrides,
) -> tuple[PreTrainedModel, ConversionReport]:
    """Convert a ``GPT2LMHeadModel`` into ``LinformerForCausalLM`` / ``PerformerForCausalLM``.

    ``source`` and the Hub arguments as for :func:`convert_bert`. GPT-2's Conv1D weights are transposed into
    nn.Linear layout and ``c_attn`` is split into q, k, v. ``config_overrides`` as for :func:`convert_bert`.
    Returns ``(model, ConversionReport)``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    gpt2 = _load(source, "convert_gpt2", hub)
    if type(gpt2).__name__ != "GPT2LMHeadModel":
        raise ValueError(f"cannot convert {type(gpt2).__name__}; pass a GPT2LMHeadModel")
    gc = gpt2.config
    config_cls, models = FAMILIES[family]
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
    fields.update(_attention_fields(gc.n_positions, config_overrides, family))
    config = config_cls(**fields)
    model = getattr(models, config_cls.__name__.removesuffix("Config") + "ForCausalLM")(config)
    src = gpt2.state_dict()
    state, mapping = {}, []

    def put(name, tensor, dst):
        state[name] = tensor
        mapping.append((name, dst))

    put("transformer.wte.weight", src["transformer.wte.weight"], "model.embeddings.word_embeddings.weight")
    put("transformer.wpe.weight", src["transformer.wpe.weight"], "model.embeddings.position_embeddings.weight")
    for p in ("weight", "bias"):
        put(f"transformer.ln_f.{p}", src[f"transformer.ln_f.{p}"], f"model.final_norm.{p}")
    for i in range(gc.n_layer):
        h, ours = f"transformer.h.{i}.", f"model.layers.{i}."
        for p in ("weight", "bias"):
            put(h + f"ln_1.{p}", src[h + f"ln_1.{p}"], ours + f"attention_norm.{p}")
            put(h + f"ln_2.{p}", src[h + f"ln_2.{p}"], ours + f"mlp_norm.{p}")
        qkv_w = src[h + "attn.c_attn.weight"].T.chunk(3, dim=0)  # Conv1D (in, 3 out) -> 3 x Linear (out, in)
        qkv_b = src[h + "attn.c_attn.bias"].chunk(3)
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), qkv_w, qkv_b):
            put(h + f"attn.c_attn.weight[{name}]", w.contiguous(), ours + f"attention.{name}.weight")
            put(h + f"attn.c_attn.bias[{name}]", b.contiguous(), ours + f"attention.{name}.bias")
        for conv, linear in (
            ("attn.c_proj", "attention.o_proj"),
            ("mlp.c_fc", "mlp.up_proj"),
            ("mlp.c_proj", "mlp.down_proj"),
        ):
            put(h + conv + ".weight", src[h + conv + ".weight"].T.contiguous(), ours + linear + ".weight")
            put(h + conv + ".bias", src[h + conv + ".bias"], ours + linear + ".bias")
    report = ConversionReport(type(gpt2).__name__, type(model).__name__)
    _init_new(model, report)
    _apply(model, state, mapping, report)
    model.tie_weights()
    used = {name.split("[")[0] for name, _ in mapping}
    report.ignored = sorted(set(src) - used - {"lm_head.weight"})  # lm_head is tied to the embeddings
    return model.eval(), report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a BERT / GPT-2 checkpoint to Linformer / Performer")
    parser.add_argument("source", help="folder or Hub id of a BertModel / BertFor* / GPT2LMHeadModel checkpoint")
    parser.add_argument("output", help="folder to save the converted model (and the tokenizer, if any)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="performer")
    parser.add_argument("--num_random_features", type=int)
    parser.add_argument("--projected_length", type=int)
    parser.add_argument("--max_seq_length", type=int)
    parser.add_argument("--revision", help="branch, tag or commit of a Hub id")
    parser.add_argument("--cache_dir", help="Hugging Face cache folder (default: the usual HF cache)")
    args = parser.parse_args(argv)
    hub = dict(revision=args.revision, cache_dir=args.cache_dir)
    convert = convert_gpt2 if _config_dict(args.source, hub).get("model_type") == "gpt2" else convert_bert
    names = ("num_random_features",) if args.family == "performer" else ("projected_length", "max_seq_length")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}  # None: not given
    model, report = convert(args.source, args.family, **hub, **overrides)
    model.save_pretrained(args.output)
    # copy the tokenizer only where the checkpoint has one: for a folder without vocabulary files transformers
    # builds an empty tokenizer of the model type, which would be saved as if it were real
    tokenizer_files = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model")
    found = (
        cached_file(args.source, name, _raise_exceptions_for_missing_entries=False, **hub) for name in tokenizer_files
    )
    if any(found):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.source, **hub).save_pretrained(args.output)
    print(report)


__all__ = ["ConversionReport", "convert_bert", "convert_gpt2"]

if __name__ == "__main__":
    main()
