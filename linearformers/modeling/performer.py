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
    """The base class of the Performer models, bound to PerformerConfig. See LinearAttentionPreTrainedModel."""

    config_class = PerformerConfig
    config: PerformerConfig


class PerformerModel(LinearAttentionModel, PerformerPreTrainedModel):
    """The bare Performer stack: embeddings and blocks, with a pooler (encoder) or a final norm (decoder). See
    LinearAttentionModel."""


class PerformerForMaskedLM(LinearAttentionForMaskedLM, PerformerPreTrainedModel):
    """Performer encoder with BERT's masked-LM head. See LinearAttentionForMaskedLM."""

    base_model_class = PerformerModel


# GenerationMixin named again among the own bases: transformers' test_inherits_generation_mixin reads __bases__
class PerformerForCausalLM(LinearAttentionForCausalLM, PerformerPreTrainedModel, GenerationMixin):
    """GPT-2-style Performer decoder with a tied LM head, for generate(); needs PerformerConfig(is_decoder=True). See
    LinearAttentionForCausalLM."""

    base_model_class = PerformerModel


class PerformerForSequenceClassification(LinearAttentionForSequenceClassification, PerformerPreTrainedModel):
    """Performer with a sequence classification / regression head. See LinearAttentionForSequenceClassification."""

    base_model_class = PerformerModel


class PerformerForMultipleChoice(LinearAttentionForMultipleChoice, PerformerPreTrainedModel):
    """Performer encoder with BERT's multiple-choice head. See LinearAttentionForMultipleChoice."""

    base_model_class = PerformerModel


class PerformerForTokenClassification(LinearAttentionForTokenClassification, PerformerPreTrainedModel):
    """Performer encoder with a token classification head (e.g. NER). See LinearAttentionForTokenClassification."""

    base_model_class = PerformerModel


class PerformerForQuestionAnswering(LinearAttentionForQuestionAnswering, PerformerPreTrainedModel):
    """Performer encoder with an extractive question-answering (span) head. See LinearAttentionForQuestionAnswering."""

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
