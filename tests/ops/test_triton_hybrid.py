"""The causal hybrid's Triton kernels (hybrid_attention(backend="triton")) against reference.py's (n x n) hybrid:
window and sinks, the linear part delayed by the window, one normalizer; forward and every gradient (q, k, v, the
features, gamma, ℓ), float32 and bf16 operands.

On a machine without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), at
small sizes that cross chunks, segments and m-blocks; with CUDA (``pytest -m cuda``) at 12 heads x 64, bf16.
"""

import pytest
import torch

pytest.importorskip("triton")

from linearformers.ops import _triton_causal, hybrid_attention, hybrid_step, set_triton_kernels
from linearformers.ops.hybrid import hybrid_backend
from linearformers.ops.reference import hybrid_reference
from tests.ops._triton_cases import CUDA, ON_CPU, ON_CUDA, TOLERANCE, assert_close, padding_mask, randn, run_with_grads

NAMES = ("out", "dq", "dk", "dv", "dphi_q", "dphi_k", "dgamma", "dell")


def _inputs(b, h, n, d, m, *, device, dtype, seed, ell):
    """q, k, v, nonnegative features, gamma in [0.5, 1.5), and ℓ (or nothing), from ``seed``."""
    q, k, v = (randn(b, h, n, d, seed=seed + i, device=device, dtype=dtype) for i in range(3))
    phi_q, phi_k = (randn(b, h, n, m, seed=seed + 3 + i, device=device, dtype=dtype).abs() for i in range(2))
    gamma = 0.5 + randn(h, seed=seed + 5, device=device).abs().clamp(max=1.0)
    extra = [randn(b, h, n, seed=seed + 6, device=device, dtype=dtype)] if ell else []
    return [q, k, v, phi_q, phi_k, gamma, *extra]


def _hybrid(window, sinks, mask, backend):
    def fn(q, k, v, phi_q, phi_k, gamma, ell=None):
        if backend == "reference":
            return hybrid_reference(
                q, k, v, phi_q, phi_k, gamma, window, causal=True, key_padding_mask=mask, query_log_scale=ell,
                sinks=sinks,
            )  # fmt: skip
        return hybrid_attention(
            q, k, v, phi_q, phi_k, gamma, window, causal=True, key_padding_mask=mask, query_log_scale=ell, sinks=sinks,
            backend=backend,
        )  # fmt: skip

    return fn


def _compare(n, window, sinks, ell, padded, dtype, device, sizes):
    b, h, d, m = sizes
    inputs = _inputs(b, h, n, d, m, device=device, dtype=dtype, seed=11, ell=ell)
    grad = randn(b, h, n, d, seed=3, device=device, dtype=torch.float64)
    mask = padding_mask(b, n, device) if padded else None
    got = run_with_grads(_hybrid(window, sinks, mask, "triton"), inputs, grad)
    # the reference on the same (rounded) values, in float64 on the CPU
    exact = [t.detach().double().cpu() for t in inputs]
    expected = run_with_grads(
        _hybrid(window, sinks, None if mask is None else mask.cpu(), "reference"), exact, grad.cpu()
    )
    assert_close([t.cpu() for t in got], expected, TOLERANCE[dtype], f"n={n} w={window} S={sinks}", NAMES)


@ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize(
    ("n", "window", "sinks", "ell", "padded"),
    [
        (37, 8, 1, False, True),  # several chunks of 8, a partial one; a sink; padding left and right
        (37, 8, 2, True, True),  # ℓ: features on the softmax's scale
        (50, 16, 0, False, False),  # no sink, no padding
        (13, 5, 1, True, True),  # a window that is not a power of two
        (1, 8, 1, False, False),  # one position
        (70, 12, 3, False, True),  # windows over several segments of the linear walk
    ],
)
def test_the_causal_hybrid_kernels_match_the_reference(n, window, sinks, ell, padded, dtype):
    """Output and the gradients of q, k, v, phi_q, phi_k, gamma (and ℓ) as the (n x n) reference's."""
    _compare(n, window, sinks, ell, padded, dtype, "cpu", (2, 2, 32, 32))


@ON_CPU
def test_the_causal_hybrid_matches_the_reference_through_the_chunk_form_too():
    """The linear part through the causal kernels' chunk-parallel form: the same reference."""
    previous = _triton_causal.TUNING["form"]
    _triton_causal.TUNING["form"] = "chunks"
    try:
        _compare(70, 12, 3, True, True, torch.float32, "cpu", (2, 2, 32, 32))
    finally:
        _triton_causal.TUNING["form"] = previous


