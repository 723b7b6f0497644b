"""LinformerConfig (model_type "linformer")."""

from typing import Literal

from huggingface_hub.dataclasses import as_validated_field, strict
from transformers.utils.type_validators import interval

from ..ops.linformer import METHODS
from .common import SHARED_FIELDS_DOC, LinearAttentionConfig, at_least_or_none, positive


@as_validated_field
def positive_entries(value: list[int] | None) -> None:
    """Every projected length k of the per-layer list is positive."""
    for k in value or ():
        if k <= 0:
            raise ValueError(f"projected length k must be positive, got {k} in {value}")


@strict(accept_kwargs=True)
class LinformerConfig(LinearAttentionConfig):
    """Configuration of a Linformer (Wang et al., 2020).

    Example:
        >>> config = LinformerConfig(
        ...     hidden_size=256, num_attention_heads=4, max_seq_length=4096, max_position_embeddings=4096,
        ...     projected_length=256,
        ... )

    Args:
        max_seq_length: n, the longest sequence the E / F projections cover (default None: max_position_embeddings;
            e.g. 4096).
        projected_length: k, the number of slots keys and values are projected to (default 256; e.g. 128).
        projected_length_per_layer: optional list of one k per layer, the paper's non-uniform k (default None:
            projected_length everywhere; e.g. [64, 64, 128, 128] for 4 layers).
        sharing: "per_head" (E, F per head and layer), "headwise" (E, F per layer, shared by the heads),
            "key_value" (E = F per layer) or "layerwise" (one E = F for every layer and head) (default "headwise").
        projection: "learned" (linear n -> k), "pool" (mean pooling) or "conv" (strided convolution); pool and
            conv use kernel = stride = max_seq_length / k. A causal decoder (is_decoder=True) needs "learned"
            (default "learned"; e.g. "pool").
        causal_chunk_size: chunk of the causal Linformer's prefix sums, in tokens: a speed / memory trade-off
            that, up to rounding, does not change the result (default 128; e.g. 64).
        hybrid_window: w, or None for plain Linformer heads (default None; e.g. 64). Encoders only. When set, each
            global head takes exact softmax scores on the real keys with |s - t| < w and on the k slots in one
            softmax, the window's scores weighted by a learned per-head balance gamma = exp(window_balance), which
            starts at 1 (``attention.linformer_hybrid``): the window keeps the sharp local attention that pooled
            slots blur. Time O(n (3 w + k) d).
        hybrid_sinks: S, the number of attention sinks of the hybrid (default 0; e.g. 1 for BERT's [CLS]): the
            first S real tokens of each sequence take exact softmax scores from every query, as if in its window.
            Needs hybrid_window.
    """

    __doc__ = (__doc__ or "") + SHARED_FIELDS_DOC  # no docstring under python -OO
    model_type = "linformer"

    max_seq_length: int | None = at_least_or_none(1)(default=None)
    projected_length: int = positive(default=256)
    projected_length_per_layer: list[int] | None = positive_entries(default=None)
    sharing: Literal["per_head", "headwise", "key_value", "layerwise"] = "headwise"
    projection: Literal[METHODS] = "learned"
    causal_chunk_size: int = positive(default=128)
    hybrid_window: int | None = at_least_or_none(1)(default=None)
    hybrid_sinks: int = interval(min=0)(default=0)

    def __post_init__(self, **kwargs):
        if self.max_seq_length is None:
            self.max_seq_length = self.max_position_embeddings
        super().__post_init__(**kwargs)

    @classmethod
    def conversion_defaults(cls, fields: dict, max_positions: int) -> dict:
        """n = the checkpoint's positions (also where ``max_seq_length`` is None) and k = n: E = F = I, so that the
        converted model starts as the original's attention exactly."""
        fields = dict(fields)
        if fields.get("max_seq_length") is None:
            fields["max_seq_length"] = max_positions
        fields.setdefault("projected_length", fields["max_seq_length"])
        return fields

    def projected_length_for(self, layer_idx: int) -> int:
        if self.projected_length_per_layer is not None:
            return self.projected_length_per_layer[layer_idx]
        return self.projected_length

    def sequence_limit(self) -> tuple[int, str]:
        return self.max_seq_length, "max_seq_length"

    def describe(self) -> tuple[str, str, list[str]]:
        """What the model card says of this attention: the rest of its summary (after the family's description in
        ``modeling/registry.py``), the details (markdown bullets) and the limits."""
        k = self.projected_length_per_layer or self.projected_length
        summary = (
            f", keys and values projected along the sequence from n={self.max_seq_length} to k={k} "
            f"({self.projection} projection, {self.sharing} sharing)."
        )
        details = (
            f"- maximum sequence length n = {self.max_seq_length}\n- projected length k = {k}\n- projection: "
            f"{self.projection}, sharing: {self.sharing}\n- position embeddings: {self.position_embedding_type}"
            f"{self.local_heads_text()}{self.hybrid_text('Linformer slots, in one softmax')}"
        )
        limits = [
            f"Inputs longer than max_seq_length={self.max_seq_length} raise an error: E and F are "
            f"k x {self.max_seq_length} matrices."
        ]
        if self.is_decoder:
            limits.append("The causal variant writes slots by position (never reads the future).")
        return summary, details, limits

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.position_embedding_type == "absolute" and self.max_seq_length > self.max_position_embeddings:
            raise ValueError(
                f"max_seq_length={self.max_seq_length} exceeds max_position_embeddings="
                f"{self.max_position_embeddings} of the learned absolute positions; raise max_position_embeddings"
            )
        per_layer = self.projected_length_per_layer is not None
        ks = list(self.projected_length_per_layer) if per_layer else [self.projected_length]
        if per_layer:
            if len(ks) != self.num_hidden_layers:
                raise ValueError(
                    f"projected_length_per_layer has {len(ks)} entries for num_hidden_layers={self.num_hidden_layers}; "
                    "give one k per layer, or None to use projected_length everywhere"
                )
            if self.sharing == "layerwise" and len(set(ks)) > 1:
                raise ValueError("sharing='layerwise' uses one projection for every layer, so all k must be equal")
        for k in ks:
            if k > self.max_seq_length:
                raise ValueError(
                    f"projected length k={k} is larger than max_seq_length={self.max_seq_length}; k must not exceed n"
                )
            if self.projection != "learned" and self.max_seq_length % k:
                raise ValueError(
                    f"the {self.projection!r} projection uses kernel = stride = max_seq_length / k, so k={k} must "
                    f"divide max_seq_length={self.max_seq_length}"
                )
        if self.hybrid_sinks and not self.hybrid_window:
            raise ValueError(
                f"hybrid_sinks={self.hybrid_sinks} needs a hybrid_window: sinks join the exact softmax window of the "
                "hybrid heads; set hybrid_window (e.g. 64), or hybrid_sinks=0"
            )
        if self.hybrid_window and self.is_decoder:
            raise ValueError(
                "hybrid_window is for Linformer encoders: a causal Linformer's slots fill as the sequence goes, which "
                "the window + slots hybrid does not model. For a decoder use PerformerConfig(hybrid_window=...), or "
                "hybrid_window=None"
            )
        if self.is_decoder and self.projection != "learned":
            raise ValueError(
                f"a causal Linformer (is_decoder=True) needs projection='learned'; {self.projection!r} pools over "
                "windows that would mix future tokens into past slots"
            )


__all__ = ["LinformerConfig"]
