"""The chunked causal FAVOR+ backend (_favor_chunked): every chunk at once, so its dispatched-op count does not grow
with n. Checked against the plain quadratic formula (reference.favor_reference), and the backend choice."""

import pytest
import torch

from linearformers.ops import (
    draw_random_features,
    favor_attention,
    favor_step,
)
from linearformers.ops import favor as favor_module
from linearformers.ops._favor_chunked import DEFAULT_CHUNK
from linearformers.ops.reference import favor_reference
from tests.ops.helpers import CountOps


def _qkv(b=2, h=2, n=37, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def _mask(b, n, padding):
    if padding is None:
        return None
    mask = torch.ones(b, n, dtype=torch.bool)
    if padding == "left":
        mask[1, :9] = False
    else:
        mask[1, -9:] = False
    return mask


def _run(backend, q, k, v, w, g, **kwargs):
    """Output and the gradients of q, k, v for the upstream gradient g."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = favor_attention(q, k, v, w, causal=True, backend=backend, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_chunked_matches_the_quadratic_formula(padding, kernel, dtype):
    q, k, v = _qkv(dtype=dtype)  # n = 37: not a multiple of the chunk
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(2, 37, padding)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    kwargs = dict(kernel=kernel, key_padding_mask=mask)
    chunked = _run("chunked", q, k, v, w, g, chunk_size=8, **kwargs)
    exact = _run("reference", *(x.double() for x in (q, k, v)), w.double(), g.double(), **kwargs)
    assert chunked[0].dtype == dtype
    for name, a, b in zip(("out", "dq", "dk", "dv"), chunked, exact):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_stay_finite_and_close_to_float32(dtype):
    q, k, v = _qkv()
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(2, 37, "left")
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    low = _run("chunked", *(x.to(dtype) for x in (q, k, v)), w, g.to(dtype), key_padding_mask=mask)
    full = _run("chunked", *(x.to(dtype).float() for x in (q, k, v)), w, g.to(dtype).float(), key_padding_mask=mask)
    for a, b in zip(low, full):
        assert a.dtype == dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_gradcheck_in_float64(kernel):
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=11, d=4, dtype=torch.float64))
    w = draw_random_features(8, 4, seed=2, dtype=torch.float64)
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, 1] = False

    def op(q, k, v):
        return favor_attention(
            q, k, v, w, causal=True, kernel=kernel, key_padding_mask=mask, chunk_size=4, backend="chunked"
        )

    assert torch.autograd.gradcheck(op, (q, k, v), atol=1e-6, rtol=1e-4)


def _offset(q, k, v, w, **kwargs):
    """The offset M of the state a causal chunked call returns: 0 from the backend's own pass, the prefix maximum of
    the key exponents (below 0) from the stabilized fallback."""
    return favor_attention(q, k, v, w, causal=True, backend="chunked", return_state=True, **kwargs)[1][2]


def test_keys_of_large_norm_take_the_stabilized_fallback():
    q, k, v = _qkv()
    k = k * 40.0  # |k'| far beyond ~15: key features underflow at offset 0
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(2, 37, "left")
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    chunked = _run("chunked", q, k, v, w, g, key_padding_mask=mask, chunk_size=8)
    assert (_offset(q, k, v, w, key_padding_mask=mask, chunk_size=8) < 0).all()
    exact = favor_reference(q.double(), k.double(), v.double(), w, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(chunked[0][0].double(), exact[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked[0][1, :, 9:].double(), exact[1, :, 9:], rtol=1e-4, atol=1e-5)
    assert (_offset(q, k / 40.0, v, w, chunk_size=8) == 0).all(), "moderate keys never take the fallback"


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_continued_prefill_and_returned_state(kernel):
    q, k, v = _qkv()
    w = draw_random_features(32, 16, seed=1)
    kwargs = dict(kernel=kernel, chunk_size=8)
    whole, state = favor_attention(q, k, v, w, causal=True, backend="chunked", return_state=True, **kwargs)
    assert (state[2] == 0).all()
    phi_k = favor_module.favor_features(k, w, is_query=False, kernel=kernel)  # the sums over every key, at offset 0
    torch.testing.assert_close(state[0], phi_k.transpose(-1, -2) @ v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], phi_k.sum(2), rtol=1e-5, atol=1e-5)
    head, mid = favor_attention(
        *(x[:, :, :13] for x in (q, k, v)), w, causal=True, backend="chunked", return_state=True, **kwargs
    )
    tail, end = favor_attention(
        *(x[:, :, 13:] for x in (q, k, v)),
        w,
        causal=True,
        backend="chunked",
        initial_state=mid,
        return_state=True,
        **kwargs,
    )
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-5, atol=1e-5)
    # the same true sums exp(M) S, exp(M) z (softmax continues through per-position offsets: M may move)
    factor = torch.exp(end[2])
    torch.testing.assert_close(end[0] * factor[..., None, None], state[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(end[1] * factor[..., None], state[1], rtol=1e-4, atol=1e-5)


def test_relu_initial_state_carries_gradient():
    q, k, v = _qkv(n=12)
    w = draw_random_features(32, 16, seed=1)
    s0 = torch.rand(2, 2, 32, 16, requires_grad=True)
    z0 = (torch.rand(2, 2, 32) + 1).requires_grad_()
    out = favor_attention(q, k, v, w, causal=True, kernel="relu", chunk_size=8, initial_state=(s0, z0))
    ds, dz = torch.autograd.grad(out.sum(), (s0, z0))
    # the same through plain autograd on the formula: out_t = phi_t (S0 + Σ_{s<=t} phi_s v_sᵀ) / phi_t (z0 + Σ phi_s)
    phi_q = favor_module.favor_features(q, w, is_query=True, kernel="relu")
    phi_k = favor_module.favor_features(k, w, is_query=False, kernel="relu")
    mask = torch.ones(12, 12).tril()
    a = phi_q @ phi_k.transpose(-1, -2) * mask
    num = a @ v + phi_q @ s0
    den = a.sum(-1, keepdim=True) + phi_q @ z0[..., None]
    ds_ref, dz_ref = torch.autograd.grad((num / den).sum(), (s0, z0))
    torch.testing.assert_close(out, (num / den).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ds, ds_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dz, dz_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_decoding_after_a_chunked_prefill_equals_the_full_pass(kernel):
    q, k, v = _qkv(n=30)
    w = draw_random_features(32, 16, seed=1)
    full = favor_attention(q, k, v, w, causal=True, kernel=kernel, backend="chunked")
    head, state = favor_attention(
        *(x[:, :, :21] for x in (q, k, v)), w, causal=True, kernel=kernel, backend="chunked", return_state=True
    )
    steps = [head]
    for t in range(21, 30):
        out, state = favor_step(*(x[:, :, t : t + 1] for x in (q, k, v)), w, state, kernel=kernel)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=1e-5, atol=1e-5)


def _ops(n, backend):
    """Ops dispatched by forward + backward of causal FAVOR+ (b = h = 1, d = 16, m = 32)."""
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=n))
    w = draw_random_features(32, 16, seed=0)
    with CountOps() as counter:
        favor_attention(q, k, v, w, causal=True, backend=backend).sum().backward()
    return counter.count


def test_chunked_op_count_does_not_depend_on_n():
    """On a GPU every dispatched op is a kernel launch: the chunked backend's count is the same at any n."""
    assert _ops(2048, "chunked") == _ops(16384, "chunked")


def test_default_chunk_is_64():
    assert DEFAULT_CHUNK == 64


def test_reference_backend_is_the_quadratic_formula():
    q, k, v = _qkv(n=10)
    w = draw_random_features(32, 16, seed=1)
    for causal in (False, True):
        out = favor_attention(q, k, v, w, causal=causal, backend="reference")
        torch.testing.assert_close(out, favor_reference(q, k, v, w, causal=causal))
        torch.testing.assert_close(
            out, favor_attention(q, k, v, w, causal=causal, backend="chunked"), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("large", [False, True], ids=["moderate-keys", "large-keys"])
@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_bidirectional_chunked_and_blockwise_match_the_quadratic_formula(padding, kernel, large):
    """Bidirectional FAVOR+ in whole-sequence products (the GPU and torch.compile path) and block by block (the CPU
    path) against the float64 formula; large keys (|k'| ~ 40) are taken relative to the largest real key exponent."""
    q, k, v = _qkv()
    k = k * (40.0 if large else 1.0)
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(2, 37, padding)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def run(backend, dtype):
        x = tuple(t.to(dtype).detach().requires_grad_() for t in (q, k, v))
        out = favor_attention(*x, w.to(dtype), key_padding_mask=mask, kernel=kernel, backend=backend, block_size=8)
        return (out, *torch.autograd.grad(out, x, g.to(dtype)))

    exact = run("reference", torch.float64)
    scale = max(float(t.abs().max()) for t in exact)
    for backend in ("chunked", "blockwise"):
        for name, a, b in zip(("out", "dq", "dk", "dv"), run(backend, torch.float32), exact):
            assert torch.isfinite(a).all(), (backend, name)
            # large keys: near one-hot attention, dk ~0 up to float32's cancellation (see test_favor)
            atol = (1e-3 if large else 1e-5) * scale
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=atol, msg=f"{backend} {name}")


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_bidirectional_chunked_gradcheck_in_float64(kernel):
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=11, d=4, dtype=torch.float64))
    w = draw_random_features(8, 4, seed=2, dtype=torch.float64)
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, 1] = False

    def op(q, k, v):
        return favor_attention(q, k, v, w, kernel=kernel, key_padding_mask=mask, backend="chunked")

    assert torch.autograd.gradcheck(op, (q, k, v), atol=1e-6, rtol=1e-4)


