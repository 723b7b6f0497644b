"""Decoding cache for linear attention: a fixed-size state per layer, in transformers' cache layers.

The cache stores; the attention modules compute. Each model layer gets one
``transformers.cache_utils.LinearAttentionLayer`` with room for ten recurrent states, of which a layer uses:
  * Performer with random features, three: S = Σ phi(k) vᵀ (b, h, m, d), z = Σ phi(k) (b, h, m) and their offset
    M (b, h) (see favor_step); with a learned map (feature_map="hedgehog"), two: S and z (see linear_step);
  * Performer with ``hybrid_window`` w, ten, the ``HybridState`` of ``attention.hybrid``: S and z over the keys that
    have left the window, the last w - 1 keys (b, h, w - 1, d), values (b, h, w - 1, d) and key features
    (b, h, w - 1, m) with their validity (b, w - 1) bool, and the ``hybrid_sinks`` S sinks' keys and values
    (b, h, S, d), validity (b, S) and distance from the newest token (b, S) (S = 0: empty);
  * causal Linformer, two: the slot states K̃ and Ṽ (b, h, k, d).
Local windowed heads keep their last ``local_window - 1`` keys and values in the layer's conv state, laid out
(b, h, 2d + 1, tokens): keys, values, and a validity channel that masks left padding and the zeros the cache
pads a short prefill with. Nothing grows with the context.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer


class LinearAttentionCache(DynamicCache):
    """A ``DynamicCache`` whose layers are all linear-attention layers. It counts the tokens it has seen, which
    ``generate()`` reads through ``get_seq_length()``, since the states themselves have no length."""

    # the most states a layer keeps: the hybrid's ten (module docstring); the others leave the rest unset
    MAX_STATES = 10

    def __init__(self, num_layers: int):
        Cache.__init__(self, layers=[LinearAttentionLayer(number_of_states=self.MAX_STATES) for _ in range(num_layers)])
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

    def set_state(self, layer_idx: int, state: tuple[torch.Tensor, ...]) -> None:
        """Store the layer's recurrent states in order (module docstring): e.g. (S, z, M) for Performer, the ten of a
        HybridState for a hybrid Performer, (K̃, Ṽ) for Linformer."""
        layer = self.layers[layer_idx]
        if len(state) > layer.number_of_states:
            raise ValueError(f"a layer of this cache holds at most {layer.number_of_states} states, got {len(state)}")
        for idx, tensor in enumerate(state):
            self.update_recurrent_state(tensor, layer_idx, idx)
            # update_recurrent_state does not set this flag; without it the next step restarts from an empty state
            layer.has_previous_state[idx] = True

    def update_local_window(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor | None,
        window: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Store the new tokens' keys and values (b, h, n, d) and validity (b, n) (None: all real) in the layer's
        window of the last ``window - 1`` tokens.

        Returns the window as it was before these tokens: keys and values (b, h, window - 1, d) and validity
        (b, window - 1) bool, or None on the layer's first call (nothing kept yet) and for a window of one token,
        which keeps nothing."""
        if window == 1:
            return None
        b, h, n, d = keys.shape
        layer = self.layers[layer_idx]
        had_window = layer.has_previous_state[0] and layer.conv_states[0] is not None
        valid = torch.ones(b, n, dtype=keys.dtype, device=keys.device) if valid is None else valid.to(keys.dtype)
        packed = torch.cat([keys, values, valid[:, None, :, None].expand(b, h, n, 1)], dim=-1).transpose(-1, -2)
        full = self.update_conv_state(packed, layer_idx, 0, conv_kernel_size=window - 1)
        if not had_window:
            return None
        past = full[..., :-n].transpose(-1, -2)  # (b, h, window - 1, 2d + 1): the window before the new tokens
        return past[..., :d], past[..., d : 2 * d], past[:, 0, :, -1] > 0.5
