"""Causal linear attention as fused Triton kernels: the chunked form of :mod:`_favor_chunked`, with the state carried
in registers from chunk to chunk, and the FAVOR+ feature maps computed inside the kernels.

    out_t = Σ_{s <= t} (phi_q,t · phi_k,s) v_s / Σ_{s <= t} phi_q,t · phi_k,s         (padded keys left out)

Kernels (``_forward``, ``_backward_q``, ``_backward_kv``). The grid is (batch·heads, m / BM, d / BD): a program owns
one (BM, BD) block of the state S = Σ phi_k vᵀ (and BM entries of z = Σ phi_k), float32 in registers, and walks the
chunks of C positions in order. Per chunk it builds its BM features of the chunk's queries and keys (loaded, or
computed from q, k and BM rows of the projection: they never reach HBM), the intra-chunk scores tril(phi_q phi_kᵀ)
(C x C, partial over its BM features) in SRAM, and adds

    N += tril(phi_q phi_kᵀ) V + phi_q S,     D += rowsum(tril(phi_q phi_kᵀ)) + phi_q z

to float32 buffers with ``tl.atomic_add``: every m-block's share of N and D adds up to the whole (phi_q·phi_k is a
sum over features), so out = N / D afterwards, in torch. Then S += phi_kᵀ V, z += Σ phi_k.

Backward, with gn = g / D and gd = -(g · out) / D (dL/dN and dL/dD, float32, from the saved output and D):

    dphi_q,t = Σ_{s <= t, same chunk} (gn_t·v_s + gd_t) phi_k,s + S gn_t + z gd_t       (forward walk, ``_backward_q``)
    dphi_k,s = Σ_{t >= s, same chunk} (gn_t·v_s + gd_t) phi_q,t + dS v_s + dz            (reverse walk, ``_backward_kv``)
    dv_s     = Σ_{t >= s, same chunk} (phi_q,t·phi_k,s) gn_t + dSᵀ phi_k,s

with dS = Σ_{t in later chunks} phi_q,t gn_tᵀ and dz = Σ phi_q,t gd_t carried in registers; after the walk they are
the gradient of the initial state. Each program's share (partial over d-blocks for the feature gradients, over
m-blocks for dv) is again atomically added. Through the FAVOR+ maps (inside the kernels, as in
``_favor_chunked._through_features``): du = dphi · phi (softmax) or dphi where W x' > 0 (relu), dx = s^½ du W, less
s x Σ_m du for the softmax map's keys (their -|x'|²/2); the queries' per-row terms cancel in N / D.

Kept for backward: the inputs, the output and D in float32, the queries' row offsets (softmax map, one float per
position), and the initial state; nothing of size (n, m) and no per-chunk state. Backward recomputes the features.

Precision (see _precision). Exponents, features, states, scores, D and every sum are float32. For bf16 inputs the
products' operands are bf16 (tensor cores), as in the chunked backend: features, v, scores, the state read by the
queries, gn; the exponents' product x W runs as two bf16 products, x W_hi + x W_lo with W = W_hi + W_lo, exact to
~2⁻¹⁶ since x is bf16 already, so the features keep float32 accuracy. Other inputs compute in float32 throughout
(``input_precision="ieee"``: no TF32). float64 is refused (:func:`refusal`).

Keys of large norm: keys' features are taken at offset 0 (exp(-|w - k'|²/2) <= 1), as in the chunked backend; a
position whose every visible key underflowed has D = 0 and is counted in ``lost``, so favor_attention redoes such
calls with the per-position offsets of :func:`_favor_chunked.favor_causal_offsets`.

Triton is imported on first use (:func:`kernels`), so the library imports without it. Off CUDA the kernels run only
under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first use), which the CPU tests use.
"""

from __future__ import annotations

import math
import os

import torch

from ._precision import outside_autocast

DEFAULT_CHUNK = 64
_TINY = 1e-30
MAPS = {"features": 0, "softmax": 1, "relu": 2}


_FOUND: dict[str, bool] = {}  # whether triton imports, checked once (a plain dict: torch.compile traces it)


def triton_importable() -> bool:
    """Whether ``import triton`` succeeds here."""
    if "triton" not in _FOUND:
        try:
            import triton  # noqa: F401
        except ImportError:
            _FOUND["triton"] = False
        else:
            _FOUND["triton"] = True
    return _FOUND["triton"]


