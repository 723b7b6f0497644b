"""hybrid_attention and hybrid_step (ops/hybrid.py): the window + sinks + linear part in one normalizer, against
reference.hybrid_reference, with padding, prefills and steps, query log scales, sinks and bad inputs. Every test runs
the CPU core in one pass and in passes (core_passes); the tests of how the core splits its work see the real split."""

import itertools
import math

import pytest
import torch

from linearformers.ops import draw_random_features, favor_positive
from linearformers.ops import hybrid as hybrid_module
from linearformers.ops.feature_maps import favor_exponents
from linearformers.ops.hybrid import HybridState, hybrid_attention, hybrid_step
from linearformers.ops.reference import hybrid_reference, softmax_reference

B, H, D, M = 2, 3, 4, 5


@pytest.fixture(autouse=True, params=["one-pass", "passes-of-1-block", "passes-of-2-blocks-recomputed"])
def core_passes(request, monkeypatch):
    """Every test runs with the core in one pass (as these small inputs get by default) and split into passes of
    one and of two query blocks (as long CPU inputs get), whose block states carry across the passes; in passes
    of two, each pass is checkpointed under autograd (as inputs with over _RECOMPUTE_BYTES of scores get)."""
    if request.param != "one-pass":
        size = int(request.param.split("-")[2])
        monkeypatch.setattr(hybrid_module, "_blocks_per_pass", lambda *args: min(size, args[4]))
    if request.param.endswith("recomputed"):
        monkeypatch.setattr(hybrid_module, "_RECOMPUTE_BYTES", 0)
    return request.param


def _inputs(n=11, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(3))
    phi_q, phi_k = (torch.rand(B, H, n, M, generator=g, dtype=dtype) for _ in range(2))
    gamma = torch.tensor([0.3, 1.0, 2.5], dtype=dtype)  # a different balance per head
    return q, k, v, phi_q, phi_k, gamma


def _mask(n, padding):
    if padding == "none":
        return None
    mask = torch.ones(B, n, dtype=torch.bool)
    if padding == "left":
        mask[0, :3] = False
        mask[1, :1] = False
    else:
        mask[0, -4:] = False
        mask[1, -2:] = False
    return mask


