"""Linformer models: the shared stack (base.py) with Linformer attention, bound to LinformerConfig.

BERT-style encoders: LinformerModel, LinformerForMaskedLM, LinformerForSequenceClassification,
LinformerForTokenClassification, LinformerForQuestionAnswering, LinformerForMultipleChoice.
GPT-2-style decoder (config.is_decoder=True): LinformerForCausalLM.
"""

from __future__ import annotations

from transformers import GenerationMixin

from ..configuration.linformer import LinformerConfig
from .base import (
    LinearAttentionForCausalLM,
    LinearAttentionForMaskedLM,
    LinearAttentionForMultipleChoice,
    LinearAttentionForQuestionAnswering,
    LinearAttentionForSequenceClassification,
    LinearAttentionForTokenClassification,
    LinearAttentionModel,
    LinearAttentionPreTrainedModel,
)


class LinformerPreTrainedModel(LinearAttentionPreTrainedModel):
    config_class = LinformerConfig
    config: LinformerConfig


class LinformerModel(LinearAttentionModel, LinformerPreTrainedModel):
    pass


class LinformerForMaskedLM(LinearAttentionForMaskedLM, LinformerPreTrainedModel):
    base_model_class = LinformerModel


# GenerationMixin named again among the own bases: transformers' test_inherits_generation_mixin reads __bases__
class LinformerForCausalLM(LinearAttentionForCausalLM, LinformerPreTrainedModel, GenerationMixin):
    base_model_class = LinformerModel


class LinformerForSequenceClassification(LinearAttentionForSequenceClassification, LinformerPreTrainedModel):
    base_model_class = LinformerModel


class LinformerForMultipleChoice(LinearAttentionForMultipleChoice, LinformerPreTrainedModel):
    base_model_class = LinformerModel


class LinformerForTokenClassification(LinearAttentionForTokenClassification, LinformerPreTrainedModel):
    base_model_class = LinformerModel


class LinformerForQuestionAnswering(LinearAttentionForQuestionAnswering, LinformerPreTrainedModel):
    base_model_class = LinformerModel


__all__ = [
    "LinformerForCausalLM",
    "LinformerForMaskedLM",
    "LinformerForMultipleChoice",
    "LinformerForQuestionAnswering",
    "LinformerForSequenceClassification",
    "LinformerForTokenClassification",
    "LinformerModel",
    "LinformerPreTrainedModel",
]
