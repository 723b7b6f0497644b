import math

import pytest
import torch

from linearformers.ops import (
    draw_random_features,
    favor_attention,
    favor_features,
    favor_step,
    native_available,
    softmax_attention,
)
from linearformers.ops.reference import favor_reference

NO_NATIVE = pytest.mark.skipif(not native_available(), reason="the native kernel is unavailable here")


def _qkv(b=2, h=3, n=40, d=16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) * s for s in (scale, scale, 1.0))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_orthogonal_blocks_are_exactly_orthogonal_with_gaussian_row_norms():
    d = 16
    w = draw_random_features(4 * d, d, seed=3, dtype=torch.float64)
    for block in w.split(d):
        directions = block / block.norm(dim=1, keepdim=True)
        torch.testing.assert_close(directions @ directions.T, torch.eye(d, dtype=torch.float64), atol=1e-10, rtol=0)
    norms = draw_random_features(4096, d, seed=5, dtype=torch.float64).norm(dim=1)
    # chi distribution with d degrees of freedom: E|g|^2 = d
    assert abs(norms.pow(2).mean().item() - d) < 0.5


def test_qr_sign_correction_makes_directions_uniform():
    # Without the sign correction, QR of a Gaussian matrix biases diag(Q) positive; with it the mean is ~0.
    d = 8
    diag = torch.stack([torch.diagonal(draw_random_features(d, d, seed=s)) for s in range(400)])
    assert abs(diag.mean().item()) < 0.05


def test_redraws_are_deterministic_in_seed_and_step():
    a = draw_random_features(64, 16, seed=7, step=3)
    torch.testing.assert_close(a, draw_random_features(64, 16, seed=7, step=3), rtol=0, atol=0)
    assert not torch.equal(a, draw_random_features(64, 16, seed=7, step=4))
    assert not torch.equal(a, draw_random_features(64, 16, seed=8, step=3))


def test_error_to_softmax_falls_like_one_over_sqrt_m():
    q, k, v = _qkv(n=64, scale=0.5)
    ref = softmax_attention(q, k, v)
    errs = {}
    for m in (64, 256, 1024):
        errs[m] = sum(_rel(favor_attention(q, k, v, draw_random_features(m, 16, seed=s)), ref) for s in range(6)) / 6
    # 4x the features -> about half the error; allow slack for noise
    assert errs[256] < 0.75 * errs[64]
    assert errs[1024] < 0.75 * errs[256]
    assert errs[1024] < 0.15
    ratio = errs[64] / errs[1024]
    assert 2.0 < ratio < 8.0, f"error ratio over 16x features is {ratio}, expected about sqrt(16) = 4"


def test_orthogonal_features_beat_iid_on_average():
    q, k, v = _qkv(b=1, h=4, n=64, scale=0.3)
    ref = softmax_attention(q, k, v)

    def mse(orthogonal):
        errs = [
            _rel(favor_attention(q, k, v, draw_random_features(16, 16, seed=s, orthogonal=orthogonal)), ref) ** 2
            for s in range(40)
        ]
        return sum(errs) / len(errs)

    assert mse(True) < 0.9 * mse(False)


def test_relu_kernel_equals_its_closed_form():
    q, k, v = _qkv(n=20)
    w = draw_random_features(32, 16, seed=1)
    out = favor_attention(q, k, v, w, feature_map="relu")
    # phi(x) = relu(x' Wᵀ) + 1e-3, x' = x d^(-1/4), out = (A V) / (A 1) with A = phi(Q) phi(K)ᵀ
    torch.testing.assert_close(out, favor_reference(q, k, v, w, feature_map="relu"), rtol=1e-4, atol=1e-5)


