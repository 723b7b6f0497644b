"""The chunked FAVOR+ backends (_favor_chunked): every chunk at once, so the dispatched-op count does not grow with n.
Checked against the plain quadratic formula (reference.favor_reference, or the formula written out for given
features, and the sums that make a state), gradcheck, and the backend choice; then the per-position offsets of
causal FAVOR+ (favor_causal_offsets: keys of large norm and continued prefills) and the precomputed-features mode of
FavorCausalChunked."""

import math

import pytest
import torch

from linearformers.ops import (
    draw_random_features,
    favor_attention,
    favor_step,
)
from linearformers.ops import favor as favor_module
from linearformers.ops._favor_chunked import (
    DEFAULT_CHUNK,
    FavorBidirectionalChunked,
    FavorCausalChunked,
    favor_causal_offsets,
    half_operands,
    offsets_chunk,
)
from linearformers.ops.reference import favor_reference
from tests.ops.helpers import CountOps

B, H, N, D, M = 2, 2, 37, 16, 32  # n = 37: not a multiple of the chunk 8
SCALE = D**-0.5


def _qkv(b=B, h=H, n=N, d=D, seed=0, dtype=torch.float32):
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
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_chunked_matches_the_quadratic_formula(padding, feature_map, dtype):
    q, k, v = _qkv(dtype=dtype)  # n = 37: not a multiple of the chunk
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(2, 37, padding)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    kwargs = dict(feature_map=feature_map, key_padding_mask=mask)
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


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_gradcheck_in_float64(feature_map):
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=11, d=4, dtype=torch.float64))
    w = draw_random_features(8, 4, seed=2, dtype=torch.float64)
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, 1] = False

    def op(q, k, v):
        return favor_attention(
            q, k, v, w, causal=True, feature_map=feature_map, key_padding_mask=mask, chunk_size=4, backend="chunked"
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


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_continued_prefill_and_returned_state(feature_map):
    q, k, v = _qkv()
    w = draw_random_features(32, 16, seed=1)
    kwargs = dict(feature_map=feature_map, chunk_size=8)
    whole, state = favor_attention(q, k, v, w, causal=True, backend="chunked", return_state=True, **kwargs)
    assert (state[2] == 0).all()
    phi_k = favor_module.favor_features(
        k, w, is_query=False, feature_map=feature_map
    )  # the sums over every key, at offset 0
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
    out = favor_attention(q, k, v, w, causal=True, feature_map="relu", chunk_size=8, initial_state=(s0, z0))
    ds, dz = torch.autograd.grad(out.sum(), (s0, z0))
    # the same through plain autograd on the formula: out_t = phi_t (S0 + Σ_{s<=t} phi_s v_sᵀ) / phi_t (z0 + Σ phi_s)
    phi_q = favor_module.favor_features(q, w, is_query=True, feature_map="relu")
    phi_k = favor_module.favor_features(k, w, is_query=False, feature_map="relu")
    mask = torch.ones(12, 12).tril()
    a = phi_q @ phi_k.transpose(-1, -2) * mask
    num = a @ v + phi_q @ s0
    den = a.sum(-1, keepdim=True) + phi_q @ z0[..., None]
    ds_ref, dz_ref = torch.autograd.grad((num / den).sum(), (s0, z0))
    torch.testing.assert_close(out, (num / den).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ds, ds_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dz, dz_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_decoding_after_a_chunked_prefill_equals_the_full_pass(feature_map):
    q, k, v = _qkv(n=30)
    w = draw_random_features(32, 16, seed=1)
    full = favor_attention(q, k, v, w, causal=True, feature_map=feature_map, backend="chunked")
    head, state = favor_attention(
        *(x[:, :, :21] for x in (q, k, v)),
        w,
        causal=True,
        feature_map=feature_map,
        backend="chunked",
        return_state=True,
    )
    steps = [head]
    for t in range(21, 30):
        out, state = favor_step(*(x[:, :, t : t + 1] for x in (q, k, v)), w, state, feature_map=feature_map)
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
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_bidirectional_chunked_and_blockwise_match_the_quadratic_formula(padding, feature_map, large):
    """Bidirectional FAVOR+ in whole-sequence products (the GPU and torch.compile path) and block by block (the CPU
    path) against the float64 formula; large keys (|k'| ~ 40) are taken relative to the largest real key exponent."""
    q, k, v = _qkv()
    k = k * (40.0 if large else 1.0)
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(2, 37, padding)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def run(backend, dtype):
        x = tuple(t.to(dtype).detach().requires_grad_() for t in (q, k, v))
        out = favor_attention(
            *x, w.to(dtype), key_padding_mask=mask, feature_map=feature_map, backend=backend, block_size=8
        )
        return (out, *torch.autograd.grad(out, x, g.to(dtype)))

    exact = run("reference", torch.float64)
    scale = max(float(t.abs().max()) for t in exact)
    for backend in ("chunked", "blockwise"):
        for name, a, b in zip(("out", "dq", "dk", "dv"), run(backend, torch.float32), exact):
            assert torch.isfinite(a).all(), (backend, name)
            # large keys: near one-hot attention, dk ~0 up to float32's cancellation (see test_favor)
            atol = (1e-3 if large else 1e-5) * scale
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=atol, msg=f"{backend} {name}")


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_bidirectional_chunked_gradcheck_in_float64(feature_map):
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=11, d=4, dtype=torch.float64))
    w = draw_random_features(8, 4, seed=2, dtype=torch.float64)
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, 1] = False

    def op(q, k, v):
        return favor_attention(q, k, v, w, feature_map=feature_map, key_padding_mask=mask, backend="chunked")

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
    q, k, v = _qkv(n=70)
    w = draw_random_features(32, 16, seed=1)
    key_weights = torch.ones(2, 1, 70, 1)
    key_weights[1, :, :9] = 0
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def run(half):
        x = tuple(t.to(operands).detach().requires_grad_() for t in (q, k, v))
        if causal:
            out = FavorCausalChunked.apply(*x, w, key_weights, "softmax", 0.25, 1e-3, 16, None, half)[0]
        else:
            out = FavorBidirectionalChunked.apply(*x, w, key_weights, "softmax", 0.25, 1e-3, half)
        return (out, *torch.autograd.grad(out, x, g.to(operands)))

    assert half_operands(q) is None and half_operands(q.to(operands)) is None  # CPU: float32 products
    assert half_operands(q.half()) is None
    full, half = run(None), run(operands)
    for name, a, b in zip(("out", "dq", "dk", "dv"), half, full):
        assert a.dtype == operands and torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * float(b.float().abs().max()), msg=name)


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("backend", [None, "chunked"])
def test_float64_inputs_are_computed_in_float64(backend, causal, feature_map):
    """float64 in, float64 math: outputs and gradients agree with the float64 formula to 1e-12 (float32 anywhere
    inside would leave ~1e-7), at a length of several chunks with padding; a decoding step continues in float64."""
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, n=300, dtype=torch.float64))
    w = draw_random_features(32, 16, seed=1, dtype=torch.float64)
    mask = torch.ones(1, 300, dtype=torch.bool)
    mask[0, :7] = False
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kwargs = dict(causal=causal, feature_map=feature_map, key_padding_mask=mask)
    got = favor_attention(q, k, v, w, backend=backend, **kwargs)
    want = favor_reference(q, k, v, w, **kwargs)
    for a, b in zip((got, *torch.autograd.grad(got, (q, k, v), g)), (want, *torch.autograd.grad(want, (q, k, v), g))):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * float(b.abs().max()))
    if causal:
        with torch.no_grad():
            _, state = favor_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], w, feature_map=feature_map,
                                       causal=True, key_padding_mask=mask[:, :-1], backend=backend,
                                       return_state=True)  # fmt: skip
            step, _ = favor_step(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], w, state, feature_map=feature_map)
        torch.testing.assert_close(step, want[:, :, -1:].detach(), rtol=0, atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize(("backend", "causal"), [("native", True), ("blockwise", False)])
def test_float32_kernels_refuse_float64_inputs(backend, causal):
    q, k, v = _qkv(n=32, dtype=torch.float64)
    w = draw_random_features(32, 16, seed=1)
    with pytest.raises(ValueError, match=rf"backend='{backend}'.*computes in float32.*backend='chunked'"):
        favor_attention(q, k, v, w, causal=causal, backend=backend)


# -- favor_causal_offsets: per-position offsets for keys of large norm and continued prefills


def _key_weights(mask):
    return None if mask is None else mask[:, None, :, None].float()


def _large(k):
    """Keys with |k| scale^½ ≈ 40: every feature underflows float32 at offset 0 (exp(-|w - k'|²/2) ~ e^-800)."""
    return k * (40.0 / (k.norm(dim=-1, keepdim=True) * math.sqrt(SCALE)))


def _rows(padding):
    """Rows compared with the reference: left-padded rows with no real key output 0 / anything there."""
    return slice(9, None) if padding == "left" else slice(None)


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_offsets_match_the_quadratic_formula(padding, large):
    q, k, v = _qkv()
    k = _large(k) if large else k
    w = draw_random_features(M, D, seed=1)
    mask = _mask(B, N, padding)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def run(fn):
        x = tuple(t.detach().requires_grad_() for t in (q, k, v))
        out, state = fn(*x)
        return (out, *torch.autograd.grad(out, x, g)), state

    chunked, state = run(lambda q, k, v: favor_causal_offsets(q, k, v, w, _key_weights(mask), SCALE, 8))
    wide, wide_state = run(  # the same function in float64: float32 loses nothing that matters
        lambda q, k, v: favor_causal_offsets(
            q.double(), k.double(), v.double(), w.double(), _key_weights(mask), SCALE, 8
        )
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), chunked, wide):
        assert torch.isfinite(a).all(), name
        atol = (2e-4 if large else 1e-5) * float(b.detach().abs().max())
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=atol, msg=name)
    for a, b in zip(state, wide_state):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5 * float(b.detach().abs().max()))
    if padding == "left":  # rows that see no real key: 0, no gradient
        assert (chunked[0][1, :, :9] == 0).all() and (chunked[1][1, :, :9] == 0).all()
    exact = favor_reference(q.double(), k.double(), v.double(), w.double(), causal=True, key_padding_mask=mask)
    # large keys: float32 exponents near -800 carry ~1e-4 absolute error, so do the weights exp(u_s - M_t)
    atol = 2e-4 if large else 1e-5
    for i in range(B):
        rows = _rows(padding) if i == 1 else slice(None)
        torch.testing.assert_close(chunked[0][i, :, rows].double(), exact[i, :, rows], rtol=1e-4, atol=atol)


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_offsets_in_float64_equal_the_reference(padding):
    q, k, v = _qkv(dtype=torch.float64)
    k = _large(k)
    w = draw_random_features(M, D, seed=1, dtype=torch.float64)
    mask = _mask(B, N, padding)
    out, (s, z, offset) = favor_causal_offsets(q, k, v, w, _key_weights(mask), SCALE, 8)
    assert out.dtype == s.dtype == torch.float64
    exact = favor_reference(q, k, v, w, causal=True, key_padding_mask=mask)
    rows = _rows(padding)
    torch.testing.assert_close(out[0], exact[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out[1, :, rows], exact[1, :, rows], rtol=1e-9, atol=1e-10)
    # the final state: Σ_s exp(u_s - M) [v_s, 1], M the largest real key exponent
    ks = k * math.sqrt(SCALE)
    u = ks @ w.T - 0.5 * ks.pow(2).sum(-1, keepdim=True) - 0.5 * w.pow(2).sum(-1)
    if mask is not None:
        u = u.masked_fill(~mask[:, None, :, None], -math.inf)
    top = u.amax((-1, -2))
    torch.testing.assert_close(offset, top)
    phi = torch.exp(u - top[..., None, None])
    torch.testing.assert_close(s, phi.transpose(-1, -2) @ v)
    torch.testing.assert_close(z, phi.sum(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_stay_finite(dtype):
    q, k, v = _qkv()
    w = draw_random_features(M, D, seed=1)
    low, _ = favor_causal_offsets(*(x.to(dtype) for x in (q, _large(k), v)), w, None, SCALE, 8)
    full, _ = favor_causal_offsets(*(x.to(dtype).float() for x in (q, _large(k), v)), w, None, SCALE, 8)
    assert low.dtype == dtype and torch.isfinite(low).all()
    torch.testing.assert_close(low.float(), full, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shift", [0.0, 60.0, -30.0])
@pytest.mark.parametrize("large", [False, True])
def test_continued_prefill_equals_the_whole(large, shift):
    """Split the sequence: the first part's state, handed to the second, gives the whole's outputs and final state.
    ``shift`` moves the state's offset M by that much (the same true sums), and large keys make M ~ -800 itself."""
    q, k, v = _qkv(dtype=torch.float64)
    k = _large(k) if large else k
    w = draw_random_features(M, D, seed=1, dtype=torch.float64)
    mask = _mask(B, N, "left")
    key_weights = _key_weights(mask)
    whole, (s, z, offset) = favor_causal_offsets(q, k, v, w, key_weights, SCALE, 8)
    cut = 13
    head, (s1, z1, m1) = favor_causal_offsets(*(x[:, :, :cut] for x in (q, k, v)), w, key_weights[:, :, :cut], SCALE, 8)
    factor = math.exp(-shift)
    mid = (s1 * factor, z1 * factor, m1 + shift)
    tail, (s2, z2, m2) = favor_causal_offsets(
        *(x[:, :, cut:] for x in (q, k, v)), w, key_weights[:, :, cut:], SCALE, 8, initial_state=mid
    )
    if large:
        assert (offset < -100).all()
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-9, atol=1e-10)
    exact = favor_reference(q, k, v, w, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(whole[:, :, 9:], exact[:, :, 9:], rtol=1e-9, atol=1e-10)
    # the same true sums exp(M) S: compared at the whole's offset (exp(M) alone may underflow)
    torch.testing.assert_close(s2 * torch.exp(m2 - offset)[..., None, None], s, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(z2 * torch.exp(m2 - offset)[..., None], z, rtol=1e-9, atol=1e-12)


def test_empty_initial_state_is_no_state():
    q, k, v = _qkv()
    w = draw_random_features(M, D, seed=1)
    mask = _mask(B, N, "left")
    empty = (torch.zeros(B, H, M, D), torch.zeros(B, H, M), torch.full((B, H), 5.0))
    a, sa = favor_causal_offsets(q, k, v, w, _key_weights(mask), SCALE, 8, initial_state=empty)
    b, sb = favor_causal_offsets(q, k, v, w, _key_weights(mask), SCALE, 8)
    torch.testing.assert_close(a, b)
    for x, y in zip(sa, sb):
        torch.testing.assert_close(x, y)
    # nothing seen at all: output 0, an empty state at offset 0
    none = torch.zeros(B, N, dtype=torch.bool)
    out, (s, z, offset) = favor_causal_offsets(q, k, v, w, _key_weights(none), SCALE, 8)
    assert (out == 0).all() and (s == 0).all() and (z == 0).all() and (offset == 0).all()


@pytest.mark.parametrize("large", [False, True])
def test_gradients_of_the_initial_state(large):
    q, k, v = _qkv()
    k = _large(k) if large else k
    w = draw_random_features(M, D, seed=1)
    mask = _mask(B, N, "right")
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    s0 = torch.randn(B, H, M, D, generator=gen)
    z0 = torch.rand(B, H, M, generator=gen) + 0.5
    m0 = torch.tensor([[-700.0, 3.0], [0.0, 40.0]]) if large else torch.zeros(B, H)

    def grads(fn):
        x = tuple(t.detach().requires_grad_() for t in (q, k, v, s0, z0))
        out, (s, z, _) = fn(*x)
        loss = (out * g).sum() + (s * 0.1).sum() + z.sum() * 0.01  # the final state is differentiable too
        return (out, *torch.autograd.grad(loss, x))

    chunked = grads(lambda q, k, v, s, z: favor_causal_offsets(q, k, v, w, _key_weights(mask), SCALE, 8, (s, z, m0)))
    # the same in float64 (checked by gradcheck below and against the reference above): float32 keeps up
    wide = grads(
        lambda q, k, v, s, z: favor_causal_offsets(
            *(x.double() for x in (q, k, v)),
            w.double(),
            _key_weights(mask),
            SCALE,
            8,
            (s.double(), z.double(), m0.double()),
        )
    )
    for name, a, b in zip(("out", "dq", "dk", "dv", "dS", "dz"), chunked, wide):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(
            a.double(), b.double(), rtol=1e-4, atol=1e-5 * float(b.detach().abs().max()), msg=name
        )


def test_offsets_gradcheck_in_float64():
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=11, d=4, dtype=torch.float64))
    w = draw_random_features(8, 4, seed=2, dtype=torch.float64)
    key_weights = torch.ones(1, 1, 11, 1, dtype=torch.float64)
    key_weights[0, 0, 1] = 0
    s0 = torch.rand(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(1, 1, 8, dtype=torch.float64) + 0.5).requires_grad_()
    m0 = torch.tensor([[2.0]], dtype=torch.float64)

    def op(q, k, v, s0, z0):
        out, (s, z, offset) = favor_causal_offsets(q, k * 3.0, v, w, key_weights, 0.5, 4, (s0, z0, m0))
        # the true sums: (S, z) alone are relative to an offset that moves with max z0 (not differentiated)
        factor = torch.exp(offset)
        return out, s * factor[..., None, None], z * factor[..., None]

    assert torch.autograd.gradcheck(op, (q, k, v, s0, z0), atol=1e-6, rtol=1e-4)


def test_the_chunk_is_an_argument():
    assert offsets_chunk(37, 8) == 8
    assert offsets_chunk(4096, 64) == 64
    assert offsets_chunk(16384, 64) == 128  # at most 128 chunks
    assert offsets_chunk(20000, 64) == 160  # ceil(20000 / 128) = 157, rounded up to a multiple of 16
    q, k, v = _qkv(n=40)
    w = draw_random_features(M, D, seed=1)
    outs = [favor_causal_offsets(q, _large(k), v, w, None, SCALE, c)[0] for c in (None, 5, 16, 40)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def _offsets_ops(n, state):
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=n))
    w = draw_random_features(32, 16, seed=0)
    key_weights = torch.ones(1, 1, n, 1)
    key_weights[..., :5, :] = 0
    initial = None
    if state:
        initial = (torch.rand(1, 1, 32, 16, requires_grad=True), torch.rand(1, 1, 32) + 1, torch.zeros(1, 1))
    with CountOps() as counter:
        out, _ = favor_causal_offsets(q, _large(k.detach()).requires_grad_(), v, w, key_weights, SCALE, 64, initial)
        out.sum().backward()
    return counter.count


def _features_ops(n):
    gen = torch.Generator().manual_seed(0)
    pq, pk = (torch.rand(1, 1, n, 32, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(1, 1, n, 16, generator=gen, requires_grad=True)
    with CountOps() as counter:
        FavorCausalChunked.apply(pq, pk, v, None, None, "features", 1.0, 0.0, 64, None)[0].sum().backward()
    return counter.count


@pytest.mark.parametrize("state", [False, True])
def test_offsets_op_count_does_not_depend_on_n(state):
    """On a GPU every dispatched op is a kernel launch: forward + backward dispatch as many at n = 512 as at 4096
    (a per-chunk loop would grow with the number of chunks)."""
    assert _offsets_ops(512, state) == _offsets_ops(4096, state)


def test_features_op_count_does_not_depend_on_n():
    assert _features_ops(512) == _features_ops(4096)


# -- FavorCausalChunked on precomputed features


def _features_formula(pq, pk, v, mask, s0):
    """Causal linear attention of given features, written out (float64): out_t = phi_q(t) (S_0 + Σ_{s<=t, real}
    phi_k(s) [v_s, 1]ᵀ), normalized; rows with a zero denominator output 0. Returns out and the final [S, z]."""
    n, d = v.shape[2], v.shape[3]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    a = (pq @ pk.transpose(-1, -2)) * allowed
    va = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    num = a @ va
    if s0 is not None:
        num = num + pq @ s0
    den = num[..., d:]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.where(den > 0, num[..., :d] / safe, torch.zeros_like(den))
    real = torch.ones_like(pk[..., :1]) if mask is None else mask[:, None, :, None].to(pk.dtype)
    final = (pk * real).transpose(-1, -2) @ va
    return out, final if s0 is None else final + s0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_features_mode_matches_the_formula(padding, with_state, dtype):
    gen = torch.Generator().manual_seed(5)
    pq = torch.rand(B, H, N, M, generator=gen, dtype=torch.float64)
    pk = torch.rand(B, H, N, M, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
    mask = _mask(B, N, padding)
    if mask is not None:  # a padded key's features must not count, whatever they are
        pk = pk + 1e3 * (~mask)[:, None, :, None]
    s0 = None
    if with_state:
        s0 = torch.cat([torch.randn(B, H, M, D, generator=gen), torch.rand(B, H, M, 1, generator=gen) + 0.5], -1)
        s0 = s0.double()
    g = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)

    inputs = [pq, pk, v] + ([s0] if with_state else [])
    x = [t.to(dtype).requires_grad_() for t in inputs]
    out, s, z, lost = FavorCausalChunked.apply(
        x[0], x[1], x[2], None, _key_weights(mask), "features", 123.0, 7.0, 8, x[3] if with_state else None
    )
    assert out.dtype == dtype and not s.requires_grad and not z.requires_grad
    grads = torch.autograd.grad(out, x, g.to(dtype))

    y = [t.clone().requires_grad_() for t in inputs]
    exact, final = _features_formula(y[0], y[1], y[2], mask, y[3] if with_state else None)
    exact_grads = torch.autograd.grad(exact, y, g)

    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.double(), exact, **tol)
    torch.testing.assert_close(s.double(), final[..., :D], **tol)
    torch.testing.assert_close(z.double(), final[..., D], **tol)
    assert int(lost) == 0  # left-padded rows see no real key: nothing to lose
    for name, a, b in zip(("dphi_q", "dphi_k", "dv", "ds0"), grads, exact_grads):
        torch.testing.assert_close(a.double(), b, **tol, msg=name)
    if mask is not None:  # padded keys: no gradient to their features, nor to their values
        assert (grads[1][~mask[:, None, :].expand(B, H, N)] == 0).all()
        assert (grads[2][~mask[:, None, :].expand(B, H, N)] == 0).all()
