import pytest
import torch

from linearformers.ops import local_attention, local_attention_step, softmax_attention
from linearformers.ops.local import causal_local_attention
from linearformers.ops.reference import local_reference


def _qkv(b=2, h=3, n=37, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [2, 5, 8])
def test_equals_softmax_with_a_band_mask(causal, window):
    q, k, v = _qkv()
    ref = local_reference(q, k, v, window, causal=causal)  # softmax with an explicit (n x n) band mask
    torch.testing.assert_close(local_attention(q, k, v, window, causal=causal), ref, rtol=1e-5, atol=1e-5)


def test_window_covering_everything_is_full_attention():
    q, k, v = _qkv(n=10)
    torch.testing.assert_close(local_attention(q, k, v, 40), softmax_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_relative_bias_is_added_by_distance():
    q, k, v = _qkv(n=20)
    bias = torch.randn(3, 5)
    out = local_attention(q, k, v, 5, causal=True, relative_bias=bias)
    ref = local_reference(q, k, v, 5, causal=True, relative_bias=bias)  # bias[:, i - j] on the band
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_causal_local_never_reads_the_future():
    q, k, v = _qkv()
    out = local_attention(q, k, v, 6, causal=True)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, 20:] = 100.0
    out2 = local_attention(q2, k2, v2, 6, causal=True)
    torch.testing.assert_close(out2[:, :, :20], out[:, :, :20], rtol=0, atol=1e-6)


def test_decoding_step_matches_the_causal_pass():
    q, k, v = _qkv(n=15)
    bias = torch.randn(3, 4)
    full = local_attention(q, k, v, 4, causal=True, relative_bias=bias)
    for t in range(15):
        lo = max(0, t - 3)
        step = local_attention_step(q[:, :, t : t + 1], k[:, :, lo : t + 1], v[:, :, lo : t + 1], 4, relative_bias=bias)
        torch.testing.assert_close(step, full[:, :, t : t + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("new", [1, 2, 9], ids=["step", "piece-shorter-than-the-window", "piece-longer"])
@pytest.mark.parametrize("before", [2, 11], ids=["window-not-full", "window-full"])
def test_continuing_from_the_kept_window_equals_the_causal_pass(new, before):
    """What a decoder keeps (the last window - 1 keys and values, with zeros marked invalid where fewer came
    before) and the new tokens give the rows of one causal pass over everything."""
    window = 5
    q, k, v = _qkv(n=before + new)
    bias = torch.randn(3, window)
    full = local_attention(q, k, v, window, causal=True, relative_bias=bias)
    kept = max(0, before - (window - 1))
    empty = window - 1 - (before - kept)
    past_k, past_v = (torch.nn.functional.pad(x[:, :, kept:before], (0, 0, empty, 0)) for x in (k, v))
    past_valid = torch.arange(window - 1).expand(2, -1) >= empty
    rows = slice(before, before + new)
    out = causal_local_attention(
        q[:, :, rows], k[:, :, rows], v[:, :, rows], window, past=(past_k, past_v, past_valid), relative_bias=bias
    )
    torch.testing.assert_close(out, full[:, :, rows], rtol=1e-5, atol=1e-5)
    first = causal_local_attention(q[:, :, :before], k[:, :, :before], v[:, :, :before], window, relative_bias=bias)
    torch.testing.assert_close(first, full[:, :, :before], rtol=0, atol=0)  # no past: the plain causal pass


def test_a_past_longer_than_the_window_reads_raises():
    q, k, v = _qkv(n=1)
    past = (torch.zeros(2, 3, 4, 16), torch.zeros(2, 3, 4, 16), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="reads at most 3 earlier ones"):
        causal_local_attention(q, k, v, 4, past=past)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_changes_nothing_for_real_tokens(causal, side):
    q, k, v = _qkv(b=1, n=21)
    ref = local_attention(q, k, v, 6, causal=causal)
    pad = 5
    junk = [torch.randn(1, 3, pad, 16) * 5 for _ in range(3)]
    parts = (lambda x, j: [j, x]) if side == "left" else (lambda x, j: [x, j])
    qp, kp, vp = (torch.cat(parts(x, j), 2) for x, j in zip((q, k, v), junk))
    mask = torch.ones(1, 21 + pad, dtype=torch.bool)
    mask[:, :pad] = False if side == "left" else True
    if side == "right":
        mask[:, 21:] = False
    out = local_attention(qp, kp, vp, 6, causal=causal, key_padding_mask=mask)
    real = out[:, :, pad:] if side == "left" else out[:, :, :21]
    torch.testing.assert_close(real, ref, rtol=1e-5, atol=1e-5)


def test_softmax_reference_handles_padding_on_either_side():
    q, k, v = _qkv(b=1, n=12)
    ref = softmax_attention(q, k, v, causal=True)
    qp, kp, vp = (torch.cat([torch.randn(1, 3, 4, 16), x], 2) for x in (q, k, v))
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[:, :4] = False
    out = softmax_attention(qp, kp, vp, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, 4:], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_large_logits_stays_finite(dtype):
    q, k, v = _qkv(n=64, d=64)
    k = q * (50 * 8 / q.pow(2).sum(-1, keepdim=True))
    out = local_attention(q.to(dtype), k.to(dtype), v.to(dtype), 16, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_bad_arguments_raise_clear_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="window must be a positive int"):
        local_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="relative_bias must be shaped"):
        local_attention(q, k, v, 4, relative_bias=torch.randn(3, 4))
    with pytest.raises(ValueError, match="key_padding_mask must be shaped"):
        local_attention(q, k, v, 4, key_padding_mask=torch.ones(3, 37))
    with pytest.raises(ValueError, match="same length"):
        local_attention(q, k[:, :, :5], v[:, :, :5], 4)
