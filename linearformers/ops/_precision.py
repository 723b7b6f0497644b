"""Precision of the attention kernels: what stays in float32, what may run in bf16, and autocast.

What needs float32, in every kernel and on every device, whatever the inputs' dtype:
* feature exponents and their exp (FAVOR+'s w·x' - |x'|²/2 reaches -20 and below for ordinary keys, where bf16's
  8-bit mantissa would put an error of ~8% on exp; keys of large norm need float32's range for their offsets);
* every sum over positions: the running / per-chunk states S = Σ phi(k) vᵀ and z = Σ phi(k), the prefix over
  chunks, the Linformer's slot softmax and its running statistics, the local window's softmax;
* the denominators and the final division (a floor of 1e-30 is 0 in fp16), and backward's g / D, which reaches
  1e5 and more where a denominator is small (past fp16's 65504).
What may run in bf16: the operands of the large products. The chunked backends (GPUs, torch.compile) take them in
bf16 when their inputs are bf16 on CUDA (tensor cores: an order of magnitude above float32 by the hardware's specification; not measured here): features
(values in [0, 1], already exponentiated in float32), v, the intra-chunk scores and backward's g_aug and feature
gradients, cast just before each product, with results brought back to float32 before any sum or division
(``_favor_chunked.half_operands``; fla's chunked kernels make the same split). fp16 inputs keep float32 products
(the g / D range above), and so does the CPU, which has no bf16 GEMM units to gain from. The causal Linformer and
the Linformer hybrid make the same split on CUDA. The compiled CPU walk, the blockwise bidirectional kernel, the rare
large-key fallback and the Linformer's blockwise backend compute in float32 throughout; the Linformer's sequence
projection E x, a plain product like a Linear's, runs in the inputs' dtype, and so does its "sdpa" backend (the GPU
default: ``scaled_dot_product_attention``, whose kernels keep the softmax and the accumulation in float32). Outputs and
gradients come back in the inputs' dtypes.

Autocast would undo this behind the kernel's back: it runs each functional product in bf16 / fp16, so ``out=``
buffers no longer match (a crash), the floor 1e-30 of a denominator becomes 0 in fp16 (0 / 0 = NaN for queries with
no real key), -1e30 overflows fp16, and large exponents lose their precision. So each public op, and each
hand-written backward (``loss.backward()`` may be called inside the context), runs with autocast off on its
tensors' device: a call gives the same result, in the same dtype, inside ``torch.autocast`` as outside it. (The
parts left to autograd, such as the causal Linformer, local attention and the large-key FAVOR+ fallback, have
backward formulas that follow whatever autocast is on when backward runs, as for any torch op; torch recommends
calling backward outside the context, as Trainer and Accelerate do.)

Why the inputs' dtype out, not float32 (``torch.amp.custom_fwd(cast_inputs=torch.float32)``) nor always the
autocast dtype: inside an autocast region q, k and v come out of Linear layers in the autocast dtype, so the
output is in that dtype already, which the output projection would cast to anyway, at half the memory of a float32
activation; and a caller that hands in float32 keeps float32, so an op never lowers a precision it was given.
``custom_fwd`` would also fix one device type at import, where these ops run on CPU and CUDA alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# R of the hybrid (ops/hybrid.py's docstring): the most the linear factor exp(ℓ_t - c'_t) may reach, e^50, far
# inside float32 even times sums over a million keys of features up to a thousand
LOG_SCALE_HEADROOM = 50.0


def _device_type(args, kwargs) -> str | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def outside_autocast(fn: F) -> F:
    """Run ``fn`` with autocast disabled on the device of its first tensor argument (when autocast is on there)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = _device_type(args, kwargs)
        if device is None:
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            # the queries below are not traceable on every torch (Dynamo of torch 2.11 cannot trace
            # is_autocast_available); entering a disabled region is, and costs a compiled graph nothing
            with torch.autocast(device_type=device, enabled=False):
                return fn(*args, **kwargs)
        if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device_type=device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
