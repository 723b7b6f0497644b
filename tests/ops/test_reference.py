"""The plain quadratic references of ops/reference.py: first against facts that do not depend on
them (exact softmax attention where the maths reduces to it, PyTorch's pooling and convolution, causality), then
every fast kernel against its reference in float64, padded on either side or not."""

import pytest
import torch
import torch.nn.functional as F

from linearformers.ops import (
    causal_linformer_attention,
    causal_linformer_step,
    draw_random_features,
    favor_attention,
    favor_step,
    linformer_attention,
    local_attention,
    local_attention_step,
    softmax_attention,
)
from linearformers.ops.local import num_relative_positions
from linearformers.ops.reference import (
    causal_linformer_reference,
    favor_reference,
    linformer_reference,
    local_reference,
    softmax_reference,
)

PADDINGS = [None, "left", "right"]


def _qkv(b=2, h=2, n=11, d=8, seed=0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))
    return q * scale, k * scale, v


def _mask(padding, b=2, n=11):
    """None, or a (b, n) mask whose second row has 4 padded positions on the given side."""
    if padding is None:
        return None
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :4] = False if padding == "left" else mask[1, :4]
    mask[1, n - 4 :] = False if padding == "right" else mask[1, n - 4 :]
    return mask


def _real(out, mask, row=1):
    """The outputs of sequence ``row`` at its real positions (all of them without a mask)."""
    return out[row] if mask is None else out[row][:, mask[row]]


# ---------------------------------------------------------------------------------------------------------------
# the references against independent facts


