"""linearformers: Linformer and Performer attention as native Hugging Face transformers models.

Importing the package registers both configs and every model class with transformers' Auto classes, so
``AutoModel*.from_pretrained(folder)`` and ``pipeline(...)`` work without ``trust_remote_code``.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import modeling
from .configuration import LinformerConfig, PerformerConfig
from .modeling import *  # noqa: F403
from .modeling import __all__ as _modeling_all

__version__ = "0.1.0"

AUTO_CLASSES = {
    AutoModel: "Model",
    AutoModelForMaskedLM: "ForMaskedLM",
    AutoModelForCausalLM: "ForCausalLM",
    AutoModelForSequenceClassification: "ForSequenceClassification",
    AutoModelForTokenClassification: "ForTokenClassification",
    AutoModelForQuestionAnswering: "ForQuestionAnswering",
    AutoModelForMultipleChoice: "ForMultipleChoice",
}

for _config in (LinformerConfig, PerformerConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    _family = _config.__name__.removesuffix("Config")
    for _auto, _suffix in AUTO_CLASSES.items():
        _auto.register(_config, getattr(modeling, _family + _suffix), exist_ok=True)

__all__ = ["AUTO_CLASSES", "LinformerConfig", "PerformerConfig", *_modeling_all]
