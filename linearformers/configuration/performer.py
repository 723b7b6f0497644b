"""PerformerConfig (model_type "performer")."""

import math
from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers.utils.type_validators import interval

from ..modeling.attention.feature_maps import KERNELS
from .common import SHARED_FIELDS_DOC, LinearAttentionConfig, at_least_or_none, positive


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

    num_random_features: int = positive(default=256)
    kernel: Literal[KERNELS] = "softmax"
    orthogonal_features: bool = True
    feature_redraw_interval: int | None = at_least_or_none(0)(default=1000)
    feature_seed: int = 0
    kernel_eps: int | float = interval(min=0.0, max=math.inf, exclude_max=True)(default=1e-3)
    causal_chunk_size: int = positive(default=32)

    def sequence_limit(self) -> tuple[int, str] | None:
        if self.position_embedding_type == "absolute":
            return self.max_position_embeddings, "max_position_embeddings"
        return None


__all__ = ["PerformerConfig"]