@pytest.mark.parametrize("ell", [False, True], ids=["paper", "softmax-scale"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)])
def test_a_state_returned_by_the_kernels_continues_decoding_as_the_chunked_backends(device, ell):
    """A prefill through the kernels returns the chunked backend's output and HybridState, so hybrid_step continues
    it: the next token's output is the same."""
    b, h, d, m = (2, 2, 32, 32) if device == "cpu" else (2, 12, 64, 128)  # two rows: left and right padding
    n, window = (29, 8) if device == "cpu" else (1000, 64)
    q, k, v, phi_q, phi_k, gamma, *rest = _inputs(
        b, h, n + 1, d, m, device=device, dtype=torch.float32, seed=5, ell=ell
    )
    ell_all = rest[0] if ell else None
    mask = padding_mask(b, n + 1, device)
    mask[1] = True  # right padding would leave the step's token padded: that row keeps every token

    def prefill_then_step(backend):
        head = (t[:, :, :n] for t in (q, k, v, phi_q, phi_k))
        out, state = hybrid_attention(
            *head, gamma, window, causal=True, key_padding_mask=mask[:, :n], sinks=1, return_state=True,
            query_log_scale=None if ell_all is None else ell_all[..., :n], backend=backend,
        )  # fmt: skip
        tail = (t[:, :, n:] for t in (q, k, v, phi_q, phi_k))
        step, _ = hybrid_step(
            *tail, gamma, window, state, key_padding_mask=mask[:, n:], sinks=1,
            query_log_scale=None if ell_all is None else ell_all[..., n:],
        )  # fmt: skip
        return out, step, state

    got, expected = prefill_then_step("triton"), prefill_then_step("chunked")
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-5)
    for a, e in zip(got[2], expected[2]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_backend_a_hybrid_call_takes_and_why_triton_refuses(monkeypatch):
    """backend=None takes "chunked" off CUDA; a named "triton" that cannot run says why; a bad name raises."""
    x = torch.zeros(1, 2, 8, 32)
    call = (x, x, x, x, x)

    def refused(match, *, window=8, sinks=0, causal=True, stateful=False, args=call):
        with pytest.raises(ValueError, match=match):
            hybrid_backend("triton", *args, window, sinks, causal, stateful)

    refused("initial_state", stateful=True)
    refused("window must be at most 128", window=129)
    refused("at most 16 sinks", sinks=17)
    refused("float64", args=tuple(t.double() for t in call))
    refused("num_features must be a multiple of 16", args=(x, x, x, x[..., :24], x[..., :24]))
    previous = set_triton_kernels(False)
    try:
        refused("set_triton_kernels")
    finally:
        set_triton_kernels(previous)
    with pytest.raises(ValueError, match="backend must be None or one of"):
        hybrid_backend("compiled", *call, 8, 0, True, False)
    assert hybrid_backend("chunked", *call, 8, 0, False, False) == "chunked"
    if not CUDA:
        assert hybrid_backend(None, *call, 8, 0, True, False) == "chunked"
        monkeypatch.delenv("TRITON_INTERPRET")
        refused("runs on CUDA tensors")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_kernels_are_the_causal_hybrid_default_on_cuda():
    x = torch.zeros(1, 2, 8, 64, device="cuda")
    assert hybrid_backend(None, x, x, x, x, x, 64, 1, True, False) == "triton"
    assert hybrid_backend(None, x, x, x, x, x, 64, 1, True, True) == "chunked"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ell", [False, True], ids=["paper", "softmax-scale"])
def test_the_causal_hybrid_kernels_match_the_reference_on_cuda(ell):
    """n = 1000, 12 heads x 64, m = 128, window 64, one sink, padding, bf16: against the float64 reference."""
    _compare(1000, 64, 1, ell, True, torch.bfloat16, "cuda", (2, 12, 64, 128))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_causal_hybrid_kernels_compile_without_graph_break():
    """torch.compile(fullgraph=True) keeps the kernels' custom ops whole: the eager output and gradients."""
    inputs = _inputs(1, 12, 1000, 64, 128, device="cuda", dtype=torch.bfloat16, seed=2, ell=False)
    grad = randn(1, 12, 1000, 64, seed=3, device="cuda", dtype=torch.float64)
    fn = _hybrid(64, 1, None, "triton")
    compiled = torch.compile(fn, fullgraph=True)
    assert_close(run_with_grads(compiled, inputs, grad), run_with_grads(fn, inputs, grad), 1e-2, "compiled", NAMES)
