"""The Linformer ops (ops/linformer.py, and the hand-written backward of _linformer_autograd.py): linformer_attention
and causal_linformer_attention against the plain formulas, padding, projections, backends and bad arguments. The
causal chunked form has its own file (test_linformer_chunked.py), as do the paths a GPU runs
(test_linformer_cuda_paths.py)."""

import pytest
import torch

from linearformers.ops import (
    causal_linformer_attention,
    causal_linformer_step,
    linformer_attention,
    softmax_attention,
)
from linearformers.ops.reference import causal_linformer_reference, linformer_reference


def _qkv(b=2, h=3, n=32, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) for _ in range(3))


def _pad(x, pad, side):
    junk = torch.randn(x.shape[0], x.shape[1], pad, x.shape[3]) * 5
    return torch.cat([junk, x], 2) if side == "left" else torch.cat([x, junk], 2)


def _mask(n, pad, side):
    mask = torch.ones(1, n + pad, dtype=torch.bool)
    if side == "left":
        mask[:, :pad] = False
    else:
        mask[:, n:] = False
    return mask


def test_identity_projection_with_k_equal_n_is_exact_attention():
    q, k, v = _qkv()
    eye = torch.eye(32)
    torch.testing.assert_close(linformer_attention(q, k, v, eye), softmax_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_causal_identity_projection_is_exact_causal_attention():
    q, k, v = _qkv(n=30)
    eye = torch.eye(30)
    out = causal_linformer_attention(q, k, v, eye, chunk_size=8)
    torch.testing.assert_close(out, softmax_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_short_sequence_uses_the_first_n_columns():
    q, k, v = _qkv(n=20)
    e = torch.randn(8, 64)
    f = torch.randn(8, 64)
    out = linformer_attention(q, k, v, e, f)
    # softmax(q (E[:, :20] k)ᵀ / 4) (F[:, :20] v)
    torch.testing.assert_close(out, linformer_reference(q, k, v, e, f), rtol=1e-5, atol=1e-5)


def test_per_head_projections_apply_per_head():
    q, k, v = _qkv(h=2, n=16)
    e = torch.randn(2, 4, 16)
    out = linformer_attention(q, k, v, e)
    for head in range(2):
        alone = linformer_attention(q[:, head : head + 1], k[:, head : head + 1], v[:, head : head + 1], e[head])
        torch.testing.assert_close(out[:, head : head + 1], alone, rtol=1e-5, atol=1e-5)


def test_pool_projection_is_mean_pooling_over_windows():
    q, k, v = _qkv(n=32)
    out = linformer_attention(q, k, v, None, method="pool", window=4)
    ref = linformer_reference(q, k, v, None, method="pool", window=4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_conv_projection_is_a_strided_convolution():
    q, k, v = _qkv(n=32)
    wk, wv = torch.randn(16, 16, 4) * 0.1, torch.randn(16, 16, 4) * 0.1
    out = linformer_attention(q, k, v, wk, wv, method="conv", window=4)
    ref = linformer_reference(q, k, v, wk, wv, method="conv", window=4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "method,proj,window",
    [("learned", torch.randn(8, 64), None), ("pool", None, 4), ("conv", torch.randn(16, 16, 4) * 0.1, 4)],
)
def test_padding_changes_nothing_for_real_tokens(side, method, proj, window):
    q, k, v = _qkv(b=1, n=22)
    ref = linformer_attention(q, k, v, proj, method=method, window=window)
    pad = 9
    qp, kp, vp = (_pad(x, pad, side) for x in (q, k, v))
    out = linformer_attention(qp, kp, vp, proj, method=method, window=window, key_padding_mask=_mask(22, pad, side))
    real = out[:, :, pad:] if side == "left" else out[:, :, :22]
    torch.testing.assert_close(real, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_causal_padding_changes_nothing_for_real_tokens(side):
    q, k, v = _qkv(b=1, n=22)
    e = torch.randn(3, 8, 64)
    ref = causal_linformer_attention(q, k, v, e, chunk_size=8)
    pad = 9
    qp, kp, vp = (_pad(x, pad, side) for x in (q, k, v))
    out = causal_linformer_attention(qp, kp, vp, e, chunk_size=8, key_padding_mask=_mask(22, pad, side))
    real = out[:, :, pad:] if side == "left" else out[:, :, :22]
    torch.testing.assert_close(real, ref, rtol=1e-4, atol=1e-5)


def test_causal_linformer_never_reads_the_future():
    q, k, v = _qkv(n=40)
    e, f = torch.randn(8, 64), torch.randn(8, 64)
    out = causal_linformer_attention(q, k, v, e, f, chunk_size=16)
    t = 17
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 10
    out2 = causal_linformer_attention(q2, k2, v2, e, f, chunk_size=16)
    torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


def test_causal_linformer_chunked_step_and_naive_agree():
    q, k, v = _qkv(n=27)
    e, f = torch.randn(3, 6, 40), torch.randn(3, 6, 40)
    chunked, state = causal_linformer_attention(q, k, v, e, f, chunk_size=5, return_state=True)
    naive = causal_linformer_reference(q, k, v, e, f)  # the definition: prefix sums of the slots, O(n k d)
    torch.testing.assert_close(chunked, naive, rtol=1e-4, atol=1e-5)
    st, steps = None, []
    for t in range(27):
        o, st = causal_linformer_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], e, f, st, t)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), chunked, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st[0], state[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_large_logits_stays_finite(dtype):
    q, k, v = _qkv(n=64, d=64)
    k = q * (50 * 8 / q.pow(2).sum(-1, keepdim=True))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    e = torch.eye(64)
    assert torch.isfinite(linformer_attention(q, k, v, e)).all()
    out = causal_linformer_attention(q, k, v, e)
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_bad_arguments_raise_clear_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k must not exceed n_max"):
        linformer_attention(q, k, v, torch.randn(64, 32))
    with pytest.raises(ValueError, match="exceeds the Linformer's max_seq_length=16"):
        linformer_attention(q, k, v, torch.randn(4, 16))
    with pytest.raises(ValueError, match="key_padding_mask must be shaped"):
        linformer_attention(q, k, v, torch.randn(4, 32), key_padding_mask=torch.ones(2, 31))
    with pytest.raises(ValueError, match="do not fit"):
        linformer_attention(q, k[:, :2], v[:, :2], torch.randn(4, 32))
    with pytest.raises(ValueError, match="unknown Linformer projection method"):
        linformer_attention(q, k, v, None, method="fft")
    with pytest.raises(ValueError, match="conv projection weight"):
        linformer_attention(q, k, v, torch.randn(16, 16, 3), method="conv", window=4)
    with pytest.raises(ValueError, match="per head"):
        linformer_attention(q, k, v, torch.randn(5, 4, 32))
    with pytest.raises(ValueError, match="past the Linformer's max_seq_length=32"):
        causal_linformer_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], torch.randn(4, 32), None, None, 32)