def refusal(
    v: torch.Tensor, num_features: int, chunk_size: int | None, *, inputs: tuple[torch.Tensor, ...] = ()
) -> str | None:
    """Why the Triton kernels cannot run this call, or None when they can. ``inputs``: the other tensors the kernels
    read (q and k, or the features), whose dtypes and widths count too."""
    for t in (v, *inputs):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"it computes float32, bfloat16 and float16 inputs, got {t.dtype} (backend='chunked' takes it)"
    widths = [("num_features", num_features), ("v's head_dim", v.shape[-1])]
    widths += [("the head_dim of q and k", t.shape[-1]) for t in inputs[:1]]
    for name, value in widths:
        if value % 16:
            return f"{name} must be a multiple of 16 (its tile width), got {value}"
    if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        return f"chunk_size must be a power of two >= 16 (its tile height), got {chunk_size}"
    if not triton_importable():
        return "triton is not installed (pip install triton)"
    if v.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it runs on CUDA tensors, these are on {v.device.type} (TRITON_INTERPRET=1 interprets it on the CPU)"
    return None


def _block(size: int) -> int:
    """The widest tile of 64, 32 or 16 that divides ``size`` (a multiple of 16)."""
    return next(b for b in (64, 32, 16) if size % b == 0)


def kernels():
    """The kernel module, imported on first use (Triton with it)."""
    from . import _triton_kernels

    return _triton_kernels


