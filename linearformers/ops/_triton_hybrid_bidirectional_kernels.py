"""The Triton kernel of :mod:`_triton_hybrid_bidirectional`: the whole bidirectional hybrid of one block of queries
in one program (read the module's docstring for the algorithm).

Imported only when a call runs it, so that the library imports without Triton; only long-stable ``tl`` APIs, as in
:mod:`_triton_causal_kernels`, whose operand rounding it shares.
"""

try:  # transformers' check of Hub remote code skips try blocks: a model exported with this file loads without Triton
    import triton
    import triton.language as tl
except ImportError as err:  # imported only after _triton_causal.triton_importable() said yes
    raise ImportError("the Triton kernels need triton (pip install triton)") from err

from ._triton_causal_kernels import _operand
from ._triton_hybrid_kernels import _balance

_LENGTHS = ["n", "W", "SIDE"]


@triton.jit
def _exact(x, see, v, m_i, l_i, acc, OPS: tl.constexpr, PREC: tl.constexpr):
    """One tile of exact logits x (C, keys) seen where ``see``, folded into the running largest logit m_i, the sum
    l_i = Σ e^{x - m_i} and acc = Σ e^{x - m_i} v (flash attention's rescaling); -inf m_i: nothing seen yet."""
    m_new = tl.maximum(m_i, tl.max(tl.where(see, x, -float("inf")), 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    rescale = tl.exp(m_i - m_safe)  # 0 while nothing was seen (its sums are 0 then)
    p = tl.where(see, tl.exp(x - m_safe[:, None]), 0.0)
    acc = acc * rescale[:, None] + tl.dot(_operand(p, OPS), _operand(v, OPS), input_precision=PREC)
    return m_new, l_i * rescale + tl.sum(p, 1), acc


@triton.jit(do_not_specialize=_LENGTHS)
def _bidirectional_forward(
    Q, K, V, PQ, PK, ELL, GAMMA, VALID, LINEAR, SINK_POS, OUT_S, OUT_Z, BLOCK_S, BLOCK_Z, CHOSEN, OUT,
    n, H, W, SIDE, scale, XD: tl.constexpr, XDP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, M: tl.constexpr,
    MP: tl.constexpr, C: tl.constexpr, SP: tl.constexpr, PICKS: tl.constexpr, HAS_ELL: tl.constexpr,
    OPS: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """out for the C queries of block program_id(1) of row program_id(0) (b·h): the window's and the sinks' exact
    scores, the chosen blocks' exact scores, and the linear scores of every other linear key, in one normalizer.
    Grid (b·h, n / C)."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    batch = bh // H
    ot = c * C + tl.arange(0, C)
    oc = tl.arange(0, C)
    ox = tl.arange(0, XDP)
    od = tl.arange(0, DP)
    om = tl.arange(0, MP)
    xmask = ox < XD
    dmask = od < D
    mmask = om < M
    tmask = ot < n
    q = tl.load(Q + bh * n * XD + ot[:, None] * XD + ox[None, :], mask=tmask[:, None] & xmask[None, :], other=0.0)
    qo = _operand(q.to(tl.float32), OPS)
    pq = tl.load(PQ + bh * n * M + ot[:, None] * M + om[None, :], mask=tmask[:, None] & mmask[None, :], other=0.0)
    pq = pq.to(tl.float32)
    pqo = _operand(pq, OPS)
    # the linear keys outside the frame: the sums of the blocks before it and after it
    state = bh * tl.num_programs(1) + c
    s_out = tl.load(
        OUT_S + state * M * D + om[:, None] * D + od[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0
    )
    lin = tl.dot(pqo, _operand(s_out, OPS), input_precision=PREC)
    lden = tl.sum(pq * tl.load(OUT_Z + state * M + om, mask=mmask, other=0.0)[None, :], 1)
    m_i = tl.full((C,), -float("inf"), tl.float32)
    l_i = tl.zeros((C,), tl.float32)
    acc = tl.zeros((C, DP), tl.float32)
    # the frame: blocks c - SIDE .. c + SIDE, every key of its queries' windows; exact scores in the window, linear
    # scores on its linear keys outside
    for jj in range(0, 2 * SIDE + 1):
        okey = (c - SIDE + jj) * C + oc
        smask = (okey >= 0) & (okey < n)
        k = tl.load(K + bh * n * XD + okey[:, None] * XD + ox[None, :], mask=smask[:, None] & xmask[None, :], other=0.0)
        v = tl.load(V + bh * n * D + okey[:, None] * D + od[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        pk = tl.load(PK + bh * n * M + okey[:, None] * M + om[None, :], mask=smask[:, None] & mmask[None, :], other=0.0)
        real = tl.load(VALID + batch * n + okey, mask=smask, other=0.0) > 0
        linear = tl.load(LINEAR + batch * n + okey, mask=smask, other=0.0) > 0
        v = v.to(tl.float32)
        x = scale * tl.dot(qo, _operand(tl.trans(k.to(tl.float32)), OPS), input_precision=PREC)
        dist = ot[:, None] - okey[None, :]
        near = (dist < W) & (dist > -W)
        m_i, l_i, acc = _exact(x, near & real[None, :], v, m_i, l_i, acc, OPS, PREC)
        b = tl.dot(pqo, _operand(tl.trans(pk.to(tl.float32)), OPS), input_precision=PREC)
        b = tl.where((~near) & linear[None, :], b, 0.0)
        lin += tl.dot(_operand(b, OPS), _operand(v, OPS), input_precision=PREC)
        lden += tl.sum(b, 1)
    # the chosen far blocks (outside the frame): exact scores on their linear keys, whose sums leave the linear part
    for i in range(PICKS):
        j = tl.load(CHOSEN + state * PICKS + i)
        jc = tl.maximum(j, 0).to(tl.int64)
        okey = jc * C + oc
        smask = (okey < n) & (oc * 0 + j >= 0)  # vectors: a scalar mask is not every backend's
        k = tl.load(K + bh * n * XD + okey[:, None] * XD + ox[None, :], mask=smask[:, None] & xmask[None, :], other=0.0)
        v = tl.load(V + bh * n * D + okey[:, None] * D + od[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        linear = tl.load(LINEAR + batch * n + okey, mask=smask, other=0.0) > 0
        x = scale * tl.dot(qo, _operand(tl.trans(k.to(tl.float32)), OPS), input_precision=PREC)
        see = (ot[:, None] >= 0) & linear[None, :]
        m_i, l_i, acc = _exact(x, see, v.to(tl.float32), m_i, l_i, acc, OPS, PREC)
        block = bh * tl.num_programs(1) + jc
        bmask = mmask & (om * 0 + j >= 0)
        s_j = tl.load(BLOCK_S + block * M * D + om[:, None] * D + od[None, :], mask=bmask[:, None] & dmask[None, :],
                      other=0.0)  # fmt: skip
        lin -= tl.dot(pqo, _operand(s_j, OPS), input_precision=PREC)
        lden -= tl.sum(pq * tl.load(BLOCK_Z + block * M + om, mask=bmask, other=0.0)[None, :], 1)
    # the sinks, where they lie outside a query's window (inside it they are window keys)
    osk = tl.arange(0, SP)
    pos = tl.load(SINK_POS + batch * SP + osk)  # (SP,) int32, -1: no sink
    has_sink = pos >= 0
    ks = tl.load(K + bh * n * XD + pos[:, None] * XD + ox[None, :], mask=has_sink[:, None] & xmask[None, :], other=0.0)
    vs = tl.load(V + bh * n * D + pos[:, None] * D + od[None, :], mask=has_sink[:, None] & dmask[None, :], other=0.0)
    xs = scale * tl.dot(qo, _operand(tl.trans(ks.to(tl.float32)), OPS), input_precision=PREC)
    dists = ot[:, None] - pos[None, :]
    m_i, l_i, acc = _exact(xs, ((dists >= W) | (dists <= -W)) & has_sink[None, :], vs.to(tl.float32), m_i, l_i, acc,
                           OPS, PREC)  # fmt: skip
    # one normalizer: the exact part relative to c (0 where nothing was seen exactly), weighed against the linear part
    top = tl.where(m_i == -float("inf"), 0.0, m_i)
    gamma = tl.load(GAMMA + bh % H).to(tl.float32)
    if HAS_ELL:
        ell = tl.load(ELL + bh * n + ot, mask=tmask, other=0.0).to(tl.float32)
    else:
        ell = top
    alpha, beta = _balance(gamma, ell, top, HAS_ELL)
    num = alpha[:, None] * acc + beta[:, None] * lin
    total = alpha * l_i + beta * lden
    out = tl.where(total[:, None] > 0, num / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(OUT + bh * n * D + ot[:, None] * D + od[None, :], out.to(OUT.dtype.element_ty),
             mask=tmask[:, None] & dmask[None, :])  # fmt: skip
