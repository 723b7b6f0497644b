"""What the causal and bidirectional Triton kernel tests share: the CPU/CUDA marks, the tolerances, seeded inputs, a
padding mask and the gradient comparison."""

import pytest
import torch

CUDA = torch.cuda.is_available()
ON_CPU = pytest.mark.skipif(CUDA, reason="with CUDA the cuda cases run the compiled kernels")
ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
DTYPES = [torch.float32, torch.bfloat16]
# max error / max |reference|: float32 computes in float32 throughout; bf16 rounds its operands (and the output)
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 4e-2}


def randn(*shape, seed, device="cpu", dtype=torch.float32, scale=1.0):
    """Normal draws from ``seed``, made in float64 on the CPU so that every device and dtype gets the same values."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def padding_mask(b, n, device="cpu"):
    """Left padding in the first sequence, right padding in the second (both keep a real key)."""
    mask = torch.ones(b, n, dtype=torch.bool, device=device)
    if b > 1 and n > 2:
        mask[0, : n // 3] = False
        mask[1, n - n // 3 :] = False
    return mask


def run_with_grads(fn, inputs, grad):
    """fn's output and its inputs' gradients under the upstream gradient ``grad``, all in float64."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach().double(), *(t.grad.double() for t in leaves)]


def assert_close(got, expected, tol, what, names=("out", "grad 1", "grad 2", "grad 3", "grad 4", "grad 5")):
    """Each of ``got`` finite and within ``tol`` of ``expected``, relative to the largest |expected| (at least 1)."""
    for name, a, b in zip(names, got, expected):
        assert torch.isfinite(a).all(), f"{what}: {name} is not finite"
        error = (a - b).abs().max().item()
        bound = tol * max(b.abs().max().item(), 1.0)  # an exact 0 (dphi_q, dq at n = 1) gets the scale of 1
        assert error <= bound, f"{what}: {name} max error {error:.3g} > {bound:.3g}"