class _Launch:
    """One call's shapes, grid and the kernels' compile-time settings."""

    def __init__(self, q, v, w, kernel, chunk):
        b, h, n, d = v.shape
        self.b, self.h, self.n, self.d = b, h, n, d
        self.m = q.shape[-1] if kernel == "features" else w.shape[0]
        xd = q.shape[-1]  # what the kernels read per row of q and k: m for given features, head_dim otherwise
        self.grid = (b * h, self.m // _block(self.m), d // _block(d))
        # a program holds ~10 tiles of C x 64 float32 at the largest blocks: 8 warps keep them in registers
        self.warps = 8 if chunk * _block(self.m) >= 64 * 64 else 4
        # bf16 operands for bf16 inputs; under the interpreter, float32 operands rounded to bf16 (see _operand)
        ops = (1 if v.device.type == "cuda" else 2) if v.dtype == torch.bfloat16 else 0
        self.constants = dict(
            M=self.m,
            D=d,
            XD=xd,
            XDP=1 << (xd - 1).bit_length(),
            C=chunk,
            BM=_block(self.m),
            BD=_block(d),
            MAP=MAPS[kernel],
            OPS=ops,
            PREC="tf32" if ops == 1 else "ieee",  # bf16 operands ignore it; float32 ones stay float32 (no TF32)
        )


def _or(t, fallback):
    """A tensor for a pointer argument that the kernel does not read (its flag is off)."""
    return fallback if t is None else t


_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? w, Tensor? keep, Tensor? s0, Tensor? z0, str kernel, float scale, "
    "float eps, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor g, Tensor q, Tensor k, Tensor v, Tensor? w, Tensor? keep, Tensor qoff, Tensor? s0, Tensor? z0, "
    "Tensor out, Tensor den, str kernel, float scale, float eps, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _forward(q, k, v, w, keep, s0, z0, kernel, scale, eps, chunk):
    """The kernels' forward: (out float32 (b, h, n, d), D (b, h, n, 1), the queries' offsets (b·h, n), final S, z)."""
    kern = kernels()
    q, k, v = (t.contiguous() for t in (q, k, v))
    w = None if w is None else w.float().contiguous()
    keep = None if keep is None else keep.float().contiguous()
    launch = _Launch(q, v, w, kernel, chunk)
    b, h, n, d, m = launch.b, launch.h, launch.n, launch.d, launch.m
    cst = launch.constants
    dev = v.device
    root = math.sqrt(scale)
    qoff = torch.zeros(b * h, n, dtype=torch.float32, device=dev)
    if kernel == "softmax":
        kern._query_offsets[(b * h, -(-n // chunk))](
            q, w, qoff, n, scale, root, m, cst["XD"], cst["XDP"], chunk, cst["BM"], cst["OPS"], cst["PREC"]
        )
    num = torch.zeros(b * h, n, d, dtype=torch.float32, device=dev)
    den = torch.zeros(b * h, n, dtype=torch.float32, device=dev)
    s_out = torch.empty(b, h, m, d, dtype=torch.float32, device=dev)
    z_out = torch.empty(b, h, m, dtype=torch.float32, device=dev)
    has_s0 = s0 is not None
    s0 = s0.float().contiguous() if has_s0 else s_out
    z0 = z0.float().contiguous() if has_s0 else z_out
    kern._forward[launch.grid](
        q, k, v, _or(w, qoff), _or(keep, qoff), qoff, s0, z0, num, den, s_out, z_out, n, h, scale, root, eps,
        HAS_KEEP=keep is not None, HAS_S0=has_s0, num_warps=launch.warps, **cst,
    )  # fmt: skip
    den = den.view(b, h, n, 1)
    return num.view(b, h, n, d).div_(den.clamp_min(_TINY)), den, qoff, s_out, z_out


def _backward(g, q, k, v, w, keep, qoff, s0, z0, out, den, kernel, scale, eps, chunk):
    """The kernels' backward: dL/dq, dL/dk, dL/dv in their dtypes, dL/dS_0, dL/dz_0 (zeros without a state)."""
    kern = kernels()
    q, k, v = (t.contiguous() for t in (q, k, v))
    w = None if w is None else w.float().contiguous()
    keep = None if keep is None else keep.float().contiguous()
    launch = _Launch(q, v, w, kernel, chunk)
    b, h, n, d, m = launch.b, launch.h, launch.n, launch.d, launch.m
    cst = launch.constants
    inv = torch.where(den > _TINY, den.reciprocal(), torch.zeros_like(den))  # rows with no real key: no gradient
    gn = (g.float() * inv).contiguous()
    gd = -(gn * out).sum(-1).contiguous()
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    ds0 = torch.zeros(b, h, m, d, dtype=torch.float32, device=v.device)
    dz0 = torch.zeros(b, h, m, dtype=torch.float32, device=v.device)
    w_arg, keep_arg = _or(w, qoff), _or(keep, qoff)
    common = dict(HAS_KEEP=keep is not None, num_warps=launch.warps, **cst)
    kern._backward_q[launch.grid](
        q, k, v, w_arg, keep_arg, qoff, _or(s0, ds0), _or(z0, dz0), gn, gd, dq, n, h, scale, math.sqrt(scale), eps,
        HAS_S0=s0 is not None, **common,
    )  # fmt: skip
    kern._backward_kv[launch.grid](
        q, k, v, w_arg, keep_arg, qoff, gn, gd, dk, dv, ds0, dz0, n, h, scale, math.sqrt(scale), eps, **common
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), ds0, dz0


def _forward_fake(q, k, v, w, keep, s0, z0, kernel, scale, eps, chunk):
    b, h, n, d = v.shape
    m = q.shape[-1] if kernel == "features" else w.shape[0]
    shapes = ((b, h, n, d), (b, h, n, 1), (b * h, n), (b, h, m, d), (b, h, m))
    return tuple(v.new_empty(shape, dtype=torch.float32) for shape in shapes)


def _backward_fake(g, q, k, v, w, keep, qoff, s0, z0, out, den, kernel, scale, eps, chunk):
    b, h, _, d = v.shape
    m = q.shape[-1] if kernel == "features" else w.shape[0]
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    return *grads, v.new_empty((b, h, m, d), dtype=torch.float32), v.new_empty((b, h, m), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, w, keep, s0, z0, kernel, scale, eps, chunk = inputs
    out, den, qoff, _, _ = output
    ctx.settings = (kernel, scale, eps, chunk)
    ctx.save_for_backward(q, k, v, w, keep, qoff, s0, z0, out, den)


@outside_autocast  # loss.backward() may be called inside autocast
def _autograd_backward(ctx, g, _g_den, _g_qoff, _g_s, _g_z):
    q, k, v, w, keep, qoff, s0, z0, out, den = ctx.saved_tensors
    dq, dk, dv, ds0, dz0 = _backward_op(g, q, k, v, w, keep, qoff, s0, z0, out, den, *ctx.settings)
    state = s0 is not None
    return dq, dk, dv, None, None, ds0 if state else None, dz0 if state else None, None, None, None, None


# Custom ops: torch.compile keeps each whole, one node in its graph (no graph break, nothing traced inside)
_forward_op = torch.library.custom_op(
    "linearformers::triton_causal_linear", _forward, mutates_args=(), schema=_FORWARD_SCHEMA
)
_backward_op = torch.library.custom_op(
    "linearformers::triton_causal_linear_backward", _backward, mutates_args=(), schema=_BACKWARD_SCHEMA
)
_forward_op.register_fake(_forward_fake)
_backward_op.register_fake(_backward_fake)
_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_causal_linear(q, k, v, w, keep, kernel, scale, eps, chunk, s0=None, z0=None):
    """Causal linear attention through the Triton kernels (module docstring), as custom ops. Inputs: q, k
    (b, h, n, d) with w (m, d) and kernel "softmax" or "relu", or the features phi_q, phi_k (b, h, n, m) with w None
    and kernel "features"; v (b, h, n, d_v); keep (b, n) float (1 real, 0 padded) or None; scale, eps (the maps');
    chunk C (a power of two >= 16); s0 (b, h, m, d_v), z0 (b, h, m): the initial state at offset 0, or None.
    Gradients reach q, k, v and the initial state. Returns (out in v's dtype, S (b, h, m, d_v), z (b, h, m) float32,
    lost): the final state (detached) and the count (0-dim) of positions that see a real key yet whose every visible
    key underflowed."""
    out, den, _, s, z = _forward_op(q, k, v, w, keep, s0, z0, kernel, float(scale), float(eps), int(chunk))
    lost = den.detach() <= _TINY
    if keep is not None:
        lost = lost & (keep.cumsum(1) > 0)[:, None, :, None]
    return out.to(v.dtype), s.detach(), z.detach(), lost.sum()
