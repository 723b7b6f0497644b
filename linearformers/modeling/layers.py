"""The stack both families share: position encodings, embeddings, the attention base with its local heads, MLP,
block, pooler and MLM head.

The global heads are the family's: each family subclasses ``LinearAttention`` in its own file (performer.py,
linformer.py) to write ``global_attention``, and its PreTrainedModel names that class as ``attention_class``, which
the model hands to every ``LinearAttentionBlock``. Shapes: hidden states are (batch, length, hidden_size); inside
attention tensors are (batch, heads, length, head_dim).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.common import LinearAttentionConfig
from ..ops.local import causal_local_attention, local_attention, num_relative_positions
from .cache import LinearAttentionCache


@dataclass(frozen=True)
class NewTensor:
    """A tensor that a module adds to the softmax attention of BERT / GPT-2, declared by the module in its
    ``new_tensors`` (attribute name -> NewTensor; a submodule's every tensor is new). ``convert.py`` starts it,
    ``transfer.py`` trains it (a parameter; a buffer stays as it is).

    start: how a conversion starts it: "model" (the model's own initialization), "zeros", or "window_means" (each of
        the k slots the mean of its window of n / k positions, so that at k = n it is the identity).
    projection: one of Linformer's E / F along the sequence, which attention transfer trains at its own
        ``projection_learning_rate`` (and, in a decoder, on their nonzero entries only).
    """

    start: Literal["model", "zeros", "window_means"] = "model"
    projection: bool = False


def new_tensors(model: nn.Module) -> dict[str, NewTensor]:
    """Every tensor of ``model`` that one of its modules declares new (``new_tensors``), by its name in
    ``model.named_parameters()`` / ``named_buffers()``; a tensor the module does not have (None) is left out."""
    found = {}
    for prefix, module in model.named_modules():
        for attribute, declared in getattr(module, "new_tensors", {}).items():
            value = getattr(module, attribute, None)
            name = f"{prefix}.{attribute}" if prefix else attribute
            if isinstance(value, nn.Module):
                for inner, _ in (*value.named_parameters(), *value.named_buffers()):
                    found[f"{name}.{inner}"] = declared
            elif value is not None:
                found[name] = declared
    return found


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

    A family subclasses it and writes ``global_attention``; ``kernel_name`` names that kernel in messages.
    PEFT LoRA targets: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (and ``up_proj``, ``down_proj`` in the MLP).
    """

    kernel_name = "linear attention"
    # the tensors this module adds to a converted model (NewTensor); a family's attention extends the table
    new_tensors: ClassVar[dict[str, NewTensor]] = {"relative_bias": NewTensor(start="zeros")}

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
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: LinearAttentionCache | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states (batch, n, hidden_size) -> (batch, n, hidden_size).

        attention_mask: (batch, n) bool, True for the real tokens among these n; None: no padding.
        position_embeddings: the rotary (cos, sin) tables, each (batch, 1, n, head_dim), or None.
        past_key_values: the decoder's cache, continued here; None: no cache.
        position_ids: (batch, n) positions of these tokens (decoding steps read them)."""
        q, k, v = (self._split(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if position_embeddings is not None:
            q, k = apply_rotary(q, *position_embeddings), apply_rotary(k, *position_embeddings)
        g = self.num_global
        # plain assignments around the kernel calls: where a kernel breaks a compiled graph, an object built in this
        # call (a list being appended to) would sit on the stack, and dynamo would recompile the rest at every call
        out = None
        if g:
            out = self.global_attention(q[:, :g], k[:, :g], v[:, :g], attention_mask, past_key_values, position_ids)
        if self.num_local:
            local = self.local_heads(q[:, g:], k[:, g:], v[:, g:], attention_mask, past_key_values)
            out = local if out is None else torch.cat([out, local], dim=1)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def local_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: LinearAttentionCache | None,
    ) -> torch.Tensor:
        """The local heads: windowed softmax; with a cache, over the kept window followed by the new tokens."""
        window = self.config.local_window
        if past_key_values is None:
            return local_attention(
                q, k, v, window, causal=self.causal, key_padding_mask=attention_mask, relative_bias=self.relative_bias
            )
        past = past_key_values.update_local_window(self.layer_idx, k, v, attention_mask, window)
        return causal_local_attention(
            q, k, v, window, past=past, key_padding_mask=attention_mask, relative_bias=self.relative_bias
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
        """The family's kernel on the global heads: q, k, v (batch, global heads, n, head_dim) -> the same shape."""
        raise NotImplementedError(f"{type(self).__name__} must implement global_attention")


class LinearAttentionMLP(nn.Module):
    """The feed-forward block: up_proj, activation, down_proj."""

    def __init__(self, config: LinearAttentionConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden_states)))


class LinearAttentionBlock(GradientCheckpointingLayer):
    """One block, around the family's ``attention_class``. Encoder (BERT, post-LN): x = LN(x + attn(x));
    x = LN(x + mlp(x)). Decoder (GPT-2, pre-LN): x = x + attn(LN(x)); x = x + mlp(LN(x))."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int, attention_class: type[LinearAttention]):
        super().__init__()
        self.pre_norm = config.is_decoder
        self.attention = attention_class(config, layer_idx)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = LinearAttentionMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: LinearAttentionCache | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attend(x):
            return self.attention(x, attention_mask, position_embeddings, past_key_values, position_ids)

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

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            first = hidden_states[:, 0]
        else:  # argmax gives the first True; a row of padding only pools position 0
            rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            first = hidden_states[rows, attention_mask.to(hidden_states.device).int().argmax(-1)]
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


def __getattr__(name: str) -> type:
    # the block's old name, which transformers' cache layer (transformers.cache_utils.LinearAttentionLayer) also has
    if name == "LinearAttentionLayer":
        warnings.warn(
            "linearformers.modeling.layers.LinearAttentionLayer is now LinearAttentionBlock; the old name goes away "
            "in linearformers 0.3.0",
            FutureWarning,
            stacklevel=2,
        )
        return LinearAttentionBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
