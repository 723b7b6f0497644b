"""Fields and checks that Linformer and Performer configs share (the BertConfig / GPT2Config fields).

Each field declares its type and, where it has one, its own range or choices, which ``@strict`` checks on
construction and on every assignment. ``validate_architecture`` holds the rules that tie fields together.
"""

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from huggingface_hub.dataclasses import as_validated_field, strict
from transformers import PreTrainedConfig
from transformers.utils.type_validators import activation_fn_key, interval


@as_validated_field
def dropout_probability(value: int | float | None) -> None:
    """A dropout probability in [0, 1), or None where the field admits it (1 would drop every activation)."""
    if value is not None and not 0 <= value < 1:  # False for NaN too
        raise ValueError(f"Value must be in [0, 1), got {value}")


def at_least_or_none(low: int) -> Callable[..., Any]:
    """Like transformers' ``interval(min=low)``, for a field that also admits None."""

    @as_validated_field
    def check(value: int | None) -> None:
        if value is not None and value < low:
            raise ValueError(f"Value must be None or greater or equal to {low}, got {value}")

    return check


# Field factories for ranges several fields share, used as transformers' own are: `hidden_size: int =
# positive(default=768)`. The excluded upper bound inf refuses infinity; NaN fails every bound.
positive = interval(min=0, exclude_min=True)
positive_finite = interval(min=0, max=math.inf, exclude_min=True, exclude_max=True)


# the metadata key of a shared field that sets the attention rather than the stack's shape (attention_fields); a
# dict per field: the field factories store their validator in it
ATTENTION = "attention"


