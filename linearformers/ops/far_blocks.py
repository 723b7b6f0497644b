"""Far-block selection for the bidirectional hybrid: each block of queries picks a few blocks of far keys, which
take exact softmax scores instead of the feature map's (after NSA's selection branch, Yuan et al. 2025,
arXiv 2502.11089, and MoBA, Lu et al. 2025, arXiv 2502.13189).

The hybrid of :mod:`hybrid` gives every key outside a query's window the linear score b_ts. A feature map spreads
its estimate over all of them, while a trained softmax head puts much of its far weight on a few keys it picks by
content: what the map misses is where the far mass lies, not how much there is. Selection finds those keys
cheaply and scores them exactly.

Positions are cut into blocks of B: block j holds positions [j B, (j + 1) B). Then:

- Each key block gets a summary: the mean k̄_j of its linear keys (real, not sinks). A block with none is never
  chosen.
- Each query block gets the mean q̄_i of its real queries.
- Query block i chooses, among the key blocks far from all of its queries (every key at least w from every query:
  |i - j| B - (B - 1) >= w), the K with the largest q̄_i·k̄_j, shared by its B queries.
- Each query t of block i gives the linear keys s of its chosen blocks the window's exact score in place of the
  linear one:

      a_ts = gamma_h exp(scale q_t·k_s - c_t)   (s chosen),   b_ts as in :mod:`hybrid` for the keys left

  normalized together with the window, the sinks and the other linear keys.

The choice is a discrete function of q and k, so no gradient flows through it; gradients reach q, k and v through
the exact scores of the chosen keys and the linear scores of the others, as in :mod:`hybrid`.

The features must be on the softmax's scale (``query_log_scale`` ℓ given): then the window, the sinks and the
linear part carry the same factor exp(-c_t), which cancels, and a chosen key's exact score and its linear score
lie on one scale. Without ℓ (LoLCATs' form) c_t is the window's largest logit by definition, and a far key whose
logit passed it could not join the window without changing that definition.

Computed after the hybrid, from its output o_t and log normalizer L_t = log(Σ_s a_ts + b_ts) at c_t = 0: with
Σ_chosen the exact part of the chosen keys and Λ_t = exp(ℓ_t) phi_q,t · Σ_{s chosen} phi_k,s [v_s, 1] the linear
part they leave (their per-block sums, one product per chosen block),

    out_t = (exp(L_t) o_t + Σ_chosen a_ts v_s - Λ_t[:d]) / (exp(L_t) + Σ_chosen a_ts - Λ_t[d])

all taken at a common stabilizer, the largest of L_t, the chosen logits and ℓ_t - R (R as in :mod:`hybrid`).
Λ_t is a part of the hybrid's own linear sum, so the difference is a sum over the keys left, up to rounding.
With B = 32 the native CPU walk (_native/hybrid_bidirectional.cpp) computes the same within its own blocks: each
query block's chosen blocks give back their sums from its linear state and take exact scores beside its window.
Cost per query O(n / B d) for the block scores and O(K B (d + d_v) + m (d_v + 1)) for the chosen keys; memory
O(n K (B + d + d_v)) per head, so linear in n at fixed K and B.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._precision import LOG_SCALE_HEADROOM


def far_gap(window: int, block: int) -> int:
    """The least |i - j| between query block i and a key block j that every query of i sees outside its window
    (bidirectional, |s - t| >= window): |i - j| block - (block - 1) >= window."""
    return -(-(window + block - 1) // block)


def _block_means(x: torch.Tensor, keep: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of each block's kept rows (b, h, nb, e), 0 where it keeps none, and how many it keeps (b, nb).
    x (b, h, n, e); keep (b, n) bool. Contracts the positions as weights, so that x is read where it lies (the
    model's q and k are strided views, which a masked product or a pad would copy whole)."""
    b, n = keep.shape
    full = n // block
    weight = keep.to(x.dtype)
    parts = []
    if full:
        w = weight[:, : full * block].view(b, full, block)
        parts.append(torch.einsum("bjs,bhjse->bhje", w, x[:, :, : full * block].unflatten(2, (full, block))))
    if n > full * block:  # the last block, part filled
        parts.append(torch.einsum("bs,bhse->bhe", weight[:, full * block :], x[:, :, full * block :])[:, :, None])
    sums = torch.cat(parts, 2) if len(parts) > 1 else parts[0]
    count = F.pad(weight, (0, -n % block)).view(b, -1, block).sum(-1)
    return sums / count.clamp_min(1)[:, None, :, None], count


