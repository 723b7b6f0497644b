"""Causal linear attention of precomputed features on the compiled CPU walk (_native, feature map "features").

    out_t = Σ_{s<=t} (phi_q,t · phi_k,s) v_s / Σ_{s<=t} phi_q,t · phi_k,s      (padded keys left out)

Why: feature maps are their own part (random, fixed or learned); whatever map produced phi_q and phi_k, the causal
chunk walk of favor_causal.cpp runs it, with the memory of that walk (the state at each block start, no per-position
prefix tensor) and a hand-written backward through the same walk, which returns d phi_q, d phi_k and dv; gradients
into the map itself are left to autograd upstream.

Constraints: CPU tensors on a machine where ``_native.available()``; compute in float32 whatever the inputs' dtype
(gradients come back in the inputs' dtypes, the output in v's); m (features), d (v's head dim) and chunk multiples
of 16 (the kernel's tile width; n is padded up to a whole number of chunks here). Features must be nonnegative, as
any positive feature map gives; denominators are floored at 1e-30 as in the FAVOR+ walk, so a query that sees no real
key outputs 0 and passes no gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._native import backward as native_backward
from ._native import forward as native_forward
from ._native import supports as native_supports
from ._precision import outside_autocast


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (b, h, n, f) as contiguous float32 with ``pad`` zero rows after position n."""
    x = x.float()
    return (torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x).contiguous()


def _native_inputs(phi_q, phi_k, v, key_weights, pad):
    """The walk's inputs: float32, contiguous, padded to a whole number of chunks; key_weights as (b, n) floats (the
    padded rows 0), None when every position is real."""
    if pad and key_weights is None:
        key_weights = torch.ones(v.shape[0], 1, v.shape[2], 1, device=v.device)
    key_weights_2d = (
        None if key_weights is None else torch.nn.functional.pad(key_weights[:, 0, :, 0].float(), (0, pad)).contiguous()
    )
    return _pad_rows(phi_q, pad), _pad_rows(phi_k, pad), _pad_rows(v, pad), key_weights_2d


def _check(phi_q, phi_k, v, key_weights, chunk):
    if phi_q.dim() != 4 or phi_k.shape != phi_q.shape or v.dim() != 4 or v.shape[:3] != phi_q.shape[:3]:
        raise ValueError(
            f"LinearCausalNative takes phi_q, phi_k (b, h, n, m) and v (b, h, n, d), got {tuple(phi_q.shape)}, "
            f"{tuple(phi_k.shape)}, {tuple(v.shape)}"
        )
    if key_weights is not None and key_weights.shape != (v.shape[0], 1, v.shape[2], 1):
        raise ValueError(f"key_weights must be (b, 1, n, 1), got {tuple(key_weights.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if not native_supports(v, phi_q.shape[-1], chunk):
        raise ValueError(
            "the native walk cannot run this call: it needs CPU tensors, num_features, head_dim and chunk multiples "
            f"of 16 (got {phi_q.shape[-1]}, {v.shape[-1]}, {chunk} on {v.device.type}) and a built kernel"
        )


class LinearCausalNative(torch.autograd.Function):
    """Causal linear attention of given features through the compiled walk.

    forward(phi_q, phi_k, v, key_weights, chunk, block_chunks): phi_q, phi_k (b, h, n, m), v (b, h, n, d);
    key_weights None or (b, 1, n, 1) float (1 real, 0 padded); chunk positions per chunk; block_chunks chunks per
    saved state (None: the native default). Returns out (b, h, n, d) in v's dtype and the final state
    S = Σ phi_k vᵀ (b, h, m, d) and z = Σ phi_k (b, h, m), float32, over real keys and not differentiable."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, key_weights, chunk, block_chunks):
        _check(phi_q, phi_k, v, key_weights, chunk)
        n = v.shape[2]
        pad = (-n) % chunk
        qf, kf, vf, key_weights_2d = _native_inputs(phi_q, phi_k, v, key_weights, pad)
        out, den, starts, zstarts, s_final, z_final, _, per_block = native_forward(
            qf, kf, vf, None, key_weights_2d, "features", 1.0, 0.0, chunk, n, block_chunks
        )
        ctx.settings = (chunk, pad, per_block)
        ctx.save_for_backward(phi_q, phi_k, v, key_weights, out, den, starts, zstarts)
        ctx.mark_non_differentiable(s_final, z_final)
        return out[:, :, :n].to(v.dtype), s_final, z_final

    @staticmethod
    @once_differentiable  # backward is hand-written: a second derivative is refused, not wrong
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g, _gs, _gz):
        phi_q, phi_k, v, key_weights, out, den, starts, zstarts = ctx.saved_tensors
        chunk, pad, per_block = ctx.settings
        n = v.shape[2]
        qf, kf, vf, key_weights_2d = _native_inputs(phi_q, phi_k, v, key_weights, pad)
        gf = _pad_rows(g, pad)
        dq, dk, dv = native_backward(
            qf, kf, vf, None, key_weights_2d, "features", 1.0, 0.0, chunk, gf, out, den, starts, zstarts, per_block
        )
        grads = (dq[:, :, :n].to(phi_q.dtype), dk[:, :, :n].to(phi_k.dtype), dv[:, :, :n].to(v.dtype))
        return (*grads, None, None, None)
