"""Causal FAVOR+ in the chunked form, batched over all chunks at once: a number of dispatched ops that does not
depend on the sequence length.

Why. A causal walk (the compiled CPU walk, _native) carries the state S = Σ phi(k) [v, 1]ᵀ chunk by chunk, one small
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

then back through the feature maps as in _favor_blockwise (du = dphi * phi; keys dx = s^½ du W - s x Σ_m du,
queries dx = s^½ du W: their per-row terms cancel in N / D).

Memory. Forward keeps q, k, v, the output and its denominator (n (3d + d + 1) per head) and nothing of size
(n, m) or larger; backward recomputes the features and the per-chunk prefix states P. While a call runs it holds
the feature maps (2 n m; 4 n m in backward with their gradients), the per-chunk states n / C · m · (d + 1) and the
intra-chunk scores n C. The chunk C sets the balance of the last two: C = 64 makes the per-chunk states
n m (d + 1) / 64 ≈ n m at d = 64, no more than one feature map, while the intra-chunk part stays n C = n · 64 and its
2 n C (m + d) FLOPs a quarter of the feature / state products' at m = 256; C = 32 would double the states (2 n m),
C = 128 double the intra-chunk work. Hence ``DEFAULT_CHUNK = 64`` (the native walk uses 32: it keeps one state, not one per
chunk). Total work space ≈ n (4 m + m (d + 1) / C + C) floats per head, i.e. O(n (m + d)) at C ~ d.

Precision (see _precision). Exponents, features, chunk sums, the prefix, the division and every sum are float32
whatever the inputs' dtype (float64 inputs alone work in float64, so that gradcheck means something). The products'
operands are float32 too, except for bf16 inputs on CUDA, where they are cast to bf16 just before each product
(``half_operands``) and the results come back to float32 before any sum. The output and the gradients come back in
the inputs' dtypes. The public ops run outside autocast, and so does backward here.

Bidirectional (``FavorBidirectionalChunked``): the same parts with one chunk, the whole sequence: KV = phi(K)ᵀ [V, 1],
[N, D] = phi(Q) KV, keys taken relative to the largest real key exponent of their (batch, head) (no causality to
keep), a fixed number of ops and no data-dependent branch.

Precomputed features (``feature_map="features"``): q and k are already phi_q, phi_k (b, h, n, m), nonnegative, and w is
None (scale and eps are ignored). Forward is the same from the features on (padded keys: phi_k times key_weights);
backward returns d(phi_q), d(phi_k), dv and dS_0, with no feature-map chain rule.

Keys of large norm: at offset 0 their features underflow (as in the native walk), so forward counts the positions whose
every visible key underflowed (``lost``) and favor_attention redoes such calls with :func:`favor_causal_offsets`:
the same chunked form with each position's keys taken relative to the prefix maximum of the key exponents,

    M_t = max_{s <= t} max_i u_s,i        (u the keys' exponents; at least the initial state's level, see below)
    intra        A_c[t, s] = phi_q(t)·phi_k(s) exp(M_s - M_t),   s <= t                one batched product
    chunk sums   U_c = Σ_{s in c} exp(M_s - E_c) phi_k(s) [v_s, 1]ᵀ,  E_c = M at chunk c's end
    states       S_c = Σ_{j <= c} exp(E_{j-1} - E_{c-1}) U_{j-1}   (U_{-1} = S_0 at E_{-1}, its level)
                 = L @ [S_0, U_0, .., U_{nc-1}] with L (nc + 1) x (nc + 1) lower triangular, entries <= 1: one GEMM
    output       [N, D]_t = A_c V_c + exp(E_{c-1} - M_t) phi_q(t) S_c

so every factor is at most 1 (M is non-decreasing) and nothing reads past t. The offsets cancel in N / D; row nc of
L @ [...] is the final state, relative to E_{nc-1}, the last M. Plain autograd (the rare path).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._precision import outside_autocast
from .feature_maps import favor_exponents, random_feature_map

DEFAULT_CHUNK = 64  # see the module docstring: per-chunk states n m (d + 1) / C ≈ n m at C = 64, d = 64
_TINY = 1e-30


def _features(x, w, scale, feature_map, eps, *, is_query, key_weights=None):
    """phi(x) (b, h, n, m) in w's dtype: the maps of :mod:`feature_maps`; padded keys (key_weights == 0) get exponent
    -inf before the exp (softmax) or features 0 (relu)."""
    mask = None if key_weights is None or is_query else key_weights[:, 0, :, 0] > 0
    phi = random_feature_map(
        x, w, is_query=is_query, feature_map=feature_map, scale=scale, eps=eps, key_padding_mask=mask
    )
    return phi.to(w.dtype)


def _pad(x, pad):
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _chunked(x, c):
    """(b, h, nc c, f) -> (b, h, nc, c, f), a view."""
    return x.unflatten(2, (-1, c))


def _prepare(q, k, v, w, key_weights, feature_map, scale, eps, c, pad, work):
    """Chunked phi(q), phi(k) (padded keys zeroed) and V = [v, 1] (padded rows 0) in ``work`` (float32, or float64),
    (b, h, nc, c, .). ``feature_map="features"``: q and k are the features already."""
    if feature_map == "features":
        pq = q.to(work)
        pk = (
            k.to(work) if key_weights is None else k.to(work) * key_weights
        )  # a new tensor: the caller's features stay as given
    else:
        pq = _features(q, w, scale, feature_map, eps, is_query=True)
        pk = _features(k, w, scale, feature_map, eps, is_query=False, key_weights=key_weights)
    vf = v.to(work)
    va = torch.cat([vf, torch.ones_like(vf[..., :1])], -1)
    if key_weights is not None:
        va = va.mul_(key_weights)
    return _chunked(_pad(pq, pad), c), _chunked(_pad(pk, pad), c), _chunked(_pad(va, pad), c)


def _prefix_states(pk, va, s0, mm=torch.matmul):
    """P_c = S_0 + Σ_{c' <= c} Phi_K,c'ᵀ V_c' for every chunk, (b, h, nc, m, d + 1): one GEMM and one cumsum."""
    prefix = mm(pk.transpose(-1, -2), va).cumsum_(2)
    if s0 is not None:
        prefix = prefix.add_(s0.unsqueeze(2))
    return prefix


def _lost_positions(den, key_weights):
    """Positions (over batch and heads) that see a real key yet have a denominator of 0 (every visible key
    underflowed at offset 0). A 0-dim tensor: no host sync here."""
    lost = den <= _TINY
    if key_weights is not None:
        lost = lost & (key_weights.cumsum(2) > 0)
    return lost.sum()


class FavorCausalChunked(torch.autograd.Function):
    """Causal FAVOR+ over all chunks at once (see the module docstring). Inputs: q, k, v (b, h, n, d) any float
    dtype; w (m, d) float32; key_weights (b, 1, n, 1) float or None; the feature map ("softmax", "relu", or
    "features": q and k are then the features phi_q, phi_k (b, h, n, m), nonnegative, w None, scale and eps ignored),
    scale, eps, chunk C; s0 (b, h, m, d + 1) float32, the initial state [S, z] at offset 0, or None. Returns (out in v's dtype,
    S (b, h, m, d), z (b, h, m), lost): the final state at offset 0 and the lost count are not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, w, key_weights, feature_map, scale, eps, chunk, s0, operands=None):
        n, d = v.shape[2:]
        work = _work_dtype(q, k, v, feature_map)
        mm = _Products(operands, work)
        w = w if w is None else w.to(work)
        key_weights = None if key_weights is None else key_weights.to(work)
        ctx.s0_dtype = None if s0 is None else s0.dtype
        s0 = None if s0 is None else s0.to(work)
        c = min(chunk, n)
        pad = (-n) % c
        pq, pk, va = _prepare(q, k, v, w, key_weights, feature_map, scale, eps, c, pad, work)
        prefix = _prefix_states(pk, va, s0, mm)
        scores = mm(pq, pk.transpose(-1, -2)).tril_()  # (b, h, nc, c, c)
        num = mm(scores, va)  # (b, h, nc, c, d + 1)
        del scores
        if num.shape[2] > 1:  # the state before chunk c is P_{c-1}
            num[:, :, 1:] += mm(pq[:, :, 1:], prefix[:, :, :-1])
        if s0 is not None:
            num[:, :, 0] += mm(pq[:, :, 0], s0)
        num = num.flatten(2, 3)[:, :, :n]
        den = num[..., d:].clamp_min(_TINY)
        out = num[..., :d] / den
        lost = _lost_positions(den, key_weights)
        final = prefix[:, :, -1]
        state_s, state_z = final[..., :d].contiguous(), final[..., d].contiguous()
        ctx.settings = (feature_map, scale, eps, c, pad, operands)
        ctx.save_for_backward(q, k, v, w, key_weights, out, den, s0)
        ctx.mark_non_differentiable(state_s, state_z, lost)
        return out.to(v.dtype), state_s, state_z, lost

    @staticmethod
    @once_differentiable
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g, _gs, _gz, _lost):
        q, k, v, w, key_weights, out, den, s0 = ctx.saved_tensors
        feature_map, scale, eps, c, pad, operands = ctx.settings
        d = v.shape[-1]
        work = out.dtype
        mm = _Products(operands, work)
        pq, pk, va = _prepare(q, k, v, w, key_weights, feature_map, scale, eps, c, pad, work)
        prefix = _prefix_states(pk, va, s0, mm)
        inv = torch.where(den > _TINY, den.reciprocal(), torch.zeros_like(den))  # rows with no real key: no gradient
        gf = g.to(work) * inv
        ga = _chunked(_pad(torch.cat([gf, -(gf * out).sum(-1, keepdim=True)], -1), pad), c)  # dL/d[N, D]
        nc = ga.shape[2]
        d_scores = mm(ga, va.transpose(-1, -2)).tril_()  # (b, h, nc, c, c)
        d_pq = mm(d_scores, pk)
        d_pk = mm(d_scores.transpose(-1, -2), pq)
        del d_scores
        d_prefix = mm(pq.transpose(-1, -2), ga)  # dP: gradient of the state each chunk reads
        d_s0 = d_prefix.sum(2).to(ctx.s0_dtype) if s0 is not None and ctx.needs_input_grad[9] else None
        scores = mm(pq, pk.transpose(-1, -2)).tril_()
        d_va = mm(scores.transpose(-1, -2), ga)
        del scores
        if nc > 1:
            d_pq[:, :, 1:] += mm(ga[:, :, 1:], prefix[:, :, :-1].transpose(-1, -2))
            # R_c = Σ_{c' > c} dP_c': the sum of chunk c reaches every later chunk's state
            later = d_prefix[:, :, 1:].flip(2).cumsum_(2).flip(2)  # R_0 .. R_{nc-2}
            d_pk[:, :, :-1] += mm(va[:, :, :-1], later.transpose(-1, -2))
            d_va[:, :, :-1] += mm(pk[:, :, :-1], later)
            del later
        del d_prefix, prefix
        if s0 is not None:
            d_pq[:, :, 0] += mm(ga[:, :, 0], s0.transpose(-1, -2))
        n = v.shape[2]
        d_pq, d_pk, pq, pk = (x.flatten(2, 3)[:, :, :n] for x in (d_pq, d_pk, pq, pk))
        d_va = d_va.flatten(2, 3)[:, :, :n]
        dv = d_va[..., :d] if key_weights is None else d_va[..., :d] * key_weights
        dq, dk = _through_features(d_pq, d_pk, pq, pk, q, k, w, key_weights, feature_map, scale, eps, mm)
        return dq, dk, dv.to(v.dtype), None, None, None, None, None, None, d_s0, None


class _Products:
    """The large products of one call: operands in ``operands`` (a half dtype: bf16 / fp16 inputs on CUDA, see
    _precision) or as they are (None), results in the working dtype, float32, where sums and divisions happen."""

    def __init__(self, operands, work):
        self.operands, self.work = operands, work

    def __call__(self, a, b):
        if self.operands is None:
            return torch.matmul(a, b)
        return torch.matmul(a.to(self.operands), b.to(self.operands)).to(self.work)


def half_operands(v: torch.Tensor) -> torch.dtype | None:
    """The operand dtype of the chunked backends' products for inputs like v: bf16 for bf16 inputs on CUDA (tensor
    cores; exponents, sums and denominators stay float32), None (the working dtype) otherwise. Not fp16: backward's
    g / D reaches 1e5 and more where a query's denominator is small, past fp16's largest value (65504), while bf16
    has float32's range. Not on the CPU: without bf16 GEMM units it would only lose time and precision."""
    return torch.bfloat16 if v.dtype == torch.bfloat16 and v.device.type == "cuda" else None


