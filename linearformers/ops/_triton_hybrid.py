"""The causal hybrid (:mod:`hybrid`: a window of exact softmax scores, sinks and linear scores in one normalizer) as
Triton kernels, forward and backward.

    out_t = (alpha_t A_t + beta_t N_t) / (alpha_t Dw_t + beta_t D_t)

The two parts are computed apart and joined per query by one normalizer:

* the window and sinks (``_window_forward``, grid (b·h, n / C), C >= w a power of two): each program takes one
  chunk of C queries, the keys of that chunk and the one before (every key a query's window may hold: w <= C) and
  the S sink keys, forms their logits in SRAM, c_t (the largest it sees exactly) and A_t = Σ e^{x - c} v,
  Dw_t = Σ e^{x - c}; no sequential walk, nothing of size (n, w) leaves the chip.
* the linear part (keys s <= t - w, sinks and padding left out): the causal linear kernels of
  :mod:`_triton_causal` on the keys' features and values delayed by w positions (key s sits at s + w), so that
  their causal sums Σ_{s' <= t} are the hybrid's Σ_{s <= t - w}; their undivided N and D are taken.
* ``_combine``: alpha = gamma e^{c - c'}, beta = e^{ℓ - c'} with c' = max(c, ℓ - R) (without ℓ: gamma and 1, and
  c' = c), as in :mod:`hybrid`; it writes out in v's dtype and the joint denominator, which backward keeps.

Backward: gn = dL/dout / total, gd = -gn·out. The linear part's walks take beta gn and beta gd (``_prep``); the
window's kernel recomputes its logits, its weights a = gamma e^{x - c'} and dx = a (gn·v + gd); without ℓ, c_t is
the largest logit, whose key takes -Σ_s dx_ts (max's gradient); with ℓ, c' cancels in the division. It also sums
Σ_s dx / gamma per query: dL/dgamma is its sum and dL/dℓ_t its negative times gamma (the joint normalizer makes
beta's share the negative of the window's). Kept for backward: the inputs, the output, the joint denominator, c_t and
the linear walks' segment sums.

Precision as in :mod:`_triton_causal`: float32 logits, exponents, sums and normalizers, bf16 product operands for
bf16 inputs. One custom op each way (torch.compile keeps each whole). The decoding state is formed by
:func:`hybrid.hybrid_attention` from the inputs, as for the other backends; an initial state is refused
(:func:`refusal`).
"""

from __future__ import annotations

import torch

from ._precision import outside_autocast
from ._triton_causal import _ROWS, _or, linear_grads, linear_sums, output_grad_dtype

MAX_WINDOW = 128  # the frame holds the query chunk and the one before, each C >= w positions, in registers
MAX_SINKS = 16


def refusal(window: int, sinks: int, stateful: bool) -> str | None:
    """Why the causal hybrid Triton kernels cannot run this causal call, beyond what the linear kernels' refusal
    says (dtypes, widths, device), or None when they can."""
    if stateful:
        return "it takes no initial_state (backend='chunked' continues a state)"
    if window > MAX_WINDOW:
        return f"its window must be at most {MAX_WINDOW}, got {window}"
    if sinks > MAX_SINKS:
        return f"it takes at most {MAX_SINKS} sinks, got {sinks}"
    return None


def _chunk(window: int) -> int:
    """C: the window's power of two, at least 16 (a tile's height)."""
    return max(16, 1 << (window - 1).bit_length())


def _kernels():
    from ._triton_hybrid_kernels import _combine, _prep, _window_backward, _window_forward

    return _window_forward, _combine, _prep, _window_backward


def _delayed(pk: torch.Tensor, v: torch.Tensor, linear: torch.Tensor, window: int):
    """The linear part's keys: phi_k, v (b, h, n, ·) and the keys' weights (b, n) moved w positions later along n,
    zeros first, the last w rows dropped."""
    n = v.shape[2]
    late = (torch.nn.functional.pad(x, (0, 0, window, 0))[:, :, :n].contiguous() for x in (pk, v))
    return *late, torch.nn.functional.pad(linear, (window, 0))[:, :n].contiguous()


