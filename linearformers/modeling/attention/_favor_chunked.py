"""Causal FAVOR+ in the chunked form, batched over all chunks at once: a number of dispatched ops that does not
depend on the sequence length.

Why. The causal walk (_favor_autograd.FavorCausal) carries the state S = Σ phi(k) [v, 1]ᵀ chunk by chunk, one small
op group per chunk: on a GPU each op is a kernel launch, so at n = 16384 forward + backward launch ~17,000 of them.
Here every step is one op over all chunks at once; the count is the same at n = 2,048 and n = 16,384.

Algorithm. Positions are cut into nc = ceil(n / C) chunks of C (the last one padded with zero rows, which only
padded queries could see and whose rows are dropped). With phi_q, phi_k the feature maps of :mod:`favor`
(softmax: keys exp(-|w - k'|²/2) at offset 0, queries with their per-row maximum taken off; relu: ReLU(W x') + eps),
V_c = [v, 1] for chunk c (padded keys: exponent -inf before the exp, features and V rows 0), and S_0 the initial
state (0 unless continuing a prefill):

    features     Phi_Q = phi_q(Q),  Phi_K = phi_k(K)                          one GEMM + exp each, (b, h, n, m)
    chunk sums   K_c = Phi_K,cᵀ V_c                                           one batched GEMM, (b, h, nc, m, d+1)
    prefix       P_c = S_0 + Σ_{c' <= c} K_c'                                  one cumsum over chunks (in place)
    intra        A_c = tril(Phi_Q,c Phi_K,cᵀ)                                 one batched GEMM, (b, h, nc, C, C)
    output       [N, D]_c = A_c V_c + Phi_Q,c P_{c-1}      (P_{-1} = S_0)     two batched GEMMs
                 out = N / D

The denominator D rides as the last column of [v, 1], so numerator and denominator come from the same GEMMs.
Backward, with g_aug = [g / D, -(g · out) / D] = dL/d[N, D]:

    dA_c = tril(g_aug,c V_cᵀ)
    dPhi_Q,c = dA_c Phi_K,c + g_aug,c P_{c-1}ᵀ
    dP_c = Phi_Q,cᵀ g_aug,c          (the gradient of the state seen by chunk c),   dS_0 = Σ_c dP_c
    R_c = Σ_{c' > c} dP_c'           (a reverse cumsum over chunks: the gradient of chunk c's sum K_c)
    dPhi_K,c = dA_cᵀ Phi_Q,c + V_c R_cᵀ,    dV_c = A_cᵀ g_aug,c + Phi_K,c R_c

then back through the feature maps as in _favor_autograd (du = dphi * phi; keys dx = s^½ du W - s x Σ_m du,
queries dx = s^½ du W: their per-row terms cancel in N / D).

Memory. Forward keeps q, k, v, the output and its denominator (n (3d + d + 1) per head) and nothing of size
(n, m) or larger; backward recomputes the features and the per-chunk prefix states P. While a call runs it holds
the feature maps (2 n m; 4 n m in backward with their gradients), the per-chunk states n / C · m · (d + 1) and the
intra-chunk scores n C. The chunk C sets the balance of the last two: C = 64 makes the per-chunk states
n m (d + 1) / 64 ≈ n m at d = 64, no more than one feature map, while the intra-chunk part stays n C = n · 64 and its
2 n C (m + d) FLOPs a quarter of the feature / state products' at m = 256; C = 32 would double the states (2 n m),
C = 128 double the intra-chunk work. Hence ``DEFAULT_CHUNK = 64`` (the walk uses 32: it keeps one state, not one per
chunk). Total work space ≈ n (4 m + m (d + 1) / C + C) floats per head, i.e. O(n (m + d)) at C ~ d.

Precision. Features, chunk sums, the prefix, the intra-chunk products, the division and every gradient are float32
whatever the inputs' dtype (bf16 / fp16 inputs are cast on entry; float64 inputs alone work in float64, so that
gradcheck means something); the output and the gradients come back in the inputs' dtypes. The public op (favor_attention) runs outside autocast, and so does backward here.

Keys of large norm: at offset 0 their features underflow (as in the walk), so forward counts the positions whose
every visible key underflowed (``lost``) and favor_attention redoes such calls with per-position offsets.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._precision import outside_autocast

DEFAULT_CHUNK = 64  # see the module docstring: per-chunk states n m (d + 1) / C ≈ n m at C = 64, d = 64
_TINY = 1e-30


def _features(x, w, scale, kernel, eps, *, is_query, keep=None):
    """phi(x) (b, h, n, m) in w's dtype, the same formula as favor.favor_features / favor._exponents; padded keys
    (keep == 0) get exponent -inf before the exp (softmax) or features 0 (relu)."""
    xs = x.to(w.dtype) * math.sqrt(scale)
    u = torch.matmul(xs, w.T)
    if kernel == "relu":
        phi = torch.relu(u).add_(eps)
        return phi if keep is None or is_query else phi.mul_(keep)
    u = u.sub_(0.5 * xs.pow(2).sum(-1, keepdim=True))
    half_w_sq = 0.5 * w.pow(2).sum(-1)
    if is_query:
        u = u.add_(half_w_sq)
        return u.sub_(u.amax(dim=-1, keepdim=True)).exp_()
    u = u.sub_(half_w_sq)
    if keep is not None:  # before exp: a padded key may sit far above the real ones (inf x 0 = NaN after)
        u = u.masked_fill_(keep == 0, -math.inf)
    return u.exp_()


def _pad(x, pad):
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _chunked(x, c):
    """(b, h, nc c, f) -> (b, h, nc, c, f), a view."""
    return x.unflatten(2, (-1, c))


def _prepare(q, k, v, w, keep, kernel, scale, eps, c, pad):
    """Chunked phi(q), phi(k) (padded keys zeroed) and V = [v, 1] (padded rows 0), float32, (b, h, nc, c, .)."""
    pq = _features(q, w, scale, kernel, eps, is_query=True)
    pk = _features(k, w, scale, kernel, eps, is_query=False, keep=keep)
    vf = v.to(w.dtype)
    va = torch.cat([vf, torch.ones_like(vf[..., :1])], -1)
    if keep is not None:
        va = va.mul_(keep)
    return _chunked(_pad(pq, pad), c), _chunked(_pad(pk, pad), c), _chunked(_pad(va, pad), c)


def _prefix_states(pk, va, s0):
    """P_c = S_0 + Σ_{c' <= c} Phi_K,c'ᵀ V_c' for every chunk, (b, h, nc, m, d + 1): one GEMM and one cumsum."""
    prefix = torch.matmul(pk.transpose(-1, -2), va).cumsum_(2)
    if s0 is not None:
        prefix = prefix.add_(s0.unsqueeze(2))
    return prefix


def _lost_positions(den, keep):
    """Positions (over batch and heads) that see a real key yet have a denominator of 0 (every visible key
    underflowed at offset 0). A 0-dim tensor: no host sync here."""
    lost = den <= _TINY
    if keep is not None:
        lost = lost & (keep.cumsum(2) > 0)
    return lost.sum()


class FavorCausalChunked(torch.autograd.Function):
    """Causal FAVOR+ over all chunks at once (see the module docstring). Inputs: q, k, v (b, h, n, d) any float
    dtype; w (m, d) float32; keep (b, 1, n, 1) float or None; the kernel, scale, eps, chunk C; s0 (b, h, m, d + 1)
    float32, the initial state [S, z] at offset 0, or None. Returns (out in v's dtype, S (b, h, m, d), z (b, h, m),
    lost): the final state at offset 0 and the lost count are not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, w, keep, kernel, scale, eps, chunk, s0):
        n, d = v.shape[2:]
        work = torch.promote_types(v.dtype, torch.float32)  # float32, float64 for float64 inputs (gradcheck)
        w, keep = w.to(work), None if keep is None else keep.to(work)
        ctx.s0_dtype = None if s0 is None else s0.dtype
        s0 = None if s0 is None else s0.to(work)
        c = min(chunk, n)
        pad = (-n) % c
        pq, pk, va = _prepare(q, k, v, w, keep, kernel, scale, eps, c, pad)
        prefix = _prefix_states(pk, va, s0)
        scores = torch.matmul(pq, pk.transpose(-1, -2)).tril_()  # (b, h, nc, c, c)
        num = torch.matmul(scores, va)  # (b, h, nc, c, d + 1)
        del scores
        if num.shape[2] > 1:  # the state before chunk c is P_{c-1}
            num[:, :, 1:] += torch.matmul(pq[:, :, 1:], prefix[:, :, :-1])
        if s0 is not None:
            num[:, :, 0] += torch.matmul(pq[:, :, 0], s0)
        num = num.flatten(2, 3)[:, :, :n]
        den = num[..., d:].clamp_min(_TINY)
        out = num[..., :d] / den
        lost = _lost_positions(den, keep)
        final = prefix[:, :, -1]
        state_s, state_z = final[..., :d].contiguous(), final[..., d].contiguous()
        ctx.settings = (kernel, scale, eps, c, pad)
        ctx.save_for_backward(q, k, v, w, keep, out, den, s0)
        ctx.mark_non_differentiable(state_s, state_z, lost)
        return out.to(v.dtype), state_s, state_z, lost

    @staticmethod
    @once_differentiable
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g, _gs, _gz, _lost):
        q, k, v, w, keep, out, den, s0 = ctx.saved_tensors
        kernel, scale, eps, c, pad = ctx.settings
        d = v.shape[-1]
        pq, pk, va = _prepare(q, k, v, w, keep, kernel, scale, eps, c, pad)
        prefix = _prefix_states(pk, va, s0)
        inv = torch.where(den > _TINY, den.reciprocal(), torch.zeros_like(den))  # rows with no real key: no gradient
        gf = g.to(w.dtype) * inv
        ga = _chunked(_pad(torch.cat([gf, -(gf * out).sum(-1, keepdim=True)], -1), pad), c)  # dL/d[N, D]
        nc = ga.shape[2]
        d_scores = torch.matmul(ga, va.transpose(-1, -2)).tril_()  # (b, h, nc, c, c)
        d_pq = torch.matmul(d_scores, pk)
        d_pk = torch.matmul(d_scores.transpose(-1, -2), pq)
        del d_scores
        d_prefix = torch.matmul(pq.transpose(-1, -2), ga)  # dP: gradient of the state each chunk reads
        d_s0 = d_prefix.sum(2).to(ctx.s0_dtype) if s0 is not None and ctx.needs_input_grad[9] else None
        scores = torch.matmul(pq, pk.transpose(-1, -2)).tril_()
        d_va = torch.matmul(scores.transpose(-1, -2), ga)
        del scores
        if nc > 1:
            d_pq[:, :, 1:] += torch.matmul(ga[:, :, 1:], prefix[:, :, :-1].transpose(-1, -2))
            # R_c = Σ_{c' > c} dP_c': the sum of chunk c reaches every later chunk's state
            later = d_prefix[:, :, 1:].flip(2).cumsum_(2).flip(2)  # R_0 .. R_{nc-2}
            d_pk[:, :, :-1] += torch.matmul(va[:, :, :-1], later.transpose(-1, -2))
            d_va[:, :, :-1] += torch.matmul(pk[:, :, :-1], later)
            del later
        del d_prefix, prefix
        if s0 is not None:
            d_pq[:, :, 0] += torch.matmul(ga[:, :, 0], s0.transpose(-1, -2))
        n = v.shape[2]
        d_pq, d_pk, pq, pk = (x.flatten(2, 3)[:, :, :n] for x in (d_pq, d_pk, pq, pk))
        d_va = d_va.flatten(2, 3)[:, :, :n]
        dv = d_va[..., :d] if keep is None else d_va[..., :d] * keep
        root = math.sqrt(scale)
        if kernel == "relu":  # phi = ReLU(u) + eps: du = dphi where u > 0 (padded keys have phi = 0 here)
            du_q, du_k = d_pq.mul_(pq > eps), d_pk.mul_(pk > eps)
        else:  # phi = exp(u): du = dphi * phi
            du_q, du_k = d_pq.mul_(pq), d_pk.mul_(pk)
        ws = w * root
        dq = torch.matmul(du_q, ws)
        dk = torch.matmul(du_k, ws)
        if kernel != "relu":  # the key exponent's -|x'|²/2: d/dx = -s x per unit of Σ_m du
            dk = dk.sub_(k.to(w.dtype) * du_k.sum(-1, keepdim=True), alpha=scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, d_s0
