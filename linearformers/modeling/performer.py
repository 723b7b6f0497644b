"""Performer models (Choromanski et al. 2021): the shared stack (base.py) with FAVOR+ attention.

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
from ..ops import (
    HedgehogFeatureMap,
    draw_random_features,
    favor_attention,
    favor_positive,
    favor_step,
    hedgehog_hybrid_attention,
    hedgehog_refusal,
    hybrid_attention,
    hybrid_step,
    linear_attention,
    linear_step,
    packed_softmax_attention,
    relu_features,
)
from ..ops.feature_maps import favor_exponents
from ..ops.hybrid import HYBRID_BLOCK
from ..seeds import mix_seed
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


class PerformerAttention(LinearAttention):
    """FAVOR+ heads. The random features are a persistent buffer (saved with the checkpoint, so a reload gives
    the same outputs), drawn deterministically from (feature_seed, layer, draw index).

    With ``config.feature_map == "hedgehog"`` the heads use a learned feature map instead: ``self.feature_map``, a
    :class:`HedgehogFeatureMap` over the global heads with ``num_features`` features, whose parameters
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

    attention_name = "FAVOR+ (Performer)"
    # all at the model's initialization: features drawn from the seed, maps as HedgehogFeatureMap starts them,
    # balances and scales at zero
    new_tensors = {
        **LinearAttention.new_tensors,
        "random_features": NewTensor(),
        "feature_map": NewTensor(),
        "window_balance": NewTensor(),
        "query_scale_weight": NewTensor(),
        "query_scale_bias": NewTensor(),
        "key_scale_weight": NewTensor(),
        "key_scale_bias": NewTensor(),
    }

    def __init__(self, config: PerformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.draw_seed = mix_seed(config.feature_seed, layer_idx)  # this layer's stream of draws
        if config.draws_random_features:
            self.feature_map = None
            self.register_buffer("random_features", self.draw_features(0), persistent=True)
        else:
            self.register_buffer("random_features", None)
            self.feature_map = (
                HedgehogFeatureMap(self.num_global, self.head_dim, config.num_features) if self.num_global else None
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
            f"{super().extra_repr()}, num_features={c.num_features}, feature_map={c.feature_map!r}, "
            f"orthogonal_features={c.orthogonal_features}, feature_redraw_interval={c.feature_redraw_interval}"
            f"{f', hybrid_window={c.hybrid_window}' if c.hybrid_window else ''}"
            f"{', hybrid_query_scale=True' if self.query_scale_weight is not None else ''}"
            f"{', hybrid_key_scale=True' if self.key_scale_weight is not None else ''}"
        )

    def draw_features(self, draw_index: int, device: torch.device | None = None) -> torch.Tensor:
        """Draw number ``draw_index`` of this layer's features, (num_features, head_dim)."""
        return draw_random_features(
            self.config.num_features,
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
        if self.window_balance is not None:
            if self.config.hybrid_exact_length is not None and past_key_values is None and not self.causal:
                return self.exact_rows(q, k, v, attention_mask)
            return self.hybrid_heads(q, k, v, attention_mask, past_key_values)
        if self.feature_map is None:
            return self.favor_heads(q, k, v, attention_mask, past_key_values)
        return self.learned_map_heads(q, k, v, attention_mask, past_key_values)

    def exact_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``hybrid_exact_length`` L: each row of at most L real tokens (by its own mask, so that padding and the
        other rows of a batch change nothing) by exact softmax over its real keys, the window covering it; the
        other rows by the hybrid. Padded positions of the exact rows output 0."""
        batch, n = q.shape[0], q.shape[2]
        if attention_mask is None:
            lengths = torch.full((batch,), n, device=q.device)
        else:
            lengths = attention_mask.sum(-1)
        short = lengths <= self.config.hybrid_exact_length
        if not bool(short.any()):
            return self.hybrid_heads(q, k, v, attention_mask, None)
        if bool(short.all()):
            return packed_softmax_attention(q, k, v, key_padding_mask=attention_mask).to(v.dtype)
        rows = [short.nonzero().squeeze(1), (~short).nonzero().squeeze(1)]
        masks = [None, None] if attention_mask is None else [attention_mask[r] for r in rows]
        exact = packed_softmax_attention(q[rows[0]], k[rows[0]], v[rows[0]], key_padding_mask=masks[0])
        rest = self.hybrid_heads(q[rows[1]], k[rows[1]], v[rows[1]], masks[1], None)
        return torch.cat([exact.to(rest.dtype), rest])[torch.cat(rows).argsort()]

    def favor_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
    ) -> torch.Tensor:
        """FAVOR+ with the random features, which the op maps q and k by inside its kernels."""
        c = self.config
        if past_key_values is None:
            return favor_attention(
                q,
                k,
                v,
                self.random_features,
                causal=self.causal,
                key_padding_mask=attention_mask,
                feature_map=c.feature_map,
                feature_eps=c.feature_eps,
                chunk_size=c.causal_chunk_size if self.causal else None,
            )
        state = past_key_values.get_state(self.layer_idx)
        if q.shape[2] == 1 and state is not None:  # a decoding step
            out, state = favor_step(
                q,
                k,
                v,
                self.random_features,
                state,
                key_padding_mask=attention_mask,
                feature_map=c.feature_map,
                feature_eps=c.feature_eps,
            )
        else:  # a prefill, or a prompt fed in pieces
            out, state = favor_attention(
                q,
                k,
                v,
                self.random_features,
                causal=True,
                key_padding_mask=attention_mask,
                feature_map=c.feature_map,
                feature_eps=c.feature_eps,
                chunk_size=c.causal_chunk_size,
                initial_state=state,
                return_state=True,
            )
        past_key_values.set_state(self.layer_idx, state)
        return out

    def learned_map_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
    ) -> torch.Tensor:
        """Linear attention of the learned map's features."""
        phi_q, phi_k = self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)
        if past_key_values is None:
            return linear_attention(
                phi_q,
                phi_k,
                v,
                causal=self.causal,
                key_padding_mask=attention_mask,
                chunk_size=self.config.causal_chunk_size if self.causal else None,
            )
        state = past_key_values.get_state(self.layer_idx)
        if q.shape[2] == 1 and state is not None:  # a decoding step
            out, state = linear_step(phi_q, phi_k, v, state=state, key_padding_mask=attention_mask)
        else:  # a prefill, or a prompt fed in pieces
            out, state = linear_attention(
                phi_q,
                phi_k,
                v,
                causal=True,
                key_padding_mask=attention_mask,
                chunk_size=self.config.causal_chunk_size,
                initial_state=state,
                return_state=True,
            )
        past_key_values.set_state(self.layer_idx, state)
        return out

    def hybrid_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
    ) -> torch.Tensor:
        """The LoLCATs hybrid: exact softmax on the window (q, k) and the feature map on the other keys (phi_q,
        phi_k from :meth:`hybrid_features`); it works by blocks of its window, so it takes no chunk size."""
        c = self.config
        gamma = torch.exp(self.window_balance)
        select = {"select_blocks": c.hybrid_select_blocks, "select_block_size": c.hybrid_select_block_size}
        if (
            past_key_values is None
            and not self.causal
            # the walk chooses far blocks among its own blocks of keys alone
            and (not c.hybrid_select_blocks or c.hybrid_select_block_size == HYBRID_BLOCK)
            and isinstance(self.feature_map, HedgehogFeatureMap)
        ):
            fused = self._hedgehog_fused(q, k, v, gamma, attention_mask)
            if fused is not None:
                return fused
        phi_q, phi_k, log_scale = self.hybrid_features(q, k, attention_mask)
        if past_key_values is None:
            return hybrid_attention(
                q,
                k,
                v,
                phi_q,
                phi_k,
                gamma,
                c.hybrid_window,
                causal=self.causal,
                key_padding_mask=attention_mask,
                query_log_scale=log_scale,
                sinks=c.hybrid_sinks,
                **select,
            )
        state = past_key_values.get_state(self.layer_idx)
        if q.shape[2] == 1 and state is not None:  # a decoding step
            out, state = hybrid_step(
                q,
                k,
                v,
                phi_q,
                phi_k,
                gamma,
                c.hybrid_window,
                state=state,
                key_padding_mask=attention_mask,
                query_log_scale=log_scale,
                sinks=c.hybrid_sinks,
            )
        else:  # a prefill, or a prompt fed in pieces
            out, state = hybrid_attention(
                q,
                k,
                v,
                phi_q,
                phi_k,
                gamma,
                c.hybrid_window,
                causal=True,
                key_padding_mask=attention_mask,
                initial_state=state,
                return_state=True,
                query_log_scale=log_scale,
                sinks=c.hybrid_sinks,
            )
        past_key_values.set_state(self.layer_idx, state)
        return out

    def hybrid_features(
        self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None, *, query_scale: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The features of the hybrid's linear part: phi_q, phi_k (batch, global heads, n, m), float32, and the
        queries' log scale ℓ (batch, global heads, n) that ``hybrid_attention`` takes, or None.

        First the map's own. The learned map: its features, ℓ = None. "relu": the ReLU features, ℓ = None. The random
        "softmax" map: the positive features of ``favor_positive``, whose query features have their row maximum u_t
        taken off (detached: it cancels against ℓ) and lack the estimator's 1/m, so phi_q·phi_k = m exp(scale q·k -
        u_t) in expectation (Lemma 1); ℓ_t = u_t - log m puts them back on the softmax's scale, and the window's
        exact scores and the FAVOR+ estimate elsewhere then add up to an estimate of softmax attention at gamma = 1.
        "relu" and the learned map are attentions of their own, whose scale gamma learns against: LoLCATs' form.

        Then, with ``hybrid_key_scale``, phi_k times exp(r) (:meth:`key_log_scale`); and with ``hybrid_query_scale``
        (unless ``query_scale=False``: ``calibrate_query_scale`` fits that term), the learned q_t·a_h + b_h added to
        ℓ, in float32."""
        c = self.config
        if self.feature_map is not None:
            phi_q, phi_k, log_scale = self.feature_map(q, is_query=True), self.feature_map(k, is_query=False), None
        elif c.feature_map == "relu":
            phi_q = relu_features(q, self.random_features, eps=c.feature_eps)
            phi_k = relu_features(k, self.random_features, eps=c.feature_eps, key_padding_mask=attention_mask)
            log_scale = None
        else:
            u = favor_exponents(q, self.random_features, is_query=True)
            top = u.amax(dim=-1, keepdim=True).detach()
            phi_q = torch.exp(u - top)
            phi_k = favor_positive(k, self.random_features, is_query=False, key_padding_mask=attention_mask)
            log_scale = top.squeeze(-1) - math.log(self.random_features.shape[0])
        if self.key_scale_weight is not None:
            key_scale = torch.exp(self.key_log_scale(k))[..., None]
            # in place where autograd records nothing: phi_k is this call's own tensor
            phi_k = phi_k * key_scale if torch.is_grad_enabled() else phi_k.mul_(key_scale)
        if query_scale and self.query_scale_weight is not None:
            learned = _per_head_dot(q, self.query_scale_weight) + self.query_scale_bias.float()[None, :, None]
            log_scale = learned if log_scale is None else log_scale + learned
        return phi_q, phi_k, log_scale

    def _hedgehog_fused(self, q, k, v, gamma, attention_mask) -> torch.Tensor | None:
        """The bidirectional hybrid with the learned map made inside the native walk (``hedgehog_hybrid_attention``),
        where it can run: inference on the CPU. It computes what :meth:`hybrid_features` and ``hybrid_attention``
        compute together, without the (batch, heads, n, m) feature tensors. None where it cannot run."""
        fm = self.feature_map
        weights = (fm.weight, fm.bias, *((fm.key_weight, fm.key_bias) if fm.separate else (fm.weight, fm.bias)))
        parameters = (gamma, self.query_scale_weight, self.query_scale_bias, self.key_scale_weight, self.key_scale_bias)
        if hedgehog_refusal(q, v, fm.num_features, (k, *weights, *parameters)) is not None:
            return None
        scales = {"key_scale_bound": self.KEY_SCALE_BOUND}
        if self.query_scale_weight is not None:
            scales["query_scale"] = (self.query_scale_weight, self.query_scale_bias)
        if self.key_scale_weight is not None:
            scales["key_scale"] = (self.key_scale_weight, self.key_scale_bias)
        c = self.config
        return hedgehog_hybrid_attention(
            q, k, v, weights, gamma, c.hybrid_window, key_padding_mask=attention_mask, sinks=c.hybrid_sinks,
            select_blocks=c.hybrid_select_blocks, **scales,
        )  # fmt: skip

    def key_log_scale(self, k: torch.Tensor) -> torch.Tensor | None:
        """The keys' learned log scale r (batch, global heads, n), float32, or None without ``hybrid_key_scale``:
        r_s = R tanh((k_s·a_h + b_h) / R), R = ``KEY_SCALE_BOUND``; a smooth bound, so that no learned value can
        take the linear sums out of float32, and close to k_s·a_h + b_h wherever that is a few units."""
        if self.key_scale_weight is None:
            return None
        raw = _per_head_dot(k, self.key_scale_weight) + self.key_scale_bias.float()[None, :, None]
        return self.KEY_SCALE_BOUND * torch.tanh(raw / self.KEY_SCALE_BOUND)


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

    new_tensors = {"feature_redraws": NewTensor()}  # the redraw counter, from zero

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
        # the layers' buffers, not the config, say whether there is anything to redraw (a learned map has none)
        attentions = [layer.attention for layer in self.layers if layer.attention.random_features is not None]
        if not (self.training and interval and attentions):
            return
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
