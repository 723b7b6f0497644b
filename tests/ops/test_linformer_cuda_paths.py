"""The Linformer paths a GPU runs (batched products, no per-block loop), exercised on the CPU by naming them, and
at real sizes on CUDA (``-m cuda``)."""

import pytest
import torch

from linearformers.ops import (
    causal_linformer_attention,
    linformer_attention,
    linformer_hybrid_attention,
)
from linearformers.ops import linformer as linformer_module
from linearformers.ops import linformer_hybrid as hybrid_module
from linearformers.ops.linformer import _choose_backend
from linearformers.ops.reference import (
    causal_linformer_reference,
    linformer_hybrid_reference,
    linformer_reference,
)

from .helpers import CountOps


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


def _assert_near(name, got, want, tolerance):
    """Max error as a share of the largest value: the measure for bf16, whose error scales with the magnitudes."""
    err = ((got.double().cpu() - want.double().cpu()).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err < tolerance, f"{name}: max error {err:.2e} of the largest value"


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


# ---------------------------------------------------------------------------------------- the Linformer hybrid


def _gpu_form(monkeypatch):
    """The hybrid's GPU form on the CPU: batched projections and the GPU's pass budget."""
    monkeypatch.setattr(hybrid_module, "_gpu_form", lambda device: True)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("method,shape,window", PROJECTIONS)
def test_hybrid_gpu_form_equals_the_reference_gradients_included(monkeypatch, sinks, method, shape, window):
    _gpu_form(monkeypatch)
    q, k, v = (x.double().detach().requires_grad_() for x in _qkv(n=32))
    g = torch.Generator().manual_seed(1)
    e, f = (None if shape is None else torch.randn(shape, generator=g).double().requires_grad_() for _ in range(2))
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64, requires_grad=True)
    mask = _padding(2, 32)
    kwargs = dict(method=method, window=window, key_padding_mask=mask, sinks=sinks)
    got = linformer_hybrid_attention(q, k, v, e, f, gamma, 4, **kwargs)
    want = linformer_hybrid_reference(q, k, v, e, f, gamma, 4, **kwargs)
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-12)
    inputs = tuple(x for x in (q, k, v, e, f, gamma) if x is not None)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=got.dtype) * real
    got_grads = torch.autograd.grad((got * weights).sum(), inputs)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs)
    for a, c in zip(got_grads, want_grads):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-11)


def test_hybrid_gpu_form_dropout_is_drawn_from_the_seed(monkeypatch):
    _gpu_form(monkeypatch)
    q, k, v = _qkv(n=32)
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    gamma = torch.ones(3)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        out = linformer_hybrid_attention(q, k, v, e, None, gamma, 4, sinks=1, dropout_p=0.5)
        runs.append((out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v))))
    for a, c in zip(runs[0], runs[1]):
        assert torch.equal(a, c)
    assert not torch.allclose(runs[0][0], runs[2][0])
    assert not torch.allclose(runs[0][0], linformer_hybrid_attention(q, k, v, e, None, gamma, 4, sinks=1))


def test_hybrid_gpu_budget_runs_the_benchmark_shape_at_16k_in_one_pass():
    blocks, per_block = 16384 // 64, 1 * 12 * 64 * (3 * 64 + 256 + 1) * 4  # b, h, w, frame + k + S, float32
    assert hybrid_module._blocks_per_pass(blocks, per_block, gpu=True) == blocks
    assert hybrid_module._blocks_per_pass(blocks, per_block, gpu=False) < 16  # the CPU's passes stay in cache
    assert not hybrid_module._gpu_form(torch.device("cpu"))
    assert hybrid_module._gpu_form(torch.device("meta"))


# ------------------------------------------------------------------------------------------- causal Linformer


def test_causal_bf16_operands_follow_the_float32_reference(monkeypatch):
    # on CUDA, bf16 inputs take bf16 operands for the products (tensor cores); here the same casts on the CPU
    monkeypatch.setattr(linformer_module, "half_operands", lambda v: torch.bfloat16)
    q, k, v = (x.bfloat16().detach().requires_grad_() for x in _qkv(n=40))
    e = (torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(1)) * 0.3).requires_grad_()
    mask = _padding(2, 40)
    out = causal_linformer_attention(q, k, v, e, key_padding_mask=mask, chunk_size=16)
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (x.float().detach().requires_grad_() for x in (q, k, v))
    ref = causal_linformer_reference(q32, k32, v32, e, e, key_padding_mask=mask)
    got, want = (out, *_grads(out, (q, k, v, e))), (ref, *_grads(ref, (q32, k32, v32, e)))
    for name, a, c in zip(("out", "dq", "dk", "dv", "de"), got, want):
        _assert_near(name, a, c, 2e-2)  # bf16 operands: ~2^-8 of each product's scale


def test_causal_products_stay_float32_off_cuda():
    from linearformers.ops._favor_chunked import half_operands

    assert half_operands(torch.empty(1, dtype=torch.bfloat16)) is None
    assert half_operands(torch.empty(1, dtype=torch.bfloat16, device="meta")) is None  # CUDA only


# ------------------------------------------------------------------------------------- on CUDA, at real sizes

N, HEADS, DIM, SLOTS = 4099, 12, 64, 256


def _real_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, N, DIM, generator=g) for _ in range(3))
    e, f = (torch.randn(SLOTS, N, generator=g) / SLOTS**0.5 for _ in range(2))
    mask = torch.ones(1, N, dtype=torch.bool)
    mask[0, :37] = False  # left padding
    return [x.to(dtype) for x in (q, k, v)], e, f, mask


