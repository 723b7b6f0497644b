"""The stack both families share: embeddings, attention module, MLP, encoder / decoder blocks, heads' parts.

Only the attention kernel differs between Linformer and Performer; the module picks it from the config in
plain code (:func:`build_attention`). Shapes: hidden states are (batch, length, hidden_size); inside attention
tensors are (batch, heads, length, head_dim).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration import LinformerConfig, PerformerConfig
from ..configuration.common import LinearAttentionConfig
from .attention import (
    causal_linformer_attention,
    causal_linformer_step,
    draw_random_features,
    favor_attention,
    favor_step,
    linformer_attention,
    local_attention,
    num_relative_positions,
)
from .attention.linformer import check_sequence_length, slot_first_writes
from .cache import LinearAttentionCache


def sinusoidal_embeddings(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017 sinusoidal positions for (batch, length) ids -> (batch, length, dim), float32."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=position_ids.device, dtype=torch.float32) / half)
    angles = position_ids.float()[..., None] * freq
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return nn.functional.pad(emb, (0, dim - 2 * half))


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (Su et al. 2021) tables for (batch, length) ids -> cos, sin of shape (batch, 1, length, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    angles = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class LinearAttentionEmbeddings(nn.Module):
    """Word + position (+ token type) embeddings. The encoder normalizes them (BERT); the decoder does not (GPT-2)."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "absolute"
            else None
        )
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size)
            if config.type_vocab_size > 0 and not config.is_decoder
            else None
        )
        self.LayerNorm = None if config.is_decoder else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.position_embeddings is not None:
            limit = self.config.max_position_embeddings
            # checked in eager mode only: reading the maximum would break a compiled graph
            if not torch.compiler.is_compiling() and position_ids.numel() and int(position_ids.max()) >= limit:
                raise ValueError(
                    f"position {int(position_ids.max())} is past max_position_embeddings={limit} of this model's "
                    "learned absolute positions. Truncate the input, or use position_embedding_type='rotary' or "
                    "'sinusoidal', which have no length limit."
                )
            embeddings = embeddings + self.position_embeddings(position_ids)
        elif self.config.position_embedding_type == "sinusoidal":
            embeddings = embeddings + sinusoidal_embeddings(position_ids, self.config.hidden_size).to(embeddings.dtype)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(position_ids)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.LayerNorm is not None:
            embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class LinearAttention(nn.Module):
    """Self-attention: q/k/v projections, the family's global kernel on the first heads, optional local
    windowed softmax heads on the last ``num_local_heads``, and the output projection ``o_proj``.

    PEFT LoRA targets: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (and ``up_proj``, ``down_proj`` in the MLP).
    """

    def __init__(self, config: LinearAttentionConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_local = config.num_local_heads
        self.num_global = config.num_attention_heads - config.num_local_heads
        self.head_dim = config.head_dim
        self.causal = config.is_decoder
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.relative_bias = (
            nn.Parameter(torch.zeros(self.num_local, num_relative_positions(config.local_window, self.causal)))
            if self.num_local and config.local_relative_bias
            else None
        )

    def extra_repr(self) -> str:
        local = f", num_local_heads={self.num_local}, local_window={self.config.local_window}" if self.num_local else ""
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}{local}"

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LinearAttentionCache | None = None,
        shared_projection: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = (self._split(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        g = self.num_global
        # plain assignments around the kernel calls: where a kernel breaks a compiled graph, an object built in this
        # call (a list being appended to) would sit on the stack, and dynamo would recompile the rest at every call
        out = None
        if g:
            out = self.global_attention(q[:, :g], k[:, :g], v[:, :g], key_mask, cache, shared_projection, position_ids)
        if self.num_local:
            local = self.local_heads(q[:, g:], k[:, g:], v[:, g:], key_mask, cache)
            out = local if out is None else torch.cat([out, local], dim=1)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def local_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: LinearAttentionCache | None,
    ) -> torch.Tensor:
        window = self.config.local_window
        if cache is None:
            return local_attention(
                q, k, v, window, causal=self.causal, key_padding_mask=key_mask, relative_bias=self.relative_bias
            )
        return cache.local_attention(self.layer_idx, q, k, v, window, key_mask, self.relative_bias)

    def global_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: LinearAttentionCache | None,
        shared_projection: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError


class PerformerAttention(LinearAttention):
    """FAVOR+ heads. The random features are a persistent buffer (saved with the checkpoint, so a reload gives
    the same outputs), drawn deterministically from (feature_seed, layer, draw index)."""

    def __init__(self, config: PerformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.draw_seed = config.feature_seed * 10_007 + layer_idx  # this layer's stream of draws
        self.register_buffer("random_features", self.draw_features(0), persistent=True)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{super().extra_repr()}, num_random_features={c.num_random_features}, kernel={c.kernel!r}, "
            f"orthogonal_features={c.orthogonal_features}, feature_redraw_interval={c.feature_redraw_interval}"
        )

    def draw_features(self, draw_index: int, device: torch.device | None = None) -> torch.Tensor:
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
        key_mask: torch.Tensor | None,
        cache: LinearAttentionCache | None,
        shared_projection: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        kwargs = {"kernel": self.config.kernel, "kernel_eps": self.config.kernel_eps}
        if not self.causal:
            return favor_attention(q, k, v, self.random_features, key_padding_mask=key_mask, **kwargs)
        if cache is None:
            return favor_attention(
                q,
                k,
                v,
                self.random_features,
                causal=True,
                key_padding_mask=key_mask,
                chunk_size=self.config.causal_chunk_size,
                **kwargs,
            )
        state = cache.get_state(self.layer_idx)
        if q.shape[2] == 1 and state is not None:
            out, state = favor_step(q, k, v, self.random_features, state, key_padding_mask=key_mask, **kwargs)
        else:
            out, state = favor_attention(
                q,
                k,
                v,
                self.random_features,
                causal=True,
                key_padding_mask=key_mask,
                chunk_size=self.config.causal_chunk_size,
                initial_state=state,
                return_state=True,
                **kwargs,
            )
        cache.set_state(self.layer_idx, state)
        return out


class LinformerAttention(LinearAttention):
    """Linformer heads: E / F projections along the sequence, owned here unless shared across layers."""

    def __init__(self, config: LinformerConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        k = config.projected_length_for(layer_idx)
        n = config.max_seq_length
        self.window = n // k if config.projection != "learned" else None
        self.e_proj = self.f_proj = None
        if config.projection == "learned" and config.sharing != "layerwise":
            shape = (self.num_global, k, n) if config.sharing == "per_head" else (k, n)
            self.e_proj = nn.Parameter(torch.empty(shape))
            if config.sharing != "key_value":
                self.f_proj = nn.Parameter(torch.empty(shape))
        elif config.projection == "conv":
            d = self.head_dim
            self.e_proj = nn.Parameter(torch.empty(d, d, self.window))
            if config.sharing not in ("key_value", "layerwise"):
                self.f_proj = nn.Parameter(torch.empty(d, d, self.window))

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{super().extra_repr()}, projected_length={c.projected_length_for(self.layer_idx)}, "
            f"max_seq_length={c.max_seq_length}, sharing={c.sharing!r}, projection={c.projection!r}"
        )

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
        key_mask: torch.Tensor | None,
        cache: LinearAttentionCache | None,
        shared_projection: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        e = shared_projection if self.e_proj is None and self.config.projection == "learned" else self.e_proj
        f = self.f_proj
        if self.window is not None:  # pool / conv run on any length: hold them to max_seq_length, as learned E is
            k_len = self.config.projected_length_for(self.layer_idx)
            check_sequence_length(q.shape[2], self.config.max_seq_length, k_len)
        if not self.causal:
            return linformer_attention(
                q,
                k,
                v,
                e,
                f,
                method=self.config.projection,
                window=self.window,
                key_padding_mask=key_mask,
                dropout_p=self.config.attention_probs_dropout_prob if self.training else 0.0,
            )
        if cache is None:
            return causal_linformer_attention(
                q, k, v, e, f, key_padding_mask=key_mask, chunk_size=self.config.causal_chunk_size
            )
        state = cache.get_state(self.layer_idx)
        if state is None:
            out, state = causal_linformer_attention(
                q, k, v, e, f, key_padding_mask=key_mask, chunk_size=self.config.causal_chunk_size, return_state=True
            )
        elif q.shape[2] == 1:
            out, state = causal_linformer_step(
                q, k, v, e, f, state, position_ids[:, -1], first_writes=self._slot_first_writes(e)
            )
        else:  # a continued prefill: a long prompt fed in pieces
            if key_mask is not None and not bool(key_mask.all()):  # compiled forwards pass an all-True mask
                raise ValueError(
                    "a cached causal Linformer continues with real tokens only; padding belongs in the first "
                    "(prefill) call. Call without past_key_values to recompute the prefix."
                )
            start = position_ids[:, :1]
            offsets = torch.arange(q.shape[2], device=q.device)
            if bool((start == start[0]).all()) and bool((position_ids == start + offsets).all()):
                out, state = causal_linformer_attention(
                    q,
                    k,
                    v,
                    e,
                    f,
                    chunk_size=self.config.causal_chunk_size,
                    initial_state=state,
                    start=int(start[0, 0]),
                    return_state=True,
                )
            else:  # rows at different positions (after a left-padded prefill): one exact step per token
                outs = []
                for t in range(q.shape[2]):
                    piece, state = causal_linformer_step(
                        q[:, :, t : t + 1],
                        k[:, :, t : t + 1],
                        v[:, :, t : t + 1],
                        e,
                        f,
                        state,
                        position_ids[:, t],
                        first_writes=self._slot_first_writes(e),
                    )
                    outs.append(piece)
                out = torch.cat(outs, dim=2)
        cache.set_state(self.layer_idx, state)
        return out


def build_attention(config: LinearAttentionConfig, layer_idx: int) -> LinearAttention:
    # by model_type, not isinstance: transformers loads an exported folder's config code and model code as two
    # separate module copies, so the config object's class need not be the PerformerConfig imported here
    if config.model_type == PerformerConfig.model_type:
        return PerformerAttention(config, layer_idx)
    if config.model_type == LinformerConfig.model_type:
        return LinformerAttention(config, layer_idx)
    raise TypeError(f"no attention for config type {type(config).__name__} (model_type {config.model_type!r})")


class LinearAttentionMLP(nn.Module):
    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden_states)))


