"""Hedgehog's feature map through its Triton kernels (_triton_hedgehog) against the map's PyTorch path: features and
the gradients of x, W and b, float32 and half inputs, widths that pad the tiles, lengths across the blocks.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at small
sizes. With CUDA (``pytest -m cuda``) HedgehogFeatureMap takes them by default: they are compared there at n = 4099,
12 heads x 64, m = 128 against the PyTorch path (``set_triton_kernels(False)``).
"""

import pytest
import torch

pytest.importorskip("triton")

from linearformers.ops import HedgehogFeatureMap, set_triton_kernels
from linearformers.ops import _triton_hedgehog as kernels
from linearformers.ops.feature_maps import softmax_pair
from tests.ops._triton_cases import CUDA, ON_CPU, randn


def _torch_map(x, weight, bias):
    """The map's PyTorch path in float32 (HedgehogFeatureMap.forward's composition)."""
    u = torch.matmul(x.float(), weight.float()) + bias.float()[None, :, None, :]
    return softmax_pair(u)


def _with_grads(fn, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _assert_close(got, want, tol, what):
    for name, a, b in zip(("phi", "dx", "dW", "db"), got, want):
        assert a.dtype == b.dtype or name != "phi", f"{what}: {name} dtype {a.dtype} != {b.dtype}"
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        error = (a.float() - b.float()).abs().max().item()
        bound = tol * max(b.float().abs().max().item(), 1e-3)
        assert error <= bound, f"{what}: {name} max error {error:.3g} > {bound:.3g}"


def _inputs(b, h, n, d, half, dtype, device="cpu", seed=0):
    x = randn(b, h, n, d, seed=seed, device=device, dtype=dtype, scale=1.5)
    weight = randn(h, d, half, seed=seed + 1, device=device, scale=0.5)
    bias = randn(h, half, seed=seed + 2, device=device, scale=0.3)
    grad = randn(b, h, n, 2 * half, seed=seed + 3, device=device)
    return x, weight, bias, grad


@ON_CPU
@pytest.mark.parametrize(
    "b, h, n, d, half",
    [(2, 3, 70, 16, 8), (1, 2, 5, 64, 64), (2, 1, 1, 40, 24), (1, 2, 129, 48, 96)],
    ids=["narrow", "tile", "one-position", "padded"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_match_the_pytorch_map(b, h, n, d, half, dtype):
    """Features and the gradients of x, W and b, from the same (rounded) inputs, to float32 rounding; dx in x's
    dtype."""
    x, weight, bias, grad = _inputs(b, h, n, d, half, dtype)
    got = _with_grads(kernels.hedgehog_features, x, weight, bias, grad)
    want = _with_grads(_torch_map, x, weight, bias, grad)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # dx is rounded to x's dtype
    _assert_close(got[:1], want[:1], 1e-5, f"{dtype} features")
    _assert_close(got[1:2], [want[1].to(dtype)], tol, f"{dtype} dx")
    _assert_close(got[2:], want[2:], 1e-5, f"{dtype} dW, db")


@ON_CPU
@pytest.mark.parametrize("programs", [1, 8])
def test_backward_programs_that_walk_several_blocks(programs, monkeypatch):
    """With a small grid target each backward program sums dW, db over several blocks of positions (the last past
    n): the same gradients."""
    monkeypatch.setattr(kernels, "PROGRAMS", programs)
    assert kernels._blocks_per_program(4, 5) > 1
    x, weight, bias, grad = _inputs(2, 2, 300, 16, 24, torch.float32, seed=8)
    got = _with_grads(kernels.hedgehog_features, x, weight, bias, grad)
    want = _with_grads(_torch_map, x, weight, bias, grad)
    _assert_close(got, want, 1e-5, f"PROGRAMS={programs}")


@ON_CPU
def test_strided_inputs_and_separate_maps_of_the_module():
    """x as the transposed view a layer makes, both maps of a separate HedgehogFeatureMap, the parameters' grads;
    each half of the features sums to 1."""
    torch.manual_seed(0)
    fmap = HedgehogFeatureMap(2, 16, 32)
    with torch.no_grad():
        for p in fmap.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = randn(1, 9, 2, 16, seed=4).transpose(1, 2)  # (b, h, n, d) with stride(-1) 1, not contiguous
    for is_query in (True, False):
        weight = fmap.weight if is_query else fmap.key_weight
        bias = fmap.bias if is_query else fmap.key_bias
        grad = randn(1, 2, 9, 32, seed=5)
        got = _with_grads(kernels.hedgehog_features, x, weight, bias, grad)
        want = _with_grads(_torch_map, x, weight, bias, grad)
        _assert_close(got, want, 1e-5, f"is_query={is_query}")
        halves = got[0].unflatten(-1, (2, -1)).sum(-1)
        torch.testing.assert_close(halves, torch.ones_like(halves))


@ON_CPU
def test_refusals_name_the_problem():
    x = torch.zeros(1, 1, 4, 16)
    weight = torch.zeros(1, 16, 8)
    assert kernels.refusal(x, weight) is None  # under the interpreter
    assert "float64" in kernels.refusal(x.double(), weight)
    assert "float64" in kernels.refusal(x, weight.double())
    assert "m / 2 must be at most 128" in kernels.refusal(x, torch.zeros(1, 16, 130))
    assert "head_dim must be at most 128" in kernels.refusal(torch.zeros(1, 1, 4, 160), torch.zeros(1, 160, 8))
    # the CPU keeps the PyTorch path whatever the switch says
    assert not kernels.takes_kernels(x, weight)


@ON_CPU
def test_the_module_keeps_its_pytorch_path_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "linearformers.ops.feature_maps.hedgehog_features", lambda *a: calls.append(1) or _torch_map(*a)
    )
    fmap = HedgehogFeatureMap(2, 16)
    fmap(torch.randn(1, 2, 5, 16), is_query=True)
    assert not calls


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("separate", [True, False])
def test_the_module_takes_the_kernels_on_cuda(dtype, separate, monkeypatch):
    """On CUDA HedgehogFeatureMap maps through the kernels (counted) and matches its PyTorch path
    (set_triton_kernels(False)) at n = 4099, 12 heads x 64, m = 128: features and every gradient."""
    calls = []
    real = kernels.hedgehog_features
    monkeypatch.setattr("linearformers.ops.feature_maps.hedgehog_features", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    fmap = HedgehogFeatureMap(12, 64, 128, separate=separate, device="cuda")
    with torch.no_grad():
        for p in fmap.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    x = randn(1, 12, 4099, 64, seed=6, device="cuda", dtype=dtype)
    grad = randn(1, 12, 4099, 128, seed=7, device="cuda")

    def run():
        fmap.zero_grad(set_to_none=True)
        leaf = x.detach().clone().requires_grad_()
        phi = fmap(leaf, is_query=False)
        phi.backward(grad)
        grads = [p.grad.float() for p in (fmap.key_weight, fmap.key_bias) if p is not None and p.grad is not None]
        grads += [p.grad.float() for p in (fmap.weight, fmap.bias) if p.grad is not None]
        return [phi.detach(), leaf.grad.float(), *grads]

    got = run()
    assert calls, "the kernels did not run"
    previous = set_triton_kernels(False)
    try:
        calls.clear()
        want = run()
        assert not calls
    finally:
        set_triton_kernels(previous)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _assert_close(got[:1], want[:1], 1e-4, "features")
    _assert_close(got[1:], want[1:], tol, "gradients")