def _cuda_against_cpu(fn, dtype, tolerance):
    """fn(q, k, v, e, f, mask) on CUDA in ``dtype`` against the CPU in float32, outputs and gradients, real rows."""
    (q, k, v), e, f, mask = _real_inputs(dtype)
    weights = torch.randn(1, HEADS, N, DIM, generator=torch.Generator().manual_seed(7)) * mask[:, None, :, None]
    results = []
    for device, dt in (("cuda", dtype), ("cpu", torch.float32)):
        inputs = [x.to(device, dt).requires_grad_() for x in (q, k, v)]
        projections = [x.to(device).requires_grad_() for x in (e, f)]
        out = fn(*inputs, *projections, mask.to(device))
        grads = torch.autograd.grad((out.float() * weights.to(device)).sum(), (*inputs, *projections))
        results.append([x.float().cpu() for x in (out, *grads)])
    for name, a, c in zip(("out", "dq", "dk", "dv", "de", "df"), *results):
        _assert_near(name, a, c, tolerance)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("family", ["bidirectional", "causal", "hybrid"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_paths_equal_the_cpu_at_real_size(family, dtype, tolerance):
    gamma = torch.full((HEADS,), 0.5)

    def fn(q, k, v, e, f, mask):
        if family == "bidirectional":
            return linformer_attention(q, k, v, e, f, key_padding_mask=mask)
        if family == "causal":
            return causal_linformer_attention(q, k, v, e, f, key_padding_mask=mask)
        return linformer_hybrid_attention(q, k, v, e, f, gamma.to(q.device), 64, key_padding_mask=mask, sinks=1)

    _cuda_against_cpu(fn, dtype, tolerance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bidirectional_bf16_gradients_against_float64_near_1000():
    n, g = 1000, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, DIM, generator=g, dtype=torch.float64) for _ in range(3))
    e = torch.randn(SLOTS, n, generator=g, dtype=torch.float64) / SLOTS**0.5
    weights = torch.randn(1, HEADS, n, DIM, generator=g, dtype=torch.float64)
    got_in = [x.cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    want_in = [x.requires_grad_() for x in (q, k, v)]
    got = linformer_attention(*got_in, e.cuda())
    want = linformer_reference(*want_in, e)
    got_grads = torch.autograd.grad((got.double() * weights.cuda()).sum(), got_in)
    want_grads = torch.autograd.grad((want * weights).sum(), want_in)
    for name, a, c in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        _assert_near(name, a, c, 3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bidirectional_dispatches_a_constant_number_of_ops():
    def count(n):
        q, k, v = (
            torch.randn(1, HEADS, n, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
        )
        e = torch.randn(SLOTS, 16384, device="cuda")
        with CountOps() as ops:
            linformer_attention(q, k, v, e, e).sum().backward()
        return ops.count

    assert count(4096) == count(16384) < 100


def test_causal_rows_before_any_slot_is_written_read_nothing_and_keep_gradients_finite():
    q, k, v = _qkv(n=20)
    e = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    e[:, :3] = 0  # positions 0..2 write no slot: their queries have nothing to read
    e.requires_grad_()
    f = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()  # F writes from position 0
    out = causal_linformer_attention(q, k, v, e, f, chunk_size=8)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    ref = causal_linformer_reference(q, k, v, e, f)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, c in zip(_grads(out, (q, k, v, e, f)), _grads(ref, (q, k, v, e, f))):
        assert bool(a.isfinite().all())
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_hybrid_bf16_operands_follow_the_float32_op(monkeypatch):
    # on CUDA, bf16 inputs take bf16 operands for the hybrid's products; here the same casts on the CPU
    _gpu_form(monkeypatch)
    q, k, v = (x.bfloat16().detach().requires_grad_() for x in _qkv(n=32))
    e = (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.3).requires_grad_()
    gamma = torch.tensor([0.5, 1.0, 3.0], requires_grad=True)
    kwargs = dict(key_padding_mask=_padding(2, 32), sinks=1)
    q32, k32, v32 = (x.float().detach().requires_grad_() for x in (q, k, v))
    want = linformer_hybrid_attention(q32, k32, v32, e, None, gamma, 4, **kwargs)
    monkeypatch.setattr(hybrid_module, "half_operands", lambda v: torch.bfloat16)
    got = linformer_hybrid_attention(q, k, v, e, None, gamma, 4, **kwargs)
    assert got.dtype == torch.bfloat16
    real = kwargs["key_padding_mask"][:, None, :, None].float()
    got_all = (got * real, *_grads(got * real, (q, k, v, e, gamma)))
    want_all = (want * real, *_grads(want * real, (q32, k32, v32, e, gamma)))
    for name, a, c in zip(("out", "dq", "dk", "dv", "de", "dgamma"), got_all, want_all):
        _assert_near(name, a, c, 2e-2)
    assert not torch.equal(got.float(), want.to(torch.bfloat16).float())  # the casts took effect


def test_sdpa_backend_compiles_whole_and_equals_the_reference():
    q, k, v = _qkv(b=1, h=2, n=32)
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    mask = _padding(2, 32)[1:]  # right padding

    def attend(q, k, v, e):
        return linformer_attention(q, k, v, e, key_padding_mask=mask, backend="sdpa")

    out = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v, e)  # a graph break raises
    ref = linformer_attention(q, k, v, e, key_padding_mask=mask, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, c in zip(_grads(out, (q, k, v, e)), _grads(ref, (q, k, v, e))):
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-3)