def _through_features(d_pq, d_pk, pq, pk, q, k, w, key_weights, feature_map, scale, eps, mm=torch.matmul):
    """dL/dq, dL/dk from the gradients of the features (overwritten), in q's and k's dtypes. "features": the
    features were the inputs (padded keys entered as phi_k key_weights). Through the softmax map phi = exp(u + const),
    du = dphi phi and dx = s^½ du W, less s x Σ_m du for keys (their -|x'|²/2); relu: du = dphi where u > 0."""
    if feature_map == "features":
        d_pk = d_pk if key_weights is None else d_pk.mul_(key_weights)
        return d_pq.to(q.dtype), d_pk.to(k.dtype)
    if feature_map == "relu":  # padded keys have phi = 0 here: no gradient
        du_q, du_k = d_pq.mul_(pq > eps), d_pk.mul_(pk > eps)
    else:
        du_q, du_k = d_pq.mul_(pq), d_pk.mul_(pk)
    ws = w * math.sqrt(scale)
    dq = mm(du_q, ws)
    dk = mm(du_k, ws)
    if feature_map != "relu":
        dk = dk.sub_(k.to(w.dtype) * du_k.sum(-1, keepdim=True), alpha=scale)
    return dq.to(q.dtype), dk.to(k.dtype)


def _work_dtype(q, k, v, feature_map):
    """float32, float64 for float64 inputs (gradcheck); for given features their dtype counts too."""
    work = torch.promote_types(v.dtype, torch.float32)
    return torch.promote_types(work, torch.promote_types(q.dtype, k.dtype)) if feature_map == "features" else work


