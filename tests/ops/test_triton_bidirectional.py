"""The bidirectional Triton kernels (backend="triton", causal=False) against reference.py: the fused FAVOR+ maps and
given features, forward and backward, float32 and bf16 operands.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at small
sizes with tiles of 16 positions, so that several tiles, m-blocks and sequence segments are crossed (head_dim 48
also pads the kernels' d tile to 64). With CUDA (``pytest -m cuda``) the same comparisons run at n = 4099, 12 heads
x 64, m = 256 against the chunked backend, and at n = 1000 against float64 features.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from linearformers.ops import (
    draw_random_features,
    favor_attention,
    linear_attention,
    set_triton_kernels,
)
from linearformers.ops.backends import choose_backend
from linearformers.ops.feature_maps import random_feature_map
from linearformers.ops.reference import favor_reference, linear_reference
from tests.ops._triton_cases import (
    CUDA,
    DTYPES,
    ON_CPU,
    TOLERANCE,
    assert_close,
    padding_mask,
    randn,
    run_with_grads,
)

QKV = ("out", "grad q", "grad k", "grad v")  # what assert_close calls the outputs of run_with_grads
B, H, M, D, TILE = 2, 1, 32, 48, 16  # CPU sizes: two m-blocks of 16, several tiles of 16 positions


@ON_CPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_fused_maps_match_the_reference(dtype, feature_map):
    """favor_attention(causal=False, backend="triton"), the map computed inside the kernels: output and dq, dk, dv
    as the float64 reference of the same (rounded) inputs, at one position, an odd length below one tile and one
    past two tiles, keys padded left and right."""
    w = draw_random_features(M, D, seed=5)
    for n in (1, 13, 37):
        inputs = [randn(B, H, n, D, seed=s, dtype=dtype) for s in (6, 7, 8)]
        grad = randn(B, H, n, D, seed=9, dtype=torch.float64)
        mask = padding_mask(B, n)
        kw = dict(feature_map=feature_map, key_padding_mask=mask)
        got = run_with_grads(
            lambda *x, kw=kw: favor_attention(*x, w, chunk_size=TILE, backend="triton", **kw), inputs, grad
        )
        expected = run_with_grads(lambda *x, kw=kw: favor_reference(*x, w, **kw), [t.double() for t in inputs], grad)
        assert_close(got, expected, TOLERANCE[dtype], f"{feature_map} n={n}", QKV)


@ON_CPU
@pytest.mark.parametrize("dtype", DTYPES)
def test_given_features_match_the_reference(dtype):
    """linear_attention(causal=False, backend="triton") on given features, 21 queries over 37 keys padded left and
    right: output and dphi_q, dphi_k, dv as the float64 reference of the same (rounded) inputs."""
    pq, pk = (torch.rand(B, H, n, M, generator=torch.Generator().manual_seed(s)) for s, n in ((1, 21), (2, 37)))
    inputs = [pq.to(dtype), pk.to(dtype), randn(B, H, 37, D, seed=3, dtype=dtype)]
    grad = randn(B, H, 21, D, seed=4, dtype=torch.float64)
    mask = padding_mask(B, 37)
    got = run_with_grads(
        lambda *x: linear_attention(*x, key_padding_mask=mask, chunk_size=TILE, backend="triton"), inputs, grad
    )
    expected = run_with_grads(
        lambda *x: linear_reference(*x, key_padding_mask=mask), [t.double() for t in inputs], grad
    )
    assert_close(got, expected, TOLERANCE[dtype], "features", QKV)


@ON_CPU
def test_keys_of_large_norm_keep_their_weight():
    """Keys with |k| scale^½ = 40, whose every feature underflows float32 at offset 0: taken relative to the
    largest real key exponent of their (batch, head), they give the reference's output and gradients."""
    w = draw_random_features(M, D, seed=5)
    n, scale = 37, D**-0.5
    q, k, v = (randn(B, H, n, D, seed=s) for s in (6, 7, 8))
    k = k * (40.0 / (k.norm(dim=-1, keepdim=True) * math.sqrt(scale)))
    grad = randn(B, H, n, D, seed=9, dtype=torch.float64)
    mask = padding_mask(B, n)
    got = run_with_grads(
        lambda *x: favor_attention(*x, w, key_padding_mask=mask, chunk_size=TILE, backend="triton"), (q, k, v), grad
    )
    expected = run_with_grads(
        lambda *x: favor_reference(*x, w, key_padding_mask=mask), [t.double() for t in (q, k, v)], grad
    )
    # float32 exponents near -800 carry ~1e-4 absolute error, so do the key weights exp(u - offset)
    assert_close(got, expected, 2e-3, "large keys", QKV)