def test_relu_features_estimate_the_arc_cosine_kernel():
    # E_w[relu(w.x) relu(w.y)] = |x||y| (sin t + (pi - t) cos t) / (2 pi), t the angle between x and y
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 8, generator=g)
    w = draw_random_features(200_000, 8, seed=2, orthogonal=False, dtype=torch.float64)
    est = (torch.relu(w @ x.double()) * torch.relu(w @ y.double())).mean().item()
    t = math.acos((x @ y / (x.norm() * y.norm())).item())
    closed = (x.norm() * y.norm()).item() * (math.sin(t) + (math.pi - t) * math.cos(t)) / (2 * math.pi)
    assert abs(est - closed) / closed < 0.02


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_causal_favor_never_reads_the_future(feature_map):
    q, k, v = _qkv(n=50)
    w = draw_random_features(64, 16, seed=0)
    out = favor_attention(q, k, v, w, causal=True, feature_map=feature_map, chunk_size=16)
    t = 23
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 10
    out2 = favor_attention(q2, k2, v2, w, causal=True, feature_map=feature_map, chunk_size=16)
    torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


def test_chunked_causal_recurrent_and_naive_quadratic_agree():
    q, k, v = _qkv(n=45)
    w = draw_random_features(48, 16, seed=4)
    chunked, state = favor_attention(q, k, v, w, causal=True, chunk_size=8, return_state=True)
    naive = favor_reference(q.double(), k.double(), v.double(), w, causal=True).float()  # the (n x n) formula
    torch.testing.assert_close(chunked, naive, rtol=1e-4, atol=1e-5)
    st, steps = None, []
    for t in range(q.shape[2]):
        o, st = favor_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], w, st)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), chunked, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st[0], state[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st[1], state[1], rtol=1e-4, atol=1e-4)


