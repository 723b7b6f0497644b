"""Deprecated path of ``linearformers.seeds`` (importing it warns, through this package's ``__init__``); goes away
in linearformers 0.3.0."""

from ...seeds import mix_seed

__all__ = ["mix_seed"]
