from .cache import LinearAttentionCache
from .linformer import *  # noqa: F403
from .linformer import __all__ as _linformer_all
from .performer import *  # noqa: F403
from .performer import __all__ as _performer_all

__all__ = ["LinearAttentionCache", *_linformer_all, *_performer_all]
