"""Deprecated alias of ``linearformers.ops`` (the attention math moved to its own floor, below the configs and
models) and of ``linearformers.seeds``; goes away in linearformers 0.3.0.

The old submodules are importable here under their old names (``linearformers.modeling.attention.favor`` is
``linearformers.ops.favor``, ``._triton_linear`` is ``linearformers.ops._triton_causal``, the same module objects),
and ``mix_seed`` from ``linearformers.modeling.attention.seeds``.
"""

import importlib
import sys
import warnings

from ... import ops
from ...ops import *  # noqa: F403
from ...ops.backends import BACKENDS, BIDIRECTIONAL_BACKENDS, CAUSAL_BACKENDS
from ...ops.feature_maps import FEATURE_MAPS, RANDOM_FEATURE_MAPS
from ...ops.linformer import BACKENDS as LINFORMER_BACKENDS
from ...ops.linformer import CAUSAL_BACKENDS as LINFORMER_CAUSAL_BACKENDS
from ...ops.linformer import METHODS, compact, uncompact
from ...ops.local import causal_local_attention, num_relative_positions

FAVOR_BACKENDS = BACKENDS
# the feature maps' tuples under their names here: linearformers.ops.feature_maps names them by what they hold
KERNELS = RANDOM_FEATURE_MAPS
PERFORMER_KERNELS = FEATURE_MAPS

# what this package exported before the move: linearformers.ops exports fewer names (the rest from its modules),
# and the deprecated path offers none of the ops' newer ones
_NEWER = (
    "favor_backend",
    "hedgehog_hybrid_attention",
    "hedgehog_refusal",
    "linear_backend",
    "packed_softmax_attention",
)
__all__ = [
    *(name for name in ops.__all__ if name not in _NEWER),
    "BIDIRECTIONAL_BACKENDS",
    "CAUSAL_BACKENDS",
    "FAVOR_BACKENDS",
    "KERNELS",
    "LINFORMER_BACKENDS",
    "LINFORMER_CAUSAL_BACKENDS",
    "METHODS",
    "PERFORMER_KERNELS",
    "causal_local_attention",
    "compact",
    "num_relative_positions",
    "uncompact",
]

warnings.warn(
    "linearformers.modeling.attention is deprecated and goes away in linearformers 0.3.0: import from "
    "linearformers.ops (and mix_seed from linearformers.seeds)",
    FutureWarning,
    stacklevel=2,
)


# the old module paths -> the ops modules that hold their code now (the same objects). Not the Triton kernel
# modules: they import Triton, and this package imports without it
_MOVED = {
    **{name: name for name in ("backends", "favor", "feature_maps", "hybrid", "linear", "linformer")},
    **{name: name for name in ("linformer_hybrid", "local", "reference", "softmax")},
    **{name: name for name in ("_checks", "_favor_chunked", "_linear_native", "_linformer_autograd")},
    **{name: name for name in ("_native", "_precision", "_triton_bidirectional")},
    "_favor_autograd": "_favor_blockwise",  # its causal wrapper, FavorCausalNative, is in _favor_native
    "_triton_linear": "_triton_causal",
}
for _old, _new in _MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f"{ops.__name__}.{_new}")
    setattr(sys.modules[__name__], _old, sys.modules[f"{__name__}.{_old}"])
