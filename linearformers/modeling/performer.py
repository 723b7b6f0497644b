"""Performer models: the shared stack (base.py) with Performer attention, bound to PerformerConfig.

BERT-style encoders: PerformerModel, PerformerForMaskedLM, PerformerForSequenceClassification,
PerformerForTokenClassification, PerformerForQuestionAnswering, PerformerForMultipleChoice.
GPT-2-style decoder (config.is_decoder=True): PerformerForCausalLM.
"""

from __future__ import annotations

from transformers.modeling_layers import GenericForQuestionAnswering, GenericForTokenClassification

from ..configuration.performer import PerformerConfig
from .base import (
    LinearAttentionForCausalLM,
    LinearAttentionForMaskedLM,
    LinearAttentionForMultipleChoice,
    LinearAttentionForSequenceClassification,
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


class PerformerForCausalLM(LinearAttentionForCausalLM, PerformerPreTrainedModel):
    base_model_class = PerformerModel


class PerformerForSequenceClassification(LinearAttentionForSequenceClassification, PerformerPreTrainedModel):
    base_model_class = PerformerModel


class PerformerForMultipleChoice(LinearAttentionForMultipleChoice, PerformerPreTrainedModel):
    base_model_class = PerformerModel


class PerformerForTokenClassification(GenericForTokenClassification, PerformerPreTrainedModel):
    # transformers' generic head averages its loss without Trainer's num_items_in_batch: Trainer must scale it
    # for gradient accumulation itself, or each accumulated step would be N x too large
    accepts_loss_kwargs = False


class PerformerForQuestionAnswering(GenericForQuestionAnswering, PerformerPreTrainedModel):
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)


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
