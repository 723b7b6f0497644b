"""feature_maps.HedgehogFeatureMap: Hedgehog's learned map [softmax(x W + b), softmax(-(x W + b))] per head. Its
form, init (the identity), dtypes and position independence; the map on every causal backend of linear_attention
(outputs and gradients into its parameters, against a float64 reference run) and in hybrid_attention; a short
training run towards exact softmax attention; state_dict round trip; argument errors."""

import pytest
import torch

from linearformers.ops import FeatureMap, hybrid_attention, linear_attention, native_available
from linearformers.ops.feature_maps import HedgehogFeatureMap, softmax_pair
from linearformers.ops.reference import hybrid_reference, softmax_reference

B, H, N, D = 2, 2, 32, 16  # multiples of 16, for the native walk
needs_native = pytest.mark.skipif(
    not native_available(), reason="the native walk needs x86-64 Linux with AVX2 / FMA and a C++ compiler"
)
CAUSAL_BACKENDS = ["reference", "chunked", pytest.param("native", marks=needs_native)]


def _data(b=B, h=H, n=N, d=D, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def _map(h=H, d=D, m=None, *, separate=True, dtype=torch.float64, seed=0):
    """A map moved off its identity init (seeded, the same values in every dtype), so that queries and keys differ
    and biases matter."""
    torch.manual_seed(seed)
    phi = HedgehogFeatureMap(h, d, m, separate=separate, dtype=torch.float64)
    with torch.no_grad():
        for p in phi.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return phi.to(dtype)


# 1. the map itself


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("m", [None, 8, 40])  # 2d (identity), m / 2 < d, m / 2 > d
def test_shape_positive_halves_sum_to_one(m, separate):
    phi = _map(m=m, separate=separate)
    assert isinstance(phi, FeatureMap) and isinstance(phi, torch.nn.Module)
    m = 2 * D if m is None else m
    assert phi.num_features == m
    q, k, _ = _data()
    for x, is_query in ((q, True), (k, False)):
        f = phi(x, is_query=is_query)
        assert f.shape == (B, H, N, m) and f.dtype == torch.float64
        assert bool((f >= 0).all()) and bool(torch.isfinite(f).all())
        torch.testing.assert_close(f[..., : m // 2].sum(-1), torch.ones(B, H, N, dtype=torch.float64))
        torch.testing.assert_close(f[..., m // 2 :].sum(-1), torch.ones(B, H, N, dtype=torch.float64))
    same = torch.equal(phi(q, is_query=True), phi(q, is_query=False))
    assert same != separate, "separate maps differ for queries and keys; a shared one does not"
    names = {name for name, _ in phi.named_parameters()}
    assert names == ({"weight", "bias", "key_weight", "key_bias"} if separate else {"weight", "bias"})


def test_dtypes():
    phi = HedgehogFeatureMap(H, D)
    assert phi.weight.dtype == torch.float32
    q, _, _ = _data()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert phi(q.to(dtype), is_query=True).dtype == torch.float32
    assert phi(q, is_query=True).dtype == torch.float64  # float64 x stays float64
    assert phi.double()(q.float(), is_query=False).dtype == torch.float64  # float64 parameters too


@pytest.mark.parametrize("separate", [True, False])
def test_identity_init(separate):
    phi = HedgehogFeatureMap(H, D, separate=separate, dtype=torch.float64)
    eye = torch.eye(D, dtype=torch.float64).expand(H, D, D)
    for w, b in ((phi.weight, phi.bias), (phi.key_weight, phi.key_bias)):
        if w is not None:
            assert torch.equal(w, eye) and torch.equal(b, torch.zeros_like(b))
    q, k, _ = _data()
    for x, is_query in ((q, True), (k, False)):
        want = torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1)
        torch.testing.assert_close(phi(x, is_query=is_query), want, rtol=0, atol=1e-15)
    narrow = HedgehogFeatureMap(H, D, 8, dtype=torch.float64)  # m / 2 < d: the first m / 2 coordinates
    want = torch.cat([torch.softmax(q[..., :4], -1), torch.softmax(-q[..., :4], -1)], -1)
    torch.testing.assert_close(narrow(q, is_query=True), want, rtol=0, atol=1e-15)
    torch.manual_seed(0)
    wide = HedgehogFeatureMap(H, D, 40)  # m / 2 > d: identity block, then small random columns
    assert torch.equal(wide.weight[:, :, :D], torch.eye(D).expand(H, D, D))
    extra = wide.weight.detach()[:, :, D:]
    assert 0 < float(extra.abs().max()) < 0.2 and float(extra.std()) < 0.05


def test_position_independence():
    phi = _map()
    q = _data()[0]
    changed = q.clone()
    changed[:, :, 5:] = torch.randn_like(changed[:, :, 5:]) * 3
    changed[:, :, :3] = 0
    for is_query in (True, False):
        a, b = phi(q, is_query=is_query), phi(changed, is_query=is_query)
        assert torch.equal(a[:, :, 3:5], b[:, :, 3:5])
        assert not torch.equal(a[:, :, 5:], b[:, :, 5:])


def test_the_softmax_pair_equals_torch_softmaxes_and_passes_gradcheck():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    composed = torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1)
    assert torch.equal(softmax_pair(u), composed)
    assert torch.autograd.gradcheck(softmax_pair, (u,))
    cot = torch.randn(composed.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad(softmax_pair(u), u, cot)[0], torch.autograd.grad(composed, u, cot)[0], rtol=0, atol=1e-15
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_features_under_no_grad_equal_the_recorded_ones(dtype):
    """Under no_grad the map takes [u, -u] from one product with [W, -W] and one softmax over both halves; the
    features are those of the recorded path (softmax_pair), to the dtype's rounding."""
    phi = _map(m=40, dtype=dtype)
    q = _data(dtype=dtype)[0]
    for is_query in (True, False):
        recorded = phi(q, is_query=is_query)
        assert recorded.requires_grad
        with torch.no_grad():
            untracked = phi(q, is_query=is_query)
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(untracked, recorded.detach(), **tol)


def test_backward_keeps_one_copy_of_the_features():
    """Through the map and a product after it, autograd keeps the features once (the product's own saved input):
    no tensor of the features' size or more that is not the features themselves."""
    phi = _map(dtype=torch.float32)
    q = _data(dtype=torch.float32)[0]
    w = torch.randn(2 * D, 4)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        features = phi(q, is_query=True)
        (features @ w).sum()
    big = [t for t in saved if t.numel() >= features.numel()]
    assert big and all(t.untyped_storage().data_ptr() == features.untyped_storage().data_ptr() for t in big)


# 2. on the attention paths


def _run(dtype, backend, **kwargs):
    """Output and the gradients of the map's parameters through causal linear_attention."""
    q, k, v = (x.to(dtype) for x in _data())
    phi = _map(dtype=dtype)
    out = linear_attention(phi(q, is_query=True), phi(k, is_query=False), v, causal=True, backend=backend, **kwargs)
    cot = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float64).view(out.shape).to(dtype)
    params = [phi.weight, phi.bias, phi.key_weight, phi.key_bias]
    return (out, *torch.autograd.grad(out, params, cot))


@pytest.mark.parametrize("backend", CAUSAL_BACKENDS)
def test_causal_linear_attention_backends_agree(backend):
    exact = _run(torch.float64, "reference")
    if backend == "native":  # the compiled walk computes in float32
        got, rtol, atol = _run(torch.float32, "native", chunk_size=16), 1e-4, 1e-5
    else:
        got, rtol, atol = _run(torch.float64, backend, chunk_size=8), 1e-9, 1e-10
    for name, a, b in zip(("out", "dW_q", "db_q", "dW_k", "db_k"), got, exact):
        assert a.shape == b.shape, name
        a, b = a.detach().double(), b.detach().double()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * float(b.abs().max()), msg=name)
    assert all(float(g.abs().max()) > 0 for g in got[1:]), "gradients reach every parameter"


@pytest.mark.parametrize("causal", [True, False])
def test_hybrid_attention_with_hedgehog_features(causal):
    q, k, v = _data(n=24)
    phi = _map()
    pq, pk = phi(q, is_query=True), phi(k, is_query=False)
    gamma = torch.tensor([0.5, 2.0], dtype=torch.float64)
    out = hybrid_attention(q, k, v, pq, pk, gamma, 5, causal=causal)
    want = hybrid_reference(q, k, v, pq, pk, gamma, 5, causal=causal)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    (gw,) = torch.autograd.grad(out.sum(), phi.weight)
    assert float(gw.abs().max()) > 0


def test_training_towards_softmax_attention_lowers_the_error():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    target = softmax_reference(q, k, v, causal=True)
    phi = HedgehogFeatureMap(2, 8)
    opt = torch.optim.Adam(phi.parameters(), lr=0.03)

    def loss():
        out = linear_attention(phi(q, is_query=True), phi(k, is_query=False), v, causal=True, backend="reference")
        return torch.nn.functional.mse_loss(out, target)

    first = float(loss().detach())
    for _ in range(30):
        opt.zero_grad()
        loss().backward()
        opt.step()
    last = float(loss().detach())
    assert last < 0.5 * first, (first, last)


# 3. saving, and errors


def test_state_dict_round_trip():
    phi = _map(m=24, dtype=torch.float32)
    other = HedgehogFeatureMap(H, D, 24)
    q, _, _ = _data(dtype=torch.float32)
    assert not torch.equal(other(q, is_query=False), phi(q, is_query=False))
    other.load_state_dict(phi.state_dict())
    assert set(phi.state_dict()) == {"weight", "bias", "key_weight", "key_bias"}
    for is_query in (True, False):
        assert torch.equal(other(q, is_query=is_query), phi(q, is_query=is_query))
    with pytest.raises(RuntimeError):  # a shared map has no key parameters
        HedgehogFeatureMap(H, D, 24, separate=False).load_state_dict(phi.state_dict())


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((H, D, 7), {}, ValueError, "even"),
        ((H, D, 0), {}, ValueError, "even"),
        ((0, D), {}, ValueError, "num_heads"),
        ((H, -1), {}, ValueError, "head_dim"),
        ((H, 4.0), {}, TypeError, "head_dim"),
        ((H, D, 8.0), {}, TypeError, "num_features"),
        ((True, D), {}, TypeError, "num_heads"),
        ((H, D), {"separate": 1}, TypeError, "separate"),
        ((H, D), {"dtype": torch.int32}, TypeError, "dtype"),
    ],
)
def test_bad_construction(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        HedgehogFeatureMap(*args, **kwargs)


def test_bad_inputs():
    phi = HedgehogFeatureMap(H, D)
    x = torch.randn(B, H, N, D)
    with pytest.raises(ValueError, match="heads"):
        phi(torch.randn(B, H + 1, N, D), is_query=True)
    with pytest.raises(ValueError, match="head_dim"):
        phi(torch.randn(B, H, N, D + 1), is_query=True)
    with pytest.raises(ValueError, match="shaped"):
        phi(x[0], is_query=True)
    with pytest.raises(TypeError, match="floating"):
        phi(x.long(), is_query=True)
    with pytest.raises(TypeError, match="torch.Tensor"):
        phi(x.tolist(), is_query=True)
    with pytest.raises(TypeError, match="is_query"):
        phi(x, is_query=1)
    with pytest.raises(TypeError):
        phi(x)  # is_query is required, keyword-only


def test_the_random_maps_take_the_old_keyword_projection_with_a_future_warning_until_0_3_0():
    from linearformers.ops import FavorPositive, draw_random_features, favor_positive, relu_features

    x = torch.randn(1, 2, 6, 8)
    w = draw_random_features(16, 8, seed=0)
    for fn in (favor_positive, relu_features):
        want = fn(x, random_features=w, is_query=True) if fn is favor_positive else fn(x, random_features=w)
        with pytest.warns(FutureWarning, match=r"projection= is renamed random_features=.*0\.3\.0"):
            got = fn(x, projection=w, is_query=True) if fn is favor_positive else fn(x, projection=w)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.warns(FutureWarning, match=r"projection= is renamed random_features="):
        assert FavorPositive(projection=w).random_features is w


def test_random_feature_map_takes_the_old_keyword_kernel_with_a_future_warning_until_0_3_0():
    from linearformers.ops import draw_random_features
    from linearformers.ops.feature_maps import random_feature_map

    x = torch.randn(1, 2, 6, 8)
    w = draw_random_features(16, 8, seed=0)
    want = random_feature_map(x, w, is_query=True, feature_map="relu")
    with pytest.warns(FutureWarning, match=r"kernel= is renamed feature_map=; .* goes away in 0\.3\.0"):
        got = random_feature_map(x, w, is_query=True, kernel="relu")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
