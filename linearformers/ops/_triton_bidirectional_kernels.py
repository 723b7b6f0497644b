"""The Triton kernels of :mod:`_triton_bidirectional` (read its docstring for the algorithm, the grid and the
precision).

Imported only when a call runs them, so that the library imports without Triton. Only long-stable ``tl`` APIs, as
in :mod:`_triton_causal_kernels`, whose exponent, operand, key-weight, feature-gradient and input-gradient helpers these
kernels share (and whose ``_offsets`` kernel the launcher runs).
"""

try:  # transformers' check of Hub remote code skips try blocks: a model exported with this file loads without Triton
    import triton
    import triton.language as tl
except ImportError as err:  # imported only after _triton_causal.triton_importable() said yes
    raise ImportError("the Triton kernels need triton (pip install triton)") from err

from ._triton_causal_kernels import _add_input_grad, _exponents, _feature_grad, _key_weights, _operand


@triton.jit
def _phi(
    X,
    W,
    row,
    ot,
    live,
    om,
    off,
    scale,
    root,
    eps,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    MAP: tl.constexpr,
    IS_QUERY: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """(C, BM) float32 features of the rows ``ot`` (row-major (n, XD) at X + row) for the m-block ``om``, 0 where
    ``live`` is False (rows past n, padded keys), and the x, W' they came from (MAP 0: X holds the features). The
    softmax map's exponents are taken relative to ``off`` (C,): the query's own maximum, or the (batch, head)'s
    largest real key exponent. A padded key's exponent may sit far above that offset, so it is dropped with a
    select, never a product, and the exponent is capped at 0 (the largest any real row has)."""
    if MAP == 0:
        phi = tl.load(X + row + ot[:, None] * XD + om[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        x = phi
        w = phi
    else:
        u, x, w = _exponents(X, W, row, ot, live, om, scale, root, XD, XDP, MAP, IS_QUERY, OPS, PREC)
        if MAP == 2:
            phi = tl.maximum(u, 0.0) + eps
        else:
            phi = tl.exp(tl.minimum(u - off[:, None], 0.0))  # <= 0 for every real row: no inf to select away
    phi = tl.where(live[:, None], phi, 0.0)
    return phi, x, w


@triton.jit
def _real_keys(KEY_WEIGHTS, KOFF, bh, H, n, ot, tmask, C: tl.constexpr, HAS_KEY_WEIGHTS: tl.constexpr):
    """Which of the keys ``ot`` are real (before n, kept), and their (C,) offset: the (batch, head)'s key offset."""
    live = tmask & (_key_weights(KEY_WEIGHTS, bh, H, n, ot, tmask, HAS_KEY_WEIGHTS) > 0)
    off = tl.zeros((C,), tl.float32) + tl.load(KOFF + bh)
    return live, off


@triton.jit
def _tile(n, XD: tl.constexpr, D: tl.constexpr, C: tl.constexpr, DP: tl.constexpr):
    """This program's (batch, head) bh and C positions ``ot`` (mask ``tmask``), the padded d columns ``od`` (mask
    ``dmask``), and where bh's rows start in the (n, XD), (n, D) and (n,) tensors."""
    bh = tl.program_id(0).to(tl.int64)
    ot = tl.program_id(1) * C + tl.arange(0, C)
    tmask = ot < n
    od = tl.arange(0, DP)
    dmask = od < D
    return bh, ot, tmask, od, dmask, bh * n * XD, bh * n * D, bh * n


@triton.jit
def _state(S, Z, bh, om, od, dmask, M: tl.constexpr, D: tl.constexpr):
    """The m-block ``om`` of bh's (m, d) and (m,) sums, float32."""
    s = tl.load(S + bh * M * D + om[:, None] * D + od[None, :], mask=dmask[None, :], other=0.0)
    z = tl.load(Z + bh * M + om)
    return s, z


@triton.jit
def _map_grad(
    DX, row, ot, tmask, om, dphi, phi, x, w, dx, scale, eps, XD: tl.constexpr, XDP: tl.constexpr, MAP: tl.constexpr,
    IS_QUERY: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dx plus this m-block's share of dL/dx (C, XDP); given features (MAP 0) have no map: their dL/dphi (C, BM) is
    stored at once, and dx comes back as it was."""
    if MAP == 0:
        _add_input_grad(DX, row, ot, tmask, om, dphi, XD, XDP, MAP, False)
    else:
        dx += _feature_grad(dphi, phi, x, w, scale, eps, MAP, IS_QUERY, OPS, PREC)
    return dx


@triton.jit
def _sums(
    X,
    Y,
    G,
    W,
    KEY_WEIGHTS,
    OFF,
    S_OUT,
    Z_OUT,
    n,
    H,
    P,
    L,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    QUERIES: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """One segment's share of the (m, d) and (m,) sums, for the m-block of program_id(1): keys (X = K, Y = V,
    OFF the key offset per (batch, head)) Σ phi_k vᵀ and Σ phi_k over real keys; queries (X = Q, Y = gn, G = gd,
    OFF the queries' offsets) Σ phi_q gnᵀ and Σ phi_q gd."""
    seg = tl.program_id(0).to(tl.int64)  # segment p of (batch, head) bh: positions [p L, p L + L)
    bh = seg // P
    start = (seg % P) * L
    end = tl.minimum(start + L, n)
    om = tl.program_id(1) * BM + tl.arange(0, BM)
    od = tl.arange(0, DP)
    dmask = od < D
    row, vrow, qrow = bh * n * XD, bh * n * D, bh * n
    s = tl.zeros((BM, DP), tl.float32)
    z = tl.zeros((BM,), tl.float32)
    for c in range(start, end, C):
        ot = c + tl.arange(0, C)
        tmask = ot < n
        if QUERIES:
            off = tl.load(OFF + qrow + ot, mask=tmask, other=0.0)
            live = tmask
            weight = tl.load(G + qrow + ot, mask=tmask, other=0.0)
        else:
            live, off = _real_keys(KEY_WEIGHTS, OFF, bh, H, n, ot, tmask, C, HAS_KEY_WEIGHTS)
            weight = live.to(tl.float32)
        phi, _x, _w = _phi(X, W, row, ot, live, om, off, scale, root, eps, XD, XDP, MAP, QUERIES, OPS, PREC)
        y = tl.load(Y + vrow + ot[:, None] * D + od[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
        s += tl.dot(_operand(tl.trans(phi), OPS), _operand(y.to(tl.float32), OPS), input_precision=PREC)
        z += tl.sum(phi * weight[:, None], 0)
    tl.store(S_OUT + seg * M * D + om[:, None] * D + od[None, :], s, mask=dmask[None, :])
    tl.store(Z_OUT + seg * M + om, z)


@triton.jit
def _output(
    Q,
    W,
    QOFF,
    S,
    Z,
    OUT,
    DEN,
    n,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    MAP: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """out = phi_q S / phi_q·z and D = phi_q·z for C queries, over every m-block (float32)."""
    bh, ot, tmask, od, dmask, row, vrow, qrow = _tile(n, XD, D, C, DP)
    off = tl.load(QOFF + qrow + ot, mask=tmask, other=0.0)
    num = tl.zeros((C, DP), tl.float32)
    den = tl.zeros((C,), tl.float32)
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        pq, _x, _w = _phi(Q, W, row, ot, tmask, om, off, scale, root, eps, XD, XDP, MAP, True, OPS, PREC)
        s, z = _state(S, Z, bh, om, od, dmask, M, D)
        num += tl.dot(_operand(pq, OPS), _operand(s, OPS), input_precision=PREC)
        den += tl.sum(pq * z[None, :], 1)
    out = num / tl.maximum(den, 1e-30)[:, None]
    tl.store(OUT + vrow + ot[:, None] * D + od[None, :], out, mask=tmask[:, None] & dmask[None, :])
    tl.store(DEN + qrow + ot, den, mask=tmask)


@triton.jit
def _grad_q(
    Q,
    W,
    QOFF,
    S,
    Z,
    GN,
    GD,
    DQ,
    n,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    MAP: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """dL/dq for C queries: dphi_q = S gn + z gd per m-block, through the map, summed over the m-blocks."""
    bh, ot, tmask, od, dmask, row, vrow, qrow = _tile(n, XD, D, C, DP)
    off = tl.load(QOFF + qrow + ot, mask=tmask, other=0.0)
    gn = tl.load(GN + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
    gd = tl.load(GD + qrow + ot, mask=tmask, other=0.0)
    dx = tl.zeros((C, XDP), tl.float32)
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        pq, x, w = _phi(Q, W, row, ot, tmask, om, off, scale, root, eps, XD, XDP, MAP, True, OPS, PREC)
        s, z = _state(S, Z, bh, om, od, dmask, M, D)
        dpq = tl.dot(_operand(gn, OPS), _operand(tl.trans(s), OPS), input_precision=PREC) + gd[:, None] * z[None, :]
        dx = _map_grad(DQ, row, ot, tmask, om, dpq, pq, x, w, dx, scale, eps, XD, XDP, MAP, True, OPS, PREC)
    if MAP != 0:
        _add_input_grad(DQ, row, ot, tmask, tl.arange(0, BM), dx, XD, XDP, MAP, False)


@triton.jit
def _grad_kv(
    K,
    V,
    W,
    KEY_WEIGHTS,
    KOFF,
    DS,
    DZ,
    DK,
    DV,
    n,
    H,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """dL/dk and dL/dv for C keys: dphi_k = dS v + dz and dv = dSᵀ phi_k per m-block (0 for padded keys), the
    first through the map, both summed over the m-blocks."""
    bh, ot, tmask, od, dmask, row, vrow, _qrow = _tile(n, XD, D, C, DP)
    live, off = _real_keys(KEY_WEIGHTS, KOFF, bh, H, n, ot, tmask, C, HAS_KEY_WEIGHTS)
    vv = tl.load(V + vrow + ot[:, None] * D + od[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
    vv = vv.to(tl.float32)
    dv = tl.zeros((C, DP), tl.float32)
    dx = tl.zeros((C, XDP), tl.float32)
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        pk, x, w = _phi(K, W, row, ot, live, om, off, scale, root, eps, XD, XDP, MAP, False, OPS, PREC)
        ds, dz = _state(DS, DZ, bh, om, od, dmask, M, D)
        dpk = tl.dot(_operand(vv, OPS), _operand(tl.trans(ds), OPS), input_precision=PREC) + dz[None, :]
        dpk = tl.where(live[:, None], dpk, 0.0)
        dv += tl.dot(_operand(pk, OPS), _operand(ds, OPS), input_precision=PREC)
        dx = _map_grad(DK, row, ot, tmask, om, dpk, pk, x, w, dx, scale, eps, XD, XDP, MAP, False, OPS, PREC)
    if MAP != 0:
        _add_input_grad(DK, row, ot, tmask, tl.arange(0, BM), dx, XD, XDP, MAP, False)
    tl.store(DV + vrow + ot[:, None] * D + od[None, :], dv, mask=tmask[:, None] & dmask[None, :])
