"""bf16 outputs and gradients of every attention kernel against float64 from the same bf16-rounded inputs.

A kernel that computes in float32 from bf16 inputs (``_precision``) rounds only its output and its input gradients
to bf16 (a gradient that reaches q by two paths, the kernel and the feature map, is the bf16 sum of two such
roundings): every element then stays within a few bf16 half ulps (2^-9 relative) of the exact result, so the
relative max error max|g - g64| / max|g64| stays at a few 1e-3 whatever the positions. A mean bound alone would
miss a few positions that lose their digits (a cancellation at low precision); hence a bound on the max as well.
Bounds are 2-3x the errors measured on the CPU. On CUDA the kernels multiply bf16 operands on the tensor cores
(features, states, scores rounded to bf16 before each product, with float32 accumulation, as flash attention rounds
its probabilities): a few more roundings per element, up to 0.0147 (max) and 0.0085 (mean) on an H100, where the CPU
computes in float32; the CUDA bounds are twice those. Errors from a bf16 step that should be float32 (an exponent
or a cancellation in bf16) are 4-16x the rounding, above either bound.
"""

import math

import pytest
import torch

from linearformers.ops import (
    HedgehogFeatureMap,
    causal_linformer_attention,
    draw_random_features,
    favor_attention,
    favor_positive,
    hybrid_attention,
    linear_attention,
    linformer_attention,
    linformer_hybrid_attention,
    local_attention,
)
from linearformers.ops.feature_maps import favor_exponents

B, H, N, D, M, WINDOW = 1, 2, 259, 16, 32, 32  # N not a multiple of the window: the last block is padded
# (max, mean) error bounds, relative to max|g64| and to mean|g64|: measured at most 0.0059 and 0.0021. The
# bidirectional Linformer projects the sequence, E x, in the inputs' dtype (_precision): 0.0066 and 0.0056
BOUNDS = {"linformer": (1.5e-2, 1.2e-2)}
DEFAULT_BOUNDS = (1.2e-2, 5e-3)
CUDA_BOUNDS = (3e-2, 1.7e-2)  # bf16 operands on the tensor cores (module docstring)

DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.cuda)] * torch.cuda.is_available()


def _favor_hybrid_features(q, k):
    """FAVOR+ features on the softmax's scale, as PerformerAttention.hybrid_features makes them."""
    projection = draw_random_features(M, D, seed=3, device=q.device)
    u = favor_exponents(q, projection, is_query=True)
    top = u.amax(-1, keepdim=True).detach()
    phi_k = favor_positive(k, projection, is_query=False)
    return torch.exp(u - top), phi_k, top.squeeze(-1) - math.log(M)


def _hedgehog(q, k):
    torch.manual_seed(4)
    feature_map = HedgehogFeatureMap(H, D, M).to(q.device)
    with torch.no_grad():  # away from the identity start, as after training
        for p in feature_map.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return feature_map.double() if q.dtype == torch.float64 else feature_map