def choose_far_blocks(
    q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, linear: torch.Tensor, window: int, blocks: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks each query block chooses (module docstring): indices (b, h, nb, K') int64 and whether each
    is a real choice (b, h, nb, K') bool (False where fewer than K far blocks hold linear keys), K' = min(K, nb).
    q, k (b, h, n, d); valid, linear (b, n) bool: the real positions, and the keys that may join the linear
    part. Computed without autograd."""
    nb = -(-q.shape[2] // block)
    with torch.no_grad():
        k_mean, count = _block_means(k, linear, block)
        q_mean, _ = _block_means(q, valid, block)
        scores = q_mean @ k_mean.transpose(-1, -2)  # (b, h, nb queries, nb keys)
        index = torch.arange(nb, device=q.device)
        far = (index[:, None] - index[None, :]).abs() >= far_gap(window, block)
        allowed = far & (count > 0)[:, None, :]  # (b, nb, nb)
        # the mask as an added bias, broadcast over the heads: a broadcast masked fill runs far slower on the CPU
        bias = torch.zeros(allowed.shape, dtype=scores.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        scores += bias[:, None]
        top = scores.topk(min(blocks, nb), dim=-1)
        return top.indices, torch.isfinite(top.values)


def add_far_blocks(
    out: torch.Tensor,
    log_norm: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    gamma: torch.Tensor,
    query_log_scale: torch.Tensor,
    valid: torch.Tensor,
    linear: torch.Tensor,
    window: int,
    blocks: int,
    block: int,
    scale: float,
) -> torch.Tensor:
    """The hybrid's output with each query block's chosen far blocks scored exactly (module docstring).

    out (b, h, n, d_v) and log_norm (b, h, n, 1): the hybrid's output and log normalizer (``_hybrid_core`` with
    ``lse``); q, k, v, phi_q, phi_k, query_log_scale (b, h, n) and gamma (h,) as the hybrid took them, in the
    compute dtype; valid, linear (b, n) bool as there. Returns (b, h, n, d_v) in the compute dtype."""
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    index, chosen = choose_far_blocks(q, k, valid, linear, window, blocks, block)

    def in_blocks(x):  # (b, h, n, e) -> (b, h, nb, block, e)
        return F.pad(x, (0, 0, 0, pad)).view(b, h, nb, block, x.shape[-1])

    kk = index.shape[-1]
    # the chosen blocks of every (batch, head) row, by one index_select over the rows' blocks (advanced indexing
    # with broadcast row and head indices copies far slower on the CPU)
    rows = torch.arange(b * h, device=q.device).view(b, h, 1, 1) * nb
    flat = (rows + index).flatten()

    def pick(x):  # (b, h, nb, ...) -> the chosen blocks (b, h, nb, K', ...)
        return x.flatten(0, 2).index_select(0, flat).view(b, h, nb, kk, *x.shape[3:])

    keys = pick(in_blocks(k)).flatten(3, 4)  # (b, h, nb, K' block, d)
    values = pick(in_blocks(v)).flatten(3, 4)
    lin = F.pad(linear, (0, pad)).view(b, 1, nb, block).expand(b, h, nb, block)
    keep = (pick(lin) & chosen[..., None]).flatten(3)  # (b, h, nb, K' block)
    logits = (in_blocks(q * scale) @ keys.transpose(-1, -2)).masked_fill(~keep[:, :, :, None], float("-inf"))
    logits = logits + torch.log(gamma)[None, :, None, None, None]  # -inf where gamma is 0: no exact score
    # the linear part the chosen keys leave: the sums phi_kᵀ [v, 1] of their blocks (sinks and padding have zero
    # features there), chosen blocks only
    phi_k_linear = phi_k * linear[:, None, :, None].to(phi_k.dtype)
    sums = in_blocks(phi_k_linear).transpose(-1, -2) @ in_blocks(torch.cat([v, torch.ones_like(v[..., :1])], -1))
    left = (pick(sums) * chosen[..., None, None].to(sums.dtype)).sum(3)  # (b, h, nb, m, dv + 1)

    ell = in_blocks(query_log_scale[..., None])
    prior = in_blocks(log_norm)
    top = torch.maximum(prior, logits.amax(-1, keepdim=True))
    top = torch.maximum(top, ell - LOG_SCALE_HEADROOM)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(prior - top)  # 0 where the hybrid saw no real key
    exact = torch.exp(logits - top)
    leaving = (in_blocks(phi_q) * torch.exp(ell - top)) @ left  # (b, h, nb, block, dv + 1)
    num = in_blocks(out) * weight + exact @ values - leaving[..., :dv]
    den = weight + exact.sum(-1, keepdim=True) - leaving[..., dv:]
    num, den = num.flatten(2, 3)[:, :, :n], den.flatten(2, 3)[:, :, :n]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.zeros_like(num))
