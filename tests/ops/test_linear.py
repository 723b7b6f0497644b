"""Linear attention on precomputed features (linear.linear_attention, linear.linear_step): any FeatureMap, a learned
one included, runs on every backend (reference, chunked, native), causal and bidirectional, in the decoding step
and in continued prefills; the known maps (FavorPositive, ReluFeatures) through it equal the fused FAVOR+ kernels.
Checked against the quadratic formula in float64 (reference.linear_reference), for gradients into the map's own
parameters, low-precision inputs, autocast, a dispatched-op count that does not depend on n, the errors, and the
native-walk switch."""

import pytest
import torch

from linearformers.ops import (
    BACKENDS,
    FavorPositive,
    FeatureMap,
    ReluFeatures,
    draw_random_features,
    favor_attention,
    linear_attention,
    linear_backend,
    linear_step,
    native_available,
    native_walk_enabled,
    set_native_walk,
)
from tests.ops.helpers import CountOps

B, H, N, D, M = 2, 2, 37, 16, 32  # n = 37: not a multiple of any chunk used here
NATIVE = native_available()
needs_native = pytest.mark.skipif(
    not NATIVE, reason="the native walk needs x86-64 Linux with AVX2 / FMA and a C++ compiler"
)
CAUSAL_BACKENDS = ["reference", "chunked", pytest.param("native", marks=needs_native)]


