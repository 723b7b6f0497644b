"""Deprecated alias of ``linearformers.conversion.transfer`` (conversion sits above the models, in its own folder); goes
away in linearformers 0.3.0. Importing this path gives the module itself (the same object)."""

import sys
import warnings

from ..conversion import transfer as _transfer

warnings.warn(
    "linearformers.modeling.transfer is deprecated and goes away in linearformers 0.3.0: import "
    "linearformers.conversion.transfer",
    FutureWarning,
    stacklevel=2,
)

sys.modules[__name__] = _transfer
