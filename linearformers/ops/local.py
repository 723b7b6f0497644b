"""Local windowed softmax attention (the "local" heads of Longformer / BigBird, used beside global ones).

Tensors are (batch, heads, length, head_dim). A window of w tokens means:
  * causal: query i sees keys j with i - w < j <= i (itself and the w - 1 before it);
  * bidirectional: query i sees keys j with |i - j| <= w // 2.
Computed by blocks of B = max(w - 1, 1) (causal) or max(w // 2, 1) (bidirectional) queries, B being the
farthest visible distance, each reading its own block and the neighbouring ones: O(n w d) time and O(n w)
memory. A decoder keeps the last w - 1 keys and values and calls :func:`causal_local_attention` with them: a
step then reads at most w keys (:func:`local_attention_step`), whatever the context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_mask, check_qkv
from ._precision import outside_autocast


def num_relative_positions(window: int, causal: bool) -> int:
    """Length of the relative-position bias vector for a window: w (causal) or 2 * (w // 2) + 1."""
    return window if causal else 2 * (window // 2) + 1


def relative_bias_index(distance: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Map distance i - j to the bias index: i - j in [0, w) (causal) or i - j + w // 2 (bidirectional)."""
    return distance if causal else distance + window // 2


@outside_autocast
def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention restricted to a window of ``window`` tokens.

    relative_bias: optional (heads, num_relative_positions(window, causal)) learnable bias added to the logit
    of each (query, key) pair by their distance i - j. Queries with no visible real key (padding) output 0.
    """
    check_qkv(q, k, v, same_length=True)
    b, h, n, d = q.shape
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if not causal and window < 2:
        raise ValueError(f"a bidirectional window must be >= 2 (it sees window // 2 on each side), got {window}")
    mask = check_mask(key_padding_mask, b, n)
    if relative_bias is not None and tuple(relative_bias.shape) != (h, num_relative_positions(window, causal)):
        raise ValueError(
            f"relative_bias must be shaped (heads, {num_relative_positions(window, causal)}) for window={window}, "
            f"causal={causal}; got {tuple(relative_bias.shape)}"
        )
    scale = d**-0.5 if scale is None else scale
    reach = window - 1 if causal else window // 2  # farthest visible distance
    blk = max(reach, 1)
    pad_end = (-n) % blk
    nb = (n + pad_end) // blk
    # keys padded by one block on each side: block c of queries reads keys [c*blk - blk, c*blk + 2*blk)
    kp = F.pad(k.float(), (0, 0, blk, blk + pad_end))
    vp = F.pad(v.float(), (0, 0, blk, blk + pad_end))
    kw = kp.unfold(2, 3 * blk, blk).transpose(-1, -2)  # (b, h, nb, 3blk, d)
    vw = vp.unfold(2, 3 * blk, blk).transpose(-1, -2)
    qb = F.pad(q.float(), (0, 0, 0, pad_end)).view(b, h, nb, blk, d)
    logits = torch.matmul(qb, kw.transpose(-1, -2)) * scale  # (b, h, nb, blk, 3blk)
    i = torch.arange(nb * blk, device=q.device).view(nb, blk, 1)
    j = (torch.arange(nb, device=q.device) * blk - blk).view(nb, 1, 1) + torch.arange(3 * blk, device=q.device)
    dist = i - j  # (nb, blk, 3blk)
    visible = (dist >= 0) & (dist <= reach) if causal else dist.abs() <= reach
    visible = visible & (j >= 0) & (j < n)
    if relative_bias is not None:
        idx = relative_bias_index(dist, window, causal).clamp(0, relative_bias.shape[1] - 1)
        logits = logits + relative_bias.float()[:, idx]  # (h, nb, blk, 3blk)
    if mask is not None:
        km = F.pad(mask, (blk, blk + pad_end)).unfold(1, 3 * blk, blk)  # (b, nb, 3blk)
        visible = visible & km[:, None, :, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    out = torch.matmul(probs, vw).reshape(b, h, nb * blk, -1)[:, :, :n]
    return out.to(v.dtype)


@outside_autocast
def local_attention_step(
    q: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    window: int,
    *,
    key_padding_mask: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal decoding step: one query (batch, heads, 1, d) over the last <= ``window`` keys, newest last."""
    check_qkv(q, k_window, v_window)
    b, _h, _, d = q.shape
    length = k_window.shape[2]
    if length > window:
        raise ValueError(f"the key window holds {length} tokens, more than window={window}")
    mask = check_mask(key_padding_mask, b, length)
    scale = d**-0.5 if scale is None else scale
    logits = torch.matmul(q.float(), k_window.float().transpose(-1, -2)) * scale  # (b, h, 1, L)
    if relative_bias is not None:
        dist = torch.arange(length - 1, -1, -1, device=q.device)
        logits = logits + relative_bias.float()[:, dist][None, :, None, :]
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.matmul(probs, v_window.float()).to(v_window.dtype)


def causal_local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal local attention of new tokens, which may continue earlier tokens whose last keys were kept (decoding).

    Args:
        q, k, v: (batch, heads, n, head_dim), the new tokens.
        window: tokens each query sees, itself included (see :func:`local_attention`).
        past: the tokens just before these, or None when q starts the sequence: keys and values
            (batch, heads, p, head_dim) and their validity (batch, p) bool, with p <= window - 1 (False marks
            padding, and the empty places of a window not yet full).
        key_padding_mask: (batch, n), True / 1 for the new real tokens; None: all real.
        relative_bias, scale: as in :func:`local_attention`.
    Returns: (batch, heads, n, head_dim) in v's dtype.

    Without ``past`` this is :func:`local_attention` with ``causal=True``. With it, one new token is a decoding
    step (:func:`local_attention_step` over the past and itself); several (a prompt fed in pieces) take the window
    attention over the past followed by them, and keep their own rows.
    """
    if past is None:
        return local_attention(
            q, k, v, window, causal=True, key_padding_mask=key_padding_mask, relative_bias=relative_bias, scale=scale
        )
    past_k, past_v, past_valid = past
    check_qkv(q, k, v, same_length=True)
    check_qkv(q, past_k, past_v)
    b, h, n, d = q.shape
    p = past_k.shape[2]
    if p > window - 1:
        raise ValueError(f"past holds {p} tokens, but a window of {window} reads at most {window - 1} earlier ones")
    if not isinstance(past_valid, torch.Tensor) or tuple(past_valid.shape) != (b, p):
        got = tuple(past_valid.shape) if isinstance(past_valid, torch.Tensor) else type(past_valid).__name__
        raise ValueError(f"past's validity must be a (batch, p) = ({b}, {p}) bool tensor, got {got}")
    valid = check_mask(key_padding_mask, b, n)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if valid is None else valid
    keys = torch.cat([past_k, k], dim=2)
    values = torch.cat([past_v, v], dim=2)
    mask = torch.cat([past_valid.bool(), valid], dim=1)
    if n == 1:
        return local_attention_step(
            q, keys, values, window, key_padding_mask=mask, relative_bias=relative_bias, scale=scale
        )
    queries = torch.cat([q.new_zeros(b, h, keys.shape[2] - n, d), q], dim=2)  # rows for the past, dropped below
    out = local_attention(
        queries, keys, values, window, causal=True, key_padding_mask=mask, relative_bias=relative_bias, scale=scale
    )
    return out[:, :, -n:]