class Hedgehog(torch.nn.Module):
    """A learned feature map (Hedgehog-style): per head, u = x W (d -> m / 2), phi = softmax([u, -u]) over the m
    features; queries and keys take their own W. Nonnegative, and each position's features depend on it alone."""

    def __init__(self, heads=H, head_dim=D, num_features=M, *, seed=0, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_features = num_features

        def weight():
            w = torch.randn(heads, head_dim, num_features // 2, generator=g, dtype=torch.float64) * head_dim**-0.5
            return torch.nn.Parameter(w.to(dtype))

        self.query, self.key = weight(), weight()

    def forward(self, x, *, is_query):
        u = torch.einsum("bhnd,hdf->bhnf", x, self.query if is_query else self.key)
        return torch.softmax(torch.cat([u, -u], -1), -1)


def _data(b=B, h=H, n=N, d=D, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def _mask(padding, b=B, n=N):
    if padding is None:
        return None
    mask = torch.ones(b, n, dtype=torch.bool)
    if padding == "left":
        mask[1, :9] = False
    else:
        mask[1, -9:] = False
    return mask


def _features(b=B, h=H, n=N, m=M, d=D, seed=2, dtype=torch.float32):
    """Random nonnegative features and v, as any positive map gives."""
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(b, h, n, m, generator=g, dtype=torch.float64) + 0.05
    phi_k = torch.rand(b, h, n, m, generator=g, dtype=torch.float64) + 0.05
    v = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (phi_q, phi_k, v))


def _cotangent(shape, dtype=torch.float64):
    return torch.linspace(-1.0, 1.0, torch.Size(shape).numel(), dtype=torch.float64).view(shape).to(dtype)


def _learned_run(dtype, n_q=N, **kwargs):
    """Output and the gradients of (W_q, W_k, q, k, v) through a learned map and linear_attention."""
    q, k, v = (x.to(dtype).requires_grad_() for x in _data())
    q = q[:, :, :n_q]
    phi = Hedgehog(dtype=dtype)
    assert isinstance(phi, FeatureMap)
    out = linear_attention(phi(q, is_query=True), phi(k, is_query=False), v, **kwargs)
    assert out.dtype == dtype and out.shape == (B, H, n_q, D)
    grads = torch.autograd.grad(out, (phi.query, phi.key, q, k, v), _cotangent(out.shape, dtype))
    return (out, *grads)


def _assert_close(got, want, names, rtol=1e-5, atol=1e-6):
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        a, b = a.detach().double(), b.detach().double()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * float(b.abs().max()), msg=name)


LEARNED = ("out", "dW_q", "dW_k", "dq", "dk", "dv")


# 1. a learned map, on every backend


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("backend", CAUSAL_BACKENDS)
def test_learned_map_causal_on_every_backend(backend, padding):
    mask = _mask(padding)
    exact = _learned_run(torch.float64, causal=True, key_padding_mask=mask, backend="reference")
    if backend == "native":  # the compiled walk computes in float32
        got = _learned_run(torch.float32, causal=True, key_padding_mask=mask, backend="native", chunk_size=16)
        _assert_close(got, exact, LEARNED, rtol=1e-4, atol=1e-5)
    else:
        got = _learned_run(torch.float64, causal=True, key_padding_mask=mask, backend=backend, chunk_size=8)
        _assert_close(got, exact, LEARNED, rtol=1e-9, atol=1e-10)
    assert all(float(g.abs().max()) > 0 for g in got[1:3]), "gradients reach the map's parameters"
    if mask is not None:  # padded keys pass nothing back
        assert bool((got[5][1][:, ~mask[1]] == 0).all())
    if padding == "left":  # queries that see no real key output 0
        assert bool((got[0][1][:, :9] == 0).all())


@pytest.mark.parametrize("backend", CAUSAL_BACKENDS[1:])
def test_learned_map_causal_float32_default_chunk(backend):
    """float32 on each fast backend at its default chunk (64 chunked: one chunk for n = 37; 32 native: two)."""
    mask = _mask("left")
    exact = _learned_run(torch.float64, causal=True, key_padding_mask=mask, backend="reference")
    got = _learned_run(torch.float32, causal=True, key_padding_mask=mask, backend=backend)
    _assert_close(got, exact, LEARNED, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_q", [N, 20])  # 20: fewer queries than keys (cross attention)
@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("backend", [None, "chunked", "reference"])
def test_learned_map_bidirectional(backend, padding, n_q):
    mask = _mask(padding)
    exact = _learned_run(torch.float64, n_q=n_q, key_padding_mask=mask, backend="reference")
    got = _learned_run(torch.float64, n_q=n_q, key_padding_mask=mask, backend=backend)
    _assert_close(got, exact, LEARNED, rtol=1e-9, atol=1e-10)
    low = _learned_run(torch.float32, n_q=n_q, key_padding_mask=mask, backend=backend)
    _assert_close(low, exact, LEARNED, rtol=1e-4, atol=1e-5)
    assert all(float(g.abs().max()) > 0 for g in got[1:3])


def test_learned_map_gradcheck_through_the_chunked_backend():
    q, k, v = (x[:1, :1, :11, :4].clone().requires_grad_() for x in _data())
    phi = Hedgehog(heads=1, head_dim=4, num_features=8)
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, 1] = False

    def op(wq, wk, q, k, v):
        params = {"query": wq, "key": wk}
        pq = torch.func.functional_call(phi, params, (q,), {"is_query": True})
        pk = torch.func.functional_call(phi, params, (k,), {"is_query": False})
        return linear_attention(pq, pk, v, causal=True, key_padding_mask=mask, chunk_size=4, backend="chunked")

    wq, wk = (p.detach().clone().requires_grad_() for p in (phi.query, phi.key))
    assert torch.autograd.gradcheck(op, (wq, wk, q, k, v), atol=1e-6, rtol=1e-4)


# 2. the known maps through linear_attention equal the fused kernels


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_known_maps_equal_favor_attention(feature_map, causal):
    q, k, v = (x.float() for x in _data())  # moderate keys
    w = draw_random_features(M, D, seed=3)
    phi = FavorPositive(w) if feature_map == "softmax" else ReluFeatures(w)
    assert isinstance(phi, FeatureMap) and phi.num_features == M
    mask = _mask("left")
    backends = ["chunked", None] + (["native"] if causal and NATIVE else [])
    g = _cotangent(v.shape, torch.float32)
    for backend in backends:
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        fused = favor_attention(*x, w, causal=causal, feature_map=feature_map, key_padding_mask=mask, backend=backend)
        fused_grads = torch.autograd.grad(fused, x, g)
        y = [t.detach().requires_grad_() for t in (q, k, v)]
        out = linear_attention(
            phi(y[0], is_query=True),
            phi(y[1], is_query=False),
            y[2],
            causal=causal,
            key_padding_mask=mask,
            backend=backend,
        )
        grads = torch.autograd.grad(out, y, g)
        _assert_close((out, *grads), (fused, *fused_grads), ("out", "dq", "dk", "dv"), rtol=1e-4, atol=1e-5)


# 3. continued prefill, the returned state and decoding


def _real_sums(phi_k, v, mask):
    key_weights = torch.ones(phi_k.shape[0], 1, phi_k.shape[2], 1) if mask is None else mask[:, None, :, None].float()
    pk = phi_k.double() * key_weights.double()
    return pk.transpose(-1, -2) @ v.double(), pk.sum(2)


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_continued_prefill_equals_the_whole(padding):
    phi_q, phi_k, v = _features()
    mask = _mask(padding)
    kwargs = dict(causal=True, backend="chunked", chunk_size=8, return_state=True)
    whole, state = linear_attention(phi_q, phi_k, v, key_padding_mask=mask, **kwargs)
    s_ref, z_ref = _real_sums(phi_k, v, mask)
    _assert_close(state, (s_ref, z_ref), ("S", "z"))
    assert state[0].dtype == state[1].dtype == torch.float32
    cut = 13
    head, mid = linear_attention(
        *(x[:, :, :cut] for x in (phi_q, phi_k, v)), key_padding_mask=None if mask is None else mask[:, :cut], **kwargs
    )
    _assert_close(mid, _real_sums(phi_k[:, :, :cut], v[:, :, :cut], None if mask is None else mask[:, :cut]), "Sz")
    tail, end = linear_attention(
        *(x[:, :, cut:] for x in (phi_q, phi_k, v)),
        key_padding_mask=None if mask is None else mask[:, cut:],
        initial_state=mid,
        **kwargs,
    )
    _assert_close((torch.cat([head, tail], 2),), (whole,), ("out",))
    _assert_close(end, state, ("S", "z"))
    # backend None with a state in runs the chunked backend too (the native walk takes none)
    again = linear_attention(
        *(x[:, :, cut:] for x in (phi_q, phi_k, v)),
        causal=True,
        key_padding_mask=None if mask is None else mask[:, cut:],
        initial_state=(*mid, torch.zeros(B, H)),  # (S, z, M) with M = 0 is accepted
    )
    _assert_close((again,), (tail,), ("out",))


def test_initial_state_carries_gradient():
    phi_q, phi_k, v = (x.double() for x in _features(n=12))
    g = torch.Generator().manual_seed(5)
    s0 = torch.rand(B, H, M, D, generator=g, dtype=torch.float64).requires_grad_()
    z0 = (torch.rand(B, H, M, generator=g, dtype=torch.float64) + 1).requires_grad_()
    x = [t.requires_grad_() for t in (phi_q, phi_k, v)]
    out = linear_attention(*x, causal=True, chunk_size=8, initial_state=(s0, z0))
    grads = torch.autograd.grad(out, (*x, s0, z0), _cotangent(out.shape))
    # plain autograd on the formula: out_t = phi_q,t (S0 + Σ_{s<=t} phi_k,s v_sᵀ) / phi_q,t (z0 + Σ_{s<=t} phi_k,s)
    y = [t.detach().requires_grad_() for t in (phi_q, phi_k, v, s0, z0)]
    a = (y[0] @ y[1].transpose(-1, -2)).tril()
    ref = (a @ y[2] + y[0] @ y[3]) / (a.sum(-1, keepdim=True) + y[0] @ y[4][..., None])
    ref_grads = torch.autograd.grad(ref, y, _cotangent(ref.shape))
    # the state enters in float32 (the state's dtype), so float32 tolerances
    _assert_close((out, *grads), (ref, *ref_grads), ("out", "dq", "dk", "dv", "dS0", "dz0"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("prefill", ["chunked", pytest.param("native", marks=needs_native)])
def test_decoding_after_a_prefill_equals_the_full_pass(prefill, padding):
    phi_q, phi_k, v = _features(n=30)
    mask = _mask(padding, n=30)
    full = linear_attention(phi_q, phi_k, v, causal=True, key_padding_mask=mask, backend="reference")
    cut = 21
    head, state = linear_attention(
        *(x[:, :, :cut] for x in (phi_q, phi_k, v)),
        causal=True,
        key_padding_mask=None if mask is None else mask[:, :cut],
        return_state=True,
        backend=prefill,
        chunk_size=16,
    )
    steps = [head]
    for t in range(cut, 30):
        out, state = linear_step(*(x[:, :, t : t + 1] for x in (phi_q, phi_k, v)), state)
        assert out.shape == (B, H, 1, D) and out.dtype == v.dtype
        steps.append(out)
    _assert_close((torch.cat(steps, 2),), (full,), ("out",))
    _assert_close(state, _real_sums(phi_k, v, mask), ("S", "z"))


def test_decoding_from_an_empty_state_equals_the_full_pass():
    phi_q, phi_k, v = _features(n=9)
    full = linear_attention(phi_q, phi_k, v, causal=True, backend="reference")
    state, steps = None, []
    for t in range(9):
        out, state = linear_step(*(x[:, :, t : t + 1] for x in (phi_q, phi_k, v)), state)
        steps.append(out)
    _assert_close((torch.cat(steps, 2),), (full,), ("out",))


def test_a_padded_new_token_leaves_the_state_unchanged():
    phi_q, phi_k, v = _features(n=10)
    _, state = linear_attention(*(x[:, :, :9] for x in (phi_q, phi_k, v)), causal=True, return_state=True)
    new = [x[:, :, 9:] for x in (phi_q, phi_k, v)]
    mask = torch.tensor([[True], [False]])
    out, (s, z) = linear_step(*new, state, key_padding_mask=mask)
    assert torch.equal(s[1], state[0][1]) and torch.equal(z[1], state[1][1])  # the padded token left no trace
    assert not torch.equal(s[0], state[0][0]) and not torch.equal(z[0], state[1][0])
    # its query still reads the state it sees; the real one's output counts its own key
    pq = new[0].double()
    expected_1 = (pq[1] @ state[0][1].double()) / (pq[1] @ state[1][1].double()[..., None])
    _assert_close((out[1],), (expected_1,), ("padded row",))
    unmasked, _ = linear_step(*new, state)
    _assert_close((out[0],), (unmasked[0],), ("real row",))
    # an integer 0/1 mask is taken as well as a bool one
    out_int, _ = linear_step(*new, state, key_padding_mask=mask.long())
    torch.testing.assert_close(out_int, out)


# 4. the chunked backend's op count does not grow with n


def _ops(n):
    phi_q, phi_k, v = (x.requires_grad_() for x in _features(b=1, h=1, n=n, m=16))
    with CountOps() as counter:
        linear_attention(phi_q, phi_k, v, causal=True, backend="chunked").sum().backward()
    assert phi_q.grad is not None and phi_k.grad is not None and v.grad is not None
    return counter.count


def test_chunked_op_count_does_not_depend_on_n():
    """On a GPU every dispatched op is a kernel launch: precomputed features keep the chunked count fixed in n."""
    assert _ops(1024) == _ops(8192)


# 5. low-precision features and values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("causal", "backend"),
    [(True, "chunked"), pytest.param(True, "native", marks=needs_native), (True, "reference"), (False, None)],
)
def test_half_inputs_stay_finite_and_close_to_float32(dtype, causal, backend):
    mask = _mask("left")
    low = [x.to(dtype).requires_grad_() for x in _features()]
    full = [x.detach().float().requires_grad_() for x in low]  # the same values, widened
    kwargs = dict(causal=causal, key_padding_mask=mask, backend=backend)
    out = linear_attention(*low, **kwargs)
    ref = linear_attention(*full, **kwargs)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    g = _cotangent(out.shape, torch.float32)
    grads = torch.autograd.grad(out, low, g.to(dtype))
    ref_grads = torch.autograd.grad(ref, full, g.to(dtype).float())
    for a, b in zip(grads, ref_grads):
        assert a.dtype == dtype and bool(torch.isfinite(a).all())
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))