class LinearAttentionLayer(GradientCheckpointingLayer):
    """One block. Encoder (BERT, post-LN): x = LN(x + attn(x)); x = LN(x + mlp(x)).
    Decoder (GPT-2, pre-LN): x = x + attn(LN(x)); x = x + mlp(LN(x))."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.is_decoder
        self.attention = build_attention(config, layer_idx)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = LinearAttentionMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: LinearAttentionCache | None = None,
        shared_projection: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attend(x):
            return self.attention(x, key_mask, rotary, past_key_values, shared_projection, position_ids)

        if self.pre_norm:
            hidden_states = hidden_states + self.dropout(attend(self.attention_norm(hidden_states)))
            return hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states)))
        attn = attend(hidden_states)
        hidden_states = self.attention_norm(hidden_states + self.dropout(attn))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))


class LinearAttentionPooler(nn.Module):
    """BERT's pooler: tanh(W h_[CLS]), [CLS] being each row's first real token: with left padding position 0 is
    a pad, and padding must not change an answer."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if key_mask is None:
            first = hidden_states[:, 0]
        else:  # argmax gives the first True; a row of padding only pools position 0
            rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            first = hidden_states[rows, key_mask.to(hidden_states.device).int().argmax(-1)]
        return self.activation(self.dense(first))


class MaskedLMHead(nn.Module):
    """BERT's MLM head: dense + activation + LayerNorm, then the decoder tied to the word embeddings."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.LayerNorm(self.act(self.dense(hidden_states))))