def _hybrid(causal, sinks, features, select_blocks=0):
    def run(q, k, v):
        gamma = torch.tensor([1.0, 0.4], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        if features == "favor":
            phi_q, phi_k, ell = _favor_hybrid_features(q, k)
        else:
            feature_map = _hedgehog(q, k)
            phi_q, phi_k, ell = feature_map(q, is_query=True), feature_map(k, is_query=False), None
        gamma = gamma.to(q.device)
        return hybrid_attention(
            q, k, v, phi_q, phi_k, gamma, WINDOW, causal=causal, query_log_scale=ell, sinks=sinks,
            select_blocks=select_blocks,
        )  # fmt: skip

    return run


def _favor(causal, feature_map):
    def run(q, k, v):
        projection = draw_random_features(M, D, seed=3, device=q.device)
        return favor_attention(q, k, v, projection, causal=causal, feature_map=feature_map)

    return run


def _linear(causal):
    def run(q, k, v):
        projection = draw_random_features(M, D, seed=3, device=q.device)
        phi_q = favor_positive(q, projection, is_query=True)
        return linear_attention(phi_q, favor_positive(k, projection, is_query=False), v, causal=causal)

    return run


def _hedgehog_linear(q, k, v):
    feature_map = _hedgehog(q, k)
    return linear_attention(feature_map(q, is_query=True), feature_map(k, is_query=False), v, causal=True)


def _projection(q):
    g = torch.Generator().manual_seed(5)
    e = torch.randn(H, 48, N, generator=g, dtype=torch.float64) / math.sqrt(N)
    return e.to(device=q.device, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


KERNELS = {
    "favor-softmax-bidirectional": _favor(False, "softmax"),
    "favor-softmax-causal": _favor(True, "softmax"),
    "favor-relu-bidirectional": _favor(False, "relu"),
    "favor-relu-causal": _favor(True, "relu"),
    "linear-bidirectional": _linear(False),
    "linear-causal": _linear(True),
    "hedgehog-linear-causal": _hedgehog_linear,
    "hybrid-favor-bidirectional": _hybrid(False, 0, "favor"),
    "hybrid-favor-causal": _hybrid(True, 0, "favor"),
    "hybrid-favor-bidirectional-sinks": _hybrid(False, 2, "favor"),
    "hybrid-favor-causal-sinks": _hybrid(True, 2, "favor"),
    "hybrid-hedgehog-bidirectional-sinks": _hybrid(False, 2, "hedgehog"),
    "hybrid-favor-bidirectional-far-blocks": _hybrid(False, 2, "favor", select_blocks=2),
    "hybrid-hedgehog-causal": _hybrid(True, 0, "hedgehog"),
    "linformer": lambda q, k, v: linformer_attention(q, k, v, _projection(q)),
    "linformer-causal": lambda q, k, v: causal_linformer_attention(q, k, v, _projection(q), chunk_size=64),
    "linformer-hybrid": lambda q, k, v: linformer_hybrid_attention(
        q, k, v, _projection(q), None, torch.tensor([1.0, 0.4], device=q.device), WINDOW, sinks=2
    ),
    "local-bidirectional": lambda q, k, v: local_attention(q, k, v, WINDOW),
    "local-causal": lambda q, k, v: local_attention(q, k, v, WINDOW, causal=True),
}


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.double() - want).abs()
    return float(diff.detach().max() / want.detach().abs().max()), float(
        diff.detach().mean() / want.detach().abs().mean()
    )


def _assert_within_bounds(name, low, high):
    if low[0].device.type == "cuda":
        max_bound, mean_bound = (max(a, b) for a, b in zip(BOUNDS.get(name, DEFAULT_BOUNDS), CUDA_BOUNDS))
    else:
        max_bound, mean_bound = BOUNDS.get(name, DEFAULT_BOUNDS)
    errors = {what: _errors(got, want) for what, got, want in zip(("out", "dq", "dk", "dv"), low, high)}
    assert all(top < max_bound and mean < mean_bound for top, mean in errors.values()), errors


def _bf16_and_float64(kernel, device, autocast=False, qk_scale=1.5):
    g = torch.Generator().manual_seed(0)
    # logits of a few units (qk_scale² of them at 1.5: up to ~10), as in a trained model's heads
    q, k, v = (torch.randn(B, H, N, D, generator=g).mul(s).bfloat16().to(device) for s in (qk_scale, qk_scale, 1.0))
    cotangent = torch.randn(B, H, N, D, generator=g).bfloat16().to(device)
    results = []
    for dtype in (torch.bfloat16, torch.float64):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast and dtype == torch.bfloat16):
            out = kernel(*x)
        assert out.dtype == dtype
        results.append((out, *torch.autograd.grad(out, x, cotangent.to(dtype))))
    return results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(KERNELS))
def test_bf16_outputs_and_gradients_stay_within_rounding_of_float64_at_every_position(name, device):
    _assert_within_bounds(name, *_bf16_and_float64(KERNELS[name], device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name",
    [
        "linear-bidirectional",
        "hedgehog-linear-causal",
        "hybrid-favor-bidirectional-sinks",
        "hybrid-hedgehog-bidirectional-sinks",
    ],
)
def test_features_made_under_bf16_autocast_keep_float32_gradients(name, device):
    """A model trained under autocast makes its features inside the autocast region: their exponents must not
    drop to bf16 products there (an error of ~1% on exp per unit of exponent)."""
    _assert_within_bounds(name, *_bf16_and_float64(KERNELS[name], device, autocast=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sinks", [0, 2], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_hybrid_takes_bf16_inputs_to_its_float32_results_rounded_at_every_element(causal, sinks, device):
    """No step of the hybrid's PyTorch core runs in bf16: from bf16 q, k, v and features, its output and all five
    gradients are the float32 ones from the same values, each element within one bf16 ulp (2^-8 relative), so no
    position can lose its digits to bf16 arithmetic inside it. (The causal Triton kernels, the CUDA default, take
    bf16 operands on tensor cores as flash attention does; the float64 bounds above hold them.)"""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, generator=g).mul(1.5) for _ in range(3))
    phi_q, phi_k, ell = _favor_hybrid_features(q, k)
    inputs = [t.bfloat16().to(device) for t in (q, k, v, phi_q, phi_k)]
    ell, gamma = ell.to(device), torch.tensor([1.0, 0.4], device=device)
    cotangent = torch.randn(B, H, N, D, generator=g).bfloat16().to(device)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        x = [t.to(dtype).requires_grad_() for t in inputs]
        out = hybrid_attention(
            *x, gamma, WINDOW, causal=causal, query_log_scale=ell, sinks=sinks, backend="chunked" if causal else None
        )
        results.append((out, *torch.autograd.grad(out, x, cotangent.to(dtype))))
    for what, low, full in zip(("out", "dq", "dk", "dv", "dphi_q", "dphi_k"), *results):
        slack = 2.0**-8 * full.abs() + 1e-6 * full.abs().max()
        assert ((low.float() - full).abs() <= slack).all(), what
