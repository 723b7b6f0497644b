"""Attention math: plain functions on (batch, heads, length, head_dim) tensors. Imports only torch (and Triton,
lazily, when a call runs its kernels).

The package exports the ops users call, the feature maps they pass, the backend switches and
:func:`favor_backend` / :func:`linear_backend`, which say which backend a call takes; the choice tuples
(``backends.CAUSAL_BACKENDS``, ``linformer.METHODS``, ``feature_maps.FEATURE_MAPS``, ...) and the helpers the models
use stay in their modules."""

from ._native import available as native_available
from .backends import BACKENDS, native_walk_enabled, set_native_walk, set_triton_kernels
from .favor import favor_attention, favor_backend, favor_features, favor_step
from .feature_maps import (
    FavorPositive,
    FeatureMap,
    HedgehogFeatureMap,
    ReluFeatures,
    draw_random_features,
    favor_positive,
    relu_features,
)
from .hybrid import HybridState, hedgehog_hybrid_attention, hedgehog_refusal, hybrid_attention, hybrid_step
from .linear import linear_attention, linear_backend, linear_step
from .linformer import causal_linformer_attention, causal_linformer_step, linformer_attention
from .linformer_hybrid import linformer_hybrid_attention
from .local import local_attention, local_attention_step
from .softmax import packed_softmax_attention, softmax_attention

__all__ = [
    "BACKENDS",
    "FavorPositive",
    "FeatureMap",
    "HedgehogFeatureMap",
    "HybridState",
    "ReluFeatures",
    "causal_linformer_attention",
    "causal_linformer_step",
    "draw_random_features",
    "favor_attention",
    "favor_backend",
    "favor_features",
    "favor_positive",
    "favor_step",
    "hedgehog_hybrid_attention",
    "hedgehog_refusal",
    "hybrid_attention",
    "hybrid_step",
    "linear_attention",
    "linear_backend",
    "linear_step",
    "linformer_attention",
    "linformer_hybrid_attention",
    "local_attention",
    "local_attention_step",
    "native_available",
    "native_walk_enabled",
    "packed_softmax_attention",
    "relu_features",
    "set_native_walk",
    "set_triton_kernels",
    "softmax_attention",
]
