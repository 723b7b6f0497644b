"""Exact softmax attention through PyTorch SDPA: the reference for every kernel, and the fallback."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_mask, check_qkv


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(Q Kᵀ · scale) V over (batch, heads, length, head_dim) tensors.

    key_padding_mask: (batch, n_k), True / 1 for real tokens. Queries that see no real key output 0.
    """
    check_qkv(q, k, v, same_length=causal)
    mask = check_mask(key_padding_mask, k.shape[0], k.shape[2])
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p)
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = mask[:, None, None, :].expand(-1, 1, n_q, n_k)
    if causal:
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    has_key = allowed.any(-1, keepdim=True)
    allowed = allowed | ~has_key  # keep SDPA away from all -inf rows; their output is zeroed below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, dropout_p=dropout_p)
    return out * has_key.to(out.dtype)
