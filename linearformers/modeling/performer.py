"""Performer models (Choromanski et al. 2021): the shared stack (base.py, layers.py) with FAVOR+ attention.

Everything Performer is here, top to bottom: the attention module and its random features, the schedule that
redraws them during training, the pretrained base (config, attention class, init), the base model, and the heads.
BERT-style encoders: PerformerModel, PerformerForMaskedLM, PerformerForSequenceClassification,
PerformerForTokenClassification, PerformerForQuestionAnswering, PerformerForMultipleChoice.
GPT-2-style decoder (config.is_decoder=True): PerformerForCausalLM.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init

from ..configuration.performer import PerformerConfig
from .attention import (
    HedgehogFeatureMap,
    draw_random_features,
    favor_attention,
    favor_positive,
    favor_step,
    hybrid_attention,
    hybrid_step,
    linear_attention,
    linear_step,
    relu_features,
)
from .attention.feature_maps import favor_exponents
from .attention.seeds import mix_seed
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
from .cache import LinearAttentionCache
from .layers import LinearAttention


class PerformerAttention(LinearAttention):
    """FAVOR+ heads. The random features are a persistent buffer (saved with the checkpoint, so a reload gives
    the same outputs), drawn deterministically from (feature_seed, layer, draw index).

    With ``config.kernel == "hedgehog"`` the heads use a learned feature map instead: ``self.feature_map``, a
    :class:`HedgehogFeatureMap` over the global heads with ``num_random_features`` features, whose parameters
    (``feature_map.weight``, ``feature_map.bias``, ``feature_map.key_weight``, ``feature_map.key_bias``) train and
    save with the layer. Such a layer has no random features (``random_features`` is None, not in the state dict),
    is never redrawn, and its decoding state is (S, z) (plain linear attention, see ``attention.linear``).

    With ``config.hybrid_window`` w set, each global head is the hybrid of ``attention.hybrid`` (LoLCATs): exact
    softmax on its window of w keys, the layer's feature map (random or learned) on the others, balanced by
    gamma = exp(``window_balance``), a parameter (global heads,) that starts at 0; its decoding state is the
    ten-tensor ``HybridState``. Without a hybrid_window the layer has no ``window_balance``.

    With ``config.hybrid_query_scale`` too, the linear scores take a learned log scale per query,
    l_t = q_t·``query_scale_weight``_h + ``query_scale_bias``_h (both zero at init), the ``query_log_scale`` of
    ``attention.hybrid`` (added to the random map's own): the parameters exist only then.

    With ``config.hybrid_key_scale``, each linear key's features are multiplied by exp(r_s), a learned log scale
    per key, r_s = R tanh((k_s·``key_scale_weight``_h + ``key_scale_bias``_h) / R) with R = ``KEY_SCALE_BOUND``
    (both zero at init, so r = 0): a key's own weight in exp(q·k), which a learned map, whose features sum to
    the same for every key, cannot give it. Again the parameters exist only then."""

    # R of the key scale: |r_s| < 20, so a key's features grow at most e^20-fold (5e8): with learned features (at
    # most 1), a million keys and the largest factor attention.hybrid gives the linear part (e^50), the sums stay
    # below 3e36 |v|, inside float32. Trained scales stay within a few units, where tanh is nearly the identity
    # (all-MiniLM-L6-v2 after 300 transfer steps: k·a + b within -6.0 .. 6.2, std about 1, on held-out text)
    KEY_SCALE_BOUND = 20.0

    kernel_name = "FAVOR+ (Performer)"

    def __init__(self, config: PerformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.draw_seed = mix_seed(config.feature_seed, layer_idx)  # this layer's stream of draws
        if config.random_feature_kernel:
            self.feature_map = None
            self.register_buffer("random_features", self.draw_features(0), persistent=True)
        else:
            self.register_buffer("random_features", None)
            self.feature_map = (
                HedgehogFeatureMap(self.num_global, self.head_dim, config.num_random_features)
                if self.num_global
                else None
            )
        self.window_balance = (
            nn.Parameter(torch.zeros(self.num_global)) if config.hybrid_window and self.num_global else None
        )
        scaled = self.window_balance is not None and config.hybrid_query_scale
        self.query_scale_weight = nn.Parameter(torch.zeros(self.num_global, self.head_dim)) if scaled else None
        self.query_scale_bias = nn.Parameter(torch.zeros(self.num_global)) if scaled else None
        keyed = self.window_balance is not None and config.hybrid_key_scale
        self.key_scale_weight = nn.Parameter(torch.zeros(self.num_global, self.head_dim)) if keyed else None
        self.key_scale_bias = nn.Parameter(torch.zeros(self.num_global)) if keyed else None

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{super().extra_repr()}, num_random_features={c.num_random_features}, kernel={c.kernel!r}, "
            f"orthogonal_features={c.orthogonal_features}, feature_redraw_interval={c.feature_redraw_interval}"
            f"{f', hybrid_window={c.hybrid_window}' if c.hybrid_window else ''}"
            f"{', hybrid_query_scale=True' if self.query_scale_weight is not None else ''}"
            f"{', hybrid_key_scale=True' if self.key_scale_weight is not None else ''}"
        )

    def draw_features(self, draw_index: int, device: torch.device | None = None) -> torch.Tensor:
        """Draw number ``draw_index`` of this layer's features, (num_random_features, head_dim)."""
        return draw_random_features(
            self.config.num_random_features,
            self.head_dim,
            seed=self.draw_seed,
            step=draw_index,
            orthogonal=self.config.orthogonal_features,
            device=device,
        )

    def global_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        # the op pair and what goes in: the hybrid takes q, k and the map's features; the random FAVOR+ map is fused
        # into its kernels (q, k in); a learned map's features go to linear attention
        if self.window_balance is not None:
            phi_q, phi_k, log_scale = self.hybrid_features(q, k, attention_mask)
            inputs = (q, k, v, phi_q, phi_k, torch.exp(self.window_balance), self.config.hybrid_window)
            attend, step = hybrid_attention, hybrid_step
            fixed = {"query_log_scale": log_scale, "sinks": self.config.hybrid_sinks}
        elif self.feature_map is None:
            inputs = (q, k, v)
            attend, step = favor_attention, favor_step
            fixed = {
                "projection": self.random_features,
                "kernel": self.config.kernel,
                "kernel_eps": self.config.kernel_eps,
            }
        else:
            inputs = (self.feature_map(q, is_query=True), self.feature_map(k, is_query=False), v)
            attend, step, fixed = linear_attention, linear_step, {}
        if not self.causal:
            return attend(*inputs, causal=False, key_padding_mask=attention_mask, **fixed)
        # the causal linear ops' chunk; the hybrid works by blocks of its window
        chunked = {} if attend is hybrid_attention else {"chunk_size": self.config.causal_chunk_size}
        if past_key_values is None:
            return attend(*inputs, causal=True, key_padding_mask=attention_mask, **chunked, **fixed)
        state = past_key_values.get_state(self.layer_idx)
        if q.shape[2] == 1 and state is not None:
            out, state = step(*inputs, state=state, key_padding_mask=attention_mask, **fixed)
        else:  # a prefill, or a prompt fed in pieces
            out, state = attend(
                *inputs,
                causal=True,
                key_padding_mask=attention_mask,
                initial_state=state,
                return_state=True,
                **chunked,
                **fixed,
            )
        past_key_values.set_state(self.layer_idx, state)
        return out

    def hybrid_features(
        self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The linear part's features of the hybrid: phi_q, phi_k (batch, global heads, n, m), float32, and the
        queries' log scale ℓ (batch, global heads, n) that ``hybrid_attention`` takes: the map's own
        (:meth:`map_features`) plus, with ``hybrid_query_scale``, the learned q_t·a_h + b_h, in float32; with
        ``hybrid_key_scale``, phi_k carries the keys' scale (:meth:`keyed_map_features`)."""
        phi_q, phi_k, log_scale = self.keyed_map_features(q, k, attention_mask)
        if self.query_scale_weight is None:
            return phi_q, phi_k, log_scale
        learned = _per_head_dot(q, self.query_scale_weight) + self.query_scale_bias.float()[None, :, None]
        return phi_q, phi_k, learned if log_scale is None else log_scale + learned

    def keyed_map_features(
        self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`map_features` with, under ``hybrid_key_scale``, phi_k times exp(r) (:meth:`key_log_scale`): the
        features of the linear part before the learned query scale."""
        phi_q, phi_k, log_scale = self.map_features(q, k, attention_mask)
        key_scale = self.key_log_scale(k)
        if key_scale is not None:
            phi_k = phi_k * torch.exp(key_scale)[..., None]
        return phi_q, phi_k, log_scale

    def key_log_scale(self, k: torch.Tensor) -> torch.Tensor | None:
        """The keys' learned log scale r (batch, global heads, n), float32, or None without ``hybrid_key_scale``:
        r_s = R tanh((k_s·a_h + b_h) / R), R = ``KEY_SCALE_BOUND``; a smooth bound, so that no learned value can
        take the linear sums out of float32, and close to k_s·a_h + b_h wherever that is a few units."""
        if self.key_scale_weight is None:
            return None
        raw = _per_head_dot(k, self.key_scale_weight) + self.key_scale_bias.float()[None, :, None]
        return self.KEY_SCALE_BOUND * torch.tanh(raw / self.KEY_SCALE_BOUND)

    def map_features(
        self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The feature map's own part of :meth:`hybrid_features`: phi_q, phi_k and ℓ (None but for FAVOR+).

        The random "softmax" map: the positive features of ``favor_positive``, whose query features have their row
        maximum u_t taken off (detached: it cancels against ℓ) and lack the estimator's 1/m, so
        phi_q·phi_k = m exp(scale q·k - u_t) in expectation (Lemma 1); ℓ_t = u_t - log m puts them back on the
        softmax's scale, and the window's exact scores and the FAVOR+ estimate elsewhere then add up to an estimate
        of softmax attention at gamma = 1. "relu" and the learned map are attentions of their own, whose scale
        gamma learns against: ℓ = None, LoLCATs' form."""
        if self.feature_map is not None:
            return self.feature_map(q, is_query=True), self.feature_map(k, is_query=False), None
        projection, c = self.random_features, self.config
        if c.kernel == "relu":
            phi_q = relu_features(q, projection, eps=c.kernel_eps)
            return phi_q, relu_features(k, projection, eps=c.kernel_eps, key_padding_mask=attention_mask), None
        u = favor_exponents(q, projection, is_query=True)
        top = u.amax(dim=-1, keepdim=True).detach()
        phi_k = favor_positive(k, projection, is_query=False, key_padding_mask=attention_mask)
        return torch.exp(u - top), phi_k, top.squeeze(-1) - math.log(projection.shape[0])


def _per_head_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x_t·a_h in float32, (batch, heads, n) from x (batch, heads, n, d) and weight (heads, d). A product and a sum
    rather than einsum: autocast runs einsum as a bf16 matmul, whose rounding the learned scales would then carry
    into every query's and key's weight, and through them into dq and dk."""
    return (x.float() * weight.float()[None, :, None, :]).sum(-1)


def _redraw_step(
    counter: torch.Tensor, features: list[torch.Tensor], seeds: list[int], interval: int, orthogonal: bool
) -> None:
    """One training forward of the redraw schedule: at every ``interval``-th forward after the first, set each
    layer's features (m, head_dim) to draw number ``counter // interval``; then count this forward.

    A custom op, so that torch.compile keeps it in the graph as one opaque call: read inside a compiled forward,
    the counter would break the graph, and as a Python int it would recompile the graph at every step."""
    seen = int(counter)
    if seen and seen % interval == 0:
        for buf, seed in zip(features, seeds):
            draw = draw_random_features(*buf.shape, seed=seed, step=seen // interval, orthogonal=orthogonal)
            buf.copy_(draw.to(device=buf.device, dtype=buf.dtype))
    counter.add_(1)


# registered once per process: a Hub remote-code copy of this module reuses the installed package's op
if hasattr(torch.ops.linearformers, "redraw_schedule_step"):
    _redraw_schedule_step = torch.ops.linearformers.redraw_schedule_step
else:
    _redraw_schedule_step = torch.library.custom_op(
        "linearformers::redraw_schedule_step", mutates_args=("counter", "features")
    )(_redraw_step)
    _redraw_schedule_step.register_fake(lambda counter, features, seeds, interval, orthogonal: None)


class PerformerPreTrainedModel(LinearAttentionPreTrainedModel):
    """The base class of the Performer models, bound to PerformerConfig and PerformerAttention. See
    LinearAttentionPreTrainedModel."""

    config_class = PerformerConfig
    config: PerformerConfig
    attention_class = PerformerAttention

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, PerformerAttention) and module.random_features is not None:
            # deterministic: the same draw as in __init__, so init tests and reloads agree
            init.copy_(module.random_features, module.draw_features(0, device=module.random_features.device))
        if isinstance(module, HedgehogFeatureMap):
            # the map's own initialization (HedgehogFeatureMap.reset_parameters), through transformers' init
            # functions so that weights loaded from a checkpoint are left alone
            for weight, bias in ((module.weight, module.bias), (module.key_weight, module.key_bias)):
                if weight is None:
                    continue
                init.copy_(weight, module.initial_weight(weight))
                init.zeros_(bias)
        if isinstance(module, PerformerAttention) and module.window_balance is not None:
            init.zeros_(module.window_balance)  # gamma = 1: the window and the linear part on an equal footing
        if isinstance(module, PerformerAttention) and module.query_scale_weight is not None:
            init.zeros_(module.query_scale_weight)  # l_t = 0 until trained or calibrated
            init.zeros_(module.query_scale_bias)
        if isinstance(module, PerformerAttention) and module.key_scale_weight is not None:
            init.zeros_(module.key_scale_weight)  # r_s = 0 until trained
            init.zeros_(module.key_scale_bias)
        if isinstance(module, PerformerModel):
            init.zeros_(module.feature_redraws)


class PerformerModel(LinearAttentionModel, PerformerPreTrainedModel):
    """The bare Performer stack: embeddings and blocks, with a pooler (encoder) or a final norm (decoder). In
    training it redraws every layer's features each ``config.feature_redraw_interval`` forwards. See
    LinearAttentionModel."""

    def __init__(self, config: PerformerConfig, add_pooling_layer: bool = True):
        super().__init__(config, add_pooling_layer)
        # training forward passes seen, for the redraws; saved, so a resumed run redraws on the same schedule
        self.register_buffer("feature_redraws", torch.zeros((), dtype=torch.long), persistent=True)
        self.post_init()

    def redraw_features(self, draw_index: int) -> None:
        """Set every layer's random features to draw number ``draw_index`` (a pure function of the config's
        feature_seed, the layer and the index: the same on every process). Nothing to do with a learned map."""
        for layer in self.layers:
            buf = layer.attention.random_features
            if buf is None:
                continue
            buf.copy_(layer.attention.draw_features(draw_index, device=buf.device).to(buf.dtype))

    def _start_forward(self) -> None:
        self._maybe_redraw()

    def _maybe_redraw(self) -> None:
        interval = self.config.feature_redraw_interval
        if not (self.training and interval and self.config.random_feature_kernel):
            return
        attentions = [layer.attention for layer in self.layers]
        features = [attention.random_features for attention in attentions]
        seeds = [attention.draw_seed for attention in attentions]
        _redraw_schedule_step(self.feature_redraws, features, seeds, interval, self.config.orthogonal_features)


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
