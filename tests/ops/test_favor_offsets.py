"""The chunked per-position offsets of causal FAVOR+ (_favor_chunked.favor_causal_offsets: keys of large norm and
continued prefills) and the precomputed-features mode of FavorCausalChunked. Checked against the quadratic formula in
float64 (reference.favor_reference, or the formula written out for given features, and the sums that make a state),
gradcheck, and for a dispatched-op count that does not depend on n."""

import math

import pytest
import torch

from linearformers.ops import draw_random_features
from linearformers.ops._favor_chunked import FavorCausalChunked, favor_causal_offsets, offsets_chunk
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


def _keep(mask):
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

    chunked, state = run(lambda q, k, v: favor_causal_offsets(q, k, v, w, _keep(mask), SCALE, 8))
    wide, wide_state = run(  # the same function in float64: float32 loses nothing that matters
        lambda q, k, v: favor_causal_offsets(q.double(), k.double(), v.double(), w.double(), _keep(mask), SCALE, 8)
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
    out, (s, z, offset) = favor_causal_offsets(q, k, v, w, _keep(mask), SCALE, 8)
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
    keep = _keep(mask)
    whole, (s, z, offset) = favor_causal_offsets(q, k, v, w, keep, SCALE, 8)
    cut = 13
    head, (s1, z1, m1) = favor_causal_offsets(*(x[:, :, :cut] for x in (q, k, v)), w, keep[:, :, :cut], SCALE, 8)
    factor = math.exp(-shift)
    mid = (s1 * factor, z1 * factor, m1 + shift)
    tail, (s2, z2, m2) = favor_causal_offsets(
        *(x[:, :, cut:] for x in (q, k, v)), w, keep[:, :, cut:], SCALE, 8, initial_state=mid
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
    a, sa = favor_causal_offsets(q, k, v, w, _keep(mask), SCALE, 8, initial_state=empty)
    b, sb = favor_causal_offsets(q, k, v, w, _keep(mask), SCALE, 8)
    torch.testing.assert_close(a, b)
    for x, y in zip(sa, sb):
        torch.testing.assert_close(x, y)
    # nothing seen at all: output 0, an empty state at offset 0
    none = torch.zeros(B, N, dtype=torch.bool)
    out, (s, z, offset) = favor_causal_offsets(q, k, v, w, _keep(none), SCALE, 8)
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

    chunked = grads(lambda q, k, v, s, z: favor_causal_offsets(q, k, v, w, _keep(mask), SCALE, 8, (s, z, m0)))
    # the same in float64 (checked by gradcheck below and against the reference above): float32 keeps up
    wide = grads(
        lambda q, k, v, s, z: favor_causal_offsets(
            *(x.double() for x in (q, k, v)), w.double(), _keep(mask), SCALE, 8, (s.double(), z.double(), m0.double())
        )
    )
    for name, a, b in zip(("out", "dq", "dk", "dv", "dS", "dz"), chunked, wide):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(
            a.double(), b.double(), rtol=1e-4, atol=1e-5 * float(b.detach().abs().max()), msg=name
        )


def test_gradcheck_in_float64():
    q, k, v = (x.requires_grad_() for x in _qkv(b=1, h=1, n=11, d=4, dtype=torch.float64))
    w = draw_random_features(8, 4, seed=2, dtype=torch.float64)
    keep = torch.ones(1, 1, 11, 1, dtype=torch.float64)
    keep[0, 0, 1] = 0
    s0 = torch.rand(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(1, 1, 8, dtype=torch.float64) + 0.5).requires_grad_()
    m0 = torch.tensor([[2.0]], dtype=torch.float64)

    def op(q, k, v, s0, z0):
        out, (s, z, offset) = favor_causal_offsets(q, k * 3.0, v, w, keep, 0.5, 4, (s0, z0, m0))
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
    keep = torch.ones(1, 1, n, 1)
    keep[..., :5, :] = 0
    initial = None
    if state:
        initial = (torch.rand(1, 1, 32, 16, requires_grad=True), torch.rand(1, 1, 32) + 1, torch.zeros(1, 1))
    with CountOps() as counter:
        out, _ = favor_causal_offsets(q, _large(k.detach()).requires_grad_(), v, w, keep, SCALE, 64, initial)
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
        x[0], x[1], x[2], None, _keep(mask), "features", 123.0, 7.0, 8, x[3] if with_state else None
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
