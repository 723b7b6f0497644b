"""The Triton kernels of :mod:`_triton_hybrid`: the window and sink part of the causal hybrid, forward and backward,
and the two elementwise kernels that join it with the linear part (read the module's docstring for the algorithm).

Imported only when a call runs them, so that the library imports without Triton; only long-stable ``tl`` APIs, as in
:mod:`_triton_causal_kernels`, whose operand rounding they share.
"""

try:  # transformers' check of Hub remote code skips try blocks: a model exported with this file loads without Triton
    import triton
    import triton.language as tl
except ImportError as err:  # imported only after _triton_causal.triton_importable() said yes
    raise ImportError("the Triton kernels need triton (pip install triton)") from err

from ._triton_causal_kernels import _operand

_LENGTHS = ["n", "W"]
_HEADROOM = tl.constexpr(50.0)  # R of hybrid.py: the most the linear factor exp(ℓ - c') may reach


@triton.jit
def _frame(
    Q, K, V, VALID, SINK_POS, bh, H, n, W, c, scale, XD: tl.constexpr, XDP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, C: tl.constexpr, SP: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """What both window kernels read of query chunk c: its positions ot, queries (C, XDP); the frame's keys and
    values, chunk c - 1 (k1, v1) and chunk c (k0, v0) and the sinks (ks, vs: SP rows, at SINK_POS of the batch,
    -1 where none); the logits (scale q·k, float32) of each, and where each query sees each key exactly:
    in its window (real keys s with t - W < s <= t) or, for a sink outside it, t - s >= W."""
    ot = c * C + tl.arange(0, C)
    o1 = ot - C
    osk = tl.arange(0, SP)
    ox = tl.arange(0, XDP)
    od = tl.arange(0, DP)
    xmask = ox < XD
    dmask = od < D
    tmask = ot < n
    batch = bh // H
    row = bh * n * XD
    vrow = bh * n * D
    pos = tl.load(SINK_POS + batch * SP + osk)  # (SP,) int32, -1: no sink
    smask = pos >= 0
    q = tl.load(Q + row + ot[:, None] * XD + ox[None, :], mask=tmask[:, None] & xmask[None, :], other=0.0)
    k1 = tl.load(K + row + o1[:, None] * XD + ox[None, :], mask=(o1 >= 0)[:, None] & xmask[None, :], other=0.0)
    k0 = tl.load(K + row + ot[:, None] * XD + ox[None, :], mask=tmask[:, None] & xmask[None, :], other=0.0)
    ks = tl.load(K + row + pos[:, None] * XD + ox[None, :], mask=smask[:, None] & xmask[None, :], other=0.0)
    v1 = tl.load(V + vrow + o1[:, None] * D + od[None, :], mask=(o1 >= 0)[:, None] & dmask[None, :], other=0.0)
    v0 = tl.load(V + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
    vs = tl.load(V + vrow + pos[:, None] * D + od[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    real1 = tl.load(VALID + batch * n + o1, mask=o1 >= 0, other=0.0) > 0
    real0 = tl.load(VALID + batch * n + ot, mask=tmask, other=0.0) > 0
    qo = _operand(q.to(tl.float32), OPS)
    x1 = scale * tl.dot(qo, _operand(tl.trans(k1.to(tl.float32)), OPS), input_precision=PREC)
    x0 = scale * tl.dot(qo, _operand(tl.trans(k0.to(tl.float32)), OPS), input_precision=PREC)
    xs = scale * tl.dot(qo, _operand(tl.trans(ks.to(tl.float32)), OPS), input_precision=PREC)
    dist1 = ot[:, None] - o1[None, :]  # >= 1
    dist0 = ot[:, None] - ot[None, :]
    dists = ot[:, None] - pos[None, :]
    see1 = (dist1 < W) & real1[None, :]
    see0 = (dist0 >= 0) & (dist0 < W) & real0[None, :]
    sees = (dists >= W) & smask[None, :]
    return (
        ot, tmask, q, k1, k0, ks, v1.to(tl.float32), v0.to(tl.float32), vs.to(tl.float32), pos, smask,
        x1, x0, xs, see1, see0, sees,
    )  # fmt: skip


@triton.jit
def _window_max(x1, x0, xs, see1, see0, sees):
    """c_t: the largest logit a query sees exactly, 0 where it sees none (its window part is 0 then)."""
    top = tl.maximum(tl.max(tl.where(see1, x1, -float("inf")), 1), tl.max(tl.where(see0, x0, -float("inf")), 1))
    top = tl.maximum(top, tl.max(tl.where(sees, xs, -float("inf")), 1))
    return tl.where(top == -float("inf"), 0.0, top)


@triton.jit(do_not_specialize=_LENGTHS)
def _window_forward(
    Q, K, V, VALID, SINK_POS, A, DW, CMAX, n, H, W, scale, XD: tl.constexpr, XDP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, C: tl.constexpr, SP: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per query of chunk program_id(1): the window part relative to c_t, A = Σ e^{x - c} v (D floats) and
    Dw = Σ e^{x - c}, over the keys it sees exactly, and c_t itself. Grid (b·h, n / C)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    ot, tmask, _q, _k1, _k0, _ks, v1, v0, vs, _pos, _sm, x1, x0, xs, see1, see0, sees = _frame(
        Q, K, V, VALID, SINK_POS, bh, H, n, W, c, scale, XD, XDP, D, DP, C, SP, OPS, PREC
    )
    top = _window_max(x1, x0, xs, see1, see0, sees)
    p1 = tl.where(see1, tl.exp(x1 - top[:, None]), 0.0)
    p0 = tl.where(see0, tl.exp(x0 - top[:, None]), 0.0)
    ps = tl.where(sees, tl.exp(xs - top[:, None]), 0.0)
    acc = tl.dot(_operand(p1, OPS), _operand(v1, OPS), input_precision=PREC)
    acc += tl.dot(_operand(p0, OPS), _operand(v0, OPS), input_precision=PREC)
    acc += tl.dot(_operand(ps, OPS), _operand(vs, OPS), input_precision=PREC)
    od = tl.arange(0, DP)
    tl.store(A + bh * n * D + ot[:, None] * D + od[None, :], acc, mask=tmask[:, None] & (od < D)[None, :])
    tl.store(DW + bh * n + ot, tl.sum(p1, 1) + tl.sum(p0, 1) + tl.sum(ps, 1), mask=tmask)
    tl.store(CMAX + bh * n + ot, top, mask=tmask)


@triton.jit
def _balance(gamma, ell, top, HAS_ELL: tl.constexpr):
    """The weights of the two parts in one normalizer, per query, from gamma, ℓ and c = top: alpha = gamma e^{c - c'}
    for the exact part (relative to c), beta = e^{ℓ - c'} for the linear part, c' = max(c, ℓ - R); without ℓ (not
    read then), gamma and 1."""
    if HAS_ELL:
        shift = tl.maximum(top, ell - _HEADROOM)
        alpha = gamma * tl.exp(top - shift)
        beta = tl.exp(ell - shift)
    else:
        alpha = gamma + top * 0.0
        beta = top * 0.0 + 1.0
    return alpha, beta


@triton.jit
def _factors(GAMMA, ELL, CMAX, bh, H, n, ot, tmask, HAS_ELL: tl.constexpr):
    """:func:`_balance`'s weights for the queries ot of row bh, c_t read from CMAX."""
    gamma = tl.load(GAMMA + bh % H).to(tl.float32)
    top = tl.load(CMAX + bh * n + ot, mask=tmask, other=0.0)
    if HAS_ELL:
        ell = tl.load(ELL + bh * n + ot, mask=tmask, other=0.0).to(tl.float32)
    else:
        ell = top
    return _balance(gamma, ell, top, HAS_ELL)


@triton.jit(do_not_specialize=_LENGTHS)
def _combine(
    NUM, DEN, A, DW, CMAX, GAMMA, ELL, OUT, OUT32, TOTAL, n, H, D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr,
    HAS_ELL: tl.constexpr, HAS_OUT32: tl.constexpr,
):  # fmt: skip
    """out = (alpha A + beta N) / (alpha Dw + beta D_lin) in OUT's dtype, 0 where no key is seen, and for backward
    that denominator (TOTAL) and, for inputs narrower than float32, out in float32 (OUT32): dL/dgamma is a sum of
    differences (gn·(A - out Dw)) that out rounded to bf16 would leave several percent off. Grid (b·h, n / T)."""
    bh = tl.program_id(0).to(tl.int64)
    ot = tl.program_id(1) * T + tl.arange(0, T)
    od = tl.arange(0, DP)
    tmask = ot < n
    mask = tmask[:, None] & (od[None, :] < D)
    alpha, beta = _factors(GAMMA, ELL, CMAX, bh, H, n, ot, tmask, HAS_ELL)
    ptrs = bh * n * D + ot[:, None] * D + od[None, :]
    num = alpha[:, None] * tl.load(A + ptrs, mask=mask, other=0.0) + beta[:, None] * tl.load(
        NUM + ptrs, mask=mask, other=0.0
    )
    total = alpha * tl.load(DW + bh * n + ot, mask=tmask, other=0.0)
    total += beta * tl.load(DEN + bh * n + ot, mask=tmask, other=0.0)
    out = tl.where(total[:, None] > 0, num / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(OUT + ptrs, out.to(OUT.dtype.element_ty), mask=mask)
    if HAS_OUT32:
        tl.store(OUT32 + ptrs, out, mask=mask)
    tl.store(TOTAL + bh * n + ot, total, mask=tmask)


@triton.jit(do_not_specialize=_LENGTHS)
def _prep(
    G, OUT, TOTAL, CMAX, GAMMA, ELL, GN, GD, n, H, D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr,
    HAS_ELL: tl.constexpr,
):  # fmt: skip
    """What the linear walks read: beta dL/dout / total (in GN's dtype) and -beta (dL/dout · out) / total (float32),
    0 where nothing is seen. Grid (b·h, n / T)."""
    bh = tl.program_id(0).to(tl.int64)
    ot = tl.program_id(1) * T + tl.arange(0, T)
    od = tl.arange(0, DP)
    tmask = ot < n
    mask = tmask[:, None] & (od[None, :] < D)
    _alpha, beta = _factors(GAMMA, ELL, CMAX, bh, H, n, ot, tmask, HAS_ELL)
    total = tl.load(TOTAL + bh * n + ot, mask=tmask, other=0.0)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    ptrs = bh * n * D + ot[:, None] * D + od[None, :]
    gn = tl.load(G + ptrs, mask=mask, other=0.0).to(tl.float32) * inv[:, None]
    out = tl.load(OUT + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(GN + ptrs, (gn * beta[:, None]).to(GN.dtype.element_ty), mask=mask)
    tl.store(GD + bh * n + ot, -beta * tl.sum(gn * out, 1), mask=tmask)


@triton.jit(do_not_specialize=_LENGTHS)
def _window_backward(
    Q, K, V, VALID, SINK_POS, G, OUT, TOTAL, GAMMA, ELL, DQ, DK, DV, WG, n, H, W, scale, XD: tl.constexpr,
    XDP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, C: tl.constexpr, SP: tl.constexpr, OPS: tl.constexpr,
    PREC: tl.constexpr, HAS_ELL: tl.constexpr,
):  # fmt: skip
    """The window part's gradients for query chunk program_id(1): with a_ts = gamma e^{x_ts - c'_t} and
    dL/da_ts = gn_t·v_s + gd_t (gn = dL/dout / total, gd = -gn·out), dx = a dL/da; without ℓ, c' = c_t is the
    largest logit, which takes -Σ_s dx_ts from its key (as max's gradient does). dq = scale dx k (stored), dk =
    scale dxᵀ q and dv = aᵀ gn added to the frame's keys and the sinks (float32, atomically: two chunks and every
    chunk's sinks share them). WG_t = Σ_s dx_ts / gamma: dL/dgamma sums it, dL/dℓ_t = -gamma WG_t. Grid (b·h, n / C)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    ot, tmask, q, k1, k0, ks, v1, v0, vs, pos, smask, x1, x0, xs, see1, see0, sees = _frame(
        Q, K, V, VALID, SINK_POS, bh, H, n, W, c, scale, XD, XDP, D, DP, C, SP, OPS, PREC
    )
    top = _window_max(x1, x0, xs, see1, see0, sees)
    gamma = tl.load(GAMMA + bh % H).to(tl.float32)
    if HAS_ELL:
        ell = tl.load(ELL + bh * n + ot, mask=tmask, other=0.0).to(tl.float32)
        shift = tl.maximum(top, ell - _HEADROOM)
    else:
        shift = top
    od = tl.arange(0, DP)
    ox = tl.arange(0, XDP)
    dmask = od < D
    xmask = ox < XD
    ptrs = bh * n * D + ot[:, None] * D + od[None, :]
    mask = tmask[:, None] & dmask[None, :]
    total = tl.load(TOTAL + bh * n + ot, mask=tmask, other=0.0)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    gn = tl.load(G + ptrs, mask=mask, other=0.0).to(tl.float32) * inv[:, None]
    gd = -tl.sum(gn * tl.load(OUT + ptrs, mask=mask, other=0.0).to(tl.float32), 1)
    gno = _operand(gn, OPS)
    e1 = tl.where(see1, tl.exp(x1 - shift[:, None]), 0.0)  # a / gamma
    e0 = tl.where(see0, tl.exp(x0 - shift[:, None]), 0.0)
    es = tl.where(sees, tl.exp(xs - shift[:, None]), 0.0)
    dx1 = e1 * (tl.dot(gno, _operand(tl.trans(v1), OPS), input_precision=PREC) + gd[:, None])
    dx0 = e0 * (tl.dot(gno, _operand(tl.trans(v0), OPS), input_precision=PREC) + gd[:, None])
    dxs = es * (tl.dot(gno, _operand(tl.trans(vs), OPS), input_precision=PREC) + gd[:, None])
    # Σ_s dx_ts as gn_t·Σ_s e v_s + gd_t Σ_s e: the window sums made as forward made them (bf16 operands for bf16
    # inputs), so that the difference it is (gd = -gn·out) cancels as it does in the output; summing dx instead
    # would add up each product's rounding (several percent of dL/dgamma in bf16)
    ev = tl.dot(_operand(e1, OPS), _operand(v1, OPS), input_precision=PREC)
    ev += tl.dot(_operand(e0, OPS), _operand(v0, OPS), input_precision=PREC)
    ev += tl.dot(_operand(es, OPS), _operand(vs, OPS), input_precision=PREC)
    wg = tl.sum(gn * ev, 1) + gd * (tl.sum(e1, 1) + tl.sum(e0, 1) + tl.sum(es, 1))
    tl.store(WG + bh * n + ot, wg, mask=tmask)
    dx1 = gamma * dx1
    dx0 = gamma * dx0
    dxs = gamma * dxs
    if not HAS_ELL:  # c_t = max: its key takes -Σ_s dx_ts, shared among ties
        at1 = see1 & (x1 == top[:, None])
        at0 = see0 & (x0 == top[:, None])
        ats = sees & (xs == top[:, None])
        ties = tl.sum(at1.to(tl.float32), 1) + tl.sum(at0.to(tl.float32), 1) + tl.sum(ats.to(tl.float32), 1)
        share = -gamma * wg / tl.where(ties > 0, ties, 1.0)
        dx1 += tl.where(at1, share[:, None], 0.0)
        dx0 += tl.where(at0, share[:, None], 0.0)
        dxs += tl.where(ats, share[:, None], 0.0)
    a1 = _operand(gamma * e1, OPS)
    a0 = _operand(gamma * e0, OPS)
    as_ = _operand(gamma * es, OPS)
    dx1o = _operand(dx1, OPS)
    dx0o = _operand(dx0, OPS)
    dxso = _operand(dxs, OPS)
    dq = tl.dot(dx1o, _operand(k1.to(tl.float32), OPS), input_precision=PREC)
    dq += tl.dot(dx0o, _operand(k0.to(tl.float32), OPS), input_precision=PREC)
    dq += tl.dot(dxso, _operand(ks.to(tl.float32), OPS), input_precision=PREC)
    row = bh * n * XD
    qmask = tmask[:, None] & xmask[None, :]
    tl.store(DQ + row + ot[:, None] * XD + ox[None, :], (scale * dq).to(DQ.dtype.element_ty), mask=qmask)
    qo = _operand(q.to(tl.float32), OPS)
    o1 = ot - C
    m1 = (o1 >= 0)[:, None]
    dk1 = scale * tl.dot(_operand(tl.trans(dx1), OPS), qo, input_precision=PREC)
    dk0 = scale * tl.dot(_operand(tl.trans(dx0), OPS), qo, input_precision=PREC)
    dks = scale * tl.dot(_operand(tl.trans(dxs), OPS), qo, input_precision=PREC)
    tl.atomic_add(DK + row + o1[:, None] * XD + ox[None, :], dk1, mask=m1 & xmask[None, :])
    tl.atomic_add(DK + row + ot[:, None] * XD + ox[None, :], dk0, mask=qmask)
    tl.atomic_add(DK + row + pos[:, None] * XD + ox[None, :], dks, mask=smask[:, None] & xmask[None, :])
    vrow = bh * n * D
    dv1 = tl.dot(tl.trans(a1), gno, input_precision=PREC)
    dv0 = tl.dot(tl.trans(a0), gno, input_precision=PREC)
    dvs = tl.dot(tl.trans(as_), gno, input_precision=PREC)
    tl.atomic_add(DV + vrow + o1[:, None] * D + od[None, :], dv1, mask=m1 & dmask[None, :])
    tl.atomic_add(DV + vrow + ot[:, None] * D + od[None, :], dv0, mask=mask)
    tl.atomic_add(DV + vrow + pos[:, None] * D + od[None, :], dvs, mask=smask[:, None] & dmask[None, :])
