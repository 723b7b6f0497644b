"""The attention kernels under autocast.

Every kernel here computes in float32 whatever its inputs' dtype (feature maps, softmax, running sums and the final
division; only the Linformer's sequence projection E x, a plain product like a Linear's, runs in the inputs' dtype),
partly with in-place and ``out=`` products on float32 buffers, and returns the dtype of its inputs.
Autocast would undo that behind the kernel's back: it runs each functional product in bf16 / fp16, so ``out=``
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
        if device is None or not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device_type=device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
