"""Attention math: plain functions on (batch, heads, length, head_dim) tensors. Imports only torch (and Triton,
lazily, when a call runs its kernels)."""

from ._native import available as native_available
from .backends import (
    BACKENDS,
    BIDIRECTIONAL_BACKENDS,
    CAUSAL_BACKENDS,
    native_walk_enabled,
    set_native_walk,
    set_triton_kernels,
)
from .favor import draw_random_features, favor_attention, favor_features, favor_step
from .feature_maps import (
    KERNELS,
    PERFORMER_KERNELS,
    FavorPositive,
    FeatureMap,
    HedgehogFeatureMap,
    ReluFeatures,
    favor_positive,
    relu_features,
)
from .hybrid import HybridState, hybrid_attention, hybrid_step
from .linear import linear_attention, linear_step
from .linformer import BACKENDS as LINFORMER_BACKENDS
from .linformer import CAUSAL_BACKENDS as LINFORMER_CAUSAL_BACKENDS
from .linformer import (
    METHODS,
    causal_linformer_attention,
    causal_linformer_step,
    compact,
    linformer_attention,
    uncompact,
)
from .linformer_hybrid import linformer_hybrid_attention
from .local import causal_local_attention, local_attention, local_attention_step, num_relative_positions
from .softmax import softmax_attention

FAVOR_BACKENDS = BACKENDS  # the name earlier releases exported

__all__ = [
    "BACKENDS",
    "BIDIRECTIONAL_BACKENDS",
    "CAUSAL_BACKENDS",
    "FAVOR_BACKENDS",
    "KERNELS",
    "LINFORMER_BACKENDS",
    "LINFORMER_CAUSAL_BACKENDS",
    "METHODS",
    "PERFORMER_KERNELS",
    "FavorPositive",
    "FeatureMap",
    "HedgehogFeatureMap",
    "HybridState",
    "ReluFeatures",
    "causal_linformer_attention",
    "causal_linformer_step",
    "causal_local_attention",
    "compact",
    "draw_random_features",
    "favor_attention",
    "favor_features",
    "favor_positive",
    "favor_step",
    "hybrid_attention",
    "hybrid_step",
    "linear_attention",
    "linear_step",
    "linformer_attention",
    "linformer_hybrid_attention",
    "local_attention",
    "local_attention_step",
    "native_available",
    "native_walk_enabled",
    "num_relative_positions",
    "relu_features",
    "set_native_walk",
    "set_triton_kernels",
    "softmax_attention",
    "uncompact",
]
