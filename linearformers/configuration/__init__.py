from .linformer import LinformerConfig
from .performer import PerformerConfig

__all__ = ["LinformerConfig", "PerformerConfig"]