@pytest.mark.parametrize("padding", PADDINGS)
def test_softmax_reference_is_sdpa(padding):
    q, k, v = _qkv()
    mask = _mask(padding)
    for causal in (False, True):
        ref = softmax_reference(q, k, v, causal=causal, key_padding_mask=mask)
        allowed = torch.ones(11, 11, dtype=torch.bool).tril() if causal else torch.ones(11, 11, dtype=torch.bool)
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~allowed.any(-1, keepdim=True))
        sdpa = sdpa * allowed.any(-1, keepdim=True)  # rows with no visible key output 0
        torch.testing.assert_close(ref, sdpa, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding", PADDINGS)
def test_linformer_reference_with_identity_projections_is_exact_softmax_attention(padding):
    """k = n and E = F = I: every real token has a slot of its own (compaction sends the r-th real token to slot r,
    and the slots of a shorter sequence stay unwritten), so both references are exact softmax attention."""
    q, k, v = _qkv()
    mask = _mask(padding)
    eye = torch.eye(11, dtype=torch.float64)
    exact = softmax_attention(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(linformer_reference(q, k, v, eye, eye, key_padding_mask=mask), exact)
    exact = softmax_attention(q, k, v, causal=True, key_padding_mask=mask)
    causal = causal_linformer_reference(q, k, v, eye, key_padding_mask=mask)
    torch.testing.assert_close(_real(causal, mask), _real(exact, mask))
    torch.testing.assert_close(causal[0], exact[0])
    if mask is not None:  # padded positions output 0
        assert torch.equal(causal[1][:, ~mask[1]], torch.zeros_like(causal[1][:, ~mask[1]]))


def test_linformer_reference_pool_and_conv_are_pytorch_pooling_and_convolution():
    q, k, v = _qkv(n=12)
    flat = lambda x: x.flatten(0, 1).transpose(1, 2)  # noqa: E731  (b h, d, n)
    back = lambda x: x.transpose(1, 2).reshape(2, 2, 3, 8)  # noqa: E731
    kp, vp = back(F.avg_pool1d(flat(k), 4)), back(F.avg_pool1d(flat(v), 4))
    expected = torch.softmax(q @ kp.mT / 8**0.5, -1) @ vp
    torch.testing.assert_close(linformer_reference(q, k, v, None, projection="pool", pool_stride=4), expected)
    wk, wv = (torch.randn(8, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    kp, vp = back(F.conv1d(flat(k), wk, stride=4)), back(F.conv1d(flat(v), wv, stride=4))
    expected = torch.softmax(q @ kp.mT / 8**0.5, -1) @ vp
    torch.testing.assert_close(linformer_reference(q, k, v, wk, wv, projection="conv", pool_stride=4), expected)


@pytest.mark.parametrize("padding", PADDINGS)
def test_local_reference_with_a_window_covering_everything_is_exact_softmax_attention(padding):
    q, k, v = _qkv()
    mask = _mask(padding)
    # causal: w >= n sees every earlier key; bidirectional: w // 2 >= n - 1 sees every key
    torch.testing.assert_close(
        local_reference(q, k, v, 22, causal=False, key_padding_mask=mask),
        softmax_attention(q, k, v, key_padding_mask=mask),
    )
    torch.testing.assert_close(
        local_reference(q, k, v, 11, causal=True, key_padding_mask=mask),
        softmax_attention(q, k, v, causal=True, key_padding_mask=mask),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_favor_reference_with_many_features_approximates_softmax_attention(causal):
    """Lemma 1: the positive random features estimate exp(q·k / √d) without bias; m = 4096 i.i.d. Gaussian features
    (no QR: instant to draw) at small norms leave ~1% of error, against tens of percent for unrelated outputs."""
    q, k, v = _qkv(b=1, n=16, scale=0.4)
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, :3] = False
    w = draw_random_features(4096, 8, seed=0, orthogonal=False, dtype=torch.float64)
    exact = softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    approx = favor_reference(q, k, v, w, causal=causal, key_padding_mask=mask)
    error = float((approx - exact).norm() / exact.norm())
    assert error < 0.03, f"relative error {error:.3f}"
    assert float((approx - softmax_attention(q, k, v.flip(2))).norm() / exact.norm()) > 0.3


def _causal_references():
    w = draw_random_features(16, 8, seed=1, dtype=torch.float64)
    e = torch.randn(2, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return {
        "softmax": lambda q, k, v, m: softmax_reference(q, k, v, causal=True, key_padding_mask=m),
        "favor-softmax": lambda q, k, v, m: favor_reference(q, k, v, w, causal=True, key_padding_mask=m),
        "favor-relu": lambda q, k, v, m: favor_reference(
            q, k, v, w, causal=True, key_padding_mask=m, feature_map="relu"
        ),
        "linformer": lambda q, k, v, m: causal_linformer_reference(q, k, v, e, e.flip(0), key_padding_mask=m),
        "local": lambda q, k, v, m: local_reference(q, k, v, 4, causal=True, key_padding_mask=m, relative_bias=bias),
    }


@pytest.mark.parametrize("name", list(_causal_references()))
@pytest.mark.parametrize("padding", [None, "left"])
def test_causal_references_never_read_the_future(name, padding):
    reference = _causal_references()[name]
    q, k, v = _qkv()
    mask = _mask(padding)
    out = reference(q, k, v, mask)
    t = 6
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 10
    out2 = reference(q2, k2, v2, mask)
    torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


@pytest.mark.parametrize("padding", ["left", "right"])
def test_references_give_real_tokens_the_same_outputs_with_any_padding(padding):
    """Padded keys leave every reference, and Linformer's compaction gives the r-th real token column r."""
    q, k, v = _qkv(b=1, n=7)
    junk = [torch.randn(1, 2, 4, 8, dtype=torch.float64) * 5 for _ in range(3)]
    qp, kp, vp = (torch.cat([j, x] if padding == "left" else [x, j], 2) for x, j in zip((q, k, v), junk))
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, :4] = False if padding == "left" else mask[0, :4]
    mask[0, 7:] = False if padding == "right" else mask[0, 7:]
    w = draw_random_features(16, 8, seed=1, dtype=torch.float64)
    e = torch.randn(2, 5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    conv = torch.randn(8, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cases = [
        lambda q, k, v, m: favor_reference(q, k, v, w, key_padding_mask=m),
        lambda q, k, v, m: favor_reference(q, k, v, w, causal=True, key_padding_mask=m, feature_map="relu"),
        lambda q, k, v, m: linformer_reference(q, k, v, e, key_padding_mask=m),
        lambda q, k, v, m: linformer_reference(q, k, v, None, projection="pool", pool_stride=3, key_padding_mask=m),
        lambda q, k, v, m: linformer_reference(q, k, v, conv, projection="conv", pool_stride=3, key_padding_mask=m),
        lambda q, k, v, m: causal_linformer_reference(q, k, v, e, key_padding_mask=m),
        lambda q, k, v, m: local_reference(q, k, v, 4, causal=False, key_padding_mask=m),
    ]
    for index, reference in enumerate(cases):
        torch.testing.assert_close(reference(qp, kp, vp, mask)[:, :, mask[0]], reference(q, k, v, None), msg=str(index))


# ---------------------------------------------------------------------------------------------------------------
# every fast kernel against its reference, float64 inputs (the kernels work in float32 inside)


def _agree(fast, reference, inputs, *, rtol=1e-5, atol=1e-6):
    """Outputs and gradients of fast(*inputs) and reference(*inputs) agree."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    out, ref = fast(*inputs), reference(*inputs)
    assert out.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(9))
    for index, (a, b) in enumerate(zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=f"gradient of input {index}")


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_favor_attention_equals_its_reference(causal, feature_map, padding):
    mask = _mask(padding)
    w = draw_random_features(16, 8, seed=1)
    kwargs = dict(causal=causal, feature_map=feature_map, key_padding_mask=mask)
    _agree(
        lambda q, k, v: favor_attention(q, k, v, w, chunk_size=4, **kwargs),
        lambda q, k, v: favor_reference(q, k, v, w, **kwargs),
        _qkv(),
    )


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_favor_steps_equal_the_causal_reference(feature_map):
    q, k, v = _qkv()
    w = draw_random_features(16, 8, seed=1)
    state, steps = None, []
    for t in range(11):
        out, state = favor_step(*(x[:, :, t : t + 1] for x in (q, k, v)), w, state, feature_map=feature_map)
        steps.append(out)
    ref = favor_reference(q, k, v, w, causal=True, feature_map=feature_map)
    torch.testing.assert_close(torch.cat(steps, 2), ref, rtol=1e-5, atol=1e-6)


def _late_slots(heads=None):
    """The 13 x 13 identity (slot j is first written at position j, as in a model converted from softmax attention)
    with slot 5 never written: a short sequence leaves the last slots empty too."""
    e = torch.eye(13, dtype=torch.float64)
    e[5, 5] = 0
    return e if heads is None else e.expand(heads, 13, 13).clone()


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("projection", ["shared", "per-head", "late"])
def test_linformer_attention_equals_its_reference(projection, padding):
    mask = _mask(padding)
    g = torch.Generator().manual_seed(5)
    e, f = {
        "shared": lambda: (torch.randn(5, 13, dtype=torch.float64, generator=g),) * 2,
        "per-head": lambda: tuple(torch.randn(2, 5, 13, dtype=torch.float64, generator=g) for _ in range(2)),
        "late": lambda: (_late_slots(), torch.randn(13, 13, dtype=torch.float64, generator=g)),
    }[projection]()
    _agree(
        lambda q, k, v, e, f: linformer_attention(q, k, v, e, f, key_padding_mask=mask),
        lambda q, k, v, e, f: linformer_reference(q, k, v, e, f, key_padding_mask=mask),
        (*_qkv(), e, f),
    )


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("projection", ["pool", "conv"])
def test_linformer_pool_and_conv_equal_their_reference(projection, padding):
    mask = _mask(padding)
    weight = torch.randn(8, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6)) / 3
    proj = weight if projection == "conv" else None
    kwargs = dict(projection=projection, pool_stride=3, key_padding_mask=mask)  # 11 positions: a short last window
    _agree(
        lambda q, k, v: linformer_attention(q, k, v, proj, **kwargs),
        lambda q, k, v: linformer_reference(q, k, v, proj, **kwargs),
        _qkv(),
    )


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("projection", ["shared", "per-head", "late"])
def test_causal_linformer_attention_equals_its_reference(projection, padding):
    mask = _mask(padding)
    g = torch.Generator().manual_seed(7)
    e, f = {
        "shared": lambda: (torch.randn(5, 13, dtype=torch.float64, generator=g),) * 2,
        "per-head": lambda: tuple(torch.randn(2, 5, 13, dtype=torch.float64, generator=g) for _ in range(2)),
        "late": lambda: (_late_slots(heads=2), torch.randn(2, 13, 13, dtype=torch.float64, generator=g)),
    }[projection]()
    _agree(
        lambda q, k, v, e, f: causal_linformer_attention(q, k, v, e, f, key_padding_mask=mask, chunk_size=4),
        lambda q, k, v, e, f: causal_linformer_reference(q, k, v, e, f, key_padding_mask=mask),
        (*_qkv(), e, f),
    )


def test_causal_linformer_steps_equal_the_reference():
    q, k, v = _qkv()
    e = _late_slots()
    f = torch.randn(13, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    state, steps = None, []
    for t in range(11):
        out, state = causal_linformer_step(*(x[:, :, t : t + 1] for x in (q, k, v)), e, f, state, t)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 2), causal_linformer_reference(q, k, v, e, f), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("causal, window", [(True, 1), (True, 4), (False, 2), (False, 5)])
def test_local_attention_equals_its_reference(causal, window, padding):
    mask = _mask(padding)
    bias = torch.randn(2, num_relative_positions(window, causal), dtype=torch.float64)
    kwargs = dict(causal=causal, key_padding_mask=mask)
    _agree(
        lambda q, k, v, bias: local_attention(q, k, v, window, relative_bias=bias, **kwargs),
        lambda q, k, v, bias: local_reference(q, k, v, window, relative_bias=bias, **kwargs),
        (*_qkv(), bias),
    )


def test_local_steps_equal_the_causal_reference():
    q, k, v = _qkv()
    bias = torch.randn(2, 4, dtype=torch.float64)
    ref = local_reference(q, k, v, 4, causal=True, relative_bias=bias)
    for t in range(11):
        lo = max(0, t - 3)
        window = (q[:, :, t : t + 1], k[:, :, lo : t + 1], v[:, :, lo : t + 1])
        step = local_attention_step(*window, 4, relative_bias=bias)
        torch.testing.assert_close(step, ref[:, :, t : t + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padding", PADDINGS)
def test_softmax_attention_equals_its_reference(padding):
    mask = _mask(padding)
    for causal in (False, True):
        _agree(
            lambda q, k, v, causal=causal: softmax_attention(q, k, v, causal=causal, key_padding_mask=mask),
            lambda q, k, v, causal=causal: softmax_reference(q, k, v, causal=causal, key_padding_mask=mask),
            _qkv(),
            rtol=1e-12,
            atol=1e-12,
        )


def test_packed_softmax_attention_is_softmax_attention_at_real_positions_and_zero_at_pads():
    from linearformers.ops import packed_softmax_attention, softmax_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[0, 5:] = False  # right-padded
    mask[1, :3] = False  # left-padded
    mask[2, ::2] = False  # holes
    mask[3] = False  # no real token
    out = packed_softmax_attention(q, k, v, key_padding_mask=mask)
    want = softmax_attention(q, k, v, key_padding_mask=mask)
    real = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], want[real])
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    torch.testing.assert_close(packed_softmax_attention(q, k, v), softmax_attention(q, k, v))
    empty = torch.zeros(2, 9, dtype=torch.bool)
    assert torch.equal(packed_softmax_attention(q[:2], k[:2], v[:2], key_padding_mask=empty), torch.zeros_like(v[:2]))
