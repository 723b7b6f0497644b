"""Linformer models: the shared stack (base.py) with Linformer attention, bound to LinformerConfig.

BERT-style encoders: LinformerModel, LinformerForMaskedLM, LinformerForSequenceClassification,
LinformerForTokenClassification, LinformerForQuestionAnswering, LinformerForMultipleChoice.
GPT-2-style decoder (config.is_decoder=True): LinformerForCausalLM.
"""

from __future__ import annotations

from transformers.modeling_layers import GenericForQuestionAnswering, GenericForTokenClassification

from ..configuration.linformer import LinformerConfig
from .base import (
    LinearAttentionForCausalLM,
    LinearAttentionForMaskedLM,
    LinearAttentionForMultipleChoice,
    LinearAttentionForSequenceClassification,
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


class LinformerForCausalLM(LinearAttentionForCausalLM, LinformerPreTrainedModel):
    base_model_class = LinformerModel


class LinformerForSequenceClassification(LinearAttentionForSequenceClassification, LinformerPreTrainedModel):
    base_model_class = LinformerModel


class LinformerForMultipleChoice(LinearAttentionForMultipleChoice, LinformerPreTrainedModel):
    base_model_class = LinformerModel


class LinformerForTokenClassification(GenericForTokenClassification, LinformerPreTrainedModel):
    # transformers' generic head averages its loss without Trainer's num_items_in_batch: Trainer must scale it
    # for gradient accumulation itself, or each accumulated step would be N x too large
    accepts_loss_kwargs = False


class LinformerForQuestionAnswering(GenericForQuestionAnswering, LinformerPreTrainedModel):
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)


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
