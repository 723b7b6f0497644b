"""Fields and checks that Linformer and Performer configs share (the BertConfig / GPT2Config fields)."""

from __future__ import annotations

import functools
import inspect
import math
import types
import typing

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

POSITION_EMBEDDING_TYPES = ("absolute", "sinusoidal", "rotary")


def _matches(value, hint) -> bool:
    """Whether value fits a field's annotation (int, float, bool, str, None, list[...] and unions of them).
    bool is not an int here, and an int is a float."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


@functools.cache
def _field_hints(cls) -> dict:
    """The annotated fields of a config class and its bases up to LinearAttentionConfig, resolved to types."""
    hints = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, LinearAttentionConfig):
            hints.update(inspect.get_annotations(klass, eval_str=True))
    return hints


def _admits_float(hint) -> bool:
    return hint is float or float in typing.get_args(hint)


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("NoneType", "None")


# The Args entries of the shared fields, appended to the docstrings of LinearAttentionConfig and of each family's
# config, so that help(PerformerConfig) lists every field (a class docstring is not inherited).
SHARED_FIELDS_DOC = """
        vocab_size: number of token ids, the rows of the word embeddings (default 30522, BERT's WordPiece; e.g.
            ``len(tokenizer)``).
        hidden_size: width d of the hidden states (default 768; e.g. 256). Must be divisible by
            num_attention_heads.
        num_hidden_layers: number of blocks (default 12; e.g. 4).
        num_attention_heads: heads per attention layer, each hidden_size / num_attention_heads wide (default 12;
            e.g. 4).
        intermediate_size: inner width of each block's MLP (default 3072, 4 x hidden_size; e.g. 1024).
        hidden_act: the MLP's activation, a key of transformers' ACT2FN (default "gelu"; e.g. "gelu_new", GPT-2's).
        hidden_dropout_prob: dropout on the embeddings and on every residual branch (default 0.1; e.g. 0.0).
        attention_probs_dropout_prob: dropout on the attention probabilities of the bidirectional Linformer; FAVOR+
            and the local heads do not use it (default 0.1; e.g. 0.0).
        max_position_embeddings: rows of the learned absolute position table, so the longest input with
            position_embedding_type="absolute" (default 512; e.g. 4096). Sinusoidal and rotary positions have no
            such limit.
        type_vocab_size: number of token-type (segment) ids of the encoder; 0 builds no token-type embeddings, and
            the decoder never has them (default 2; e.g. 0).
        layer_norm_eps: epsilon of every LayerNorm (default 1e-12, BERT's; e.g. 1e-5, GPT-2's).
        initializer_range: standard deviation of the normal initialization of the weights (default 0.02).
        position_embedding_type: "absolute" (learned table), "sinusoidal" (fixed, added to the embeddings) or
            "rotary" (RoPE on queries and keys; needs an even head width) (default "absolute"; e.g. "rotary").
        rope_theta: base of the rotary frequencies, used with position_embedding_type="rotary" (default 10000.0;
            e.g. 500000.0).
        classifier_dropout: dropout before the classification heads; None uses hidden_dropout_prob (default None;
            e.g. 0.2).
        num_local_heads: how many of the num_attention_heads heads run windowed softmax attention instead of the
            family's linear attention (default 0; e.g. 1).
        local_window: window of the local heads in tokens: a decoder's query sees itself and the local_window - 1
            tokens before it, an encoder's sees local_window // 2 on each side (default 128; e.g. 64).
        local_relative_bias: give the local heads a learnable bias per relative distance (default False).
        is_decoder: False builds the BERT-style post-LN encoder, True the GPT-2-style pre-LN causal decoder that
            ``*ForCausalLM`` needs (default False).
        use_cache: a decoder returns its recurrent state (a LinearAttentionCache) as past_key_values, which
            generate() continues from (default True).
        pad_token_id: id of the padding token; its embedding row gets no gradient (default 0; e.g.
            ``tokenizer.pad_token_id``).
        bos_token_id: id that generation starts from (default None; e.g. 50256, GPT-2's).
        eos_token_id: id, or list of ids, that ends generation (default None; e.g. 50256, GPT-2's).
        tie_word_embeddings: the LM heads (masked and causal) share their output weights with the word embeddings
            (default True).
        problem_type, id2label, label2id, output_hidden_states, return_dict, dtype, architectures,
            transformers_version, chunk_size_feed_forward, is_encoder_decoder: PreTrainedConfig's own fields, as
            for every transformers model (e.g. problem_type="multi_label_classification", id2label={0: "neg",
            1: "pos"}, dtype="bfloat16"); see transformers' PreTrainedConfig.
"""


@strict(accept_kwargs=True)
class LinearAttentionConfig(PreTrainedConfig):
    """Common fields. ``is_decoder=False`` builds the BERT-style post-LN encoder stack (with token types and a
    pooler); ``is_decoder=True`` builds the GPT-2-style pre-LN causal stack with a final norm, used by
    ``*ForCausalLM``.

    Position embeddings: ``"absolute"`` (learned, limited to ``max_position_embeddings``), ``"sinusoidal"`` or
    ``"rotary"`` (computed on the fly, no length limit of their own).

    Local heads: ``num_local_heads`` of the ``num_attention_heads`` heads run softmax attention inside a window of
    ``local_window`` tokens (with a learnable relative-position bias when ``local_relative_bias``); the others
    run the family's global linear attention.

    Args:
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    position_embedding_type: str = "absolute"
    rope_theta: float = 10000.0
    classifier_dropout: float | None = None
    num_local_heads: int = 0
    local_window: int = 128
    local_relative_bias: bool = False
    is_decoder: bool = False
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True

    __doc__ = (__doc__ or "") + SHARED_FIELDS_DOC  # no docstring under python -OO

    def __post_init__(self, **kwargs):
        saved_type = kwargs.get("model_type", type(self).model_type)
        if type(self).model_type and saved_type != type(self).model_type:
            # PreTrainedConfig would only warn, then set model_type to the saved one: a Linformer checkpoint would
            # build Linformer layers around a PerformerConfig and fail later on a missing attribute
            raise ValueError(
                f"this config has model_type '{saved_type}', but {type(self).__name__} builds model_type "
                f"'{type(self).model_type}' models. Load the checkpoint with its own family's classes (or the Auto "
                "classes, after `import linearformers`); a BERT / GPT-2 checkpoint goes through "
                "linearformers.modeling.convert."
            )
        super().__post_init__(**kwargs)
        # Validate here too, so that a bad value raises a plain ValueError naming it at construction
        # (@strict re-raises validate_architecture's errors wrapped in its own exception type).
        self.validate_architecture()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_global_heads(self) -> int:
        return self.num_attention_heads - self.num_local_heads

    def _sequence_limit(self) -> tuple[int, str] | None:
        """The longest input this config's attention accepts, and the field that sets it (None: no limit)."""
        return None

    def _check_field_types(self):
        """TypeError naming the field for a value of the wrong type (hidden_size=16.0, is_decoder="yes"), instead
        of a failure deep inside model construction. (@strict cannot check these: the annotations are strings.)"""
        for name in _field_hints(type(self)):
            self._check_field_type(name, getattr(self, name, None))

    def _check_field_type(self, name, value):
        hint = _field_hints(type(self)).get(name)
        if hint is not None and not _matches(value, hint):
            raise TypeError(
                f"{type(self).__name__}.{name} must be {_type_name(hint)}, got {type(value).__name__} {value!r}"
            )

    def __setattr__(self, name, value):
        # assignment after construction (config.hidden_size = 16.0) gets the same type check as the constructor;
        # values are checked together (validate_architecture) when the config is built or a model is made from it
        self._check_field_type(name, value)
        super().__setattr__(name, value)

    def validate_architecture(self) -> None:
        self._check_field_types()
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "local_window",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
                "pick a head count that divides it"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:  # False for NaN too
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        for name, low in (("layer_norm_eps", "> 0"), ("initializer_range", ">= 0"), ("rope_theta", "> 0")):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (low == "> 0" and value == 0):
                raise ValueError(f"{name} must be a finite number {low}, got {value}")
        for name, hint in _field_hints(type(self)).items():  # every float field, this family's own included
            value = getattr(self, name, None)
            if _admits_float(hint) and isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and not 0 <= token < self.vocab_size:
                    raise ValueError(f"{name}={value} is not a token id of the vocabulary [0, {self.vocab_size})")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; choose one of transformers' ACT2FN keys")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"unknown position_embedding_type {self.position_embedding_type!r}; "
                f"choose one of {POSITION_EMBEDDING_TYPES}"
            )
        if self.position_embedding_type == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if not 0 <= self.num_local_heads <= self.num_attention_heads:
            raise ValueError(
                f"num_local_heads={self.num_local_heads} must be between 0 and "
                f"num_attention_heads={self.num_attention_heads}"
            )
        limit = self._sequence_limit()
        if self.num_local_heads and limit is not None and self.local_window > limit[0]:
            raise ValueError(
                f"local_window={self.local_window} is larger than {limit[1]}={limit[0]}, the longest sequence "
                "this model accepts; lower local_window"
            )
        if self.num_local_heads and not self.is_decoder and self.local_window < 2:
            raise ValueError(f"a bidirectional local_window must be >= 2, got {self.local_window}")
