"""The Linformer paths a GPU runs (batched products, no per-block loop), exercised on the CPU by naming them, and
at real sizes on CUDA (``-m cuda``)."""

import pytest
import torch

from linearformers.modeling.attention import linformer_attention
from linearformers.modeling.attention.linformer import _choose_backend
from linearformers.modeling.attention.reference import linformer_reference

from .helpers import CountOps

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qkv(b=2, h=3, n=30, d=16, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))


def _padding(b, n):
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :7] = False  # left padding
    mask[1, n - 5 :] = False  # right padding
    return mask


def _grads(out, inputs, seed=3):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad((out * weights).sum(), inputs)


PROJECTIONS = [
    ("learned", (8, 64), None),  # shared E, F
    ("learned", (3, 8, 64), None),  # per head
    ("pool", None, 4),
    ("conv", (16, 16, 4), 4),
]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("method,shape,window", PROJECTIONS)
def test_sdpa_backend_equals_the_reference_gradients_included(masked, method, shape, window):
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(1)
    e, f = (None if shape is None else (torch.randn(shape, generator=g) * 0.3).requires_grad_() for _ in range(2))
    kwargs = dict(method=method, window=window, key_padding_mask=_padding(2, 30) if masked else None)
    out = linformer_attention(q, k, v, e, f, backend="sdpa", **kwargs)
    ref = linformer_reference(q, k, v, e, f, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    inputs = tuple(x for x in (q, k, v, e, f) if x is not None)
    for name, a, c in zip("qkvef", _grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_sdpa_backend_dropout_gradients_follow_the_forward_mask():
    # with E = I (k = n) the slots are the tokens, and values that are the identity show the dropped probabilities;
    # the same seed draws the same mask for other values, which must then equal the reference under that mask
    b, h, n, d = 2, 3, 8, 16
    q, k, v = _qkv(b, h, n, d)
    eye = torch.eye(n)
    probe = torch.zeros(b, h, n, d)
    probe[..., :n] = eye
    torch.manual_seed(5)
    shown = linformer_attention(q, k, probe, eye, dropout_p=0.3, backend="sdpa")
    keep = (shown[..., :n] != 0).float() / 0.7
    assert 0.1 < (keep == 0).float().mean() < 0.5  # dropout really drops
    torch.manual_seed(5)
    out = linformer_attention(q, k, v, eye, dropout_p=0.3, backend="sdpa")
    ref = linformer_reference(q, k, v, eye, dropout_multiplier=keep)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, a, c in zip("qkv", _grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"gradient of {name}: {m}")
    torch.manual_seed(6)
    assert not torch.allclose(linformer_attention(q, k, v, eye, dropout_p=0.3, backend="sdpa"), out)


def test_sdpa_backend_gives_zeros_for_a_row_of_padding_only():
    q, k, v = _qkv()
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1] = False  # no real token: no slot written
    out = linformer_attention(q, k, v, e, key_padding_mask=mask, backend="sdpa")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], linformer_attention(q, k, v, e, key_padding_mask=mask, backend="reference")[0])
    assert all(bool(x.isfinite().all()) for x in _grads(out, (q, k, v, e)))


def test_sdpa_backend_masks_slots_no_real_token_wrote():
    q, k, v = (x[:, :, :20] for x in _qkv())  # identity E at k = 32 on 20 tokens: slots 20..31 stay empty
    eye = torch.eye(32)
    out = linformer_attention(q, k, v, eye, backend="sdpa")
    ref = linformer_reference(q, k, v, eye)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("per_head", [False, True])
def test_sdpa_backend_op_count_does_not_grow_with_the_length(per_head):
    def count(n):
        q, k, v = _qkv(n=n)
        shape = (3, 8, 1024) if per_head else (8, 1024)
        e = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with CountOps() as ops:
            out = linformer_attention(q, k, v, e, backend="sdpa")
            out.sum().backward()
        return ops.count

    assert count(64) == count(512)  # the blockwise backend walks 256-row blocks: its count grows with n


def test_sdpa_backend_keeps_bf16_and_follows_float32():
    q, k, v = _qkv()
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.3
    out = linformer_attention(*(x.bfloat16() for x in (q, k, v)), e, backend="sdpa")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), linformer_attention(q, k, v, e, backend="reference"), rtol=0.05, atol=0.05)


def test_default_backend_is_blockwise_on_the_cpu_and_sdpa_elsewhere():
    assert _choose_backend(None, torch.empty(1)) == "blockwise"
    assert _choose_backend(None, torch.empty(1, device="meta")) == "sdpa"
    assert _choose_backend("blockwise", torch.empty(1, device="meta")) == "blockwise"
    with pytest.raises(ValueError, match="unknown Linformer backend 'flash'"):
        _choose_backend("flash", torch.empty(1))
