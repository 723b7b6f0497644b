"""Performer models: the shared stack (base.py) with Performer attention, bound to PerformerConfig.

BERT-style encoders: PerformerModel, PerformerForMaskedLM, PerformerForSequenceClassification,
PerformerForTokenClassification, PerformerForQuestionAnswering, PerformerForMultipleChoice.
GPT-2-style decoder (config.is_decoder=True): PerformerForCausalLM.
"""

from __future__ import annotations

from transformers import GenerationMixin

from ..configuration.performer import PerformerConfig
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


class PerformerPreTrainedModel(LinearAttentionPreTrainedModel):
    config_class = PerformerConfig
    config: PerformerConfig


class PerformerModel(LinearAttentionModel, PerformerPreTrainedModel):
    pass


class PerformerForMaskedLM(LinearAttentionForMaskedLM, PerformerPreTrainedModel):
    base_model_class = PerformerModel


# GenerationMixin named again among the own bases: transformers' test_inherits_generation_mixin reads __bases__
class PerformerForCausalLM(LinearAttentionForCausalLM, PerformerPreTrainedModel, GenerationMixin):
    base_model_class = PerformerModel


class PerformerForSequenceClassification(LinearAttentionForSequenceClassification, PerformerPreTrainedModel):
    base_model_class = PerformerModel


class PerformerForMultipleChoice(LinearAttentionForMultipleChoice, PerformerPreTrainedModel):
    base_model_class = PerformerModel


class PerformerForTokenClassification(LinearAttentionForTokenClassification, PerformerPreTrainedModel):
    base_model_class = PerformerModel


class PerformerForQuestionAnswering(LinearAttentionForQuestionAnswering, PerformerPreTrainedModel):
    base_model_class = PerformerModel


__all__ = [
    "PerformerForCausalLM",
    "PerformerForMaskedLM",
    "PerformerForMultipleChoice",
    "PerformerForQuestionAnswering",
    "PerformerForSequenceClassification",
    "PerformerForTokenClassification",
    "PerformerModel",
    "PerformerPreTrainedModel",
]
