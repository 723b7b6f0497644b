"""Linformer models (Wang et al. 2020): the shared stack (base.py) with Linformer attention.

Everything Linformer is here, top to bottom: the attention module with its E / F projections, the pretrained base
(config, attention class, init of E / F), the base model (which owns E = F when ``sharing="layerwise"``), and the
heads.
BERT-style encoders: LinformerModel, LinformerForMaskedLM, LinformerForSequenceClassification,
LinformerForTokenClassification, LinformerForQuestionAnswering, LinformerForMultipleChoice.
GPT-2-style decoder (config.is_decoder=True): LinformerForCausalLM.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init

from ..configuration.linformer import LinformerConfig
from ..ops import causal_linformer_attention, causal_linformer_step, linformer_attention
from ..ops.linformer import slot_first_writes
from ..ops.linformer_hybrid import linformer_hybrid_attention
from .base import (
    LinearAttention,
    LinearAttentionForCausalLM,
    LinearAttentionForMaskedLM,
    LinearAttentionForMultipleChoice,
    LinearAttentionForQuestionAnswering,
    LinearAttentionForSequenceClassification,
    LinearAttentionForTokenClassification,
    LinearAttentionModel,
    LinearAttentionPreTrainedModel,
    NewTensor,
)
from .cache import LinearAttentionCache


class LinformerAttention(LinearAttention):
    """Linformer heads: E / F projections along the sequence, owned here, or read from the model that owns them
    when they are shared across layers (``sharing="layerwise"``, see :meth:`use_shared_projection`).

    With ``config.hybrid_window`` w set (encoders), each global head is the window + slots hybrid of
    ``attention.linformer_hybrid``: exact softmax on the keys within w and on the sinks, Linformer's slots for the
    rest, in one softmax, the window weighted by gamma = exp(``window_balance``), a parameter (global heads,) that
    starts at 0. Without a hybrid_window the layer has no ``window_balance``."""

    attention_name = "Linformer's E/F projections"
    new_tensors = {
        **LinearAttention.new_tensors,
        "e_proj": NewTensor(start="window_means", projection=True),
        "f_proj": NewTensor(start="window_means", projection=True),
        "window_balance": NewTensor(),  # zero: gamma = 1
    }

    def __init__(self, config: LinformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        k = config.projected_length_for(layer_idx)
        n = config.max_seq_length
        # pooling and conv read n / k positions per slot: their kernel and stride (not the hybrid's window)
        self.pool_stride = n // k if config.projection != "learned" else None
        self.e_proj = self.f_proj = None
        if config.projection == "learned" and config.sharing != "layerwise":
            shape = (self.num_global, k, n) if config.sharing == "per_head" else (k, n)
            self.e_proj = nn.Parameter(torch.empty(shape))
            if config.sharing != "key_value":
                self.f_proj = nn.Parameter(torch.empty(shape))
        elif config.projection == "conv":
            d = self.head_dim
            self.e_proj = nn.Parameter(torch.empty(d, d, self.pool_stride))
            if config.sharing not in ("key_value", "layerwise"):
                self.f_proj = nn.Parameter(torch.empty(d, d, self.pool_stride))
        self._projection_owner = None
        self.window_balance = (
            nn.Parameter(torch.zeros(self.num_global)) if config.hybrid_window and self.num_global else None
        )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{super().extra_repr()}, projected_length={c.projected_length_for(self.layer_idx)}, "
            f"max_seq_length={c.max_seq_length}, sharing={c.sharing!r}, projection={c.projection!r}"
            f"{f', hybrid_window={c.hybrid_window}' if c.hybrid_window else ''}"
        )

    def use_shared_projection(self, owner: nn.Module) -> None:
        """Read E (= F) from ``owner.shared_projection`` at every call. ``owner`` is kept as a plain reference,
        outside the module tree, so the parameter is registered, saved and loaded once, under the owner's name;
        read at the call, it is whatever tensor the owner holds then (after loading, sharding or a move)."""
        object.__setattr__(self, "_projection_owner", owner)

    def projections(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """E and F as the ops take them; F None means F = E, and both None is pooling (no parameters)."""
        if self._projection_owner is not None:
            return self._projection_owner.shared_projection, None
        return self.e_proj, self.f_proj

    def _slot_first_writes(self, e: torch.Tensor) -> torch.Tensor:
        """slot_first_writes(E), recomputed only when E changes (decoding calls it once per token)."""
        key = (e.data_ptr(), e._version)
        if getattr(self, "_first_writes_key", None) != key:
            self._first_writes_key, self._first_writes = key, slot_first_writes(e)
        return self._first_writes

    def global_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        e, f = self.projections()
        if self.window_balance is not None:  # the config refuses a hybrid_window for decoders
            return linformer_hybrid_attention(
                q,
                k,
                v,
                e,
                f,
                torch.exp(self.window_balance),
                self.config.hybrid_window,
                projection=self.config.projection,
                pool_stride=self.pool_stride,
                key_padding_mask=attention_mask,
                sinks=self.config.hybrid_sinks,
                dropout_p=self.config.attention_probs_dropout_prob if self.training else 0.0,
            )
        if not self.causal:
            return linformer_attention(
                q,
                k,
                v,
                e,
                f,
                projection=self.config.projection,
                pool_stride=self.pool_stride,
                key_padding_mask=attention_mask,
                dropout_p=self.config.attention_probs_dropout_prob if self.training else 0.0,
            )
        chunk_size = self.config.causal_chunk_size
        if past_key_values is None:
            return causal_linformer_attention(q, k, v, e, f, key_padding_mask=attention_mask, chunk_size=chunk_size)
        state = past_key_values.get_state(self.layer_idx)
        if q.shape[2] == 1 and state is not None:
            out, state = causal_linformer_step(
                q, k, v, e, f, state, position_ids[:, 0], first_writes=self._slot_first_writes(e)
            )
        else:  # a prefill, or a prompt fed in pieces, whose rows continue from their own positions
            out, state = causal_linformer_attention(
                q,
                k,
                v,
                e,
                f,
                key_padding_mask=attention_mask,
                chunk_size=chunk_size,
                initial_state=state,
                start=0 if state is None else position_ids[:, 0],
                return_state=True,
            )
        past_key_values.set_state(self.layer_idx, state)
        return out


class LinformerPreTrainedModel(LinearAttentionPreTrainedModel):
    """The base class of the Linformer models, bound to LinformerConfig and LinformerAttention. See
    LinearAttentionPreTrainedModel."""

    config_class = LinformerConfig
    config: LinformerConfig
    attention_class = LinformerAttention
    # a Performer redraw counter, which checkpoints of the shared stack carried for both families: nothing to load
    _keys_to_ignore_on_load_unexpected = [
        *LinearAttentionPreTrainedModel._keys_to_ignore_on_load_unexpected,
        r"feature_redraws$",
    ]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LinformerAttention):
            for proj in (module.e_proj, module.f_proj):
                if proj is None:
                    continue
                if module.config.projection == "conv":  # (d, d, pool_stride): fan-in scaling
                    init.normal_(proj, mean=0.0, std=(proj.shape[1] * proj.shape[2]) ** -0.5)
                else:  # learned E, F (.., k, n): std 1/sqrt(k), as in the reference implementation
                    init.normal_(proj, mean=0.0, std=proj.shape[-2] ** -0.5)
            if module.window_balance is not None:
                init.zeros_(module.window_balance)  # gamma = 1: the window and the slots on an equal footing
        if isinstance(module, LinformerModel) and module.shared_projection is not None:
            init.normal_(module.shared_projection, mean=0.0, std=module.shared_projection.shape[0] ** -0.5)


class LinformerModel(LinearAttentionModel, LinformerPreTrainedModel):
    """The bare Linformer stack: embeddings and blocks, with a pooler (encoder) or a final norm (decoder). With
    ``sharing="layerwise"`` (learned projections) it owns the one E = F of every layer, ``shared_projection``
    (k, max_seq_length). See LinearAttentionModel."""

    new_tensors = {"shared_projection": NewTensor(start="window_means", projection=True)}

    def __init__(self, config: LinformerConfig, add_pooling_layer: bool = True):
        super().__init__(config, add_pooling_layer)
        self.shared_projection = None
        if config.sharing == "layerwise" and config.projection == "learned":
            self.shared_projection = nn.Parameter(torch.empty(config.projected_length_for(0), config.max_seq_length))
            for layer in self.layers:
                layer.attention.use_shared_projection(self)
        self.post_init()


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