def test_prefill_state_continues_like_one_long_pass():
    q, k, v = _qkv(n=30)
    w = draw_random_features(32, 16, seed=4)
    full = favor_attention(q, k, v, w, causal=True, chunk_size=7)
    head, state = favor_attention(q[:, :, :17], k[:, :, :17], v[:, :, :17], w, causal=True, return_state=True)
    tail = favor_attention(q[:, :, 17:], k[:, :, 17:], v[:, :, 17:], w, causal=True, initial_state=state)
    torch.testing.assert_close(torch.cat([head, tail], 2), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_left_or_right_changes_nothing_for_real_tokens(causal):
    q, k, v = _qkv(b=1, n=20)
    w = draw_random_features(32, 16, seed=0)
    ref = favor_attention(q, k, v, w, causal=causal)
    for side in ("left", "right"):
        pad = 7
        junk = [torch.randn(1, 3, pad, 16) * 5 for _ in range(3)]
        cat = (lambda x, j: torch.cat([j, x], 2)) if side == "left" else (lambda x, j: torch.cat([x, j], 2))
        qp, kp, vp = (cat(x, j) for x, j in zip((q, k, v), junk))
        mask = torch.ones(1, 20 + pad, dtype=torch.bool)
        if side == "left":
            mask[:, :pad] = False
        else:
            mask[:, 20:] = False
        out = favor_attention(qp, kp, vp, w, causal=causal, key_padding_mask=mask)
        real = out[:, :, pad:] if side == "left" else out[:, :, :20]
        torch.testing.assert_close(real, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_with_large_logits_stays_finite(dtype, causal):
    d = 64
    q, k, v = _qkv(n=64, d=d)
    # q.k / sqrt(d) reaches ~50 for aligned pairs
    k = q * (50 * math.sqrt(d) / q.pow(2).sum(-1, keepdim=True))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    logits = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
    assert logits.max() > 45
    w = draw_random_features(128, d, seed=0)
    out = favor_attention(q, k, v, w, causal=causal)  # |k| scale^½ ~ 18: key features need an offset
    assert out.float().abs().amax() > 0.1
    assert out.dtype == dtype
    assert torch.isfinite(out).all()


def test_bad_arguments_raise_clear_errors():
    q, k, v = _qkv()
    w = draw_random_features(32, 16, seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        favor_attention(q, k[:1], v[:1], w)
    with pytest.raises(ValueError, match="random_features must be shaped"):
        favor_attention(q, k, v, torch.randn(32, 8))
    with pytest.raises(ValueError, match="key_padding_mask must be shaped"):
        favor_attention(q, k, v, w, key_padding_mask=torch.ones(2, 39))
    with pytest.raises(ValueError, match="unknown FAVOR\\+ feature map .cosine."):
        favor_attention(q, k, v, w, feature_map="cosine")
    with pytest.raises(ValueError, match="batch, heads, length, head_dim"):
        favor_attention(q[0], k[0], v[0], w)
    with pytest.raises(ValueError, match="num_features and head_dim must be positive"):
        draw_random_features(-3, 16, seed=0)
    with pytest.raises(ValueError, match="causal FAVOR\\+ only"):
        favor_attention(q, k, v, w, return_state=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("masked", [False, True])
def test_hand_written_backward_matches_autograd_of_the_naive_formula(causal, feature_map, masked):
    q, k, v = (x.double().requires_grad_() for x in _qkv(n=37))
    w = draw_random_features(24, 16, seed=2)
    mask = torch.ones(2, 37, dtype=torch.bool)
    if masked:
        mask[0, :5] = False
        mask[1, 30:] = False
    out = favor_attention(q, k, v, w, causal=causal, feature_map=feature_map, chunk_size=8, key_padding_mask=mask)
    g = torch.randn_like(out)
    fast = torch.autograd.grad(out, (q, k, v), g)

    # plain autograd through the (n x n) formula, in float64; queries that see only padding output 0, as in the kernel
    naive = favor_reference(q, k, v, w, causal=causal, feature_map=feature_map, key_padding_mask=mask)
    torch.testing.assert_close(out, naive, rtol=1e-4, atol=1e-5)
    slow = torch.autograd.grad(naive, (q, k, v), g)
    for name, f, s in zip("qkv", fast, slow):
        assert f.dtype == torch.float64
        torch.testing.assert_close(f.float(), s.float(), rtol=1e-3, atol=1e-5, msg=f"d{name}")


CAUSAL_BACKENDS = ["chunked", pytest.param("native", marks=NO_NATIVE)]


@pytest.mark.parametrize("backend", [None, *CAUSAL_BACKENDS])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_over_long_sequences_match_one_block(causal, backend):
    """block_size only trades memory against per-block overhead: the bidirectional kernel's feature-map blocks and
    the native walk's saved states. Chunks of 8 and 32 give the same results too."""
    if backend is not None and not causal:
        pytest.skip("one bidirectional kernel")
    q, k, v = (x.requires_grad_() for x in _qkv(n=70, d=16))
    w = draw_random_features(32, 16, seed=2)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[0, :9] = False
    chunk = 16 if causal else None
    out = favor_attention(q, k, v, w, causal=causal, chunk_size=chunk, key_padding_mask=mask, backend=backend)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    for block, other_chunk in ((16, chunk), (32, 32 if causal else None)):  # 5 or 3 blocks instead of 1
        out_blocks = favor_attention(
            q, k, v, w, causal=causal, chunk_size=other_chunk, block_size=block, key_padding_mask=mask, backend=backend
        )
        torch.testing.assert_close(out_blocks, out, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(out_blocks.pow(2).sum(), (q, k, v)), grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", CAUSAL_BACKENDS)
def test_causal_backward_twice_through_a_retained_graph_and_under_saved_tensor_hooks(backend):
    """A second backward (retain_graph) gives the same gradients; under saved-tensor hooks (non-reentrant
    checkpointing, offloading) everything backward reads goes through the hooks, with the same result."""
    q, k, v = (x.requires_grad_() for x in _qkv(n=50, d=16))
    w = draw_random_features(32, 16, seed=2)
    out = favor_attention(q, k, v, w, causal=True, chunk_size=16, block_size=16, backend=backend)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out_hooked = favor_attention(q, k, v, w, causal=True, chunk_size=16, block_size=16, backend=backend)
    assert packed.count(tuple(q.shape)) >= 3  # q, k, v at least (the native walk keeps a padded output)
    for a, b in zip(torch.autograd.grad(out_hooked, (q, k, v), g), first):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    checkpointed = torch.utils.checkpoint.checkpoint(
        lambda x, y, z: favor_attention(x, y, z, w, causal=True, chunk_size=16, backend=backend),
        q,
        k,
        v,
        use_reentrant=False,
    )
    for a, b in zip(torch.autograd.grad(checkpointed, (q, k, v), g), first):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", CAUSAL_BACKENDS)
def test_causal_forward_without_a_graph_gives_the_same_output_and_state(backend):
    q, k, v = (x.requires_grad_() for x in _qkv(n=50, d=16))
    w = draw_random_features(32, 16, seed=2)
    out, state = favor_attention(q, k, v, w, causal=True, chunk_size=16, return_state=True, backend=backend)
    with torch.no_grad():  # generate()'s prefill
        out_ng, state_ng = favor_attention(q, k, v, w, causal=True, chunk_size=16, return_state=True, backend=backend)
    torch.testing.assert_close(out_ng, out.detach(), rtol=0, atol=0)
    for a, b in zip(state_ng, state):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _float64_reference(q, k, v, w, mask=None, causal=True):
    """FAVOR+ with Lemma 1's features in float64, in log space, where nothing underflows (reference.py)."""
    return favor_reference(q.double(), k.double(), v.double(), w, causal=causal, key_padding_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [1, 3])
def test_keys_of_large_norm_stay_exact_and_differentiable(causal, blocks):
    """Every key feature is exp(-|w - k'|² / 2) <= 1; at |k'| ~ 20 most of them fall below float32's range and the
    outputs used to collapse to 0. Bidirectional attention subtracts a running maximum of the key exponents;
    causal attention redoes such a call with per-position prefix maxima. Both cancel in N / D, so outputs and
    gradients match a float64 evaluation of the same features."""
    q, k, v = _qkv(n=37, seed=3)
    k = k * 10.0
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0, :5] = False
    w = draw_random_features(24, 16, seed=2)
    a = favor_features(q, w, is_query=True) @ favor_features(k, w, is_query=False).mT
    den = (a.tril() if causal else a).sum(-1)
    assert (den < 1e-30).float().mean() > 0.5, "most queries must lose every key in float32 without an offset"
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    block = 16 if blocks > 1 else None
    out = favor_attention(q, k, v, w, causal=causal, chunk_size=8, block_size=block, key_padding_mask=mask)
    g = torch.randn_like(out)
    fast = torch.autograd.grad(out, (q, k, v), g)
    naive = _float64_reference(q, k, v, w, mask, causal)
    torch.testing.assert_close(out, naive, rtol=1e-4, atol=1e-5)
    slow = torch.autograd.grad(naive, (q, k, v), g)
    for name, f, s in zip("qkv", fast, slow):  # float32 work: errors ~1e-5 of the largest gradient
        torch.testing.assert_close(f, s, rtol=1e-3, atol=1e-4 * float(s.abs().max()), msg=f"d{name}")


def test_causal_fallback_for_large_keys_never_reads_the_future_and_is_not_taken_otherwise():
    """The state's offset M shows the path: 0 from the fast walk, the prefix maximum of the key exponents (below 0)
    from the per-position offsets of the fallback."""
    q, k, v = _qkv(n=37, seed=3)
    w = draw_random_features(24, 16, seed=2)
    _, (_, _, offset) = favor_attention(q, k, v, w, causal=True, chunk_size=8, return_state=True)
    assert (offset == 0).all(), "moderate keys must stay on the fast walk"
    k = k * 10.0
    out, (_, _, offset) = favor_attention(q, k, v, w, causal=True, chunk_size=8, return_state=True)
    assert (offset < 0).all()
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:] *= 3.0  # much larger keys after position 19 (in the same chunk as 16-19)
    v2[:, :, 20:] = torch.randn_like(v2[:, :, 20:])
    out2 = favor_attention(q, k2, v2, w, causal=True, chunk_size=8)
    torch.testing.assert_close(out2[:, :, :20], out[:, :, :20], rtol=1e-6, atol=1e-6)


def test_more_bad_arguments_raise_clear_errors():
    from linearformers.ops import causal_linformer_attention, linformer_attention

    q, k, v = _qkv(n=12)
    w = draw_random_features(24, 16, seed=2)
    with pytest.raises(TypeError, match="must share one dtype"):
        favor_attention(q, k.double(), v, w)
    with pytest.raises(TypeError, match="key_padding_mask must be bool or hold only 0 and 1"):
        favor_attention(q, k, v, w, key_padding_mask=torch.zeros(2, 12).masked_fill(torch.rand(2, 12) > 0.5, -1e4))
    with pytest.raises(ValueError, match="length 0"):
        favor_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], w, causal=True)
    with pytest.raises(ValueError, match="v's head_dim equal to q's"):
        favor_attention(q, k, v[..., :8], w)
    with pytest.raises(ValueError, match="random_features is a fixed draw"):
        favor_attention(q, k, v, w.clone().requires_grad_())
    e = torch.randn(4, 12)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        linformer_attention(q, k, v, e, dropout_p=1.0)
    with pytest.raises(ValueError, match="v's head_dim equal to q's"):
        causal_linformer_attention(q, k, v[..., :8], e)


def test_hand_written_backwards_refuse_a_second_derivative():
    from linearformers.ops import linformer_attention

    q, k, v = (x.requires_grad_() for x in _qkv(n=12))
    w = draw_random_features(24, 16, seed=2)
    outs = [favor_attention(q, k, v, w), favor_attention(q, k, v, w, causal=True, chunk_size=4)]
    outs.append(linformer_attention(q, k, v, torch.randn(4, 12)))
    for out in outs:
        (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        with pytest.raises(
            RuntimeError, match="once_differentiable|does not require grad|not have been used in the graph"
        ):
            torch.autograd.grad(dq.pow(2).sum(), q)


def _large_keys(n=29):
    q, k, v = _qkv(n=n, seed=5)
    k = k * 10.0  # |k'| ~ 20: most key features underflow at offset 0
    k[:, :, 3] *= 0.05  # and one key of moderate norm among them
    return q, k, v


def test_decoding_steps_keep_keys_of_large_norm():
    """favor_step keeps its state relative to an offset M that follows the keys, so keys whose features underflow
    at offset 0 count in decoding as in the stabilized causal pass and the float64 reference."""
    q, k, v = _large_keys()
    w = draw_random_features(24, 16, seed=2)
    reference = _float64_reference(q, k, v, w).float()
    state, steps, offsets = None, [], []
    for t in range(q.shape[2]):
        out, state = favor_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], w, state)
        steps.append(out)
        offsets.append(state[2])
    torch.testing.assert_close(torch.cat(steps, 2), reference, rtol=1e-4, atol=1e-5)
    assert (offsets[0] < -30).all(), "the offset must follow the first (large) key down"
    assert (offsets[3] > offsets[2]).all(), "and come back up for the moderate key"
    # a prefill through the fast walk's fallback, then steps from its state
    head, state = favor_attention(
        q[:, :, :20], k[:, :, :20], v[:, :, :20], w, causal=True, chunk_size=8, return_state=True
    )
    tail = []
    for t in range(20, q.shape[2]):
        out, state = favor_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], w, state)
        tail.append(out)
    torch.testing.assert_close(torch.cat([head, *tail], 2), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("split", [1, 13, 20])
def test_continued_prefill_keeps_keys_of_large_norm(split):
    q, k, v = _large_keys()
    mask = torch.ones(2, q.shape[2], dtype=torch.bool)
    mask[1, :6] = False  # left padding, all inside the first piece
    w = draw_random_features(24, 16, seed=2)
    reference = _float64_reference(q, k, v, w, mask).float()
    pieces = [slice(0, split), slice(split, q.shape[2])]
    head, state = favor_attention(
        *(x[:, :, pieces[0]] for x in (q, k, v)),
        w,
        causal=True,
        chunk_size=8,
        key_padding_mask=mask[:, pieces[0]],
        return_state=True,
    )
    tail, state = favor_attention(
        *(x[:, :, pieces[1]] for x in (q, k, v)),
        w,
        causal=True,
        chunk_size=8,
        key_padding_mask=mask[:, pieces[1]],
        initial_state=state,
        return_state=True,
    )
    out = torch.cat([head, tail], 2)
    torch.testing.assert_close(out[0], reference[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1, :, 6:], reference[1, :, 6:], rtol=1e-4, atol=1e-5)
    # the state ends where a step-by-step decode ends: the same true sums exp(M) S, exp(M) z
    stepped = None
    for t in range(q.shape[2]):
        _, stepped = favor_step(
            *(x[:, :, t : t + 1] for x in (q, k, v)), w, stepped, key_padding_mask=mask[:, t : t + 1]
        )
    for a, b in zip(state[:2], stepped[:2]):
        shift = (state[2] - stepped[2]).view(*state[2].shape, *([1] * (a.dim() - 2)))
        torch.testing.assert_close(a * torch.exp(shift), b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def test_moderate_keys_leave_the_offset_at_zero():
    """The fast walk's state is at offset 0, and steps with keys of moderate norm never move it: the states of
    prefill and decoding agree entry for entry (the chunked-vs-recurrent test compares S and z)."""
    q, k, v = _qkv(n=40)
    w = draw_random_features(32, 16, seed=4)
    _, state = favor_attention(q, k, v, w, causal=True, chunk_size=8, return_state=True)
    assert len(state) == 3 and (state[2] == 0).all()
    for t in range(q.shape[2]):
        _, state = favor_step(*(x[:, :, t : t + 1] for x in (q, k, v)), w, state)
        assert (state[2] == 0).all()


def test_bad_decoding_states_raise():
    q, k, v = _qkv(n=4)
    w = draw_random_features(8, 16, seed=0)
    one = tuple(x[:, :, :1] for x in (q, k, v))
    _, state = favor_step(*one, w, None)
    with pytest.raises(ValueError, match="state must be"):
        favor_step(*one, w, (state[0][:, :, :4], state[1]))
    with pytest.raises(ValueError, match="state must be"):
        favor_step(*one, w, (state[0], state[1], state[2][:1]))
    with pytest.raises(TypeError, match="tuple"):
        favor_step(*one, w, state[0])
    with pytest.raises(ValueError, match="state must be"):
        favor_attention(q, k, v, w, causal=True, initial_state=(state[0], state[1][..., :3]))
    # a two-tensor state is one at offset 0
    torch.testing.assert_close(favor_step(*one, w, state[:2])[0], favor_step(*one, w, state)[0])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_of_large_norm_never_turn_outputs_or_gradients_nan(causal):
    """A padded key's exponents may pass the offset taken over the real keys (bidirectional: their running maximum;
    decoding: the state's M); exp then overflowed before the mask zeroed it, and 0 x inf = NaN in ~30% of draws.
    Padded keys are masked before the exp. Causal: both backends (the compiled walk where it builds)."""
    for backend in (None, "chunked") if causal else (None,):
        for seed in range(20):
            q, k, v = (x.requires_grad_() for x in _qkv(b=2, h=2, n=12, seed=seed))
            mask = torch.ones(2, 12, dtype=torch.bool)
            mask[0, 9:] = False  # right padding
            mask[1, :4] = False  # left padding
            w = draw_random_features(16, 16, seed=seed)
            out = favor_attention(q, k * 40, v, w, causal=causal, key_padding_mask=mask, chunk_size=16, backend=backend)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
            grads = torch.autograd.grad(out, (q, k, v), g)
            # float64, in log space (reference.py): exact however large the keys; queries that see no real key
            # output 0 and pass no gradient
            reference = _float64_reference(q, k * 40, v, w, mask, causal)
            ref_grads = torch.autograd.grad(reference, (q, k, v), g.double())
            assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in grads), f"seed {seed}"
            torch.testing.assert_close(out.double(), reference, rtol=1e-3, atol=1e-4, msg=f"seed {seed}")
            # near one-hot attention: dq and dk are ~0, up to float32's cancellation in dk = s (du W - k' Σ du)
            scale = max(float(b.abs().max()) for b in ref_grads)
            for name, a, b in zip("qkv", grads, ref_grads):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * scale, msg=f"d{name}, seed {seed}")


