"""Causal FAVOR+ on the compiled CPU walk (_native/favor_causal.cpp) as an autograd function. The gradients are
those of _favor_blockwise's module docstring, with prefix sums running forward for dphi(Q) and suffix sums running
backward for dphi(K) and dV, each split into whole chunks and a triangular intra-chunk part; the walk computes both
directions, and this wrapper pads, casts and keeps what backward needs.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._native import backward as native_backward
from ._native import forward as native_forward
from ._precision import outside_autocast


class FavorCausalNative(torch.autograd.Function):
    """Causal FAVOR+ on the compiled CPU walk (_native/favor_causal.cpp): chunks of C positions, one running state
    S = Σ phi(k) [v, 1]ᵀ carried chunk by chunk, the feature map fused into the walk's GEMM tiles. Forward keeps the
    state at the start of each block of ``block_chunks`` chunks; backward walks the blocks in reverse, rebuilding the
    state forward inside each block for dphi(Q) and carrying the gradient of the state backward for dphi(K) and dV.
    Returns (out in v's dtype, the final S (b, h, m, d) and z (b, h, m) at offset 0, the count of lost positions:
    queries whose every visible key underflowed at offset 0), the last three not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, w, key_weights, feature_map, scale, eps, chunk, block_chunks=None):
        n = v.shape[2]
        pad = (-n) % chunk
        qf, kf, vf, key_weights_2d = _native_inputs(q, k, v, key_weights, pad)
        out, den, starts, zstarts, s_final, z_final, lost, per_block = native_forward(
            qf, kf, vf, w.float(), key_weights_2d, feature_map, scale, eps, chunk, n, block_chunks
        )
        ctx.settings = (feature_map, scale, eps, chunk, pad, per_block)
        ctx.save_for_backward(q, k, v, w, key_weights, out, den, starts, zstarts)
        ctx.mark_non_differentiable(s_final, z_final, lost)
        return out[:, :, :n].to(v.dtype), s_final, z_final, lost

    @staticmethod
    @once_differentiable  # backward is hand-written: a second derivative is refused, not wrong
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g, _gs, _gz, _lost):
        q, k, v, w, key_weights, out, den, starts, zstarts = ctx.saved_tensors
        feature_map, scale, eps, chunk, pad, per_block = ctx.settings
        n = v.shape[2]
        qf, kf, vf, key_weights_2d = _native_inputs(q, k, v, key_weights, pad)
        gf = _pad_rows(g.float(), pad).contiguous()
        dq, dk, dv = native_backward(
            qf,
            kf,
            vf,
            w.float(),
            key_weights_2d,
            feature_map,
            scale,
            eps,
            chunk,
            gf,
            out,
            den,
            starts,
            zstarts,
            per_block,
        )
        grads = (dq[:, :, :n].to(q.dtype), dk[:, :, :n].to(k.dtype), dv[:, :, :n].to(v.dtype))
        return (*grads, None, None, None, None, None, None, None)


def _native_inputs(q, k, v, key_weights, pad):
    """float32, contiguous, padded to a whole number of chunks; key_weights as (b, n) floats, None when all real."""
    qf, kf, vf = (_pad_rows(t.float(), pad).contiguous() for t in (q, k, v))
    if pad and key_weights is None:
        key_weights = torch.ones(v.shape[0], 1, v.shape[2], 1, device=v.device)
    key_weights_2d = (
        None if key_weights is None else torch.nn.functional.pad(key_weights[:, 0, :, 0].float(), (0, pad)).contiguous()
    )
    return qf, kf, vf, key_weights_2d


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