@pytest.mark.parametrize("window", [3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_a_length_that_fills_its_blocks_with_strided_inputs_equals_the_reference(causal, window):
    """n = 12, a multiple of the window: the blocks are views of the inputs, here laid out (b, n, h, ·) and
    transposed, as a model's heads are; outputs and gradients as the reference's."""
    x = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in _inputs(12)[:5]]
    gamma = _inputs(12)[5]
    assert not x[0].is_contiguous()
    out = hybrid_attention(*x, gamma, window, causal=causal)
    ref = hybrid_reference(*x, gamma, window, causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    cot = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, x, cot), torch.autograd.grad(ref, x, cot)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("window", [1, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_equals_the_reference(causal, window, padding):
    n = 11  # not a multiple of any window here but 1
    x = _inputs(n)
    mask = _mask(n, padding)
    out = hybrid_attention(*x, window, causal=causal, key_padding_mask=mask)
    ref = hybrid_reference(*x, window, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sinks", [0, 2], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_equal_the_reference(causal, sinks):
    mask = _mask(9, "left")
    grads = []
    for fn in (hybrid_attention, hybrid_reference):
        x = [t.clone().requires_grad_(True) for t in _inputs(9)]
        out = fn(*x, 3, causal=causal, key_padding_mask=mask, sinks=sinks)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append([t.grad for t in x])
    for name, got, want in zip(("q", "k", "v", "phi_q", "phi_k", "gamma"), *grads, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_window_covering_everything_is_softmax_attention(causal, padding):
    q, k, v, phi_q, phi_k, gamma = _inputs(7)
    mask = _mask(7, padding)
    out = hybrid_attention(q, k, v, phi_q, phi_k, gamma, 7 if causal else 8, causal=causal, key_padding_mask=mask)
    ref = softmax_reference(q, k, v, causal=causal, key_padding_mask=mask)  # the linear part is empty
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_causal_never_reads_the_future():
    x = _inputs(12)
    out = hybrid_attention(*x, 3, causal=True)
    changed = [t.clone() for t in x[:5]]
    for t in changed:
        t[:, :, 7:] = 3.0
    out2 = hybrid_attention(*changed, x[5], 3, causal=True)
    torch.testing.assert_close(out2[:, :, :7], out[:, :, :7], rtol=0, atol=0)
    assert not torch.allclose(out2[:, :, 7:], out[:, :, 7:])


def test_a_query_with_no_real_key_outputs_zero():
    x = _inputs(6)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[0, :2] = False
    out = hybrid_attention(*x, 2, causal=True, key_padding_mask=mask)
    assert (out[0, :, :2] == 0).all()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [True, False])
def test_padding_invariance(causal):
    n, pad = 7, 3
    q, k, v, phi_q, phi_k, gamma = _inputs(n)
    plain = hybrid_attention(q, k, v, phi_q, phi_k, gamma, 3, causal=causal)

    def padded(side):
        def put(t):
            zeros = torch.full((*t.shape[:2], pad, t.shape[-1]), 9.0, dtype=t.dtype)  # junk in the padding
            return torch.cat([zeros, t] if side == "left" else [t, zeros], 2)

        real = torch.ones(B, n, dtype=torch.bool)
        fake = torch.zeros(B, pad, dtype=torch.bool)
        mask = torch.cat([fake, real] if side == "left" else [real, fake], 1)
        out = hybrid_attention(
            *(put(t) for t in (q, k, v, phi_q, phi_k)), gamma, 3, causal=causal, key_padding_mask=mask
        )
        return out[:, :, pad:] if side == "left" else out[:, :, :n]

    torch.testing.assert_close(padded("left"), plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(padded("right"), plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [1, 4])
@pytest.mark.parametrize("prefill", [2, 6], ids=["prefill-shorter-than-the-window", "prefill-longer"])
def test_prefill_then_steps_equal_the_causal_pass(window, prefill):
    n = 10
    x = _inputs(n)
    mask = _mask(n, "left")
    full = hybrid_attention(*x, window, causal=True, key_padding_mask=mask)
    q, k, v, phi_q, phi_k, gamma = x
    cut = slice(0, prefill)
    out, state = hybrid_attention(
        q[:, :, cut], k[:, :, cut], v[:, :, cut], phi_q[:, :, cut], phi_k[:, :, cut], gamma, window,
        causal=True, key_padding_mask=mask[:, cut], return_state=True,
    )  # fmt: skip
    assert isinstance(state, HybridState) and state.k.shape[2] == window - 1
    torch.testing.assert_close(out, full[:, :, cut])
    for t in range(prefill, n):
        one = slice(t, t + 1)
        out, state = hybrid_step(
            q[:, :, one], k[:, :, one], v[:, :, one], phi_q[:, :, one], phi_k[:, :, one], gamma, window, state,
            key_padding_mask=mask[:, one],
        )  # fmt: skip
        torch.testing.assert_close(out, full[:, :, one], rtol=1e-10, atol=1e-12)
        assert state.k.shape[2] == window - 1  # constant memory


def test_steps_from_nothing_and_a_multi_token_continuation_equal_the_causal_pass():
    n, window = 9, 3
    q, k, v, phi_q, phi_k, gamma = x = _inputs(n)
    full = hybrid_attention(*x, window, causal=True)
    state = None
    for t in range(4):
        one = slice(t, t + 1)
        out, state = hybrid_step(
            q[:, :, one], k[:, :, one], v[:, :, one], phi_q[:, :, one], phi_k[:, :, one], gamma, window, state
        )
        torch.testing.assert_close(out, full[:, :, one])
    rest = slice(4, n)
    out = hybrid_attention(
        q[:, :, rest], k[:, :, rest], v[:, :, rest], phi_q[:, :, rest], phi_k[:, :, rest], gamma, window,
        causal=True, initial_state=state,
    )  # fmt: skip
    torch.testing.assert_close(out, full[:, :, rest])


@pytest.mark.parametrize("causal", [True, False])
def test_bf16_is_finite_and_close_to_float32(causal):
    x32 = [t.float() for t in _inputs(13)]
    x16 = [t.bfloat16() for t in x32]
    out16 = hybrid_attention(*x16, 4, causal=causal)
    out32 = hybrid_attention(*(t.float() for t in x16), 4, causal=causal)  # the same rounded inputs
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    torch.testing.assert_close(out16.float(), out32, rtol=2e-2, atol=2e-2)


def test_runs_outside_autocast():
    x = [t.float() for t in _inputs(8)]
    plain = hybrid_attention(*x, 3, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = hybrid_attention(*x, 3, causal=True)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, plain, rtol=0, atol=0)


def test_bad_inputs_are_named():
    q, k, v, phi_q, phi_k, gamma = _inputs(6)
    with pytest.raises(ValueError, match="window must be a positive int"):
        hybrid_attention(q, k, v, phi_q, phi_k, gamma, 0, causal=True)
    with pytest.raises(ValueError, match="window must be a positive int"):
        hybrid_attention(q, k, v, phi_q, phi_k, gamma, -2, causal=False)
    with pytest.raises(ValueError, match="window must be a positive int"):
        hybrid_attention(q, k, v, phi_q, phi_k, gamma, 2.0, causal=True)
    with pytest.raises(ValueError, match=r"gamma must be shaped \(heads,\)"):
        hybrid_attention(q, k, v, phi_q, phi_k, gamma[:2], 2, causal=True)
    with pytest.raises(ValueError, match="gamma must be finite and nonnegative"):
        hybrid_attention(q, k, v, phi_q, phi_k, -gamma, 2, causal=True)
    with pytest.raises(TypeError, match="gamma must be a torch.Tensor"):
        hybrid_attention(q, k, v, phi_q, phi_k, [1.0, 1.0, 1.0], 2, causal=True)
    with pytest.raises(ValueError, match="phi_k must be shaped"):
        hybrid_attention(q, k, v, phi_q, phi_k[:, :, :5], gamma, 2, causal=True)
    with pytest.raises(ValueError, match="same number of features"):
        hybrid_attention(q, k, v, phi_q, phi_k[..., :3], gamma, 2, causal=True)
    with pytest.raises(ValueError, match="same length"):
        hybrid_attention(q, k[:, :, :5], v[:, :, :5], phi_q, phi_k, gamma, 2, causal=True)
    with pytest.raises(ValueError, match="causal attention only"):
        hybrid_attention(q, k, v, phi_q, phi_k, gamma, 2, causal=False, return_state=True)
    with pytest.raises(ValueError, match="one new token"):
        hybrid_step(q, k, v, phi_q, phi_k, gamma, 2, None)
    _, state = hybrid_attention(q, k, v, phi_q, phi_k, gamma, 3, causal=True, return_state=True)
    with pytest.raises(ValueError, match="the state's k must be shaped"):
        one = slice(0, 1)
        hybrid_step(q[:, :, one], k[:, :, one], v[:, :, one], phi_q[:, :, one], phi_k[:, :, one], gamma, 4, state)


def _log_scale(n, dtype=torch.float64, seed=5, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return offset + 2.0 * torch.randn(B, H, n, generator=g, dtype=dtype)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_query_log_scale_equals_the_reference(causal, window, padding):
    n = 11
    x = _inputs(n)
    mask = _mask(n, padding)
    ell = _log_scale(n)
    out = hybrid_attention(*x, window, causal=causal, key_padding_mask=mask, query_log_scale=ell)
    ref = hybrid_reference(*x, window, causal=causal, key_padding_mask=mask, query_log_scale=ell)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # the scale moves the balance between the two parts: the output is not the one without it
    assert not torch.allclose(out, hybrid_attention(*x, window, causal=causal, key_padding_mask=mask))


@pytest.mark.parametrize("offset", [-100.0, 100.0])
@pytest.mark.parametrize("causal", [True, False])
def test_query_log_scale_far_from_the_window_logits_neither_overflows_nor_loses_the_reference(causal, offset):
    # exp(±100) is past float32's range: the op must not form it. Far above, the first causal queries (no linear key)
    # still need their window part, which a stabilizer of ℓ_t alone would send to 0.
    x32 = [t.float() for t in _inputs(9)]
    ell = _log_scale(9, offset=offset)
    out = hybrid_attention(*x32, 3, causal=causal, query_log_scale=ell.float())
    ref = hybrid_reference(*(t.double() for t in x32), 3, causal=causal, query_log_scale=ell)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_with_a_query_log_scale_equal_the_reference(causal):
    mask = _mask(9, "left")
    grads = []
    for fn in (hybrid_attention, hybrid_reference):
        x = [t.clone().requires_grad_(True) for t in (*_inputs(9), _log_scale(9))]
        out = fn(*x[:6], 3, causal=causal, key_padding_mask=mask, query_log_scale=x[6])
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append([t.grad for t in x])
    for name, got, want in zip(("q", "k", "v", "phi_q", "phi_k", "gamma", "query_log_scale"), *grads, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)
    assert grads[0][6].abs().sum() > 0


def test_prefill_then_steps_with_a_query_log_scale_equal_the_causal_pass():
    n, window, prefill = 10, 3, 4
    x = _inputs(n)
    ell = _log_scale(n)
    mask = _mask(n, "left")
    full = hybrid_attention(*x, window, causal=True, key_padding_mask=mask, query_log_scale=ell)
    q, k, v, phi_q, phi_k, gamma = x
    cut = slice(0, prefill)
    out, state = hybrid_attention(
        q[:, :, cut], k[:, :, cut], v[:, :, cut], phi_q[:, :, cut], phi_k[:, :, cut], gamma, window,
        causal=True, key_padding_mask=mask[:, cut], return_state=True, query_log_scale=ell[:, :, cut],
    )  # fmt: skip
    torch.testing.assert_close(out, full[:, :, cut], rtol=1e-10, atol=1e-12)
    for t in range(prefill, n):
        one = slice(t, t + 1)
        out, state = hybrid_step(
            q[:, :, one], k[:, :, one], v[:, :, one], phi_q[:, :, one], phi_k[:, :, one], gamma, window, state,
            key_padding_mask=mask[:, one], query_log_scale=ell[:, :, one],
        )  # fmt: skip
        torch.testing.assert_close(out, full[:, :, one], rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def many_orthogonal_features():
    return draw_random_features(4096, 8, seed=0, step=0, orthogonal=True).double()  # seconds: drawn once


@pytest.mark.parametrize("causal", [True, False])
def test_favor_features_on_the_softmax_scale_estimate_softmax_attention(causal, many_orthogonal_features):
    """FAVOR+ features with ℓ = u - log m and gamma = 1: exact softmax on the window plus the FAVOR+ estimate
    elsewhere, so with many features the hybrid is close to softmax attention over all keys; without ℓ the linear
    part is off by a factor m exp(c_t - u_t) per query, and so is the result."""
    projection = many_orthogonal_features
    (m, d), n = projection.shape, 12
    g = torch.Generator().manual_seed(0)
    # moderate logits: FAVOR+'s variance grows as exp(|q' + k'|²), and m = 4096 keeps it small for these
    q, k = (0.5 * torch.randn(B, 2, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 2, n, d, generator=g, dtype=torch.float64)
    u = favor_exponents(q, projection, is_query=True)
    top = u.amax(-1, keepdim=True)
    phi_q, phi_k = torch.exp(u - top), favor_positive(k, projection, is_query=False)
    ell = top.squeeze(-1) - math.log(m)
    gamma = torch.ones(2, dtype=torch.float64)
    exact = softmax_reference(q, k, v, causal=causal)
    out = hybrid_attention(q, k, v, phi_q, phi_k, gamma, 3, causal=causal, query_log_scale=ell)
    ref = hybrid_reference(q, k, v, phi_q, phi_k, gamma, 3, causal=causal, query_log_scale=ell)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    err = (out - exact).abs().max()
    err_unscaled = (hybrid_attention(q, k, v, phi_q, phi_k, gamma, 3, causal=causal) - exact).abs().max()
    assert err < 0.1, err  # 0.033 causal, 0.026 bidirectional measured
    assert err_unscaled > 10 * err, (err_unscaled, err)


def test_a_bad_query_log_scale_is_named():
    x = _inputs(6)
    with pytest.raises(ValueError, match=r"query_log_scale must be shaped \(batch, heads, length\)"):
        hybrid_attention(*x, 2, causal=True, query_log_scale=_log_scale(5))
    with pytest.raises(TypeError, match="query_log_scale must be a torch.Tensor"):
        hybrid_attention(*x, 2, causal=True, query_log_scale=1.0)
    with pytest.raises(TypeError, match="query_log_scale must be a floating-point"):
        hybrid_attention(*x, 2, causal=True, query_log_scale=torch.zeros(B, H, 6, dtype=torch.long))
    bad = _log_scale(6)
    bad[0, 1, 2] = float("inf")
    with pytest.raises(ValueError, match="query_log_scale must be finite"):
        hybrid_attention(*x, 2, causal=False, query_log_scale=bad)


# attention sinks: the first S real tokens join every window and leave the linear part


@pytest.mark.parametrize("sinks", [1, 3, 20])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_sinks_equal_the_reference(causal, window, padding, sinks):
    n = 11
    x = _inputs(n)
    mask = _mask(n, padding)
    ell = _log_scale(n)
    out = hybrid_attention(*x, window, causal=causal, key_padding_mask=mask, query_log_scale=ell, sinks=sinks)
    ref = hybrid_reference(*x, window, causal=causal, key_padding_mask=mask, query_log_scale=ell, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(
        out, hybrid_attention(*x, window, causal=causal, key_padding_mask=mask, query_log_scale=ell)
    )


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_token_a_sink_is_softmax_attention(causal, padding):
    # sinks take exact scores and never the linear part: with every real token a sink, the features play no role
    q, k, v, phi_q, phi_k, gamma = _inputs(9)
    mask = _mask(9, padding)
    out = hybrid_attention(
        q, k, v, phi_q, phi_k, torch.ones_like(gamma), 2, causal=causal, key_padding_mask=mask, sinks=9
    )
    ref = softmax_reference(q, k, v, causal=causal, key_padding_mask=mask)
    real = slice(None) if mask is None else mask[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-12)


def test_a_sink_is_the_first_real_token_of_each_row():
    # one sink, a one-token window, no features: every query sees itself and its row's first real token only
    n = 8
    q, k, v, _, _, gamma = _inputs(n)
    zeros = torch.zeros(B, H, n, M, dtype=q.dtype)
    mask = _mask(n, "left")  # row 0 starts at 3, row 1 at 1
    out = hybrid_attention(q, k, v, zeros, zeros, gamma, 1, causal=False, key_padding_mask=mask, sinks=1)
    for row, first in ((0, 3), (1, 1)):
        for t in range(first + 1, n):
            logits = torch.stack([(q[row, :, t] * k[row, :, s]).sum(-1) for s in (first, t)], -1) * D**-0.5
            weights = logits.softmax(-1)
            want = weights[:, :1] * v[row, :, first] + weights[:, 1:] * v[row, :, t]
            torch.testing.assert_close(out[row, :, t], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sinks", [1, 4])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_sinks_in_pieces_and_steps_equal_the_causal_pass(padding, window, sinks):
    # the sinks may arrive in the first piece, across pieces or during the steps (left padding delays them)
    n = 13
    x = _inputs(n)
    mask = _mask(n, padding)
    ell = _log_scale(n)
    full = hybrid_attention(*x, window, causal=True, key_padding_mask=mask, query_log_scale=ell, sinks=sinks)
    q, k, v, phi_q, phi_k, gamma = x
    state, outs = None, []
    cuts = [0, 2, 3, 7, 8, 9, 10, 11, 12, 13]  # pieces, then single steps
    for start, stop in itertools.pairwise(cuts):
        part = slice(start, stop)
        args = [t[:, :, part] for t in (q, k, v, phi_q, phi_k)] + [gamma, window]
        kwargs = dict(key_padding_mask=None if mask is None else mask[:, part], query_log_scale=ell[:, :, part])
        if stop - start == 1 and state is not None:
            out, state = hybrid_step(*args, state, **kwargs, sinks=sinks)
        else:
            out, state = hybrid_attention(
                *args, causal=True, initial_state=state, return_state=True, **kwargs, sinks=sinks
            )
        outs.append(out)
        assert state.sink_k.shape == (B, H, sinks, D) and state.k.shape[2] == window - 1  # constant memory
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-10, atol=1e-12)
    assert state.sink_valid.all()


def test_bad_sinks_are_named():
    q, k, v, phi_q, phi_k, gamma = _inputs(6)
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match="sinks must be an int >= 0"):
            hybrid_attention(q, k, v, phi_q, phi_k, gamma, 2, causal=False, sinks=bad)
    _, state = hybrid_attention(q, k, v, phi_q, phi_k, gamma, 3, causal=True, return_state=True, sinks=1)
    one = slice(0, 1)
    with pytest.raises(ValueError, match="the state's sink_k must be shaped"):
        hybrid_step(
            q[:, :, one], k[:, :, one], v[:, :, one], phi_q[:, :, one], phi_k[:, :, one], gamma, 3, state, sinks=2
        )


# -- how the CPU core splits its work

# The real split, not core_passes' stand-ins: one run each, in one pass.
REAL_SPLIT = pytest.mark.parametrize("core_passes", ["one-pass"], indirect=True)


@REAL_SPLIT
def test_the_cpu_core_runs_in_passes_whose_scores_stay_under_the_byte_cap():
    cap, per_block = hybrid_module._PASS_BYTES, 1 * 12 * 64 * 192 * 4  # b, h, blk, frame, float32
    step = hybrid_module._blocks_per_pass(1, 12, 64, 192, 256, 4, torch.device("cpu"))
    assert 1 <= step < 256 and step * per_block <= cap < (step + 1) * per_block
    assert hybrid_module._blocks_per_pass(64, 12, 64, 192, 256, 4, torch.device("cpu")) == 1  # at least one block
    assert hybrid_module._blocks_per_pass(1, 1, 4, 12, 3, 4, torch.device("cpu")) == 3  # never more than there are
    assert hybrid_module._blocks_per_pass(1, 12, 64, 192, 256, 4, torch.device("cuda")) == 256  # one pass off the CPU
    assert hybrid_module._blocks_per_pass(0, 12, 64, 192, 256, 4, torch.device("cpu")) == 256  # empty batch


@REAL_SPLIT
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(0, 2), (1, 0)], ids=["empty-batch", "no-heads"])
def test_empty_inputs_give_empty_outputs(shape, causal):
    b, h = shape
    q, phi = torch.randn(b, h, 8, 4), torch.rand(b, h, 8, 3)
    out = hybrid_attention(q, q, q, phi, phi, torch.ones(h), 4, causal=causal)
    assert out.shape == (b, h, 8, 4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-softmax", "products"])
@pytest.mark.parametrize("sinks", [0, 2], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("padding", ["none", "left", "right", "long-right"])
@pytest.mark.parametrize("causal", [True, False])
def test_inference_equals_the_path_autograd_records(causal, padding, sinks, fused, monkeypatch):
    """Where autograd records nothing the core takes its in-place pass: with the queries' scale ℓ in float32, the
    window part by ATen's fused softmax attention over the frames; otherwise by products over the frame views
    (scores combined in place, gamma in the stabilizer). Both give the recorded path's outputs, float32, with
    padding, sinks, a gamma of 0, and padded queries whose window holds no real key ("long-right")."""
    n, window = 37, 6  # blocks of 3 queries, a partial last block
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    phi_q, phi_k = (torch.rand(B, H, n, M, generator=g) for _ in range(2))
    ell = torch.randn(B, H, n, generator=g) * 3
    gamma = torch.tensor([0.3, 0.0, 2.5])
    mask = _mask(n, "right") if padding == "long-right" else _mask(n, padding)
    if padding == "long-right":
        mask[1, 12:] = False  # queries from 18 on see no real key in their window
    calls = []
    if fused:
        kernel = hybrid_module._FUSED_SOFTMAX
        assert kernel is not None  # torch on every supported version has it

        def counted(*args, **kwargs):
            calls.append(1)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(hybrid_module, "_FUSED_SOFTMAX", counted)
    else:
        monkeypatch.setattr(hybrid_module, "_FUSED_SOFTMAX", None)
    kwargs = dict(causal=causal, key_padding_mask=mask, query_log_scale=ell, sinks=sinks)
    with torch.no_grad():
        untracked = hybrid_attention(q, k, v, phi_q, phi_k, gamma, window, **kwargs)
    assert bool(calls) == fused
    tracked = hybrid_attention(q.requires_grad_(), k, v, phi_q, phi_k, gamma, window, **kwargs)
    assert tracked.requires_grad
    torch.testing.assert_close(untracked, tracked.detach(), rtol=1e-5, atol=1e-6)


@REAL_SPLIT
def test_inference_compiles_without_graph_breaks():
    """Under torch.compile the core keeps its general form where autograd records nothing too: the in-place pass
    asks each pass whether its frame keys are all real, which would break the graph."""
    q, k, v, phi_q, phi_k, gamma = _inputs(12, dtype=torch.float32)

    def attend(*x):
        return hybrid_attention(*x, 4, causal=False, key_padding_mask=_mask(12, "right"), sinks=1)

    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(attend)(q, k, v, phi_q, phi_k, gamma)
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_states_made_in_pieces_equal_the_reference(causal, padding, monkeypatch):
    """A pass's block states come from pieces of at most _STATE_BLOCKS blocks, carried from piece to piece: pieces
    of 2 blocks (here 5 of them per pass in one pass) give the reference's outputs and gradients."""
    monkeypatch.setattr(hybrid_module, "_STATE_BLOCKS", 2)
    n = 29  # blocks of 2 queries at window 4: 15 blocks, the last one partial
    x = [t.requires_grad_() for t in _inputs(n)]
    mask = _mask(n, padding)
    out = hybrid_attention(*x, 4, causal=causal, key_padding_mask=mask, sinks=1)
    ref = hybrid_reference(*x, 4, causal=causal, key_padding_mask=mask, sinks=1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    cot = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, x, cot), torch.autograd.grad(ref, x, cot)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    with torch.no_grad():
        torch.testing.assert_close(hybrid_attention(*x, 4, causal=causal, key_padding_mask=mask, sinks=1), ref)
