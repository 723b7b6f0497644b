"""Decoding cache for linear attention: a fixed-size recurrent state per layer, in transformers' cache layers.

Each model layer gets one ``transformers.cache_utils.LinearAttentionLayer`` with up to three recurrent states:
  * Performer: S = Σ phi(k) vᵀ (b, h, m, d), z = Σ phi(k) (b, h, m) and their offset M (b, h) (see favor_step);
  * causal Linformer: the slot states K̃ and Ṽ (b, h, k, d).
Local windowed heads keep their last ``local_window - 1`` keys and values in the layer's conv state, laid out
(b, h, 2d + 1, tokens): keys, values, and a validity channel that masks left padding and the zeros the cache
pads a short prefill with. Nothing grows with the context.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer

from .attention import local_attention, local_attention_step


class LinearAttentionCache(DynamicCache):
    """A ``DynamicCache`` whose layers are all linear-attention layers. It counts the tokens it has seen, which
    ``generate()`` reads through ``get_seq_length()``, since the states themselves have no length."""

    def __init__(self, num_layers: int):
        # three states: Performer keeps (S, z, M), causal Linformer (K̃, Ṽ) and leaves the third unset
        Cache.__init__(self, layers=[LinearAttentionLayer(number_of_states=3) for _ in range(num_layers)])
        self.seen_tokens = 0

    @property
    def is_compileable(self) -> bool:
        # False keeps generate() from building 4-D attention masks: the kernels take the 2-D padding mask
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def batch_size(self) -> int | None:
        """The batch the stored states were built for, or None while the cache is empty."""
        for layer in self.layers:
            for states in (layer.recurrent_states, layer.conv_states):
                for tensor in states.values():
                    if tensor is not None:
                        return tensor.shape[0]
        return None

    def get_state(self, layer_idx: int) -> tuple[torch.Tensor, ...] | None:
        """The layer's recurrent states in order, or None before its first call."""
        states = []
        for idx in range(self.layers[layer_idx].number_of_states):
            tensor = self.get_recurrent_state(layer_idx, idx)
            if tensor is None:
                break
            states.append(tensor)
        return tuple(states) or None

    def set_state(self, layer_idx: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        layer = self.layers[layer_idx]
        for idx, tensor in enumerate(state):
            self.update_recurrent_state(tensor, layer_idx, idx)
            # update_recurrent_state does not set this flag; without it the next step restarts from an empty state
            layer.has_previous_state[idx] = True

    def local_attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int,
        key_mask: torch.Tensor | None,
        relative_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal local heads with the window kept in the cache: prefill computes the whole window attention,
        a one-token step reads the cached window plus the new token, and several new tokens (a prefill fed in
        pieces) attend over the cached window followed by themselves."""
        b, h, n, d = k.shape
        valid = torch.ones(b, n, dtype=k.dtype, device=k.device) if key_mask is None else key_mask.to(k.dtype)
        packed = torch.cat([k, v, valid[:, None, :, None].expand(b, h, n, 1)], dim=-1).transpose(-1, -2)
        has_window = self.layers[layer_idx].has_previous_state[0] and self.layers[layer_idx].conv_states[0] is not None
        if window == 1:
            full = packed
        else:
            full = self.update_conv_state(packed, layer_idx, 0, conv_kernel_size=window - 1)
        if not has_window:
            return local_attention(q, k, v, window, causal=True, key_padding_mask=key_mask, relative_bias=relative_bias)
        full = full.transpose(-1, -2)  # (b, h, window - 1 + n, 2d + 1): the cached window, then the new tokens
        if n != 1:  # a continued prefill: window attention over [cached window, new tokens], the new rows kept
            queries = torch.cat([q.new_zeros(b, h, full.shape[2] - n, d), q], dim=2)
            out = local_attention(
                queries,
                full[..., :d],
                full[..., d : 2 * d],
                window,
                causal=True,
                key_padding_mask=full[:, 0, :, -1] > 0.5,
                relative_bias=relative_bias,
            )
            return out[:, :, -n:]
        return local_attention_step(
            q,
            full[..., :d],
            full[..., d : 2 * d],
            window,
            key_padding_mask=full[:, 0, :, -1] > 0.5,
            relative_bias=relative_bias,
        )
