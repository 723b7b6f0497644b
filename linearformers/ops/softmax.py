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


def packed_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Bidirectional softmax attention of each row's real tokens among themselves, at a cost set by the longest
    row's real length, not the padded one: the real tokens of every row are gathered to the front, in order, attend
    there, and go back to their places. The same as :func:`softmax_attention` at real positions; padded positions
    output 0. q, k: (batch, heads, n, head_dim); v: (batch, heads, n, d_v); key_padding_mask: (batch, n), True / 1
    for real tokens (None: every token real)."""
    check_qkv(q, k, v, same_length=True)
    mask = check_mask(key_padding_mask, k.shape[0], k.shape[2])
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    lengths = mask.sum(-1)
    longest = int(lengths.max()) if mask.shape[0] else 0
    if longest == 0:  # no real token anywhere
        return torch.zeros_like(v)
    # each row's real positions first, in order (a stable sort of the pads behind them)
    places = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[:, :longest]
    inside = torch.arange(longest, device=mask.device)[None, :] < lengths[:, None]

    def gather(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, places[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))

    packed = softmax_attention(gather(q), gather(k), gather(v), key_padding_mask=inside, scale=scale)
    packed = packed * inside[:, None, :, None].to(packed.dtype)
    return torch.zeros_like(v, dtype=packed.dtype).scatter(
        2, places[:, None, :, None].expand(-1, v.shape[1], -1, v.shape[3]), packed
    )