def _bidirectional_features(q, k, v, w, key_weights, feature_map, scale, eps, work, top=None):
    """phi(q), phi(k) (padded keys 0) and [v, 1] (padded rows 0) over the whole sequence, and the key offset: for
    the softmax map, keys are taken relative to the largest real key exponent of their (batch, head), a constant
    that cancels in N / D (keys of large norm would underflow at offset 0; no causality to keep here)."""
    if feature_map == "features":  # queries and keys may differ in length here: no chunking of either
        pq = q.to(work)
        pk = k.to(work) if key_weights is None else k.to(work) * key_weights
    elif feature_map == "relu":
        pq = _features(q, w, scale, feature_map, eps, is_query=True)
        pk = _features(k, w, scale, feature_map, eps, is_query=False, key_weights=key_weights)
    else:
        pq = _features(q, w, scale, feature_map, eps, is_query=True)
        u = _key_exponents(k, w, scale)
        if key_weights is not None:
            u = u.masked_fill_(key_weights == 0, -math.inf)
        if top is None:
            top = u.amax(dim=(-1, -2), keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # no real key: offset 0
        pk = u.sub_(top).exp_()
    vf = v.to(work)
    va = torch.cat([vf, torch.ones_like(vf[..., :1])], -1)
    if key_weights is not None:
        va = va.mul_(key_weights)
    return pq, pk, va, top


class FavorBidirectionalChunked(torch.autograd.Function):
    """Bidirectional FAVOR+ (or linear attention of given features, feature map "features") in whole-sequence batched
    products: KV = phi(K)ᵀ [V, 1], [N, D] = phi(Q) KV, a fixed number of ops at any length and no data-dependent
    branch (torch.compile traces it whole). Forward keeps q, k, v, the output, its denominator and the key offset;
    backward recomputes the features: dKV = phi(Q)ᵀ g_aug, dphi(Q) = g_aug KVᵀ, dphi(K) = [V, 1] dKVᵀ,
    dV = phi(K) dKV. Holds the feature maps (n m per head) while it runs, where the blockwise kernel of
    _favor_blockwise holds one block of them. Same inputs as FavorCausalChunked, without chunk and s0."""

    @staticmethod
    def forward(ctx, q, k, v, w, key_weights, feature_map, scale, eps, operands=None):
        d = v.shape[-1]
        work = _work_dtype(q, k, v, feature_map)
        mm = _Products(operands, work)
        w = w if w is None else w.to(work)
        key_weights = None if key_weights is None else key_weights.to(work)
        pq, pk, va, top = _bidirectional_features(q, k, v, w, key_weights, feature_map, scale, eps, work)
        num = mm(pq, mm(pk.transpose(-1, -2), va))
        den = num[..., d:].clamp_min(_TINY)
        out = num[..., :d] / den
        ctx.settings = (feature_map, scale, eps, operands)
        ctx.save_for_backward(q, k, v, w, key_weights, out, den, top)
        return out.to(v.dtype)

    @staticmethod
    @once_differentiable
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g):
        q, k, v, w, key_weights, out, den, top = ctx.saved_tensors
        feature_map, scale, eps, operands = ctx.settings
        d = v.shape[-1]
        mm = _Products(operands, out.dtype)
        pq, pk, va, _ = _bidirectional_features(q, k, v, w, key_weights, feature_map, scale, eps, out.dtype, top)
        kv = mm(pk.transpose(-1, -2), va)
        inv = torch.where(den > _TINY, den.reciprocal(), torch.zeros_like(den))  # rows with no real key: no gradient
        gf = g.to(out.dtype) * inv
        ga = torch.cat([gf, -(gf * out).sum(-1, keepdim=True)], -1)  # dL/d[N, D]
        d_kv = mm(pq.transpose(-1, -2), ga)
        d_pq = mm(ga, kv.transpose(-1, -2))
        d_pk = mm(va, d_kv.transpose(-1, -2))
        dv = mm(pk, d_kv[..., :d])
        dv = dv if key_weights is None else dv.mul_(key_weights)
        dq, dk = _through_features(d_pq, d_pk, pq, pk, q, k, w, key_weights, feature_map, scale, eps, mm)
        return dq, dk, dv.to(v.dtype), None, None, None, None, None, None