@ON_CPU
def test_compiles_without_graph_break():
    """The kernels are custom ops: torch.compile(fullgraph=True) takes the call whole and gives the eager output
    and gradients."""
    w = draw_random_features(M, D, seed=5)
    inputs = [randn(B, H, 37, D, seed=s) for s in (6, 7, 8)]
    grad = randn(B, H, 37, D, seed=9)

    def fn(q, k, v):
        return favor_attention(q, k, v, w, chunk_size=TILE, backend="triton")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert_close(run_with_grads(compiled, inputs, grad), run_with_grads(fn, inputs, grad), 1e-6, "compiled", QKV)


def test_refusals_and_never_the_default_off_cuda(monkeypatch):
    """Bidirectional backend="triton" says why it cannot run a call, as the causal kernels do, and backend=None
    does not pick it for CPU tensors (interpreted, it is for tests)."""
    v = torch.zeros(1, 1, 8, 32)
    w = torch.randn(32, 32)

    def refused(match, *args, **kwargs):
        with pytest.raises(ValueError, match=match):
            favor_attention(*args, **{"backend": "triton", **kwargs})

    refused("float64", v.double(), v.double(), v.double(), w)
    refused("num_features must be a multiple of 16", v, v, v, torch.randn(24, 32))
    refused("head_dim must be a multiple of 16", v[..., :24], v[..., :24], v[..., :24], w[:, :24])
    refused("chunk_size must be a power of two", v, v, v, w, chunk_size=24)
    with pytest.raises(ValueError, match="v's head_dim must be a multiple of 16"):
        linear_attention(v[..., :16], v[..., :16], v[..., :24], backend="triton")
    previous = set_triton_kernels(False)
    try:
        refused("set_triton_kernels", v, v, v, w)
    finally:
        set_triton_kernels(previous)
    for device in ["cpu"] + (["cuda"] if CUDA else []):
        x = v.to(device)
        assert choose_backend(None, x, 32, None, causal=False, inputs=(x, x)) != "triton"
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        refused("runs on CUDA tensors", v, v, v, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_long_sequences_match_the_chunked_backend_on_cuda(dtype, feature_map, padded):
    """n = 4099 (64 tiles and a partial one), 12 heads x 64, m = 256: output and gradients as the chunked PyTorch
    backend's (whose float64 reference would not fit in memory)."""
    b, h, m, d, n = 1, 12, 256, 64, 4099
    w = draw_random_features(m, d, seed=5, device="cuda")
    inputs = [randn(b, h, n, d, seed=s, device="cuda", dtype=dtype) for s in (6, 7, 8)]
    grad = randn(b, h, n, d, seed=9, device="cuda")
    mask = padding_mask(b, n, "cuda") if padded else None
    kw = dict(feature_map=feature_map, key_padding_mask=mask)
    got, expected = (
        run_with_grads(lambda *x, backend=backend: favor_attention(*x, w, backend=backend, **kw), inputs, grad)
        for backend in ("triton", "chunked")
    )
    assert_close(got, expected, TOLERANCE[dtype], f"{feature_map} n=4099", QKV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_matches_float64_features_on_cuda(dtype):
    """n = 1000, 12 heads x 64, m = 256, keys padded: output and gradients as linear attention of float64 features
    of the same (rounded) inputs, within a bound on the max error (bf16: its gradients included)."""
    b, h, m, d, n = 2, 12, 256, 64, 1000
    w = draw_random_features(m, d, seed=5, device="cuda")
    inputs = [randn(b, h, n, d, seed=s, device="cuda", dtype=dtype) for s in (6, 7, 8)]
    grad = randn(b, h, n, d, seed=9, device="cuda", dtype=torch.float64)
    mask = padding_mask(b, n, "cuda")
    got = run_with_grads(lambda *x: favor_attention(*x, w, key_padding_mask=mask, backend="triton"), inputs, grad)

    def reference(q, k, v):
        pq, pk = (random_feature_map(x, w.double(), is_query=t) for x, t in ((q, True), (k, False)))
        return linear_reference(pq, pk, v, key_padding_mask=mask)

    expected = run_with_grads(reference, [t.double() for t in inputs], grad)
    assert_close(got, expected, TOLERANCE[dtype], "n=1000", QKV)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_is_the_bidirectional_default_for_the_fused_maps_on_cuda():
    """On CUDA, bidirectional FAVOR+ with its map to fuse takes the kernels by default; given features and a
    switched-off kernel set take the chunked backend."""
    v = torch.zeros(1, 12, 64, 64, device="cuda", dtype=torch.bfloat16)
    assert choose_backend(None, v, 256, None, causal=False, inputs=(v, v)) == "triton"
    assert choose_backend(None, v, 256, None, causal=False, fused=False, inputs=(v, v)) == "chunked"
    previous = set_triton_kernels(False)
    try:
        assert choose_backend(None, v, 256, None, causal=False, inputs=(v, v)) == "chunked"
    finally:
        set_triton_kernels(previous)