def _window_settings(q, v, window):
    xd, d = q.shape[-1], v.shape[-1]
    ops = (1 if v.device.type == "cuda" else 2) if v.dtype == torch.bfloat16 else 0
    chunk = _chunk(window)
    warps = 8 if chunk >= 64 else 4  # the frame's (C, C) tiles: 4 warps would spill them at C = 64
    return dict(
        XD=xd, XDP=1 << (xd - 1).bit_length(), D=d, DP=1 << (d - 1).bit_length(), C=chunk, SP=16, OPS=ops,
        PREC="tf32" if ops == 1 else "ieee", num_warps=warps, num_stages=1,
    )  # fmt: skip


_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor pq, Tensor pk, Tensor gamma, Tensor? ell, Tensor valid, Tensor linear, "
    "Tensor sink_pos, int window, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor g, Tensor q, Tensor k, Tensor v, Tensor pq, Tensor pk, Tensor gamma, Tensor? ell, Tensor valid, "
    "Tensor linear, Tensor sink_pos, Tensor out, Tensor total, Tensor top, Tensor sums, Tensor z_sums, int window, "
    "float scale) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _window_max_and_sums(q, k, v, valid, sink_pos, window, scale):
    """(A (b·h, n, d), Dw, c (b·h·n)) float32 of the window part."""
    b, h, n, d = v.shape
    a = torch.empty(b * h, n, d, dtype=torch.float32, device=v.device)
    dw = torch.empty(b * h * n, dtype=torch.float32, device=v.device)
    top = torch.empty(b * h * n, dtype=torch.float32, device=v.device)
    cst = _window_settings(q, v, window)
    _kernels()[0][(b * h, -(-n // cst["C"]))](q, k, v, valid, sink_pos, a, dw, top, n, h, window, scale, **cst)
    return a, dw, top


def _forward(q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, window, scale):
    """(out in v's dtype, out in float32 (for backward), the joint denominator and each query's largest window
    logit c_t (b·h·n) float32, the linear walks' segment sums)."""
    q, k, v, pq = (t.contiguous() for t in (q, k, v, pq))
    b, h, n, d = v.shape
    pk_late, v_late, keep_late = _delayed(pk, v, linear, window)
    num, den, _, _, _, sums, z_sums = linear_sums(pq, pk_late, v_late, None, keep_late, None, None, "features", 1.0,
                                                  0.0, 64)  # fmt: skip
    del pk_late, v_late
    a, dw, top = _window_max_and_sums(q, k, v, valid, sink_pos, window, scale)
    out = torch.empty_like(v)
    out32 = out if v.dtype == torch.float32 else torch.empty(v.shape, dtype=torch.float32, device=v.device)
    total = torch.empty(b * h * n, dtype=torch.float32, device=v.device)
    ell_arg = None if ell is None else ell.contiguous()
    _kernels()[1][(b * h, -(-n // _ROWS))](
        num, den, a, dw, top, gamma.contiguous(), _or(ell_arg, top), out, out32, total, n, h, d,
        1 << (d - 1).bit_length(), _ROWS, ell is not None, out32 is not out, num_warps=8,
    )  # fmt: skip
    # float32 inputs: out itself is kept (an op's outputs may not alias one another: the second is empty then)
    return out, (out32 if out32 is not out else out.new_empty(0)), total, top, sums, z_sums


def _backward(g, q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, out, total, top, sums, z_sums, window, scale):
    """dL/dq, dL/dk, dL/dv, dL/dphi_q, dL/dphi_k in their dtypes, dL/dgamma (h,), dL/dℓ (b, h, n) (empty without)."""
    q, k, v, pq, g = (t.contiguous() for t in (q, k, v, pq, g))
    b, h, n, d = v.shape
    _, _, prep, window_backward = _kernels()
    ell_arg = None if ell is None else ell.contiguous()
    gn = torch.empty(b * h, n, d, dtype=output_grad_dtype(v), device=v.device)
    gd = torch.empty(b * h, n, dtype=torch.float32, device=v.device)
    prep[(b * h, -(-n // _ROWS))](
        g, out, total, top, gamma.contiguous(), _or(ell_arg, top), gn, gd, n, h, d, 1 << (d - 1).bit_length(), _ROWS,
        ell is not None, num_warps=8,
    )  # fmt: skip
    pk_late, v_late, keep_late = _delayed(pk, v, linear, window)
    dpq, dpk_late, dv_late, _, _ = linear_grads(gn, gd, pq, pk_late, v_late, None, keep_late, top.view(b * h, n), None,
                                                None, sums, z_sums, "features", 1.0, 0.0, 64)  # fmt: skip
    del gn, gd, pk_late, v_late
    dpk = torch.nn.functional.pad(dpk_late[:, :, window:], (0, 0, 0, min(window, n)))
    dv = torch.nn.functional.pad(dv_late[:, :, window:], (0, 0, 0, min(window, n))).contiguous()
    del dpk_late, dv_late
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    wg = torch.empty(b * h * n, dtype=torch.float32, device=v.device)
    cst = _window_settings(q, v, window)
    window_backward[(b * h, -(-n // cst["C"]))](
        q, k, v, valid, sink_pos, g, out, total, gamma.contiguous(), _or(ell_arg, top), dq, dk, dv, wg, n, h, window,
        scale, HAS_ELL=ell is not None, **cst,
    )  # fmt: skip
    wg = wg.view(b, h, n)
    dgamma = wg.sum((0, 2)).to(gamma.dtype)
    dell = (-gamma.float()[None, :, None] * wg).to(ell.dtype) if ell is not None else wg.new_empty(0)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dpq.to(pq.dtype), dpk.to(pk.dtype), dgamma, dell


def _forward_fake(q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, window, scale):
    from ._triton_causal import _Launch, _segments

    b, h, n, d = v.shape
    m = pq.shape[-1]
    count = _segments(_Launch(pq, v, None, "features", 64, 1.0, 0.0), v.device)[0]
    sums = ((b * h * count, m, d), (b * h * count, m)) if count > 1 else ((0,), (0,))
    out32 = (0,) if v.dtype == torch.float32 else v.shape
    return (v.new_empty(v.shape), v.new_empty(out32, dtype=torch.float32),
            *(v.new_empty(b * h * n, dtype=torch.float32) for _ in range(2)),
            *(v.new_empty(s, dtype=torch.float32) for s in sums))  # fmt: skip


def _backward_fake(g, q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, out, total, top, sums, z_sums, window,
                   scale):  # fmt: skip
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, pq, pk, gamma))
    return *grads, (torch.empty_like(ell) if ell is not None else v.new_empty(0, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, window, scale = inputs
    out, out32, total, top, sums, z_sums = output
    out = out32 if out32.numel() else out  # out in float32
    ctx.settings = (window, scale)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, out, total, top, sums, z_sums)


@outside_autocast
def _autograd_backward(ctx, g, *_not_differentiated):
    if g is None:
        return (None,) * 12
    saved = ctx.saved_tensors  # q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, out, total, top, sums, z_sums
    dq, dk, dv, dpq, dpk, dgamma, dell = _backward_op(g, *saved, *ctx.settings)
    ell = saved[6]
    return dq, dk, dv, dpq, dpk, dgamma, dell if ell is not None else None, None, None, None, None, None


_forward_op = torch.library.custom_op(
    "linearformers::triton_causal_hybrid", _forward, mutates_args=(), schema=_FORWARD_SCHEMA
)
_backward_op = torch.library.custom_op(
    "linearformers::triton_causal_hybrid_backward", _backward, mutates_args=(), schema=_BACKWARD_SCHEMA
)
_forward_op.register_fake(_forward_fake)
_backward_op.register_fake(_backward_fake)
_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_causal_hybrid(q, k, v, phi_q, phi_k, gamma, window, *, valid, linear, sink_pos, query_log_scale, scale):
    """The causal hybrid through the kernels (module docstring). q, k (b, h, n, d_k), v (b, h, n, d), phi_q, phi_k
    (b, h, n, m), gamma (h,), ℓ (b, h, n) or None; valid (b, n) bool (real keys), linear (b, n) bool (the real keys
    that may join the linear part: not the sinks), sink_pos (b, S) int64 positions of the sinks (-1: none yet).
    Gradients reach q, k, v, the features, gamma and ℓ. Returns (b, h, n, d) in v's dtype."""
    q, k, v, phi_q = (t.contiguous() for t in (q, k, v, phi_q))  # kept for backward as they are (no second copy)
    b = v.shape[0]
    pos = torch.full((b, 16), -1, dtype=torch.int32, device=v.device)
    pos[:, : sink_pos.shape[1]] = sink_pos.to(torch.int32)
    out, *_ = _forward_op(
        q, k, v, phi_q, phi_k, gamma, query_log_scale, valid.float().contiguous(), linear.float().contiguous(), pos,
        int(window), float(scale),
    )  # fmt: skip
    return out