@pytest.mark.parametrize("per_head", [False, True])
def test_hand_written_backward_matches_autograd_over_several_query_blocks(per_head):
    q, k, v = (x.double().float().requires_grad_() for x in _qkv(n=40))
    shape = (q.shape[1], 8, 64) if per_head else (8, 64)
    g = torch.Generator().manual_seed(1)
    e, f = (torch.randn(shape, generator=g).requires_grad_() for _ in range(2))
    out = linformer_attention(q, k, v, e, f, block_size=16)  # 40 queries: 3 blocks, the last one short
    ref = linformer_reference(q, k, v, e, f)  # plain autograd: softmax(q (E k)ᵀ scale) (F v)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v, e, f))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v, e, f))
    for name, a, b in zip("qkvef", got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=f"gradient of {name}")


def test_hand_written_backward_with_dropout_regenerates_the_forward_mask():
    from linearformers.ops import _linformer_autograd as module  # for its per-block dropout draw

    q, k, v = (x.requires_grad_() for x in _qkv(n=40))
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(123)
    out = linformer_attention(q, k, v, e, dropout_p=0.3, block_size=16)
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**62, (1,)).item())
    b, h, n = q.shape[:3]
    keep = torch.cat(
        [module._dropout_keep((b, h, min(16, n - i), 8), 0.3, seed, j, "cpu") for j, i in enumerate(range(0, n, 16))],
        dim=2,
    )
    assert 0.1 < (keep == 0).float().mean() < 0.5  # dropout really drops
    ref = linformer_reference(q, k, v, e, dropout_multiplier=keep)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v, e))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v, e))
    for name, a, c in zip("qkve", got, want):
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-3, msg=lambda m, name=name: f"gradient of {name}: {m}")
    torch.manual_seed(124)
    assert not torch.allclose(linformer_attention(q, k, v, e, dropout_p=0.3, block_size=16), out)  # new draw per call


