"""The Triton kernels of :mod:`_triton_hedgehog` (read its docstring for what they compute and why).

Imported only when a call runs them, so that the library imports without Triton.
"""

try:  # transformers' check of Hub remote code skips try blocks: a model exported with this file loads without Triton
    import triton
    import triton.language as tl
except ImportError as err:  # imported only after _triton_causal.triton_importable() said yes
    raise ImportError("the Triton kernels need triton (pip install triton)") from err


@triton.jit
def _softmax_rows(u, live):
    """Each row's softmax over the columns where ``live`` (float32; 0 elsewhere)."""
    u = tl.where(live, u, float("-inf"))
    e = tl.exp(u - tl.max(u, 1)[:, None])
    e = tl.where(live, e, 0.0)
    return e / tl.sum(e, 1)[:, None]


@triton.jit
def _projection(
    X, W, B, bh, H, n, sxb, sxh, sxn, rows, cols, feats, D: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """u = x W_h + b_h (BN, HP) float32 for the rows ``rows`` of (batch, head) ``bh``, with the x tile and W_h."""
    head = bh % H
    x = tl.load(
        X + (bh // H) * sxb + head * sxh + rows[:, None] * sxn + cols[None, :],
        mask=(rows[:, None] < n) & (cols[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    w = tl.load(
        W + head * D * HALF + cols[:, None] * HALF + feats[None, :],
        mask=(cols[:, None] < D) & (feats[None, :] < HALF),
        other=0.0,
    ).to(tl.float32)
    bias = tl.load(B + head * HALF + feats, mask=feats < HALF, other=0.0).to(tl.float32)
    u = tl.dot(x, w, input_precision="ieee") + bias[None, :]
    return u, x, w


@triton.jit
def _hedgehog_forward(
    X, W, B, OUT, n, H, sxb, sxh, sxn,
    D: tl.constexpr, DP: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """phi = [softmax(u), softmax(-u)] (float32, (b·h, n, 2·HALF) row-major) for BN rows of one (batch, head)."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    cols = tl.arange(0, DP)
    feats = tl.arange(0, HP)
    u, _, _ = _projection(X, W, B, bh, H, n, sxb, sxh, sxn, rows, cols, feats, D, HALF)
    live = feats[None, :] < HALF
    at = OUT + bh * n * 2 * HALF + rows[:, None] * (2 * HALF) + feats[None, :]
    keep = (rows[:, None] < n) & live
    tl.store(at, _softmax_rows(u, live), mask=keep)
    tl.store(at + HALF, _softmax_rows(-u, live), mask=keep)


@triton.jit
def _hedgehog_backward(
    X, W, B, G, DX, DW, DB, n, H, sxb, sxh, sxn,
    D: tl.constexpr, DP: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """From dL/dphi (G, (b·h, n, 2·HALF) row-major): dL/dx into DX ((b·h, n, D) row-major, in its dtype), and the
    share of dL/dW_h, dL/db_h of R blocks of BN rows, summed in registers, added to DW (h, D, HALF), DB (h, HALF)
    float32 once. The features are made again from x (one product), as in forward."""
    bh = tl.program_id(0)
    cols = tl.arange(0, DP)
    feats = tl.arange(0, HP)
    live = feats[None, :] < HALF
    dw = tl.zeros((DP, HP), tl.float32)
    db = tl.zeros((HP,), tl.float32)
    for step in range(R):
        rows = (tl.program_id(1) * R + step) * BN + tl.arange(0, BN)
        u, x, w = _projection(X, W, B, bh, H, n, sxb, sxh, sxn, rows, cols, feats, D, HALF)
        keep = (rows[:, None] < n) & live
        at = G + bh * n * 2 * HALF + rows[:, None] * (2 * HALF) + feats[None, :]
        g1 = tl.load(at, mask=keep, other=0.0).to(tl.float32)
        g2 = tl.load(at + HALF, mask=keep, other=0.0).to(tl.float32)
        p1 = _softmax_rows(u, live)
        p2 = _softmax_rows(-u, live)
        # softmax's Jacobian-vector product p (g - Σ p g) per half; the second half's sign is -u's
        du = p1 * (g1 - tl.sum(p1 * g1, 1)[:, None]) - p2 * (g2 - tl.sum(p2 * g2, 1)[:, None])
        du = tl.where(keep, du, 0.0)
        dx = tl.dot(du, tl.trans(w), input_precision="ieee")
        tl.store(
            DX + bh * n * D + rows[:, None] * D + cols[None, :],
            dx.to(DX.dtype.element_ty),
            mask=(rows[:, None] < n) & (cols[None, :] < D),
        )
        dw += tl.dot(tl.trans(x), du, input_precision="ieee")
        db += tl.sum(du, 0)
    head = bh % H
    tl.atomic_add(DW + head * D * HALF + cols[:, None] * HALF + feats[None, :], dw, mask=(cols[:, None] < D) & live)
    tl.atomic_add(DB + head * HALF + feats, db, mask=feats < HALF)
