"""Deprecated alias of ``linearformers.conversion.convert`` (conversion sits above the models, in its own folder); goes
away in linearformers 0.3.0. Importing this path gives the module itself (the same object)."""

import sys
import warnings

from ..conversion import convert as _convert

warnings.warn(
    "linearformers.modeling.convert is deprecated and goes away in linearformers 0.3.0: import "
    "linearformers.conversion.convert",
    FutureWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # python -m linearformers.modeling.convert
    _convert.main()
else:
    sys.modules[__name__] = _convert
