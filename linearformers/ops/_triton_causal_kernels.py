"""The Triton kernels of :mod:`_triton_causal` (read its docstring for the algorithm, the grid and the precision).

Imported only when a call runs them, so that the library imports without Triton. Only long-stable ``tl`` APIs
(loads and stores with masks, ``tl.dot``, ``tl.atomic_add``, ``tl.exp``, reductions): the kernels must compile with
Triton 3.6 as with the current release, and run under its interpreter (``TRITON_INTERPRET=1``) on the CPU.
"""

try:  # transformers' check of Hub remote code skips try blocks: a model exported with this file loads without Triton
    import triton
    import triton.language as tl
except ImportError as err:  # imported only after _triton_causal.triton_importable() said yes
    raise ImportError("the Triton kernels need triton (pip install triton)") from err

# Lengths and segment counts stay runtime values: specialized (== 1, a multiple of 16), each new length would compile
# another variant of every kernel; the tiles' sizes are constexprs, so they gain nothing from it.
_LENGTHS = ["n", "P", "L"]


@triton.jit
def _operand(x, OPS: tl.constexpr):
    """A product's operand: OPS 0 float32 as it is, 1 bf16 (tensor cores), 2 bf16-rounded float32 (the interpreter,
    whose bf16 products are wrong, computes the same rounding this way)."""
    if OPS == 1:
        x = x.to(tl.bfloat16)
    elif OPS == 2:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _exponents(
    X,
    W,
    row,
    ot,
    tmask,
    om,
    scale,
    root,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    MAP: tl.constexpr,
    IS_QUERY: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """The exponents u (C, BM) of the chunk's rows ``ot`` (row-major (n, XD) at X + row) for the BM rows ``om``
    of W, float32, with the inputs x (C, XDP) and W' = s^½ W (BM, XDP) they came from. Softmax map: keys
    w·x' - |x'|²/2 - |w|²/2, queries w·x' - |x'|²/2 + |w|²/2; relu map: w·x'."""
    ox = tl.arange(0, XDP)
    xmask = ox < XD
    x = tl.load(X + row + ot[:, None] * XD + ox[None, :], mask=tmask[:, None] & xmask[None, :], other=0.0)
    x = x.to(tl.float32)
    w_rows = tl.load(W + om[:, None] * XD + ox[None, :], mask=xmask[None, :], other=0.0)
    w = w_rows * root
    if OPS > 0:  # x is bf16 already; W' = W_hi + W_lo, each bf16: the product keeps ~16 bits
        w_hi = _operand(w, OPS)
        w_lo = _operand(w - w_hi.to(tl.float32), OPS)
        xb = _operand(x, OPS)
        u = tl.dot(xb, tl.trans(w_hi), input_precision=PREC) + tl.dot(xb, tl.trans(w_lo), input_precision=PREC)
    else:
        u = tl.dot(x, tl.trans(w), input_precision=PREC)
    if MAP == 1:
        half_x = 0.5 * scale * tl.sum(x * x, 1)
        half_w = 0.5 * tl.sum(w_rows * w_rows, 1)  # |w|²/2 of the projection's own rows: keys -|w - x'|²/2 <= 0
        if IS_QUERY:
            u = u - half_x[:, None] + half_w[None, :]
        else:
            u = u - half_x[:, None] - half_w[None, :]
    return u, x, w


@triton.jit
def _features(
    X,
    W,
    QOFF,
    row,
    qrow,
    ot,
    tmask,
    om,
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
    """(C, BM) float32 features of the chunk's rows for the m-block ``om``, and the x, W' of
    :func:`_exponents` (MAP 0, given features: X holds them, and the two others are the features again)."""
    if MAP == 0:
        phi = tl.load(X + row + ot[:, None] * XD + om[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        x = phi
        w = phi
    else:
        u, x, w = _exponents(X, W, row, ot, tmask, om, scale, root, XD, XDP, MAP, IS_QUERY, OPS, PREC)
        if MAP == 2:
            phi = tl.maximum(u, 0.0) + eps
        elif IS_QUERY:  # the row's largest exponent taken off: cancels in N / D
            phi = tl.exp(u - tl.load(QOFF + qrow + ot, mask=tmask, other=0.0)[:, None])
        else:
            phi = tl.exp(u)
        # rows past n: x = 0 gives query features up to exp(|w|²/2), inf for wide heads, and inf x 0 = NaN
        phi = tl.where(tmask[:, None], phi, 0.0)
    return phi, x, w


@triton.jit
def _start_state(
    S0, Z0, SUMS, Z_SUMS, bh, p, P, om, od, M: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    HAS_S0: tl.constexpr, HAS_SUMS: tl.constexpr, REVERSE: tl.constexpr,
):  # fmt: skip
    """The (BM, BD) state and BM sums segment p of (batch, head) bh starts from, float32: the initial state S0, Z0
    ((b·h, M, D), (b·h, M)) when given, plus the sums (b·h·P, M, D), (b·h·P, M) of the segments before p, or
    (REVERSE) after it. A few tiles per segment: cheaper than a prefix pass of its own."""
    if HAS_S0:
        s = tl.load(S0 + bh * M * D + om[:, None] * D + od[None, :]).to(tl.float32)
        z = tl.load(Z0 + bh * M + om).to(tl.float32)
    else:
        s = tl.zeros((BM, BD), tl.float32)
        z = tl.zeros((BM,), tl.float32)
    if HAS_SUMS:
        if REVERSE:
            lo, hi = p + 1, P
        else:
            lo, hi = p * 0, p
        for i in range(lo, hi):
            s += tl.load(SUMS + (bh * P + i) * M * D + om[:, None] * D + od[None, :])
            z += tl.load(Z_SUMS + (bh * P + i) * M + om)
    return s, z


@triton.jit
def _segment(n, P, L, XD: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """This program's segment seg (of b·h·P), its (batch, head) bh, its positions [start, end), its m- and d-blocks
    om, od, and where bh's rows start in the (n, XD), (n, D) and (n,) tensors."""
    seg = tl.program_id(0).to(tl.int64)  # segment p of (batch, head) bh: positions [p L, p L + L)
    bh = seg // P
    start = (seg % P) * L
    end = tl.minimum(start + L, n)
    om = tl.program_id(1) * BM + tl.arange(0, BM)
    od = tl.program_id(2) * BD + tl.arange(0, BD)
    return seg, bh, start, end, om, od, bh * n * XD, bh * n * D, bh * n


@triton.jit
def _key_weights(KEY_WEIGHTS, bh, H, n, ot, tmask, HAS_KEY_WEIGHTS: tl.constexpr):
    """The (C,) float32 weights of the keys at ``ot``: KEY_WEIGHTS of bh's batch when given, else 1; 0 past n."""
    if HAS_KEY_WEIGHTS:
        key_weights = tl.load(KEY_WEIGHTS + (bh // H) * n + ot, mask=tmask, other=0.0)
    else:
        key_weights = tmask.to(tl.float32)
    return key_weights


@triton.jit
def _chunk(
    Q, K, V, W, KEY_WEIGHTS, QOFF, bh, H, n, row, vrow, qrow, ot, om, od, scale, root, eps, D: tl.constexpr,
    XD: tl.constexpr, XDP: tl.constexpr, MAP: tl.constexpr, HAS_KEY_WEIGHTS: tl.constexpr, OPS: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """What every causal kernel reads of the chunk ``ot``: its mask, the keys' weights, the query features and the
    weighted key features, each with the x, W' of :func:`_features`, and v (C, BD) float32."""
    tmask = ot < n
    key_weights = _key_weights(KEY_WEIGHTS, bh, H, n, ot, tmask, HAS_KEY_WEIGHTS)
    pq, xq, wq = _features(Q, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, XD, XDP, MAP, True, OPS, PREC)
    pk, xk, wk = _features(K, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, XD, XDP, MAP, False, OPS, PREC)
    pk = pk * key_weights[:, None]
    vv = tl.load(V + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    return tmask, key_weights, pq, xq, wq, pk, xk, wk, vv


@triton.jit
def _output_grads(GN, GD, vrow, qrow, ot, od, tmask, D: tl.constexpr):
    """dL/dN (C, BD) and dL/dD (C,) of the chunk ``ot``, as :func:`_backward_prep` stored them."""
    gn = tl.load(GN + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None], other=0.0)
    gd = tl.load(GD + qrow + ot, mask=tmask, other=0.0)
    return gn, gd


@triton.jit
def _advance(s, z, pk, vv, OPS: tl.constexpr, PREC: tl.constexpr):
    """The state after the chunk: s + phi_kᵀ v, z + Σ phi_k."""
    s += tl.dot(_operand(tl.trans(pk), OPS), _operand(vv, OPS), input_precision=PREC)
    z += tl.sum(pk, 0)
    return s, z


@triton.jit
def _store_state(S_OUT, Z_OUT, seg, om, od, s, z, M: tl.constexpr, D: tl.constexpr):
    """Store the segment's (BM, BD) state and, from the first d-block only, its BM sums."""
    tl.store(S_OUT + seg * M * D + om[:, None] * D + od[None, :], s)
    tl.store(Z_OUT + seg * M + om, z, mask=om * 0 + tl.program_id(2) == 0)


@triton.jit(do_not_specialize=["n"])
def _offsets(
    X,
    W,
    OUT,
    n,
    scale,
    root,
    M: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    IS_QUERY: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """The largest of the softmax map's m exponents per position (queries w·x' - |x'|²/2 + |w|²/2, keys
    w·x' - |x'|²/2 - |w|²/2): the causal kernels' query offsets, and both offsets of the bidirectional ones."""
    bh = tl.program_id(0).to(tl.int64)
    ot = tl.program_id(1) * C + tl.arange(0, C)
    tmask = ot < n
    top = tl.full((C,), -float("inf"), tl.float32)
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        u, _x, _w = _exponents(X, W, bh * n * XD, ot, tmask, om, scale, root, XD, XDP, 1, IS_QUERY, OPS, PREC)
        top = tl.maximum(top, tl.max(u, 1))
    tl.store(OUT + bh * n + ot, top, mask=tmask)


@triton.jit(do_not_specialize=_LENGTHS)
def _forward(
    Q,
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    S0,
    Z0,
    SUMS,
    Z_SUMS,
    NUM,
    DEN,
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
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    HAS_S0: tl.constexpr,
    HAS_SUMS: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    seg, bh, start, end, om, od, row, vrow, qrow = _segment(n, P, L, XD, D, BM, BD)
    s, z = _start_state(S0, Z0, SUMS, Z_SUMS, bh, seg % P, P, om, od, M, D, BM, BD, HAS_S0, HAS_SUMS, False)
    for c in range(start, end, C):
        ot = c + tl.arange(0, C)
        tmask, _weights, pq, _x, _w, pk, _x, _w, vv = _chunk(
            Q, K, V, W, KEY_WEIGHTS, QOFF, bh, H, n, row, vrow, qrow, ot, om, od, scale, root, eps, D, XD, XDP, MAP,
            HAS_KEY_WEIGHTS, OPS, PREC,
        )  # fmt: skip
        scores = tl.dot(_operand(pq, OPS), _operand(tl.trans(pk), OPS), input_precision=PREC)
        scores = tl.where(ot[:, None] >= ot[None, :], scores, 0.0)
        num = tl.dot(_operand(scores, OPS), _operand(vv, OPS), input_precision=PREC)
        num += tl.dot(_operand(pq, OPS), _operand(s, OPS), input_precision=PREC)
        den = tl.sum(scores, 1) + tl.sum(pq * z[None, :], 1)
        tl.atomic_add(NUM + vrow + ot[:, None] * D + od[None, :], num, mask=tmask[:, None])
        tl.atomic_add(DEN + qrow + ot, den, mask=tmask & (ot * 0 + tl.program_id(2) == 0))
        s, z = _advance(s, z, pk, vv, OPS, PREC)
    _store_state(S_OUT, Z_OUT, seg, om, od, s, z, M, D)


@triton.jit
def _feature_grad(
    dphi, phi, x, w, scale, eps, MAP: tl.constexpr, IS_QUERY: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr
):
    """dL/dx (C, XDP) of this m-block's features from dL/dphi (C, BM); MAP 0: dphi itself."""
    if MAP == 0:
        dx = dphi
    else:
        if MAP == 2:
            du = tl.where(phi > eps, dphi, 0.0)
        else:
            du = dphi * phi
        dx = tl.dot(_operand(du, OPS), _operand(w, OPS), input_precision=PREC)
        if MAP == 1:
            if not IS_QUERY:
                dx -= scale * x * tl.sum(du, 1)[:, None]
    return dx


@triton.jit
def _add_input_grad(
    DX, row, ot, tmask, om, dx, XD: tl.constexpr, XDP: tl.constexpr, MAP: tl.constexpr, ATOMIC: tl.constexpr
):
    """Put dL/dx (C, XDP), or this m-block's dL/dphi (C, BM) for given features, into DX: added (ATOMIC, where
    several programs share the rows) or stored."""
    if MAP == 0:
        ptrs = DX + row + ot[:, None] * XD + om[None, :]
        mask = tmask[:, None] & (om[None, :] < XD)
    else:
        ox = tl.arange(0, XDP)
        ptrs = DX + row + ot[:, None] * XD + ox[None, :]
        mask = tmask[:, None] & (ox[None, :] < XD)
    if ATOMIC:
        tl.atomic_add(ptrs, dx, mask=mask)
    else:
        tl.store(ptrs, dx, mask=mask)


@triton.jit(do_not_specialize=_LENGTHS)
def _backward_q(
    Q,
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    S0,
    Z0,
    SUMS,
    Z_SUMS,
    GN,
    GD,
    DQ,
    n,
    H,
    P,
    L,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    HAS_S0: tl.constexpr,
    HAS_SUMS: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    seg, bh, start, end, om, od, row, vrow, qrow = _segment(n, P, L, XD, D, BM, BD)
    first = (tl.program_id(2) == 0).to(tl.float32)
    s, z = _start_state(S0, Z0, SUMS, Z_SUMS, bh, seg % P, P, om, od, M, D, BM, BD, HAS_S0, HAS_SUMS, False)
    for c in range(start, end, C):
        ot = c + tl.arange(0, C)
        tmask, _weights, pq, x, w, pk, _x, _w, vv = _chunk(
            Q, K, V, W, KEY_WEIGHTS, QOFF, bh, H, n, row, vrow, qrow, ot, om, od, scale, root, eps, D, XD, XDP, MAP,
            HAS_KEY_WEIGHTS, OPS, PREC,
        )  # fmt: skip
        gn, gd = _output_grads(GN, GD, vrow, qrow, ot, od, tmask, D)
        gd = gd * first
        d_scores = tl.dot(_operand(gn, OPS), _operand(tl.trans(vv), OPS), input_precision=PREC) + gd[:, None]
        d_scores = tl.where(ot[:, None] >= ot[None, :], d_scores, 0.0)
        dpq = tl.dot(_operand(d_scores, OPS), _operand(pk, OPS), input_precision=PREC)
        dpq += tl.dot(_operand(gn, OPS), _operand(tl.trans(s), OPS), input_precision=PREC)
        dpq += gd[:, None] * z[None, :]
        dq = _feature_grad(dpq, pq, x, w, scale, eps, MAP, True, OPS, PREC)
        _add_input_grad(DQ, row, ot, tmask, om, dq, XD, XDP, MAP, True)
        s, z = _advance(s, z, pk, vv, OPS, PREC)


@triton.jit(do_not_specialize=_LENGTHS)
def _backward_kv(
    Q,
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    GN,
    GD,
    DK,
    DV,
    SUMS,
    Z_SUMS,
    DS0,
    DZ0,
    n,
    H,
    P,
    L,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    HAS_LATER: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    seg, bh, start, end, om, od, row, vrow, qrow = _segment(n, P, L, XD, D, BM, BD)
    first = (tl.program_id(2) == 0).to(tl.float32)
    # the gradient of this segment's end state: the queries' sums of the later segments
    ds, dz = _start_state(DS0, DZ0, SUMS, Z_SUMS, bh, seg % P, P, om, od, M, D, BM, BD, False, HAS_LATER, True)
    chunks = tl.cdiv(end - start, C)
    for i in range(0, chunks):
        ot = start + (chunks - 1 - i) * C + tl.arange(0, C)
        tmask, key_weights, pq, _x, _w, pk, x, w, vv = _chunk(
            Q, K, V, W, KEY_WEIGHTS, QOFF, bh, H, n, row, vrow, qrow, ot, om, od, scale, root, eps, D, XD, XDP, MAP,
            HAS_KEY_WEIGHTS, OPS, PREC,
        )  # fmt: skip
        gn, gd = _output_grads(GN, GD, vrow, qrow, ot, od, tmask, D)
        causal = ot[:, None] <= ot[None, :]  # rows: keys s, columns: queries t
        d_scores_t = tl.dot(_operand(vv, OPS), _operand(tl.trans(gn), OPS), input_precision=PREC)
        d_scores_t = tl.where(causal, d_scores_t + first * gd[None, :], 0.0)
        dpk = tl.dot(_operand(d_scores_t, OPS), _operand(pq, OPS), input_precision=PREC)
        dpk += tl.dot(_operand(vv, OPS), _operand(tl.trans(ds), OPS), input_precision=PREC)
        dpk = (dpk + first * dz[None, :]) * key_weights[:, None]
        scores_t = tl.dot(_operand(pk, OPS), _operand(tl.trans(pq), OPS), input_precision=PREC)
        scores_t = tl.where(causal, scores_t, 0.0)
        dv = tl.dot(_operand(scores_t, OPS), _operand(gn, OPS), input_precision=PREC)
        dv += tl.dot(_operand(pk, OPS), _operand(ds, OPS), input_precision=PREC)
        dk = _feature_grad(dpk, pk, x, w, scale, eps, MAP, False, OPS, PREC)
        _add_input_grad(DK, row, ot, tmask, om, dk, XD, XDP, MAP, True)
        tl.atomic_add(DV + vrow + ot[:, None] * D + od[None, :], dv * key_weights[:, None], mask=tmask[:, None])
        ds += tl.dot(_operand(tl.trans(pq), OPS), _operand(gn, OPS), input_precision=PREC)
        dz += tl.sum(pq * gd[:, None], 0)
    _store_state(DS0, DZ0, seg, om, od, ds, dz, M, D)


@triton.jit(do_not_specialize=_LENGTHS)
def _segment_sums(
    X,
    Y,
    G,
    W,
    KEY_WEIGHTS,
    QOFF,
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
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    QUERIES: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """Each segment's sums, which the segments before (forward) or after it (backward) need: keys (X = K, Y = V),
    Σ phi_k vᵀ and Σ phi_k; queries (X = Q, Y = gn, G = gd), Σ phi_q gnᵀ and Σ phi_q gd."""
    seg, bh, start, end, om, od, row, vrow, qrow = _segment(n, P, L, XD, D, BM, BD)
    s = tl.zeros((BM, BD), tl.float32)
    z = tl.zeros((BM,), tl.float32)
    for c in range(start, end, C):
        ot = c + tl.arange(0, C)
        tmask = ot < n
        phi, _x, _w = _features(
            X, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, XD, XDP, MAP, QUERIES, OPS, PREC
        )
        if QUERIES:
            weight = tl.load(G + qrow + ot, mask=tmask, other=0.0)
        else:
            weight = tmask.to(tl.float32)
            if HAS_KEY_WEIGHTS:
                phi = phi * tl.load(KEY_WEIGHTS + (bh // H) * n + ot, mask=tmask, other=0.0)[:, None]
        y = tl.load(Y + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        s += tl.dot(_operand(tl.trans(phi), OPS), _operand(y, OPS), input_precision=PREC)
        z += tl.sum(phi * weight[:, None], 0)
    _store_state(S_OUT, Z_OUT, seg, om, od, s, z, M, D)


@triton.jit(do_not_specialize=_LENGTHS)
def _normalize(NUM, DEN, FIRST, OUT, n, H, D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr, HAS_FIRST: tl.constexpr):
    """out = N / D (in OUT's dtype) for T positions, and the count of lost positions added to DEN's last entry (after
    the b·h·n of D): D <= 1e-30 at a position that sees a real key (from FIRST[batch], the first real key's
    position, on)."""
    bh = tl.program_id(0).to(tl.int64)
    ot = tl.program_id(1) * T + tl.arange(0, T)
    od = tl.arange(0, DP)
    tmask = ot < n
    mask = tmask[:, None] & (od[None, :] < D)
    den = tl.load(DEN + bh * n + ot, mask=tmask, other=1.0)
    num = tl.load(NUM + bh * n * D + ot[:, None] * D + od[None, :], mask=mask, other=0.0)
    out = num / tl.maximum(den, 1e-30)[:, None]
    tl.store(OUT + bh * n * D + ot[:, None] * D + od[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    lost = tmask & (den <= 1e-30)
    if HAS_FIRST:
        lost = lost & (ot >= tl.load(FIRST + bh // H))
    tl.atomic_add(DEN + tl.num_programs(0).to(tl.int64) * n, tl.sum(lost.to(tl.float32), 0))


@triton.jit(do_not_specialize=_LENGTHS)
def _backward_prep(
    G, OUT, DEN, GN, GD, n, D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr
):  # fmt: skip
    """dL/dN = g / D (in GN's dtype) and dL/dD = -(g · out) / D (float32) for T positions, 0 where D <= 1e-30 (no
    real key); dL/dD from the float32 dL/dN."""
    bh = tl.program_id(0).to(tl.int64)
    ot = tl.program_id(1) * T + tl.arange(0, T)
    od = tl.arange(0, DP)
    tmask = ot < n
    mask = tmask[:, None] & (od[None, :] < D)
    den = tl.load(DEN + bh * n + ot, mask=tmask, other=1.0)
    inv = tl.where(den > 1e-30, 1.0 / tl.maximum(den, 1e-30), 0.0)
    g = tl.load(G + bh * n * D + ot[:, None] * D + od[None, :], mask=mask, other=0.0).to(tl.float32)
    out = tl.load(OUT + bh * n * D + ot[:, None] * D + od[None, :], mask=mask, other=0.0).to(tl.float32)
    gn = g * inv[:, None]
    tl.store(GN + bh * n * D + ot[:, None] * D + od[None, :], gn.to(GN.dtype.element_ty), mask=mask)
    tl.store(GD + bh * n + ot, -tl.sum(gn * out, 1), mask=tmask)


# ------------------------------------------------------------------------------------------ the chunk-parallel form
# (module docstring of _triton_causal, "Two forms"): the walks only carry the state and store it at every chunk;
# the outputs and the input gradients then come from one program per chunk, all m-blocks summed in its registers.


@triton.jit(do_not_specialize=_LENGTHS)
def _states(
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    S0,
    Z0,
    SUMS,
    Z_SUMS,
    H,
    HZ,
    S_OUT,
    Z_OUT,
    n,
    NC,
    HH,
    P,
    L,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    MAP: tl.constexpr,
    HAS_KEY_WEIGHTS: tl.constexpr,
    HAS_S0: tl.constexpr,
    HAS_SUMS: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """The keys' walk: the state (S, z) before each chunk, stored in H (b·h, NC, M, D) (H's dtype) and HZ
    (b·h, NC, M) float32, and each segment's end state. Grid (b·h·P, M / BM, D / BD)."""
    seg, bh, start, end, om, od, row, vrow, qrow = _segment(n, P, L, XD, D, BM, BD)
    s, z = _start_state(S0, Z0, SUMS, Z_SUMS, bh, seg % P, P, om, od, M, D, BM, BD, HAS_S0, HAS_SUMS, False)
    for c in range(start, end, C):
        ot = c + tl.arange(0, C)
        tmask = ot < n
        chunk = (bh * NC + c // C).to(tl.int64)
        tl.store(H + chunk * M * D + om[:, None] * D + od[None, :], s.to(H.dtype.element_ty))
        tl.store(HZ + chunk * M + om, z, mask=om * 0 + tl.program_id(2) == 0)
        key_weights = _key_weights(KEY_WEIGHTS, bh, HH, n, ot, tmask, HAS_KEY_WEIGHTS)
        pk, _x, _w = _features(K, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, XD, XDP, MAP, False, OPS, PREC)
        pk = pk * key_weights[:, None]
        vv = tl.load(V + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        s, z = _advance(s, z, pk, vv, OPS, PREC)
    _store_state(S_OUT, Z_OUT, seg, om, od, s, z, M, D)


@triton.jit(do_not_specialize=_LENGTHS)
def _dstates(
    Q,
    W,
    QOFF,
    GN,
    GD,
    SUMS,
    Z_SUMS,
    DH,
    DHZ,
    DS0,
    DZ0,
    n,
    NC,
    P,
    L,
    scale,
    root,
    eps,
    M: tl.constexpr,
    D: tl.constexpr,
    XD: tl.constexpr,
    XDP: tl.constexpr,
    C: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    MAP: tl.constexpr,
    HAS_LATER: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
):
    """The queries' reverse walk: dS = Σ phi_q gnᵀ and dz = Σ phi_q gd over the chunks after each chunk, stored in
    DH (b·h, NC, M, D) (DH's dtype) and DHZ float32, and each segment's sums over its own chunks and the later
    ones (the first segment's: dL/dS_0, dL/dz_0). Grid (b·h·P, M / BM, D / BD)."""
    seg, bh, start, end, om, od, row, vrow, qrow = _segment(n, P, L, XD, D, BM, BD)
    ds, dz = _start_state(DS0, DZ0, SUMS, Z_SUMS, bh, seg % P, P, om, od, M, D, BM, BD, False, HAS_LATER, True)
    chunks = tl.cdiv(end - start, C)
    for i in range(0, chunks):
        c = start + (chunks - 1 - i) * C
        ot = c + tl.arange(0, C)
        tmask = ot < n
        chunk = (bh * NC + c // C).to(tl.int64)
        tl.store(DH + chunk * M * D + om[:, None] * D + od[None, :], ds.to(DH.dtype.element_ty))
        tl.store(DHZ + chunk * M + om, dz, mask=om * 0 + tl.program_id(2) == 0)
        pq, _x, _w = _features(Q, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, XD, XDP, MAP, True, OPS, PREC)
        gn, gd = _output_grads(GN, GD, vrow, qrow, ot, od, tmask, D)
        ds += tl.dot(_operand(tl.trans(pq), OPS), _operand(gn, OPS), input_precision=PREC)
        dz += tl.sum(pq * gd[:, None], 0)
    _store_state(DS0, DZ0, seg, om, od, ds, dz, M, D)


@triton.jit
def _chunk_features(
    X, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, M: tl.constexpr, XD: tl.constexpr, XDP: tl.constexpr,
    MAP: tl.constexpr, IS_QUERY: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr, MASK_M: tl.constexpr,
):  # fmt: skip
    """:func:`_features` of the m-block ``om``; MASK_M (a tile of features wider than what is left of m): the
    features past m are read at m's last row and set to zero, so they add nothing to any sum or gradient."""
    rows = om
    if MASK_M:
        rows = tl.minimum(om, M - 1)
    phi, x, w = _features(X, W, QOFF, row, qrow, ot, tmask, rows, scale, root, eps, XD, XDP, MAP, IS_QUERY, OPS, PREC)
    if MASK_M:
        phi = tl.where((om < M)[None, :], phi, 0.0)
    return phi, x, w


@triton.jit
def _chunk_pair(
    Q, K, W, QOFF, row, qrow, ot, tmask, om, key_weights, scale, root, eps, M: tl.constexpr, XD: tl.constexpr,
    XDP: tl.constexpr, MAP: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr, MASK_M: tl.constexpr,
):  # fmt: skip
    """The chunk's query and weighted key features of the m-block ``om`` (:func:`_chunk_features`), each with the
    x, W' it came from: pq, xq, wq, pk, xk, wk."""
    pq, xq, wq = _chunk_features(
        Q, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, M, XD, XDP, MAP, True, OPS, PREC, MASK_M
    )  # fmt: skip
    pk, xk, wk = _chunk_features(
        K, W, QOFF, row, qrow, ot, tmask, om, scale, root, eps, M, XD, XDP, MAP, False, OPS, PREC, MASK_M
    )  # fmt: skip
    return pq, xq, wq, pk * key_weights[:, None], xk, wk


@triton.jit
def _state_rows(H, HZ, chunk, om, od, M: tl.constexpr, D: tl.constexpr, MASK_M: tl.constexpr):
    """The (BM, DP) rows ``om`` of chunk ``chunk``'s stored state H (float32) and its BM sums HZ; zero past m and d."""
    mask = (od < D)[None, :]
    if MASK_M:
        mask = mask & (om < M)[:, None]
        z = tl.load(HZ + chunk * M + om, mask=om < M, other=0.0)
    else:
        z = tl.load(HZ + chunk * M + om)
    s = tl.load(H + chunk * M * D + om[:, None] * D + od[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _chunk_ids(n, NC, XD: tl.constexpr, D: tl.constexpr, C: tl.constexpr, DP: tl.constexpr):
    """This program's (batch, head) bh, its chunk's positions ot and their mask, the chunk's index in H, d's
    offsets, and where bh's rows start in the (n, XD), (n, D) and (n,) tensors. Grid (b·h, NC)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    ot = c * C + tl.arange(0, C)
    od = tl.arange(0, DP)
    return bh, ot, ot < n, bh * NC + c, od, bh * n * XD, bh * n * D, bh * n


@triton.jit(do_not_specialize=_LENGTHS)
def _chunk_out(
    Q,
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    H,
    HZ,
    FIRST,
    NUM,
    DEN,
    OUT,
    n,
    NC,
    HH,
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
    HAS_FIRST: tl.constexpr,
    NORMALIZE: tl.constexpr,
    OPS: tl.constexpr,
    PREC: tl.constexpr,
    MASK_M: tl.constexpr,
):
    """One chunk's outputs: N = tril(phi_q phi_kᵀ) V + phi_q S, D = rowsum(...) + phi_q z, summed over the m-blocks
    in registers, with S, z the state before the chunk (H, HZ). NORMALIZE: out = N / D in OUT's dtype, D stored
    for backward, and the lost positions counted into DEN's last entry (as _normalize does); else N (NUM) and D
    stored as they are. Grid (b·h, NC)."""
    bh, ot, tmask, chunk, od, row, vrow, qrow = _chunk_ids(n, NC, XD, D, C, DP)
    dmask = od < D
    key_weights = _key_weights(KEY_WEIGHTS, bh, HH, n, ot, tmask, HAS_KEY_WEIGHTS)
    scores = tl.zeros((C, C), tl.float32)
    num = tl.zeros((C, DP), tl.float32)
    den = tl.zeros((C,), tl.float32)
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        pq, _xq, _wq, pk, _xk, _wk = _chunk_pair(
            Q, K, W, QOFF, row, qrow, ot, tmask, om, key_weights, scale, root, eps, M, XD, XDP, MAP, OPS, PREC, MASK_M
        )  # fmt: skip
        scores += tl.dot(_operand(pq, OPS), _operand(tl.trans(pk), OPS), input_precision=PREC)
        s, hz = _state_rows(H, HZ, chunk, om, od, M, D, MASK_M)
        num += tl.dot(_operand(pq, OPS), _operand(s, OPS), input_precision=PREC)
        den += tl.sum(pq * hz[None, :], 1)
    scores = tl.where(ot[:, None] >= ot[None, :], scores, 0.0)
    vv = tl.load(V + vrow + ot[:, None] * D + od[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
    num += tl.dot(_operand(scores, OPS), _operand(vv.to(tl.float32), OPS), input_precision=PREC)
    den += tl.sum(scores, 1)
    ptrs = vrow + ot[:, None] * D + od[None, :]
    mask = tmask[:, None] & dmask[None, :]
    if NORMALIZE:
        out = num / tl.maximum(den, 1e-30)[:, None]
        tl.store(OUT + ptrs, out.to(OUT.dtype.element_ty), mask=mask)
        lost = tmask & (den <= 1e-30)
        if HAS_FIRST:
            lost = lost & (ot >= tl.load(FIRST + bh // HH))
        tl.atomic_add(DEN + tl.num_programs(0).to(tl.int64) * n, tl.sum(lost.to(tl.float32), 0))
    else:
        tl.store(NUM + ptrs, num, mask=mask)
    tl.store(DEN + qrow + ot, den, mask=tmask)


@triton.jit
def _chunk_grad_inputs(GN, GD, V, vrow, qrow, ot, tmask, od, D: tl.constexpr, OPS: tl.constexpr, PREC: tl.constexpr):
    """gn (C, DP), gd (C,), v (C, DP) float32 of the chunk, and dL/dscores = tril(gn vᵀ + gd) (queries x keys)."""
    dmask = od < D
    mask = tmask[:, None] & dmask[None, :]
    gn = tl.load(GN + vrow + ot[:, None] * D + od[None, :], mask=mask, other=0.0).to(tl.float32)
    gd = tl.load(GD + qrow + ot, mask=tmask, other=0.0)
    vv = tl.load(V + vrow + ot[:, None] * D + od[None, :], mask=mask, other=0.0).to(tl.float32)
    d_scores = tl.dot(_operand(gn, OPS), _operand(tl.trans(vv), OPS), input_precision=PREC) + gd[:, None]
    d_scores = tl.where(ot[:, None] >= ot[None, :], d_scores, 0.0)
    return gn, gd, vv, d_scores


@triton.jit(do_not_specialize=_LENGTHS)
def _chunk_grads_q(
    Q,
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    H,
    HZ,
    GN,
    GD,
    DQ,
    n,
    NC,
    HH,
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
    MASK_M: tl.constexpr,
):
    """One chunk's dL/dq: dphi_q = tril(gn vᵀ + gd) phi_k + gn Sᵀ + gd z per m-block, through the map, summed in
    registers (given features: each m-block's columns stored). Grid (b·h, NC)."""
    bh, ot, tmask, chunk, od, row, vrow, qrow = _chunk_ids(n, NC, XD, D, C, DP)
    key_weights = _key_weights(KEY_WEIGHTS, bh, HH, n, ot, tmask, HAS_KEY_WEIGHTS)
    gn, gd, _v, d_scores = _chunk_grad_inputs(GN, GD, V, vrow, qrow, ot, tmask, od, D, OPS, PREC)
    dq = tl.zeros((C, XDP), tl.float32)
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        pq, x, w, pk, _xk, _wk = _chunk_pair(
            Q, K, W, QOFF, row, qrow, ot, tmask, om, key_weights, scale, root, eps, M, XD, XDP, MAP, OPS, PREC, MASK_M
        )  # fmt: skip
        s, hz = _state_rows(H, HZ, chunk, om, od, M, D, MASK_M)
        dpq = tl.dot(_operand(d_scores, OPS), _operand(pk, OPS), input_precision=PREC)
        dpq += tl.dot(_operand(gn, OPS), _operand(tl.trans(s), OPS), input_precision=PREC)
        dpq += gd[:, None] * hz[None, :]
        if MAP == 0:
            _add_input_grad(DQ, row, ot, tmask, om, dpq, XD, XDP, MAP, False)
        else:
            dq += _feature_grad(dpq, pq, x, w, scale, eps, MAP, True, OPS, PREC)
    if MAP != 0:
        _add_input_grad(DQ, row, ot, tmask, 0, dq, XD, XDP, MAP, False)


@triton.jit(do_not_specialize=_LENGTHS)
def _chunk_grads_kv(
    Q,
    K,
    V,
    W,
    KEY_WEIGHTS,
    QOFF,
    DH,
    DHZ,
    GN,
    GD,
    DK,
    DV,
    n,
    NC,
    HH,
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
    MASK_M: tl.constexpr,
):
    """One chunk's dL/dk and dL/dv: dphi_k = (tril(gn vᵀ + gd)ᵀ phi_q + v dSᵀ + dz) key_weights and
    dv = (tril(phi_q phi_kᵀ)ᵀ gn + phi_k dS) key_weights per m-block, summed in registers, with dS, dz the queries'
    sums over the later chunks (DH, DHZ). Grid (b·h, NC)."""
    bh, ot, tmask, chunk, od, row, vrow, qrow = _chunk_ids(n, NC, XD, D, C, DP)
    dmask = od < D
    key_weights = _key_weights(KEY_WEIGHTS, bh, HH, n, ot, tmask, HAS_KEY_WEIGHTS)
    gn, _gd, vv, d_scores = _chunk_grad_inputs(GN, GD, V, vrow, qrow, ot, tmask, od, D, OPS, PREC)
    d_scores_t = tl.trans(d_scores)
    dk = tl.zeros((C, XDP), tl.float32)
    dv = tl.zeros((C, DP), tl.float32)
    causal_t = ot[:, None] <= ot[None, :]  # rows: keys s, columns: queries t
    for mb in range(0, M, BM):
        om = mb + tl.arange(0, BM)
        pq, _xq, _wq, pk, x, w = _chunk_pair(
            Q, K, W, QOFF, row, qrow, ot, tmask, om, key_weights, scale, root, eps, M, XD, XDP, MAP, OPS, PREC, MASK_M
        )  # fmt: skip
        ds, dhz = _state_rows(DH, DHZ, chunk, om, od, M, D, MASK_M)
        scores_t = tl.dot(_operand(pk, OPS), _operand(tl.trans(pq), OPS), input_precision=PREC)
        scores_t = tl.where(causal_t, scores_t, 0.0)
        dv += tl.dot(_operand(scores_t, OPS), _operand(gn, OPS), input_precision=PREC)
        dv += tl.dot(_operand(pk, OPS), _operand(ds, OPS), input_precision=PREC)
        dpk = tl.dot(_operand(d_scores_t, OPS), _operand(pq, OPS), input_precision=PREC)
        dpk += tl.dot(_operand(vv, OPS), _operand(tl.trans(ds), OPS), input_precision=PREC)
        dpk = (dpk + dhz[None, :]) * key_weights[:, None]
        if MAP == 0:
            _add_input_grad(DK, row, ot, tmask, om, dpk, XD, XDP, MAP, False)
        else:
            dk += _feature_grad(dpk, pk, x, w, scale, eps, MAP, False, OPS, PREC)
    if MAP != 0:
        _add_input_grad(DK, row, ot, tmask, 0, dk, XD, XDP, MAP, False)
    tl.store(DV + vrow + ot[:, None] * D + od[None, :], dv * key_weights[:, None], mask=tmask[:, None] & dmask[None, :])
