"""Hedgehog's learned feature map (:class:`feature_maps.HedgehogFeatureMap`) as two Triton kernels, its CUDA path.

    u = x W_h + b_h,    phi(x) = [softmax(u), softmax(-u)]

Composed of torch's ops, the map is a cast of x to float32, the product, the bias, two softmaxes and their
concatenation, and backward as many again (the softmaxes' Jacobian-vector products, two products, the sums): about
eight kernels each way, each a pass over (n, m) float32 in memory, and a float32 copy of x kept for backward. Here
one program takes BN positions of one (batch, head): ``_hedgehog_forward`` forms u in registers, both softmaxes, and
stores the features once; ``_hedgehog_backward`` forms them again from x (one product), writes dL/dx in x's dtype
and sums dL/dW_h = xᵀ du and dL/db_h = Σ du over R blocks in registers before adding them to float32 buffers
atomically (one add per program, not per block: every program of a head adds to the same floats). Kept for
backward: x in its own dtype, W and b.

Precision as the PyTorch path's: float32 products (``input_precision="ieee"``: no TF32, no bf16 operands),
exponentials and sums; float32 features out, whatever x's dtype. float64 stays with the PyTorch path.

Tiles: BN = 64 positions; head_dim and m / 2 padded to powers of two of at least 64 columns, masked, so that every
product's tiles are at least 64 wide (Triton 3.6 compiled products of 64-row tiles with 16- or 32-wide operands wrong
on an H200, see :mod:`_triton_causal`); widths over 128 (and float64) take the PyTorch path.

The map takes these kernels on CUDA when the Triton kernels are switched on (``set_triton_kernels``) and autograd
is not being traced by ``torch.compile`` (which fuses the PyTorch path itself); the CPU keeps the PyTorch path, and
the tests run the kernels under Triton's interpreter.
"""

from __future__ import annotations

import torch

from ._triton_causal import where_refusal

BN = 64
PROGRAMS = 512  # the backward grid's target size: about four programs per multiprocessor of an H100 / H200
MIN_TILE = 64
MAX_WIDTH = 128


def refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernels cannot map ``x`` with ``weight`` (heads, head_dim, m / 2), or None when they can."""
    for name, t in (("x", x), ("the weight", weight)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"{name} must be float32, bfloat16 or float16, got {t.dtype}"
    for name, value in (("head_dim", weight.shape[1]), ("m / 2", weight.shape[2])):
        if value > MAX_WIDTH:
            return f"{name} must be at most {MAX_WIDTH} (one tile), got {value}"
    return where_refusal(x)


def takes_kernels(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`HedgehogFeatureMap` maps ``x`` with the kernels: CUDA tensors, the Triton kernels switched on,
    not traced by torch.compile, and nothing in :func:`refusal`."""
    from .backends import triton_kernels_enabled

    return (
        x.device.type == "cuda"
        and triton_kernels_enabled()
        and not torch.compiler.is_compiling()
        and refusal(x, weight) is None
    )


def _settings(weight: torch.Tensor) -> dict:
    _, d, half = weight.shape
    dp, hp = (max(MIN_TILE, 1 << (size - 1).bit_length()) for size in (d, half))
    return dict(D=d, DP=dp, HALF=half, HP=hp, BN=BN, num_warps=4 if hp <= 64 else 8, num_stages=1)


def _blocks_per_program(rows: int, blocks: int) -> int:
    """R: the blocks of BN positions one backward program walks, summing its dL/dW, dL/db in registers before one
    atomic add, so that every program of a head does not add to the same (head_dim, m / 2) floats: a power of two up
    to 16, as many as leave about PROGRAMS programs in the grid."""
    per = 1
    while per < 16 and rows * -(-blocks // (2 * per)) >= PROGRAMS:
        per *= 2
    return per


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along head_dim (a copy only where it lacks one)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _HedgehogMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        from ._triton_hedgehog_kernels import _hedgehog_forward

        x = _rows(x)
        weight, bias = weight.contiguous(), bias.contiguous()
        b, h, n, _ = x.shape
        half = weight.shape[2]
        out = torch.empty(b, h, n, 2 * half, dtype=torch.float32, device=x.device)
        if out.numel():
            _hedgehog_forward[(b * h, -(-n // BN))](
                x, weight, bias, out, n, h, x.stride(0), x.stride(1), x.stride(2), **_settings(weight)
            )
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, g):
        from ._triton_hedgehog_kernels import _hedgehog_backward

        x, weight, bias = ctx.saved_tensors
        b, h, n, d = x.shape
        dx = torch.empty(b, h, n, d, dtype=x.dtype, device=x.device)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        db = torch.zeros(bias.shape, dtype=torch.float32, device=x.device)
        if dx.numel():
            blocks = -(-n // BN)
            per = _blocks_per_program(b * h, blocks)
            _hedgehog_backward[(b * h, -(-blocks // per))](
                x, weight, bias, g.contiguous(), dx, dw, db, n, h, x.stride(0), x.stride(1), x.stride(2), R=per,
                **_settings(weight),
            )  # fmt: skip
        need_x, need_w, need_b = ctx.needs_input_grad
        return (
            dx if need_x else None,
            dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None,
        )


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[softmax(x W_h + b_h), softmax(-(x W_h + b_h))] per head through the kernels: x (batch, heads, n, head_dim),
    weight (heads, head_dim, m / 2), bias (heads, m / 2) -> (batch, heads, n, m) float32, differentiable in all
    three. The caller checks :func:`refusal` (or :func:`takes_kernels`) first."""
    return _HedgehogMap.apply(x, weight, bias)