_NOTHING = -1e30  # the offset of a (batch, head) that has seen no real key yet (as favor._NOTHING)
_MAX_CHUNKS = 128  # favor_causal_offsets keeps nc <= 128 chunks: see offsets_chunk


def offsets_chunk(n: int, chunk: int | None = None) -> int:
    """The chunk favor_causal_offsets takes at length n: ``chunk`` (DEFAULT_CHUNK when None), raised to
    ceil(n / 128) rounded up to a multiple of 16 where that is larger, so that there are at most 128 chunks.

    Why. Next to the work every chunk size shares (the feature maps, 2 n m d multiply-adds, the chunk sums and the
    inter-chunk output, n m (d + 1) each), the offsets pay the intra-chunk products, n C (m + d), and the states: one
    (nc + 1) x (nc + 1) by (nc + 1) x m (d + 1) product, ~(n / C)² m d. Their sum is least at C³ ≈ 2 n m d / (m + d),
    C ≈ 75 at n = 4096 and 119 at n = 16384 (m = 256, d = 64), so C = 64 up to n = 8192, ceil(n / 128) beyond. With
    nc <= 128 the states cost at most 128² m d: 2 n m d at n = 8192, one feature map's GEMM (n m d) at n = 16384 and
    less beyond, while the intra-chunk part n C (m + d) stays ~2.5 n m d at n = 16384 (C = 128). Multiples of 16 keep
    the GEMM tiles whole. Any chunk gives the same result up to rounding; the op count depends on none of this."""
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    floor = -(-n // _MAX_CHUNKS)
    return -(-floor // 16) * 16 if floor > chunk else chunk


def _key_exponents(x, w, scale, *, is_query=False):
    """The softmax features' exponents (b, h, n, m) in w's dtype: :func:`feature_maps.favor_exponents`."""
    return favor_exponents(x, w, is_query=is_query, scale=scale).to(w.dtype)


def _decay(levels):
    """exp(levels[j] - levels[i]) for j <= i, 0 above the diagonal, (..., L, L) from non-decreasing levels (..., L):
    entries in [0, 1]; the upper triangle is set to -inf before the exp, so nothing overflows."""
    size = levels.shape[-1]
    upper = torch.ones(size, size, dtype=torch.bool, device=levels.device).triu_(1)
    return (levels[..., None, :] - levels[..., :, None]).masked_fill_(upper, -math.inf).exp_()


def favor_causal_offsets(q, k, v, w, key_weights, scale, chunk=None, initial_state=None):
    """Causal FAVOR+ (softmax feature map) with each position's keys taken relative to the prefix maximum M_t of the key
    exponents, for keys of large norm whose features underflow at offset 0 and for continued prefills: the math of
    favor._causal_stabilized, batched over all chunks (see the module docstring), so the number of dispatched ops
    does not depend on n. Every factor exp(.) taken is at most 1, and M_t reads nothing past t.

    Args: q, k, v (b, h, n, d) of one float dtype; w (m, d) the random features; key_weights (b, 1, n, 1) float
    (1 real, 0 padded) or None; scale; chunk C (None: DEFAULT_CHUNK), raised by :func:`offsets_chunk` so there are at
    most 128 chunks; initial_state (S (b, h, m, d), z (b, h, m), M (b, h)) or None: the true sums are exp(M) S and
    exp(M) z; it enters at its level log max z + M (an empty state, z = 0, counts as none), which every M_t is then at
    least.

    Computes in float32 (float64 for float64 v), plain autograd: gradients reach q, k, v and S, z (and M) of the
    initial state. A position that sees no real key (and no state) outputs 0 and passes no gradient. Returns
    (out in v's dtype, (S, z, M)): the final state relative to its offset M (b, h) = the last M_t (0 when nothing was
    seen), in the working dtype, still attached to the graph (detach it to keep it as a decoding state)."""
    b, h, n, d = v.shape
    work = torch.promote_types(v.dtype, torch.float32)
    w = w.to(device=v.device, dtype=work)
    m = w.shape[0]
    c = min(offsets_chunk(n, chunk), n)
    pad = (-n) % c
    nc = (n + pad) // c

    u = _key_exponents(k, w, scale)  # (b, h, n, m), <= 0
    va = torch.cat([v.to(work), torch.ones_like(v[..., :1], dtype=work)], -1)  # [v, 1]: N and D from one product
    if key_weights is not None:
        key_weights = key_weights.to(work)
        u = u.masked_fill(key_weights == 0, -math.inf)  # before the exp: a padded key may sit far above the real ones
        va = va * key_weights
    top = torch.cummax(u.detach().amax(-1), dim=-1).values  # M_t (b, h, n), -inf before the first real key
    if initial_state is None:
        start = top.new_full((b, h), _NOTHING)
        s_init = va.new_zeros(b, h, m, d + 1)
    else:
        s0, z0, m0 = (t.to(device=v.device, dtype=work) for t in initial_state)
        level = m0.detach() + torch.log(z0.detach().amax(-1))  # log of the state's largest entry; -inf: empty
        known = torch.isfinite(level)
        top = torch.maximum(top, level[..., None])
        start = torch.where(known, level, torch.full_like(level, _NOTHING))
        factor = torch.where(known, torch.exp(m0 - start), torch.zeros_like(level))  # <= 1 (max z e^{M - level} = 1)
        s_init = torch.cat([s0, z0[..., None]], -1) * factor[..., None, None]  # relative to E_{-1} = start
    top = top.clamp_min(_NOTHING)  # -inf -> _NOTHING: differences stay finite (and 0 between two such)
    phi_k = torch.exp(u - top[..., None])  # <= 1; 0 for padded keys
    uq = _key_exponents(q, w, scale, is_query=True)
    phi_q = torch.exp(uq - uq.amax(-1, keepdim=True).detach())  # per-row maximum off: cancels in N / D

    if pad:  # the last chunk's padded rows: keys and V 0, their M the last M (so E of the last chunk is M_{n-1})
        top = torch.cat([top, top[..., -1:].expand(b, h, pad)], -1)
    tc = top.unflatten(-1, (nc, c))  # (b, h, nc, c)
    pq, pk, vc = (_chunked(_pad(x, pad), c) for x in (phi_q, phi_k, va))
    ends = tc[..., -1]  # E_c (b, h, nc)

    # intra-chunk: phi_q(t)·phi_k(s) exp(M_s - M_t), s <= t
    scores = torch.matmul(pq, pk.transpose(-1, -2)) * _decay(tc)
    num = torch.matmul(scores, vc)  # (b, h, nc, c, d + 1)
    # chunk sums relative to E_c, then every state S_c relative to E_{c-1} (row nc: the final state) in one GEMM
    sums = torch.matmul((pk * torch.exp(tc - ends[..., None])[..., None]).transpose(-1, -2), vc)  # (b, h, nc, m, d+1)
    levels = torch.cat([start[..., None], ends], -1)  # E_{-1}, E_0, .., E_{nc-1}
    stacked = torch.cat([s_init[:, :, None], sums], 2).flatten(-2)  # (b, h, nc + 1, m (d + 1))
    states = torch.matmul(_decay(levels), stacked).unflatten(-1, (m, d + 1))
    # inter-chunk: exp(E_{c-1} - M_t) phi_q(t) S_c
    before = torch.exp(levels[..., :-1, None] - tc)[..., None]  # (b, h, nc, c, 1), <= 1
    num = num + before * torch.matmul(pq, states[:, :, :-1])
    num = num.flatten(2, 3)[:, :, :n]
    den = num[..., d:]
    seen = den > _TINY
    out = torch.where(seen, num[..., :d] / torch.where(seen, den, torch.ones_like(den)), torch.zeros_like(den))
    final = states[:, :, -1]
    offset = ends[..., -1]
    offset = torch.where(offset > _NOTHING, offset, torch.zeros_like(offset))  # 0: nothing seen yet
    return out.to(v.dtype), (final[..., :d], final[..., d], offset)
