"""Bidirectional linear attention as fused Triton kernels: the two products of
:class:`_favor_chunked.FavorBidirectionalChunked`, with the FAVOR+ feature maps computed inside the kernels.

    KV = Σ_s phi_k,s [v_s, 1]ᵀ  (real keys s),      out_t = phi_q,t KV[:, :d] / phi_q,t KV[:, d]

Opt-in until measured on a GPU: ``backend="triton"`` runs it when named, ``backend=None`` never picks it. The
kernels have run only under Triton's interpreter so far.

Kernels (:mod:`_triton_bidirectional_kernels`; ``_offsets`` is the causal kernels' own, in :mod:`_triton_causal_kernels`):

* ``_offsets`` (softmax map): the largest of each position's m exponents, one float per query and per key. The keys'
  maximum over the real keys of a (batch, head), in torch, is their offset: taken off every key exponent, it cancels
  in N / D and keeps keys of large norm from underflowing (no causality to keep here). The queries keep their own
  row maximum, which cancels in N / D too.
* ``_sums`` (pass 1), grid (batch·heads·P, m / BM): a program walks one of P segments of the keys in tiles of C
  positions, builds its BM features of each tile (from k and BM rows of the projection, or loaded when given) and
  adds phi_kᵀ V and Σ phi_k into (BM, d) and (BM,) float32 registers; the P segments' shares go to a
  (batch·heads, P, m, d + 1) buffer and are summed in torch (deterministic, no atomics). P is chosen so that the
  grid holds about two programs per multiprocessor (the interpreter: 8 programs, so the CPU tests cross segments).
* ``_output`` (pass 2), grid (batch·heads, n_q / C): C queries' features, m-block by m-block, times KV, summed in
  registers: out and D, float32.
* ``_grad_q`` and ``_grad_kv`` (backward), grid (batch·heads, n / C) each, after one more ``_sums`` over the queries:

      dKV = Σ_t phi_q,t g_aug,tᵀ,   g_aug = [gn, gd] = [g / D, -(g · out) / D]            (``_sums``, queries)
      dphi_q,t = KV g_aug,t         (``_grad_q``)
      dphi_k,s = dKV [v_s, 1],  dv_s = dKV[:, :d]ᵀ phi_k,s   (``_grad_kv``; 0 for padded keys)

  then through the maps inside the same programs, as in the causal kernels (``_feature_grad``): du = dphi · phi
  (softmax) or dphi where u > 0 (relu), dx = s^½ du W, less s x Σ_m du for the softmax map's keys. A program sums
  its m-blocks' shares of dx in registers and stores its rows once: no atomics anywhere.

Kept for backward: the inputs, the output and D (float32), KV (m (d + 1) per head), the queries' offsets (one float
per query) and the keys' (one per head); nothing of size (n, m). Backward recomputes the features, in three passes
over the sequence (dKV, queries, keys).

Precision as in :mod:`_triton_causal`: exponents, features, KV, D and every sum are float32; for bf16 inputs the
products' operands are bf16 (the exponents' product split as x W_hi + x W_lo), emulated under the interpreter as
float32 values rounded to bf16; float32 and fp16 inputs compute in float32 (no TF32); float64 is refused.

Both passes are custom ops (``torch.library``) with autograd and fake implementations, so torch.compile keeps each
as one node. Queries and keys may differ in length.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ._precision import outside_autocast
from ._triton_causal import MAPS

_TINY = 1e-30


def kernels():
    """The kernel module, imported on first use (Triton with it)."""
    from ._triton_bidirectional_kernels import _grad_kv, _grad_q, _output, _sums
    from ._triton_causal_kernels import _offsets

    return SimpleNamespace(_grad_kv=_grad_kv, _grad_q=_grad_q, _offsets=_offsets, _output=_output, _sums=_sums)


def _block(size: int) -> int:
    """The widest tile of 64, 32 or 16 that divides ``size`` (a multiple of 16)."""
    return next(b for b in (64, 32, 16) if size % b == 0)


def _pow2(size: int) -> int:
    return 1 << (size - 1).bit_length()


class _Launch:
    """One call's shapes and the kernels' compile-time settings."""

    def __init__(self, q, k, v, w, feature_map, chunk, scale, eps):
        b, h, nk, d = v.shape
        self.b, self.h, self.nq, self.nk, self.d = b, h, q.shape[2], nk, d
        self.chunk, self.scale, self.root, self.eps = chunk, scale, math.sqrt(scale), eps
        self.m = q.shape[-1] if feature_map == "features" else w.shape[0]
        xd = q.shape[-1]  # what the kernels read per row of q and k: m for given features, head_dim otherwise
        ops = (1 if v.device.type == "cuda" else 2) if v.dtype == torch.bfloat16 else 0  # see _triton_causal
        self.warps = 8 if chunk * _block(self.m) >= 64 * 64 else 4
        self.shape = dict(M=self.m, D=d, DP=_pow2(d), XD=xd, XDP=_pow2(xd), C=chunk, BM=_block(self.m))
        self.settings = dict(MAP=MAPS[feature_map], OPS=ops, PREC="tf32" if ops == 1 else "ieee")

    def segments(self, n: int, device: torch.device) -> tuple[int, int]:
        """(P, L): pass 1's n positions cut into P segments of L (whole tiles), about two programs per
        multiprocessor (the interpreter: 8 programs)."""
        tiles = -(-n // self.chunk)
        programs = self.b * self.h * (self.m // self.shape["BM"])
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        per_segment = -(-tiles // max(1, min(tiles, -(-target // programs))))
        length = per_segment * self.chunk
        return -(-n // length), length


def _or(t, fallback):
    """A tensor for a pointer argument that the kernel does not read (its flag is off)."""
    return fallback if t is None else t


def _sums(kern, launch, x, y, g, w, key_weights, off, n, *, queries):
    """Σ phi yᵀ (b·h, m, d) and Σ phi weight (b·h, m), float32, over n rows of x: keys (y = v, weight 1 for real
    keys) or queries (y = gn, weight gd)."""
    (count, length), b, h, m, d = launch.segments(n, y.device), launch.b, launch.h, launch.m, launch.d
    s = torch.empty(b * h * count, m, d, dtype=torch.float32, device=y.device)
    z = torch.empty(b * h * count, m, dtype=torch.float32, device=y.device)
    kern._sums[(b * h * count, m // launch.shape["BM"])](
        x, y, _or(g, off), _or(w, off), _or(key_weights, off), off, s, z, n, h, count, length, launch.scale,
        launch.root, launch.eps, HAS_KEY_WEIGHTS=key_weights is not None, QUERIES=queries, num_warps=launch.warps,
        **launch.shape, **launch.settings,
    )  # fmt: skip
    return s.view(b * h, count, m, d).sum(1), z.view(b * h, count, m).sum(1)


def _offsets(kern, launch, q, k, w, key_weights, feature_map):
    """The queries' offsets (b·h, n_q) and the keys' (b·h,): zeros except for the softmax map (module docstring);
    a (batch, head) without a real key takes 0."""
    b, h, dev = launch.b, launch.h, q.device
    qoff = torch.zeros(b * h, launch.nq, dtype=torch.float32, device=dev)
    koff = torch.zeros(b * h, dtype=torch.float32, device=dev)
    if feature_map != "softmax":
        return qoff, koff
    shape, c = launch.shape, launch.chunk
    args = (launch.scale, launch.root, shape["M"], shape["XD"], shape["XDP"], c, shape["BM"])
    tail = (launch.settings["OPS"], launch.settings["PREC"])
    kern._offsets[(b * h, -(-launch.nq // c))](q, w, qoff, launch.nq, *args, True, *tail)
    rows = torch.empty(b * h, launch.nk, dtype=torch.float32, device=dev)
    kern._offsets[(b * h, -(-launch.nk // c))](k, w, rows, launch.nk, *args, False, *tail)
    if key_weights is not None:
        rows = rows.view(b, h, launch.nk).masked_fill(key_weights[:, None, :] == 0, -math.inf).view(b * h, launch.nk)
    top = rows.amax(1)
    return qoff, torch.where(torch.isfinite(top), top, koff)


def _prepare(q, k, v, w, key_weights, feature_map, scale, eps, chunk):
    q, k, v = (t.contiguous() for t in (q, k, v))
    w = None if w is None else w.float().contiguous()
    key_weights = None if key_weights is None else key_weights.float().contiguous()
    return q, k, v, w, key_weights, _Launch(q, k, v, w, feature_map, chunk, scale, eps)


def _forward(q, k, v, w, key_weights, feature_map, scale, eps, chunk):
    """(out float32 (b, h, n_q, d), D (b, h, n_q), the queries' offsets (b·h, n_q), the keys' (b·h,),
    S (b·h, m, d), z (b·h, m))."""
    kern = kernels()
    q, k, v, w, key_weights, launch = _prepare(q, k, v, w, key_weights, feature_map, scale, eps, chunk)
    b, h, nq, d = launch.b, launch.h, launch.nq, launch.d
    qoff, koff = _offsets(kern, launch, q, k, w, key_weights, feature_map)
    s, z = _sums(kern, launch, k, v, None, w, key_weights, koff, launch.nk, queries=False)
    out = torch.empty(b, h, nq, d, dtype=torch.float32, device=v.device)
    den = torch.empty(b, h, nq, dtype=torch.float32, device=v.device)
    kern._output[(b * h, -(-nq // chunk))](
        q, _or(w, qoff), qoff, s, z, out, den, nq, launch.scale, launch.root, eps, num_warps=launch.warps,
        **launch.shape, **launch.settings,
    )  # fmt: skip
    return out, den, qoff, koff, s, z


def _backward(g, q, k, v, w, key_weights, qoff, koff, s, z, out, den, feature_map, scale, eps, chunk):
    """dL/dq, dL/dk, dL/dv in their dtypes."""
    kern = kernels()
    q, k, v, w, key_weights, launch = _prepare(q, k, v, w, key_weights, feature_map, scale, eps, chunk)
    b, h = launch.b, launch.h
    inv = torch.where(den > _TINY, den.reciprocal(), torch.zeros_like(den))[..., None]  # no real key: no gradient
    gn = (g.float() * inv).contiguous()
    gd = -(gn * out).sum(-1).contiguous()
    ds, dz = _sums(kern, launch, q, gn, gd, w, None, qoff, launch.nq, queries=True)
    dq, dk = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k))
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    common = dict(num_warps=launch.warps, **launch.shape, **launch.settings)
    w_arg = _or(w, qoff)
    kern._grad_q[(b * h, -(-launch.nq // chunk))](
        q, w_arg, qoff, s, z, gn, gd, dq, launch.nq, launch.scale, launch.root, eps, **common
    )
    kern._grad_kv[(b * h, -(-launch.nk // chunk))](
        k, v, w_arg, _or(key_weights, koff), koff, ds, dz, dk, dv, launch.nk, h, launch.scale, launch.root, eps,
        HAS_KEY_WEIGHTS=key_weights is not None, **common,
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? w, Tensor? key_weights, str feature_map, float scale, float eps, "
    "int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor g, Tensor q, Tensor k, Tensor v, Tensor? w, Tensor? key_weights, Tensor qoff, Tensor koff, Tensor s, "
    "Tensor z, Tensor out, Tensor den, str feature_map, float scale, float eps, int chunk) -> (Tensor, Tensor, Tensor)"
)


def _forward_fake(q, k, v, w, key_weights, feature_map, scale, eps, chunk):
    b, h, _, d = v.shape
    nq = q.shape[2]
    m = q.shape[-1] if feature_map == "features" else w.shape[0]
    shapes = ((b, h, nq, d), (b, h, nq), (b * h, nq), (b * h,), (b * h, m, d), (b * h, m))
    return tuple(v.new_empty(shape, dtype=torch.float32) for shape in shapes)


def _backward_fake(g, q, k, v, w, key_weights, qoff, koff, s, z, out, den, feature_map, scale, eps, chunk):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, w, key_weights, feature_map, scale, eps, chunk = inputs
    out, den, qoff, koff, s, z = output
    ctx.settings = (feature_map, scale, eps, chunk)
    ctx.save_for_backward(q, k, v, w, key_weights, qoff, koff, s, z, out, den)


@outside_autocast  # loss.backward() may be called inside autocast
def _autograd_backward(ctx, g, _g_den, _g_qoff, _g_koff, _g_s, _g_z):
    dq, dk, dv = _backward_op(g, *ctx.saved_tensors, *ctx.settings)
    return dq, dk, dv, None, None, None, None, None, None


# Custom ops: torch.compile keeps each whole, one node in its graph (no graph break, nothing traced inside)
_forward_op = torch.library.custom_op(
    "linearformers::triton_bidirectional_linear", _forward, mutates_args=(), schema=_FORWARD_SCHEMA
)
_backward_op = torch.library.custom_op(
    "linearformers::triton_bidirectional_linear_backward", _backward, mutates_args=(), schema=_BACKWARD_SCHEMA
)
_forward_op.register_fake(_forward_fake)
_backward_op.register_fake(_backward_fake)
_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_bidirectional_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor | None,
    key_weights: torch.Tensor | None,
    feature_map: str,
    scale: float,
    eps: float,
    chunk: int,
) -> torch.Tensor:
    """Bidirectional linear attention through the Triton kernels (module docstring), as custom ops. Inputs: q
    (b, h, n_q, d), k (b, h, n_k, d) with w (m, d) and feature_map "softmax" or "relu", or the features phi_q
    (b, h, n_q, m), phi_k (b, h, n_k, m) with w None and feature_map "features"; v (b, h, n_k, d_v); key_weights
    (b, n_k) float (1 real, 0 padded) or None; scale, eps (the maps'); chunk C, the tile of positions (a power of two
    >= 16). Gradients reach q, k and v. Returns (b, h, n_q, d_v) in v's dtype; a query without a real key outputs 0."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # kept for backward as they are (views would be copied again)
    out = _forward_op(q, k, v, w, key_weights, feature_map, float(scale), float(eps), int(chunk))[0]
    return out.to(v.dtype)