def test_bidirectional_chunked_op_count_does_not_depend_on_n():
    def ops(n):
        q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=n))
        w = draw_random_features(32, 16, seed=0)
        with CountOps() as counter:
            favor_attention(q, k, v, w, backend="chunked").sum().backward()
        return counter.count

    assert ops(512) == ops(4096)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_products_keep_sums_and_denominators_in_float32(causal):
    """On CUDA with bf16 inputs the chunked backends take the large products in bf16 (tensor cores) and keep
    exponents, sums and denominators in float32 (_precision). Forced here on the CPU: outputs and gradients stay
    within bf16's rounding of the float32 path, and finite, with left padding."""
    operands = torch.bfloat16
    from linearformers.ops._favor_chunked import (
        FavorBidirectionalChunked,
        FavorCausalChunked,
        half_operands,
    )

    q, k, v = _qkv(n=70)
    w = draw_random_features(32, 16, seed=1)
    keep = torch.ones(2, 1, 70, 1)
    keep[1, :, :9] = 0
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def run(half):
        x = tuple(t.to(operands).detach().requires_grad_() for t in (q, k, v))
        if causal:
            out = FavorCausalChunked.apply(*x, w, keep, "softmax", 0.25, 1e-3, 16, None, half)[0]
        else:
            out = FavorBidirectionalChunked.apply(*x, w, keep, "softmax", 0.25, 1e-3, half)
        return (out, *torch.autograd.grad(out, x, g.to(operands)))

    assert half_operands(q) is None and half_operands(q.to(operands)) is None  # CPU: float32 products
    assert half_operands(q.half()) is None
    full, half = run(None), run(operands)
    for name, a, b in zip(("out", "dq", "dk", "dv"), half, full):
        assert a.dtype == operands and torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * float(b.float().abs().max()), msg=name)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("backend", [None, "chunked"])
