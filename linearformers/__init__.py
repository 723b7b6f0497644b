"""linearformers: Linformer and Performer attention as native Hugging Face transformers models.

Importing the package registers both configs and every model class with transformers' Auto classes, so
``AutoModel*.from_pretrained(folder)`` and ``pipeline(...)`` work without ``trust_remote_code``.
"""

import transformers
from transformers import AutoConfig

from . import modeling
from .configuration import LinformerConfig, PerformerConfig
from .modeling import *  # noqa: F403
from .modeling import __all__ as _modeling_all
from .modeling.registry import FAMILIES, HEADS

__version__ = "0.1.0"

# transformers' Auto class -> the class-name suffix of the head it loads (the heads table, modeling/registry.py)
AUTO_CLASSES = {getattr(transformers, head.auto_class): head.suffix for head in HEADS.values()}

for _family in FAMILIES.values():
    AutoConfig.register(_family.name, _family.config_class, exist_ok=True)
    for _head in HEADS.values():
        _auto = getattr(transformers, _head.auto_class)
        _auto.register(_family.config_class, getattr(modeling, _family.class_name(_head)), exist_ok=True)

# PEFT picks LoRA's default target_modules by model_type, as for in-tree models (llama's are q_proj and v_proj, the
# names this package's attention uses too). peft stays optional; it cannot be imported under python -OO (a
# ValueError from transformers' docstring processing), where linearformers must still import
try:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
except (ImportError, ValueError):
    pass
else:
    for _family in FAMILIES.values():
        TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(_family.name, ["q_proj", "v_proj"])

__all__ = ["AUTO_CLASSES", "LinformerConfig", "PerformerConfig", *_modeling_all]
