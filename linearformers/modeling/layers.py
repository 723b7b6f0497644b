"""Deprecated path of the shared stack's modules, which live in :mod:`linearformers.modeling.base`; this module goes
away in linearformers 0.3.0."""

from __future__ import annotations

import warnings

from . import base as _base


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # the block's old name, which transformers' cache layer (transformers.cache_utils.LinearAttentionLayer) also has
    target = "LinearAttentionBlock" if name == "LinearAttentionLayer" else name
    if not hasattr(_base, target):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"linearformers.modeling.layers.{name} is now linearformers.modeling.base.{target}; the old path goes away "
        "in linearformers 0.3.0",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(_base, target)
