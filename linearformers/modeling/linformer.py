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
    """The base class of the Linformer models, bound to LinformerConfig. See LinearAttentionPreTrainedModel."""

    config_class = LinformerConfig
    config: LinformerConfig


class LinformerModel(LinearAttentionModel, LinformerPreTrainedModel):
    """The bare Linformer stack: embeddings and blocks, with a pooler (encoder) or a final norm (decoder). See
    LinearAttentionModel."""


class LinformerForMaskedLM(LinearAttentionForMaskedLM, LinformerPreTrainedModel):
    """Linformer encoder with BERT's masked-LM head. See LinearAttentionForMaskedLM."""

    base_model_class = LinformerModel


# GenerationMixin named again among the own bases: transformers' test_inherits_generation_mixin reads __bases__
class LinformerForCausalLM(LinearAttentionForCausalLM, LinformerPreTrainedModel, GenerationMixin):
    """GPT-2-style Linformer decoder with a tied LM head, for generate(); needs LinformerConfig(is_decoder=True). See
    LinearAttentionForCausalLM."""

    base_model_class = LinformerModel


class LinformerForSequenceClassification(LinearAttentionForSequenceClassification, LinformerPreTrainedModel):
    """Linformer with a sequence classification / regression head. See LinearAttentionForSequenceClassification."""

    base_model_class = LinformerModel


class LinformerForMultipleChoice(LinearAttentionForMultipleChoice, LinformerPreTrainedModel):
    """Linformer encoder with BERT's multiple-choice head. See LinearAttentionForMultipleChoice."""

    base_model_class = LinformerModel


class LinformerForTokenClassification(LinearAttentionForTokenClassification, LinformerPreTrainedModel):
    """Linformer encoder with a token classification head (e.g. NER). See LinearAttentionForTokenClassification."""

    base_model_class = LinformerModel


class LinformerForQuestionAnswering(LinearAttentionForQuestionAnswering, LinformerPreTrainedModel):
    """Linformer encoder with an extractive question-answering (span) head. See LinearAttentionForQuestionAnswering."""

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