def renamed_fields(version: str, **renames: str) -> Callable[[type], type]:
    """Let a config class take each field's old name (``old="new"``) until linearformers ``version``: as a keyword
    and as a key of a saved config.json (``from_pretrained`` passes the keys as keywords). An old name raises a
    FutureWarning naming the new one and the version that drops it, and sets the new field; saving writes the new
    name only. Reading the old attribute warns the same way. An old name given with its new name is a ValueError:
    the two could disagree. Apply it above ``@strict``, whose ``__init__`` it wraps."""

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise ValueError(
                            f"{cls.__name__} got both {old}={kwargs[old]!r} and {new}={kwargs[new]!r}; pass only "
                            f"{new} (the new name of {old})"
                        )
                    warnings.warn(_renamed_message(cls, old, new, version), FutureWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.old_names = {**cls.old_names, **renames}
        for old, new in renames.items():
            setattr(cls, old, property(functools.partial(_renamed_attribute, old=old, new=new, version=version)))
        return cls

    return decorate


def _renamed_message(cls: type, old: str, new: str, version: str) -> str:
    return (
        f"{cls.__name__}: {old} is renamed {new}; the name {old} goes away in linearformers {version} (pass {new}, "
        "or save an old config again to write the new name)"
    )


def _renamed_attribute(config: Any, *, old: str, new: str, version: str) -> Any:
    warnings.warn(_renamed_message(type(config), old, new, version), FutureWarning, stacklevel=2)
    return getattr(config, new)


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

    vocab_size: int = positive(default=30522)
    hidden_size: int = positive(default=768)
    num_hidden_layers: int = positive(default=12)
    num_attention_heads: int = positive(default=12)
    intermediate_size: int = positive(default=3072)
    hidden_act: str = activation_fn_key(default="gelu")
    hidden_dropout_prob: int | float = dropout_probability(default=0.1)
    attention_probs_dropout_prob: int | float = dropout_probability(default=0.1)
    max_position_embeddings: int = positive(default=512)
    type_vocab_size: int = interval(min=0)(default=2)
    layer_norm_eps: int | float = positive_finite(default=1e-12)
    initializer_range: int | float = interval(min=0.0, max=1.0)(default=0.02)
    position_embedding_type: Literal["absolute", "sinusoidal", "rotary"] = "absolute"
    rope_theta: int | float = positive_finite(default=10000.0)
    classifier_dropout: int | float | None = dropout_probability(default=None)
    # the local heads' fields set the attention (attention_fields), the others above the stack's shape
    num_local_heads: int = interval(min=0)(default=0, metadata={ATTENTION: True})
    local_window: int = positive(default=128, metadata={ATTENTION: True})
    local_relative_bias: bool = dataclasses.field(default=False, metadata={ATTENTION: True})
    is_decoder: bool = False
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True

    __doc__ = (__doc__ or "") + SHARED_FIELDS_DOC  # no docstring under python -OO

    # old name -> new name of each renamed field (renamed_fields), which conversion and its CLI accept too
    old_names: ClassVar[dict[str, str]] = {}

    # set by register_for_auto_class (a class attribute, not a field): every save_pretrained of this family's models
    # then writes the Hub code (modeling/hub_code.py)
    _hub_code_registered = False

    @classmethod
    def register_for_auto_class(cls, auto_class: str | type = "AutoConfig") -> None:
        """Make every ``save_pretrained`` of this family's models write the flat Hub code and an ``auto_map``, as
        transformers does for registered classes. transformers' own copy (``custom_object_save``) cannot follow
        this package's nested imports, so it is not used. ``auto_class`` must name one of transformers' Auto
        classes."""
        import transformers.models.auto as auto_module

        name = auto_class if isinstance(auto_class, str) else auto_class.__name__
        if not hasattr(auto_module, name):
            raise ValueError(f"{name} is not a valid auto class; pass one of transformers' (e.g. 'AutoConfig')")
        cls._hub_code_registered = True

    def __post_init__(self, **kwargs):
        saved_type = kwargs.get("model_type", type(self).model_type)
        if type(self).model_type and saved_type != type(self).model_type:
            # PreTrainedConfig would only warn, then set model_type to the saved one: a Linformer checkpoint would
            # build Linformer layers around a PerformerConfig and fail later on a missing attribute
            raise ValueError(
                f"this config has model_type '{saved_type}', but {type(self).__name__} builds model_type "
                f"'{type(self).model_type}' models. Load the checkpoint with its own family's classes (or the Auto "
                "classes, after `import linearformers`); a BERT / GPT-2 checkpoint goes through "
                "linearformers.conversion.convert."
            )
        super().__post_init__(**kwargs)
        # The rules across fields, here too: @strict runs validate_architecture after __init__ as well, but wraps its
        # errors in StrictDataclassClassValidationError; from here they arrive as the plain ValueError they are.
        self.validate_architecture()

    @classmethod
    def attention_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The fields of a family's config that set its attention, not the shape of the stack a conversion copies
        from BERT / GPT-2: every field the family's class declares itself, and the shared ones marked
        ``ATTENTION`` (the local heads'). The conversion CLI offers one flag for each."""
        own = inspect.get_annotations(cls)
        return tuple(f for f in dataclasses.fields(cls) if f.name in own or f.metadata.get(ATTENTION))

    @classmethod
    def conversion_defaults(cls, fields: dict, max_positions: int) -> dict:
        """``fields`` (the user's settings for a model converted from a BERT / GPT-2 checkpoint of
        ``max_positions`` positions) with this family's defaults for conversion added; a value the user gave wins.
        None is a value (``feature_redraw_interval=None``: never redraw) unless the family says otherwise."""
        return dict(fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def sequence_limit(self) -> tuple[int, str] | None:
        """The longest input this config's model accepts, and the field that sets it (None: no limit). The shared
        embeddings' learned position table bounds it; sinusoidal and rotary positions do not. A family whose
        attention is sized by the length too (the Linformer's E / F) narrows it."""
        if self.position_embedding_type == "absolute":
            return self.max_position_embeddings, "max_position_embeddings"
        return None

    def check_input_length(self, length: int, *, past: int = 0) -> None:
        """Raise a ValueError naming the limiting field if ``past`` tokens already seen (a cache's) and ``length``
        new ones are more than this config's model accepts (:meth:`sequence_limit`)."""
        if length < 0 or past < 0:
            raise ValueError(f"input length and past must be >= 0, got length={length}, past={past}")
        limit = self.sequence_limit()
        if limit is None or past + length <= limit[0]:
            return
        value, name = limit
        tokens = f"{length} tokens after {past} cached ones ({past + length} in all)" if past else f"{length} tokens"
        if name == "max_position_embeddings":
            fix = "use position_embedding_type='rotary' or 'sinusoidal', which have no length limit"
        else:
            fix = f"build the model with a larger {name}"
        raise ValueError(
            f"an input of {tokens} exceeds {name}={value}, the longest a model of this config accepts. "
            f"Truncate the input, or {fix}."
        )

    def local_heads_text(self) -> str:
        """The model card's sentence on the local heads ("" without them); see the families' ``describe``."""
        if not self.num_local_heads:
            return ""
        bias = " with a learned relative-position bias" if self.local_relative_bias else ""
        return (
            f" {self.num_local_heads} of the {self.num_attention_heads} heads are local softmax heads over a window "
            f"of {self.local_window} tokens{bias}."
        )

    def hybrid_text(self, rest: str) -> str:
        """The model card's sentences on the hybrid heads of a family with ``hybrid_window`` and ``hybrid_sinks``
        fields (both have them), whose exact window joins ``rest`` ("" without a hybrid_window)."""
        if not self.hybrid_window:
            return ""
        sinks = (
            f" The first {self.hybrid_sinks} real token(s) of each sequence are attention sinks, in every query's "
            "window."
            if self.hybrid_sinks
            else ""
        )
        return (
            f" Each global head adds exact softmax attention over a window of {self.hybrid_window} tokens to its "
            f"{rest}, normalized together with a learned per-head balance (LoLCATs hybrid).{sinks}"
        )

    def validate_architecture(self) -> None:
        """The rules across fields; each field's own range or choices are declared on the field."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
                "pick a head count that divides it"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, list) else [value]:
                if token is not None and not 0 <= token < self.vocab_size:
                    raise ValueError(f"{name}={value} is not a token id of the vocabulary [0, {self.vocab_size})")
        if self.position_embedding_type == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if self.num_local_heads > self.num_attention_heads:
            raise ValueError(
                f"num_local_heads={self.num_local_heads} must be at most num_attention_heads={self.num_attention_heads}"
            )
        limit = self.sequence_limit()
        if self.num_local_heads and limit is not None and self.local_window > limit[0]:
            raise ValueError(
                f"local_window={self.local_window} is larger than {limit[1]}={limit[0]}, the longest sequence "
                "this model accepts; lower local_window"
            )
        if self.num_local_heads and not self.is_decoder and self.local_window < 2:
            raise ValueError(f"a bidirectional local_window must be >= 2, got {self.local_window}")