def test_unwritten_slots_are_masked_in_the_hand_written_backward():
    # identity E at k = n on a shorter sequence: slots n'..n were never written and must take no share
    q, k, v = (x.requires_grad_() for x in _qkv(n=20))
    eye = torch.eye(32)
    out = linformer_attention(q, k, v, eye)
    ref = linformer_reference(q, k, v, eye)  # slots 20..31 (zero columns of E[:, :20]) take no share
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    got = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    want = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("masked", [False, True])
def test_causal_prefill_without_gradients_walks_blocks_with_the_same_result(masked):
    q, k, v = _qkv(n=40)
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    mask = None
    if masked:
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[0, :5] = False  # left padding in the first row
    with torch.no_grad():
        whole, whole_state = causal_linformer_attention(
            q, k, v, e, key_padding_mask=mask, chunk_size=8, return_state=True
        )
        blocks, block_state = causal_linformer_attention(
            q, k, v, e, key_padding_mask=mask, chunk_size=8, return_state=True, prefill_block=16
        )  # 3 blocks: 16, 16, 8
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)
    for a, b in zip(block_state, whole_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "method,proj,window",
    [("learned", torch.randn(3, 8, 64), None), ("pool", None, 4), ("conv", torch.randn(16, 16, 4) * 0.1, 4)],
)
def test_reference_backend_equals_the_default(masked, method, proj, window):
    q, k, v = (x.double() for x in _qkv(n=30))
    proj = None if proj is None else proj.double()
    mask = None
    if masked:
        mask = torch.ones(2, 30, dtype=torch.bool)
        mask[0, :7] = False
        mask[1, 25:] = False
    kwargs = dict(method=method, window=window, key_padding_mask=mask)
    ref = linformer_attention(q, k, v, proj, backend="reference", **kwargs)
    assert ref.dtype == torch.float64
    torch.testing.assert_close(ref, linformer_reference(q, k, v, proj, **kwargs), rtol=0, atol=0)
    default = linformer_attention(q, k, v, proj, **kwargs)
    assert torch.equal(linformer_attention(q, k, v, proj, backend="blockwise", **kwargs), default)
    torch.testing.assert_close(default, ref, rtol=1e-4, atol=1e-5)  # the blockwise kernel computes in float32


@pytest.mark.parametrize("masked", [False, True])
def test_block_size_changes_nothing_gradients_included(masked):
    q, k, v = (x.requires_grad_() for x in _qkv(n=30))
    e, f = (torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(s)).requires_grad_() for s in (1, 2))
    mask = None
    if masked:
        mask = torch.ones(2, 30, dtype=torch.bool)
        mask[1, :9] = False
    default = linformer_attention(q, k, v, e, f, key_padding_mask=mask)
    small = linformer_attention(q, k, v, e, f, key_padding_mask=mask, block_size=4)  # 8 blocks, the last short
    torch.testing.assert_close(small, default, rtol=1e-5, atol=1e-5)  # float32 rounding of other block shapes
    weights = torch.randn_like(default)
    got = torch.autograd.grad((small * weights).sum(), (q, k, v, e, f))
    want = torch.autograd.grad((default * weights).sum(), (q, k, v, e, f))
    for name, a, c in zip("qkvef", got, want):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_bad_backend_and_block_size_raise_value_errors():
    from linearformers.ops.linformer import BACKENDS

    q, k, v = _qkv()
    e = torch.randn(4, 32)
    assert BACKENDS == ("reference", "blockwise", "sdpa")
    with pytest.raises(ValueError, match=r"unknown Linformer backend 'chunked'.*'reference', 'blockwise', 'sdpa'"):
        linformer_attention(q, k, v, e, backend="chunked")
    for bad in (0, -1, 4.0, False, "16"):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            linformer_attention(q, k, v, e, block_size=bad)
    with pytest.raises(ValueError, match="backend='reference' has no dropout"):
        linformer_attention(q, k, v, e, dropout_p=0.1, backend="reference")
    with pytest.raises(ValueError, match="needs a positive window"):
        linformer_attention(q, k, v, None, method="pool", backend="reference")
    with pytest.raises(ValueError, match="conv projection weight"):
        linformer_attention(q, k, v, torch.randn(16, 16, 3), method="conv", window=4, backend="reference")


def test_dropout_under_compile_is_one_graph_and_drops_each_share_with_probability_p():
    """Under torch.compile the dropout masks come from torch's generator in the graph (no host read of a seed):
    fullgraph=True compiles. With v = 1 each output is the kept share of its row's probabilities / (1 - p): 1 on
    average, spread by the drops; a row of a padded sequence keeps its own slots only (its output stays finite)."""
    q, k, _ = _qkv(n=64)
    v = torch.ones_like(k)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, :40] = False

    def attend(q, k, v, mask):
        return linformer_attention(q, k, v, None, method="pool", window=4, key_padding_mask=mask, dropout_p=0.5)

    torch.manual_seed(0)
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    assert torch.isfinite(out).all()
    shares = out[..., 0]
    assert abs(float(shares.mean()) - 1.0) < 0.2
    assert float(shares.std()) > 0.1  # without dropout every share is exactly 1
