"""Causal linear attention of precomputed features on the compiled walk (_linear_native.LinearCausalNative, kernel
"features" of _native) against the plain quadratic formula in float64: outputs, final state and the gradients of
phi_q, phi_k and v, with and without padding, n off the chunk grid, m != d, bf16 inputs and any state spacing; and
the fused FAVOR+ kernels of the same library, still equal to their reference."""

import pytest
import torch

from linearformers.ops import _native, draw_random_features, favor_attention, native_available
from linearformers.ops._linear_native import LinearCausalNative
from linearformers.ops.reference import linear_reference

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native kernel needs x86-64 Linux with AVX2 / FMA and a C++ compiler"
)


def _inputs(b=2, h=3, n=37, m=32, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(b, h, n, m, generator=g) + 0.05  # nonnegative, as a positive feature map gives
    phi_k = torch.rand(b, h, n, m, generator=g) + 0.05
    v = torch.randn(b, h, n, d, generator=g)
    return tuple(x.to(dtype).requires_grad_() for x in (phi_q, phi_k, v))


def _mask(padding, b=2, n=37):
    if padding is None:
        return None
    mask = torch.ones(b, n, dtype=torch.bool)
    if padding == "left":
        mask[1, :11] = False
    else:
        mask[1, 23:] = False
    return mask


def _key_weights(mask):
    return None if mask is None else mask[:, None, :, None].float()


def _native_run(phi_q, phi_k, v, mask, chunk=16, block_chunks=None):
    out, s, z = LinearCausalNative.apply(phi_q, phi_k, v, _key_weights(mask), chunk, block_chunks)
    grads = torch.autograd.grad(out, (phi_q, phi_k, v), _cotangent(out))
    return out, s, z, grads


def _cotangent(out):
    return torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float64).view(out.shape).to(out.dtype)


def _reference_run(phi_q, phi_k, v, mask):
    """float64: out by the quadratic formula, S = Σ phi_k vᵀ and z = Σ phi_k over real keys, and the gradients."""
    x = [t.detach().double().requires_grad_() for t in (phi_q, phi_k, v)]
    out = linear_reference(*x, causal=True, key_padding_mask=mask)
    grads = torch.autograd.grad(out, x, _cotangent(out))
    key_weights = (
        torch.ones(v.shape[0], 1, v.shape[2], 1, dtype=torch.float64) if mask is None else _key_weights(mask).double()
    )
    pk = x[1].detach() * key_weights
    return out.detach(), pk.transpose(-1, -2) @ x[2].detach(), pk.sum(2), grads


@pytest.mark.parametrize("padding", [None, "left", "right"])
# (64, 16, 48, 32): m below both d and chunk, so the packing buffer must hold the chunk x d products on v
@pytest.mark.parametrize(("n", "m", "d", "chunk"), [(37, 32, 16, 16), (64, 16, 48, 32), (80, 48, 32, 16)])
def test_features_walk_matches_the_quadratic_formula(padding, n, m, d, chunk):
    phi_q, phi_k, v = _inputs(n=n, m=m, d=d)
    mask = _mask(padding, n=n)
    out, s, z, grads = _native_run(phi_q, phi_k, v, mask, chunk=chunk, block_chunks=2)
    ref_out, ref_s, ref_z, ref_grads = _reference_run(phi_q, phi_k, v, mask)
    assert out.shape == v.shape and out.dtype == torch.float32
    assert s.shape == (2, 3, m, d) and z.shape == (2, 3, m) and not s.requires_grad and not z.requires_grad
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-5, atol=1e-5 * float(ref_s.abs().max()))
    torch.testing.assert_close(z.double(), ref_z, rtol=1e-5, atol=1e-5 * float(ref_z.abs().max()))
    for name, a, b in zip(("phi_q", "phi_k", "v"), grads, ref_grads):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=f"d{name}")
    if mask is not None:  # padded keys pass nothing back
        padded = ~mask[1]
        assert bool((grads[1][1][:, padded] == 0).all()) and bool((grads[2][1][:, padded] == 0).all())


def test_features_walk_takes_bf16_inputs():
    phi_q, phi_k, v = _inputs(n=70, m=32, d=32, dtype=torch.bfloat16)
    mask = _mask("left", n=70)
    out, s, z, grads = _native_run(phi_q, phi_k, v, mask, chunk=32)
    assert out.dtype == torch.bfloat16 and s.dtype == z.dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()) for g in grads)
    assert bool(torch.isfinite(out).all())
    as_float = [t.detach().float().requires_grad_() for t in (phi_q, phi_k, v)]
    ref_out, ref_s, _, ref_grads = _native_run(*as_float, mask, chunk=32)
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s, ref_s)  # the same bf16 values, widened: the same float32 sums
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_state_spacing_does_not_change_the_result():
    phi_q, phi_k, v = _inputs(n=150, m=32, d=16)
    mask = _mask("right", n=150)
    default = _native_run(phi_q, phi_k, v, mask)
    for block_chunks in (1, 2):
        other = _native_run(phi_q, phi_k, v, mask, block_chunks=block_chunks)
        for a, b in zip((*other[:3], *other[3]), (*default[:3], *default[3])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_chunks", [0, -1, 1.5, True, "2"])
def test_bad_block_chunks_are_refused(block_chunks):
    phi_q, phi_k, v = _inputs(n=32)
    with pytest.raises(ValueError, match="block_chunks"):
        LinearCausalNative.apply(phi_q, phi_k, v, None, 16, block_chunks)


def test_bad_feature_map_names_are_refused():
    x = torch.zeros(1, 1, 16, 16)
    for entry in (
        lambda: _native.forward(x, x, x, None, None, "linear", 1.0, 0.0, 16, 16),
        lambda: _native.backward(x, x, x, None, None, "exp", 1.0, 0.0, 16, x, x, x, x, x, 1),
    ):
        with pytest.raises(ValueError, match="unknown native feature map .(linear|exp)."):
            entry()


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_fused_kernels_still_match_the_reference(feature_map):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 45, 16, generator=g).requires_grad_() for _ in range(3))
    w = draw_random_features(32, 16, seed=5)
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, :7] = False
    outs, grads = [], []
    for backend in ("native", "reference"):
        out = favor_attention(q, k, v, w, causal=True, feature_map=feature_map, key_padding_mask=mask, backend=backend)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), _cotangent(out)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for name, a, b in zip("qkv", *grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()), msg=f"d{name}")