def test_float64_inputs_are_computed_in_float64(backend, causal, kernel):
    """float64 in, float64 math: outputs and gradients agree with the float64 formula to 1e-12 (float32 anywhere
    inside would leave ~1e-7), at a length of several chunks with padding; a decoding step continues in float64."""
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, n=300, dtype=torch.float64))
    w = draw_random_features(32, 16, seed=1, dtype=torch.float64)
    mask = torch.ones(1, 300, dtype=torch.bool)
    mask[0, :7] = False
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kwargs = dict(causal=causal, kernel=kernel, key_padding_mask=mask)
    got = favor_attention(q, k, v, w, backend=backend, **kwargs)
    want = favor_reference(q, k, v, w, **kwargs)
    for a, b in zip((got, *torch.autograd.grad(got, (q, k, v), g)), (want, *torch.autograd.grad(want, (q, k, v), g))):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * float(b.abs().max()))
    if causal:
        with torch.no_grad():
            _, state = favor_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], w, kernel=kernel, causal=True,
                                       key_padding_mask=mask[:, :-1], backend=backend, return_state=True)  # fmt: skip
            step, _ = favor_step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], w, state, kernel=kernel)
        torch.testing.assert_close(step, want[:, :, -1:].detach(), rtol=0, atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize(("backend", "causal"), [("native", True), ("blockwise", False)])
def test_float32_kernels_refuse_float64_inputs(backend, causal):
    q, k, v = _qkv(n=32, dtype=torch.float64)
    w = draw_random_features(32, 16, seed=1)
    with pytest.raises(ValueError, match=rf"backend='{backend}'.*computes in float32.*backend='chunked'"):
        favor_attention(q, k, v, w, causal=causal, backend=backend)
