"""PerformerConfig (model_type "performer")."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .common import SHARED_FIELDS_DOC, LinearAttentionConfig

KERNELS = ("softmax", "relu")


@strict(accept_kwargs=True)
class PerformerConfig(LinearAttentionConfig):
    """Configuration of a Performer (Choromanski et al., 2021), FAVOR+ attention.

    Attention has no length limit of its own: with sinusoidal or rotary positions the model runs past
    max_position_embeddings.

    Example:
        >>> config = PerformerConfig(
        ...     hidden_size=256, num_attention_heads=4, position_embedding_type="rotary", num_random_features=128,
        ... )

    Args:
        num_random_features: m, the number of random features per head (default 256; e.g. 128).
        kernel: "softmax" (positive random features, Lemma 1) or "relu" (the generalized ReLU kernel) (default
            "softmax").
        orthogonal_features: draw exactly orthogonal blocks (True) or i.i.d. Gaussian rows (default True).
        feature_redraw_interval: redraw the features every this many training forward passes (None or 0:
            never). Each draw is a pure function of (feature_seed, layer, draw index): every DDP rank draws the
            same features without communication (default 1000; e.g. None).
        feature_seed: seed of the feature draws (default 0; e.g. 42).
        kernel_eps: the ReLU kernel's additive epsilon (default 1e-3).
        causal_chunk_size: chunk of the causal prefix sums, in tokens: a speed / memory trade-off that, up to rounding,
            does not change the result (default 32; e.g. 64).
    """

    __doc__ = (__doc__ or "") + SHARED_FIELDS_DOC  # no docstring under python -OO
    model_type = "performer"

    num_random_features: int = 256
    kernel: str = "softmax"
    orthogonal_features: bool = True
    feature_redraw_interval: int | None = 1000
    feature_seed: int = 0
    kernel_eps: float = 1e-3
    causal_chunk_size: int = 32

    def _sequence_limit(self) -> tuple[int, str] | None:
        if self.position_embedding_type == "absolute":
            return self.max_position_embeddings, "max_position_embeddings"
        return None

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.num_random_features <= 0:
            raise ValueError(f"num_random_features must be positive, got {self.num_random_features}")
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown Performer kernel {self.kernel!r}; choose one of {KERNELS}")
        if self.feature_redraw_interval is not None and self.feature_redraw_interval < 0:
            raise ValueError(f"feature_redraw_interval must be >= 0 or None, got {self.feature_redraw_interval}")
        if self.causal_chunk_size <= 0:
            raise ValueError(f"causal_chunk_size must be positive, got {self.causal_chunk_size}")
        if self.kernel_eps < 0:
            raise ValueError(f"kernel_eps must be >= 0, got {self.kernel_eps}")


__all__ = ["PerformerConfig"]