def test_decoding_step_drops_a_padded_key_above_the_state_offset():
    """After keys of large norm the state's offset M sits hundreds of e-folds below 0; a padded new token with a
    moderate key has exponents far above it, which overflowed exp before the mask dropped the token."""
    q, k, v = _qkv(b=2, h=2, n=10)
    w = draw_random_features(32, 16, seed=0)
    _, state = favor_attention(q, k * 40, v, w, causal=True, return_state=True)
    assert (state[2] < -300).all()
    mask = torch.tensor([[True], [False]])
    one = tuple(x[:, :, :1] for x in (q, k * 0.1, v))
    out, new_state = favor_step(*one, w, state, key_padding_mask=mask)
    assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in new_state)
    for a, b in zip(new_state, state):  # the padded sequence's state is unchanged
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    phi_q = favor_features(one[0][1], w, is_query=True)  # the padded sequence's query reads the old state
    expected = (phi_q @ state[0][1]) / (phi_q @ state[1][1][..., None])
    torch.testing.assert_close(out[1], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", [favor_attention, favor_reference])
def test_the_old_keyword_projection_still_works_with_a_future_warning_until_0_3_0(op):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    w = draw_random_features(16, 8, seed=0)
    want = op(q, k, v, random_features=w, causal=True)
    with pytest.warns(FutureWarning, match=r"projection= is renamed random_features=; .* goes away in 0\.3\.0"):
        got = op(q, k, v, projection=w, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op", [favor_attention, favor_reference])
def test_the_old_keywords_kernel_and_kernel_eps_still_work_with_a_future_warning_until_0_3_0(op):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    w = draw_random_features(16, 8, seed=0)
    want = op(q, k, v, w, causal=True, feature_map="relu", feature_eps=0.1)
    with pytest.warns(FutureWarning, match=r"kernel= is renamed feature_map=; .* goes away in 0\.3\.0"):
        with pytest.warns(FutureWarning, match=r"kernel_eps= is renamed feature_eps=; .* goes away in 0\.3\.0"):
            got = op(q, k, v, w, causal=True, kernel="relu", kernel_eps=0.1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_favor_step_and_favor_features_take_the_old_keyword_kernel_with_a_future_warning():
    q = torch.randn(1, 2, 1, 8)
    w = draw_random_features(16, 8, seed=0)
    want = favor_step(q, q, q, w, None, feature_map="relu")[0]
    with pytest.warns(FutureWarning, match=r"favor_step\(\): kernel= is renamed feature_map="):
        torch.testing.assert_close(favor_step(q, q, q, w, None, kernel="relu")[0], want, rtol=0, atol=0)
    with pytest.warns(FutureWarning, match=r"favor_features\(\): kernel= is renamed feature_map="):
        got = favor_features(q, w, is_query=True, kernel="relu")
    torch.testing.assert_close(got, favor_features(q, w, is_query=True, feature_map="relu"), rtol=0, atol=0)


def test_the_old_keyword_kernel_beside_feature_map_is_a_type_error():
    q = torch.randn(1, 2, 12, 8)
    w = draw_random_features(16, 8, seed=0)
    with pytest.raises(TypeError, match="got both kernel= and feature_map="):
        favor_attention(q, q, q, w, kernel="relu", feature_map="relu")


def test_the_old_keyword_projection_beside_random_features_is_a_type_error():
    q = torch.randn(1, 2, 12, 8)
    w = draw_random_features(16, 8, seed=0)
    with pytest.raises(TypeError, match="got both projection= and random_features="):
        favor_attention(q, q, q, projection=w, random_features=w)
