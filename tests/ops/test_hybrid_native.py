"""The native bidirectional hybrid walk (_native/hybrid_bidirectional.cpp): hybrid_attention's "native" backend,
held to the PyTorch blocks ("chunked") and the quadratic reference; hedgehog_hybrid_attention, which makes
Hedgehog's features and the learned scales inside the walk, held to hybrid_attention on features made by
HedgehogFeatureMap; when each runs and why not; and a hybrid Performer encoder's inference taking it."""

import pytest
import torch

import linearformers as lf
import linearformers.modeling.performer as performer_module
from linearformers.ops import (
    HedgehogFeatureMap,
    hedgehog_hybrid_attention,
    hedgehog_refusal,
    hybrid_attention,
    native_available,
    set_native_walk,
)
from linearformers.ops.hybrid import hybrid_backend
from linearformers.ops.reference import hybrid_reference
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(not native_available(), reason="the native CPU kernels do not build here")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(b, h, n, d, m, *, seed=0, strided=True):
    """q, k, v as a model's heads are (views of (b, n, h, d) projections) or packed; features, gamma, ℓ."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        q, k, v = (torch.randn(b, n, h, d, generator=g).transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    pq, pk = (torch.rand(b, h, n, m, generator=g) for _ in range(2))
    gamma = torch.rand(h, generator=g) + 0.5
    ell = torch.randn(b, h, n, generator=g)
    return q, k, v, pq, pk, gamma, ell


def _mask(b, n, right, left):
    mask = torch.ones(b, n, dtype=torch.bool)
    if right:
        mask[0, n - right :] = False
    if left and b > 1:
        mask[-1, :left] = False
    return mask


CASES = [  # b, h, n, d, m, window, sinks, with ℓ, right padding, left padding
    (1, 2, 100, 16, 16, 8, 0, True, 0, 0),
    (2, 3, 257, 32, 64, 64, 1, True, 5, 3),
    (2, 2, 97, 16, 32, 1, 2, False, 7, 4),
    (1, 2, 300, 32, 16, 40, 3, True, 0, 0),
    (2, 2, 31, 16, 16, 100, 1, True, 4, 2),  # the window holds the whole sequence
    (2, 1, 64, 16, 48, 33, 0, False, 0, 9),
]


@pytest.mark.parametrize("b, h, n, d, m, window, sinks, scaled, right, left", CASES)
def test_the_native_walk_computes_what_the_pytorch_blocks_compute(b, h, n, d, m, window, sinks, scaled, right, left):
    q, k, v, pq, pk, gamma, ell = _inputs(b, h, n, d, m, seed=n)
    mask = _mask(b, n, right, left)
    kwargs = dict(causal=False, key_padding_mask=mask, sinks=sinks, query_log_scale=ell if scaled else None)
    with torch.no_grad():
        native = hybrid_attention(q, k, v, pq, pk, gamma, window, backend="native", **kwargs)
        chunked = hybrid_attention(q, k, v, pq, pk, gamma, window, backend="chunked", **kwargs)
    torch.testing.assert_close(native, chunked, **TOL)
    assert bool(torch.isfinite(native).all())


def test_the_native_walk_matches_the_quadratic_reference_and_takes_a_zero_gamma_and_lone_padding():
    q, k, v, pq, pk, gamma, ell = _inputs(2, 3, 120, 16, 32, seed=3)
    gamma[1] = 0.0  # that head is the linear part alone
    mask = _mask(2, 120, 10, 0)
    mask[1, :] = False  # a row with no real key: zeros out
    mask[1, 50] = True
    kwargs = dict(causal=False, key_padding_mask=mask, sinks=1, query_log_scale=ell)
    with torch.no_grad():
        native = hybrid_attention(q, k, v, pq, pk, gamma, 16, backend="native", **kwargs)
    reference = hybrid_reference(q.double(), k.double(), v.double(), pq.double(), pk.double(), gamma.double(), 16,
                                 **{**kwargs, "query_log_scale": ell.double()})  # fmt: skip
    torch.testing.assert_close(native.double(), reference, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_run_natively_in_float32_and_threads_change_nothing():
    q, k, v, pq, pk, gamma, ell = _inputs(2, 4, 150, 16, 32, seed=5)
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), pq, pk, gamma, 20)
    kwargs = dict(causal=False, sinks=1, query_log_scale=ell)
    threads = torch.get_num_threads()
    with torch.no_grad():
        native = hybrid_attention(*args, backend="native", **kwargs)
        chunked = hybrid_attention(*args, backend="chunked", **kwargs)
        try:
            torch.set_num_threads(1)
            one_thread = hybrid_attention(*args, backend="native", **kwargs)
        finally:
            torch.set_num_threads(threads)
    assert native.dtype == torch.bfloat16
    torch.testing.assert_close(native.float(), chunked.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(native, one_thread), "each (batch, head) row is one thread's, whatever the split"


@pytest.mark.parametrize("b, h", [(0, 2), (2, 0)])
def test_an_empty_batch_or_no_heads_give_an_empty_output(b, h):
    q, k, v, pq, pk, _, ell = _inputs(b, h, 10, 16, 16)
    with torch.no_grad():
        out = hybrid_attention(q, k, v, pq, pk, torch.ones(h), 4, causal=False, backend="native", query_log_scale=ell)
    assert out.shape == (b, h, 10, 16)


def test_the_backend_a_bidirectional_cpu_call_takes_and_why_native_refuses():
    q, k, v, pq, pk, *_ = _inputs(1, 2, 40, 16, 32)
    call = (q, k, v, pq, pk)
    assert hybrid_backend(None, *call, 8, 0, False, False) == "native"
    assert hybrid_backend(None, *call, 8, 0, False, False, tracked=True) == "chunked"
    assert hybrid_backend(None, *call, 8, 0, True, False) == "chunked"

    def refused(match, *, args=call, causal=False, tracked=False):
        with pytest.raises(ValueError, match=match):
            hybrid_backend("native", *args, 8, 0, causal, False, tracked=tracked)

    refused("bidirectional only", causal=True)
    refused("computes no gradients", tracked=True)
    refused("float64", args=tuple(t.double() for t in call))
    refused("multiples of 16", args=(q[..., :8], k[..., :8], v[..., :8], pq, pk))
    refused("multiples of 16", args=(q, k, v, pq[..., :24], pk[..., :24]))
    refused("value dim equal to head_dim", args=(q, k, torch.cat([v, v], -1), pq, pk))
    with pytest.raises(ValueError, match="positive logit scale, got 0.0"):
        hybrid_backend("native", *call, 8, 0, False, False, scale=0.0)
    previous = set_native_walk(False)
    try:
        refused(r"set_native_walk\(False\)")
        assert hybrid_backend(None, *call, 8, 0, False, False) == "chunked"
    finally:
        set_native_walk(previous)
    # under autograd the default is the PyTorch blocks, whose gradients flow
    q.requires_grad_(True)
    out = hybrid_attention(q, k, v, pq, pk, torch.ones(2), 8, causal=False)
    out.sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


def _hedgehog(h, d, m, separate=True, seed=0):
    torch.manual_seed(seed)
    fm = HedgehogFeatureMap(h, d, m, separate=separate)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    key_weight, key_bias = (fm.key_weight, fm.key_bias) if separate else (fm.weight, fm.bias)
    return fm, (fm.weight, fm.bias, key_weight, key_bias)


@pytest.mark.parametrize(
    "b, h, n, d, m, window, sinks, separate, scales, right",
    [
        (2, 3, 150, 32, 64, 20, 1, True, True, 5),
        (1, 2, 70, 16, 32, 64, 0, False, False, 0),
        (2, 2, 90, 16, 48, 9, 2, True, True, 3),  # m / 2 = 24: the map's product padded to 32 columns
    ],
)
def test_hedgehog_hybrid_attention_is_hybrid_attention_on_the_maps_features(
    b, h, n, d, m, window, sinks, separate, scales, right
):
    fm, weights = _hedgehog(h, d, m, separate, seed=n)
    q, k, v, *_ = _inputs(b, h, n, d, m, seed=n)
    g = torch.Generator().manual_seed(1)
    gamma = torch.rand(h, generator=g) + 0.5
    qa, qb, ka, kb = torch.randn(h, d, generator=g), torch.randn(h, generator=g), torch.randn(h, d, generator=g), \
        torch.randn(h, generator=g)  # fmt: skip
    bound = 3.0
    mask = _mask(b, n, right, 0)
    ell = (q * qa[None, :, None]).sum(-1) + qb[None, :, None] if scales else None
    r = bound * torch.tanh(((k * ka[None, :, None]).sum(-1) + kb[None, :, None]) / bound) if scales else None
    extra = {"query_scale": (qa, qb), "key_scale": (ka, kb), "key_scale_bound": bound} if scales else {}
    with torch.no_grad():
        pq, pk = fm(q, is_query=True), fm(k, is_query=False)
        if scales:
            pk = pk * torch.exp(r)[..., None]
        kwargs = dict(key_padding_mask=mask, sinks=sinks)
        expected = hybrid_attention(q, k, v, pq, pk, gamma, window, causal=False, backend="chunked",
                                    query_log_scale=ell, **kwargs)  # fmt: skip
        fused = hedgehog_hybrid_attention(q, k, v, weights, gamma, window, **kwargs, **extra)
    torch.testing.assert_close(fused, expected, **TOL)


def test_hedgehog_hybrid_attention_refuses_what_it_cannot_take():
    h, d, m = 2, 16, 32
    _, weights = _hedgehog(h, d, m)
    q, k, v, *_ = _inputs(1, h, 40, d, m)
    gamma = torch.ones(h)
    with torch.no_grad():
        with pytest.raises(TypeError, match="weights must be a tuple of 4 tensors"):
            hedgehog_hybrid_attention(q, k, v, weights[:3], gamma, 8)
        with pytest.raises(ValueError, match=r"W_k must be shaped \(2, 16, 16\)"):
            hedgehog_hybrid_attention(q, k, v, (*weights[:2], weights[2][:, :8], weights[3]), gamma, 8)
        with pytest.raises(ValueError, match=r"query_scale\[0\] must be shaped \(2, 16\)"):
            hedgehog_hybrid_attention(q, k, v, weights, gamma, 8, query_scale=(torch.ones(2, 8), torch.ones(2)))
        with pytest.raises(ValueError, match="key_scale_bound must be a positive number"):
            hedgehog_hybrid_attention(q, k, v, weights, gamma, 8, key_scale=(torch.ones(2, 16), torch.ones(2)),
                                      key_scale_bound=0.0)  # fmt: skip
        with pytest.raises(ValueError, match="window must be"):
            hedgehog_hybrid_attention(q, k, v, weights, gamma, 0)
        with pytest.raises(ValueError, match="cannot run this call: it computes in float32"):
            hedgehog_hybrid_attention(q.double(), k.double(), v.double(), weights, gamma, 8)
    # autograd records the map's parameters: refused, with the reason
    with pytest.raises(ValueError, match="computes no gradients"):
        hedgehog_hybrid_attention(q, k, v, weights, gamma, 8)
    assert "computes no gradients" in hedgehog_refusal(q, v, m, weights)
    with torch.no_grad():
        assert hedgehog_refusal(q, v, m, weights) is None


def _hybrid_encoder(**overrides):
    config = tiny_config(
        "performer", hidden_size=64, num_attention_heads=4, intermediate_size=64, feature_map="hedgehog",
        num_features=32, hybrid_window=8, hybrid_sinks=1, hybrid_query_scale=True, hybrid_key_scale=True,
        max_position_embeddings=256, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = lf.PerformerModel(config).eval()
    with torch.no_grad():  # learned scales and maps away from their zero / identity start
        for name, p in model.named_parameters():
            if "scale" in name or "feature_map" in name or "window_balance" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def test_a_hybrid_encoder_s_inference_takes_the_fused_walk_and_matches_the_pytorch_path(monkeypatch):
    model = _hybrid_encoder()
    ids = torch.randint(1, 99, (2, 150))
    mask = torch.ones_like(ids)
    mask[1, 120:] = 0
    calls = []
    fused = performer_module.hedgehog_hybrid_attention
    monkeypatch.setattr(
        performer_module, "hedgehog_hybrid_attention", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    with torch.no_grad():
        native = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert len(calls) == model.config.num_hidden_layers
        previous = set_native_walk(False)
        try:
            pytorch = model(input_ids=ids, attention_mask=mask).last_hidden_state
        finally:
            set_native_walk(previous)
    assert len(calls) == model.config.num_hidden_layers, "switched off, the layers take the PyTorch path"
    torch.testing.assert_close(native[0], pytorch[0], **TOL)
    torch.testing.assert_close(native[1, :120], pytorch[1, :120], **TOL)
    # training records the graph: the PyTorch path, and its gradients
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert len(calls) == model.config.num_hidden_layers
    assert model.layers[0].attention.feature_map.weight.grad is not None
