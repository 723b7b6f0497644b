"""Every attention kernel, and both model families, under CPU autocast in bf16 and fp16: the kernels compute in
float32 and return their inputs' dtype whatever the ambient autocast, so outputs and gradients match a float32
evaluation of the same (rounded) inputs, padded on either side or not, through both causal FAVOR+ backends (the native walk and the chunked form).

Backward runs outside the autocast context, as torch recommends and Trainer / Accelerate do. The hand-written
backward passes also give float32 results when ``loss.backward()`` is called inside it (autograd's own backward
formulas follow the ambient autocast there, as for any torch op)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from linearformers.ops import (
    causal_linformer_attention,
    causal_linformer_step,
    draw_random_features,
    favor_attention,
    favor_backend,
    favor_step,
    linformer_attention,
    local_attention,
    local_attention_step,
    native_available,
    set_native_walk,
)
from tests.conftest import tiny_config

DTYPES = [torch.bfloat16, torch.float16]
# a few roundings of the output / gradient dtype; float32 inputs (under autocast too) see float32 work only
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
NO_NATIVE = pytest.mark.skipif(not native_available(), reason="the native kernel is unavailable here")
WALKS = [pytest.param(True, id="native", marks=NO_NATIVE), pytest.param(False, id="chunked")]


@pytest.fixture
def walk(request):
    """Causal FAVOR+ through the compiled walk (True) or the chunked backend (False: set_native_walk(False)) for
    ``backend=None`` calls; None leaves the choice alone (not a FAVOR+ test)."""
    if request.param is not None:
        previous = set_native_walk(request.param)
        request.addfinalizer(lambda: set_native_walk(previous))
    return request.param


def _inputs(b=2, h=2, n=40, d=16, seed=0, key_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    return q, k * key_scale, v


def _mask(padding, b=2, n=40):
    if padding is None:
        return None
    mask = torch.ones(b, n, dtype=torch.bool)
    if padding == "left":
        mask[1, :9] = False
    else:
        mask[1, n - 9 :] = False
    return mask


def _close(a, b, dtype, name):
    tolerance = TOLERANCE[dtype]
    assert torch.isfinite(a).all(), f"{name} is not finite"
    b = b.detach()
    torch.testing.assert_close(a.float(), b, rtol=tolerance, atol=tolerance * float(b.abs().max()), msg=name)


def _check(op, dtype, tensors, params=(), backward_inside=False, inputs_dtype=None):
    """op(*tensors, *params) under autocast(dtype), forward and backward, against float32 outside autocast. tensors
    enter in ``dtype`` (as a Linear's output would under autocast) or ``inputs_dtype``, params stay float32 (as
    module parameters). ``backward_inside``: call backward inside the autocast context too."""
    low = [t.to(inputs_dtype or dtype).requires_grad_() for t in tensors]
    low_params = [p.clone().requires_grad_() for p in params]
    full = [t.detach().float().requires_grad_() for t in low]
    full_params = [p.clone().requires_grad_() for p in params]
    with torch.autocast("cpu", dtype=dtype):
        out = op(*low, *low_params)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        loss = (out.float() * weight).sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    ref = op(*full, *full_params)
    (ref * weight).sum().backward()
    dtype = low[0].dtype
    assert out.dtype == dtype, "outputs come in the inputs' dtype"
    _close(out, ref, dtype, "output")
    for index, (a, b) in enumerate(zip(low + low_params, full + full_params)):
        assert a.grad.dtype == a.dtype
        _close(a.grad, b.grad, dtype, f"gradient of input {index}")


MAP_PADDING = [("softmax", None), ("softmax", "left"), ("softmax", "right"), ("relu", "left")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map, padding", MAP_PADDING)
@pytest.mark.parametrize("walk", WALKS, indirect=True)
def test_causal_favor_under_autocast_matches_float32(walk, feature_map, padding, dtype):
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(padding)

    def op(q, k, v):
        return favor_attention(q, k, v, w, causal=True, feature_map=feature_map, key_padding_mask=mask, chunk_size=16)

    _check(op, dtype, _inputs())
    chosen = {
        favor_backend(*(t.to(d) for t in _inputs()), w, causal=True, chunk_size=16) for d in (dtype, torch.float32)
    }
    assert chosen == {"native" if walk else "chunked"}  # autocast and float32: both on the chosen walk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("walk", WALKS, indirect=True)
def test_causal_favor_with_left_padding_and_keys_of_large_norm_under_autocast(walk, dtype):
    """fp16 autocast ran the large-key fallback's float32 sums in fp16, where the denominator's floor 1e-30 is 0:
    the left-padded rows (no real key) divided 0 by 0, and their NaN gradients reached every input."""
    w = draw_random_features(32, 16, seed=1)
    mask = _mask("left")

    def op(q, k, v):
        return favor_attention(q, k, v, w, causal=True, key_padding_mask=mask, chunk_size=16)

    _check(op, dtype, _inputs(key_scale=10.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map, padding", MAP_PADDING)
@pytest.mark.parametrize("key_scale", [1.0, 10.0])
def test_bidirectional_favor_under_autocast_matches_float32(key_scale, feature_map, padding, dtype):
    w = draw_random_features(32, 16, seed=1)
    mask = _mask(padding)
    op = lambda q, k, v: favor_attention(q, k, v, w, feature_map=feature_map, key_padding_mask=mask)  # noqa: E731
    _check(op, dtype, _inputs(key_scale=key_scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("key_scale", [1.0, 10.0])
def test_favor_step_under_autocast_matches_float32(key_scale, feature_map, dtype):
    w = draw_random_features(32, 16, seed=1)
    q, k, v = _inputs(key_scale=key_scale)
    mask = _mask("left")
    _, state = favor_attention(
        q, k, v, w, causal=True, feature_map=feature_map, key_padding_mask=mask, return_state=True
    )
    step_mask = torch.tensor([[True], [False]])

    def op(q1, k1, v1):
        out, _ = favor_step(q1, k1, v1, w, state, key_padding_mask=step_mask, feature_map=feature_map)
        return out

    _check(op, dtype, _inputs(n=1, seed=2, key_scale=key_scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "projection, padding",
    [("learned", None), ("learned", "left"), ("learned", "right"), ("pool", "left"), ("conv", "left")],
)
def test_linformer_under_autocast_matches_float32(projection, padding, dtype):
    mask = _mask(padding)
    g = torch.Generator().manual_seed(3)
    params = {
        "learned": (torch.randn(8, 40, generator=g) / 8, torch.randn(8, 40, generator=g) / 8),  # E and F
        "conv": (torch.randn(16, 16, 5, generator=g) / 9,),  # shared by keys and values
        "pool": (),
    }[projection]

    def op(q, k, v, *proj):
        proj = proj or (None,)
        return linformer_attention(q, k, v, *proj, projection=projection, pool_stride=5, key_padding_mask=mask)

    _check(op, dtype, _inputs(), params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_causal_linformer_and_its_step_under_autocast_match_float32(padding, dtype):
    mask = _mask(padding)
    g = torch.Generator().manual_seed(3)
    e, f = torch.randn(8, 41, generator=g) / 8, torch.randn(8, 41, generator=g) / 8

    def op(q, k, v, e, f):
        return causal_linformer_attention(q, k, v, e, f, key_padding_mask=mask, chunk_size=16)

    _check(op, dtype, _inputs(), (e, f))
    q, k, v = _inputs()
    _, state = causal_linformer_attention(q, k, v, e, f, return_state=True)

    def step(q1, k1, v1, e, f):
        return causal_linformer_step(q1, k1, v1, e, f, state, 40)[0]

    _check(step, dtype, _inputs(n=1, seed=2), (e, f))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal, padding", [(True, None), (True, "left"), (True, "right"), (False, "left")])
def test_local_attention_and_its_step_under_autocast_match_float32(causal, padding, dtype):
    mask = _mask(padding)
    bias = torch.randn(2, 5, generator=torch.Generator().manual_seed(3))  # (heads, relative positions of window 5)

    def op(q, k, v, bias):
        return local_attention(q, k, v, 5, causal=causal, key_padding_mask=mask, relative_bias=bias)

    _check(op, dtype, _inputs(), (bias,))
    if causal:
        window_mask = None if mask is None else mask[:, :5]

        def step(q1, k, v, bias):
            return local_attention_step(q1, k, v, 5, key_padding_mask=window_mask, relative_bias=bias)

        q, k, v = _inputs(n=5)
        _check(step, dtype, (q[:, :, -1:], k, v), (bias,))


def _model_loss_and_grads(model, dtype, *, causal):
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, **({"use_cache": False} if causal else {}))
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _check_model(model, dtype, causal, tolerance=0.02):
    """Finite loss and gradients under autocast, close to float32: the loss within 1%, all gradients together
    within ``tolerance`` (relative error of the whole gradient vector: some, like k_proj's bias, are ~0 and noise)."""
    loss32, grads32 = _model_loss_and_grads(model, None, causal=causal)
    loss, grads = _model_loss_and_grads(model, dtype, causal=causal)
    assert torch.isfinite(loss), f"loss {loss} under {dtype} autocast"
    assert grads.keys() == grads32.keys()
    bad = [name for name, g in grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients under {dtype} autocast: {bad}"
    assert abs(float(loss - loss32)) < 0.01 * float(loss32), (float(loss), float(loss32))
    flat, flat32 = (torch.cat([g[name].flatten() for name in grads32]) for g in (grads, grads32))
    error = float((flat - flat32).norm() / flat32.norm())
    assert error < tolerance, f"relative gradient error {error:.4f} under {dtype} autocast"


def _tiny_model(family, causal, **overrides):
    torch.manual_seed(0)
    # head_dim 16 and m 32: causal FAVOR+ may take the compiled walk; one local softmax head beside three global
    config = tiny_config(family, is_decoder=causal, hidden_size=64, num_local_heads=1, local_window=4, **overrides)
    auto = AutoModelForCausalLM if causal else AutoModelForMaskedLM
    return auto.from_config(config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal_lm"])
@pytest.mark.parametrize(
    "family, walk",
    [
        pytest.param("linformer", None, id="linformer"),
        pytest.param("performer", True, id="performer-native", marks=NO_NATIVE),
        pytest.param("performer", False, id="performer-chunked"),
    ],
    indirect=["walk"],
)
def test_models_train_under_autocast_with_left_padding(family, walk, causal, dtype):
    _check_model(_tiny_model(family, causal), dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("walk", WALKS, indirect=True)
def test_performer_lm_with_keys_of_large_norm_trains_under_autocast_with_left_padding(walk, dtype):
    """The k_proj weights x100 put the keys far beyond float32's range at offset 0: the causal walk hands the call to
    its large-key fallback, which fp16 autocast used to turn into NaN gradients."""
    model = _tiny_model("performer", True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attention.k_proj.weight.mul_(100.0)
    # keys of norm ~100s: bf16's rounding of them (8 bits) moves the logits by units, so the model itself differs
    _check_model(model, dtype, causal=True, tolerance=0.02 if dtype == torch.float16 else 0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("walk", WALKS, indirect=True)
def test_hand_written_backwards_ignore_an_autocast_around_loss_backward(walk, dtype):
    """With float32 inputs nothing is rounded on the way: any product that autocast took to bf16 / fp16 in the
    hand-written backward passes would show as an error far above float32's."""
    w = draw_random_features(32, 16, seed=1)
    mask = _mask("left")
    for causal in (False, True):

        def op(q, k, v, causal=causal):
            return favor_attention(q, k, v, w, causal=causal, key_padding_mask=mask, chunk_size=16)

        _check(op, dtype, _inputs(), backward_inside=True, inputs_dtype=torch.float32)
    e = torch.randn(8, 40, generator=torch.Generator().manual_seed(3)) / 8
    op = lambda q, k, v, e: linformer_attention(q, k, v, e, key_padding_mask=mask)  # noqa: E731
    _check(op, dtype, _inputs(), (e,), backward_inside=True, inputs_dtype=torch.float32)
