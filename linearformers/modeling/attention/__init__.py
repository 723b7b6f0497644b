"""Deprecated alias of ``linearformers.ops`` (the attention math moved to its own floor, below the configs and
models) and of ``linearformers.seeds``; goes away in linearformers 0.3.0.

Every submodule of ``linearformers.ops`` is also importable here under its old name
(``linearformers.modeling.attention.favor`` is ``linearformers.ops.favor``, the same module object), and so is
``linearformers.modeling.attention.seeds`` (``linearformers.seeds``).
"""

import importlib
import pkgutil
import sys
import warnings

from ... import ops, seeds
from ...ops import *  # noqa: F403
from ...ops.backends import BACKENDS, BIDIRECTIONAL_BACKENDS, CAUSAL_BACKENDS
from ...ops.feature_maps import KERNELS, PERFORMER_KERNELS
from ...ops.linformer import BACKENDS as LINFORMER_BACKENDS
from ...ops.linformer import CAUSAL_BACKENDS as LINFORMER_CAUSAL_BACKENDS
from ...ops.linformer import METHODS, compact, uncompact
from ...ops.local import causal_local_attention, num_relative_positions

FAVOR_BACKENDS = BACKENDS

# what this package exported before the move: linearformers.ops exports fewer names (the rest from its modules)
__all__ = [
    *ops.__all__,
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


# the old submodule paths name the same module objects; a submodule is imported before its alias
_OLD_NAMES = {f"{__name__}.seeds": seeds}
for _info in pkgutil.walk_packages(ops.__path__, prefix=f"{ops.__name__}."):
    _OLD_NAMES[_info.name.replace(ops.__name__, __name__, 1)] = importlib.import_module(_info.name)
for _old, _module in _OLD_NAMES.items():
    sys.modules[_old] = _module
    _parent, _, _child = _old.rpartition(".")
    setattr(sys.modules[_parent], _child, _module)
