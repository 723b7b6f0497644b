"""Model cards and the Hub export: weights + config (auto_map) + tokenizer + card + self-contained code."""

from ..modeling.hub_code import auto_map_for, flatten_module, remote_modules, write_hub_files, write_remote_code
from .card import render_model_card
from .export import check_repo_id, push_to_hub, save_for_hub

__all__ = [
    "auto_map_for",
    "check_repo_id",
    "flatten_module",
    "push_to_hub",
    "remote_modules",
    "render_model_card",
    "save_for_hub",
    "write_hub_files",
    "write_remote_code",
]
