"""Attention math: plain functions on (batch, heads, length, head_dim) tensors. Imports only torch."""

from .favor import BACKENDS as FAVOR_BACKENDS
from .favor import KERNELS, draw_random_features, favor_attention, favor_features, favor_step
from .linformer import (
    METHODS,
    causal_linformer_attention,
    causal_linformer_step,
    compact,
    linformer_attention,
    uncompact,
)
from .local import local_attention, local_attention_step, num_relative_positions
from .softmax import softmax_attention

__all__ = [
    "FAVOR_BACKENDS",
    "KERNELS",
    "METHODS",
    "causal_linformer_attention",
    "causal_linformer_step",
    "compact",
    "draw_random_features",
    "favor_attention",
    "favor_features",
    "favor_step",
    "linformer_attention",
    "local_attention",
    "local_attention_step",
    "num_relative_positions",
    "softmax_attention",
    "uncompact",
]