def test_half_decoding_step():
    phi_q, phi_k, v = (x[:, :, :1] for x in _features(n=1))
    out, (s, z) = linear_step(phi_q.bfloat16(), phi_k.bfloat16(), v.bfloat16(), None)
    assert out.dtype == torch.bfloat16 and s.dtype == z.dtype == torch.float32
    ref, _ = linear_step(phi_q.bfloat16().float(), phi_k.bfloat16().float(), v.bfloat16().float(), None)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


# 6. autocast changes nothing


@pytest.mark.parametrize(
    ("causal", "backend"),
    [(True, "chunked"), pytest.param(True, "native", marks=needs_native), (True, "reference"), (False, None)],
)
def test_autocast_changes_nothing(causal, backend):
    phi_q, phi_k, v = _features()
    mask = _mask("right")
    kwargs = dict(causal=causal, key_padding_mask=mask, backend=backend)
    outside = linear_attention(phi_q, phi_k, v, **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = linear_attention(phi_q, phi_k, v, **kwargs)
        step, state = linear_step(*(x[:, :, :1] for x in (phi_q, phi_k, v)), None)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    step_out, step_state = linear_step(*(x[:, :, :1] for x in (phi_q, phi_k, v)), None)
    torch.testing.assert_close(step, step_out, rtol=0, atol=0)
    torch.testing.assert_close(state, step_state, rtol=0, atol=0)


# 7. errors


def _call_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_errors_name_the_problem():
    phi_q, phi_k, v = _features(n=8)
    state = (torch.zeros(B, H, M, D), torch.zeros(B, H, M))
    cases = [
        (lambda: linear_attention(phi_q, phi_k[..., :16], v), ValueError, "same number of features"),
        (lambda: linear_attention(phi_q[:, :, :6], phi_k, v, causal=True), ValueError, "as many queries as keys"),
        (lambda: linear_attention(phi_q[0], phi_k, v), ValueError, r"phi_q must be shaped"),
        (lambda: linear_attention(phi_q, phi_k, v[0]), ValueError, r"v must be shaped"),
        (lambda: linear_attention(phi_q, phi_k[:, :, :6], v), ValueError, "must share batch, heads and length"),
        (lambda: linear_attention(phi_q[:1], phi_k, v), ValueError, "must share batch and heads"),
        (lambda: linear_attention(phi_q.numpy(), phi_k, v), TypeError, "phi_q must be a torch.Tensor"),
        (lambda: linear_attention(phi_q, phi_k.long(), v), TypeError, "floating-point"),
        (
            lambda: linear_attention(phi_q, phi_k, v, causal=True, initial_state=(state[0][..., :8], state[1])),
            ValueError,
            "the state must be",
        ),
        (
            lambda: linear_attention(phi_q, phi_k, v, causal=True, initial_state=(*state, torch.ones(B, H))),
            ValueError,
            "M != 0",
        ),
        (lambda: linear_attention(phi_q, phi_k, v, causal=True, initial_state=state[0]), TypeError, "tuple"),
        (lambda: linear_attention(phi_q, phi_k, v, initial_state=state), ValueError, "causal attention only"),
        (lambda: linear_attention(phi_q, phi_k, v, return_state=True), ValueError, "causal attention only"),
        (lambda: linear_attention(phi_q, phi_k, v, key_padding_mask=torch.ones(B, 7)), ValueError, "key_padding_mask"),
        (lambda: linear_attention(phi_q, phi_k, v, backend="flash"), ValueError, "unknown backend"),
        (lambda: linear_attention(phi_q, phi_k, v, backend="native"), ValueError, "bidirectional"),
        (
            lambda: linear_attention(phi_q, phi_k, v, causal=True, backend="reference", return_state=True),
            ValueError,
            "no state",
        ),
        (lambda: linear_step(phi_q[:, :, :2], phi_k[:, :, :2], v[:, :, :2], None), ValueError, "one new token"),
        (
            lambda: linear_step(*(x[:, :, :1] for x in (phi_q, phi_k, v)), (state[0], state[1][..., :8])),
            ValueError,
            "the state must be",
        ),
        (
            lambda: linear_step(*(x[:, :, :1] for x in (phi_q, phi_k, v)), (*state, torch.ones(B, H))),
            ValueError,
            "M != 0",
        ),
        (
            lambda: linear_step(phi_q[:, :, :1], phi_k[:, :, :1, :16], v[:, :, :1], None),
            ValueError,
            "same number of features",
        ),
    ]
    empty = [x[:, :, :0] for x in (phi_q, phi_k, v)]
    for backend in ("chunked", "reference", None):
        cases.append((lambda b=backend: linear_attention(*empty, causal=True, backend=b), ValueError, "length 0"))
    if "blockwise" in BACKENDS:  # the fused bidirectional FAVOR+ kernel builds its own map: given features are refused
        cases.append((lambda: linear_attention(phi_q, phi_k, v, backend="blockwise"), ValueError, "blockwise"))
    for call, error, match in cases:
        _call_error(call, error, match)


@pytest.mark.parametrize("chunk_size", [0, -8, 1.5, "8", True])
def test_bad_chunk_size_is_refused(chunk_size):
    phi_q, phi_k, v = _features(n=8)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention(phi_q, phi_k, v, causal=True, chunk_size=chunk_size, backend="chunked")


@needs_native
def test_native_refuses_what_it_cannot_run():
    phi_q, phi_k, v = _features(n=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_attention(phi_q, phi_k, v[..., :8], causal=True, backend="native")  # v's head_dim 8
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_attention(phi_q[..., :24], phi_k[..., :24], v, causal=True, backend="native")  # m = 24
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_attention(phi_q, phi_k, v, causal=True, backend="native", chunk_size=8)
    with pytest.raises(ValueError, match="initial_state"):
        linear_attention(
            phi_q,
            phi_k,
            v,
            causal=True,
            backend="native",
            initial_state=(torch.zeros(B, H, M, D), torch.zeros(B, H, M)),
        )
    # backend None takes the chunked backend where the walk cannot run (v's head_dim 8)
    out = linear_attention(phi_q, phi_k, v[..., :8], causal=True)
    torch.testing.assert_close(out, linear_attention(phi_q, phi_k, v[..., :8], causal=True, backend="reference"))


def test_inputs_are_not_modified():
    phi_q, phi_k, v = _features()
    copies = [x.clone() for x in (phi_q, phi_k, v)]
    mask = _mask("left")
    for causal, backend in ((True, "chunked"), (True, None), (False, None), (True, "reference")):
        linear_attention(phi_q, phi_k, v, causal=causal, key_padding_mask=mask, backend=backend)
    for a, b in zip((phi_q, phi_k, v), copies):
        assert torch.equal(a, b)


# 8. the native switch


@needs_native
def test_set_native_walk_false_takes_the_chunked_backend():
    phi_q, phi_k, v = _features()
    assert native_walk_enabled()
    assert linear_backend(phi_q, phi_k, v, causal=True) == "native", "backend None runs the native walk where it can"
    on = linear_attention(phi_q, phi_k, v, causal=True)
    assert torch.equal(on, linear_attention(phi_q, phi_k, v, causal=True, backend="native"))
    previous = set_native_walk(False)
    try:
        assert previous is True and not native_walk_enabled()
        assert linear_backend(phi_q, phi_k, v, causal=True) == "chunked", "switched off, None runs the chunked backend"
        off = linear_attention(phi_q, phi_k, v, causal=True)
        assert torch.equal(off, linear_attention(phi_q, phi_k, v, causal=True, backend="chunked"))
        torch.testing.assert_close(off, on, rtol=1e-5, atol=1e-6)
        for ask in (linear_backend, linear_attention):
            with pytest.raises(ValueError, match="switched off"):
                ask(phi_q, phi_k, v, causal=True, backend="native")
    finally:
        assert set_native_walk(previous) is False
    assert native_walk_enabled()
    assert linear_backend(phi_q, phi_k, v, causal=True) == "native", "restored: None runs the native walk again"


def test_float64_prefill_and_steps_stay_in_float64():
    """float64 features in, float64 math: a chunked prefill continued by linear_step agrees with the float64
    formula over the whole sequence to 1e-12 (a float32 state would leave ~1e-7)."""
    q, k, v = _data()
    phi = Hedgehog()
    pq, pk = phi(q, is_query=True), phi(k, is_query=False)
    want = linear_attention(pq, pk, v, causal=True, backend="reference")
    _, state = linear_attention(pq[:, :, :-2], pk[:, :, :-2], v[:, :, :-2], causal=True, backend="chunked",
                                return_state=True)  # fmt: skip
    for t in (N - 2, N - 1):
        step, state = linear_step(pq[:, :, t : t + 1], pk[:, :, t : t + 1], v[:, :, t : t + 1], state)
        assert step.dtype == state[0].dtype == torch.float64
        torch.testing.assert_close(step, want[:, :, t : t + 1], rtol=0, atol=1e-12)
