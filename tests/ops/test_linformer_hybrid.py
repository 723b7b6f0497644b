"""linformer_hybrid_attention (ops/linformer_hybrid.py): an exact sliding window (and sinks) beside Linformer's slots,
in one softmax, against the dense reference, in passes of query blocks, with dropout and bad arguments; and the form a
GPU runs (batched projections, the GPU's pass budget, bf16 operands), exercised on the CPU by naming it. Its CUDA
tests at real sizes are test_linformer.py's, beside the other Linformer paths."""

import pytest
import torch

from linearformers.ops import linformer_attention, linformer_hybrid_attention
from linearformers.ops import linformer_hybrid as linformer_hybrid_module
from linearformers.ops.reference import linformer_hybrid_reference, softmax_reference
from tests.ops.helpers import LINFORMER_PROJECTIONS, assert_near, grads_in_dtype, padding_left_right

WINDOW = 3


def _qkv(b=2, h=3, n=13, d=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


def _projections(projection, h, n_max, k, d, dtype=torch.float64, per_head=False):
    g = torch.Generator().manual_seed(1)
    if projection == "learned":
        shape = (h, k, n_max) if per_head else (k, n_max)
        return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype), None
    if projection == "conv":
        pool_stride = n_max // k
        return (
            torch.randn(d, d, pool_stride, generator=g, dtype=dtype),
            torch.randn(d, d, pool_stride, generator=g, dtype=dtype),
            pool_stride,
        )
    return None, None, n_max // k


@pytest.mark.parametrize("sinks", [0, 1, 2])
@pytest.mark.parametrize("window", [1, WINDOW, 7, 40])
@pytest.mark.parametrize(
    ("projection", "per_head"), [("learned", False), ("learned", True), ("pool", False), ("conv", False)],
    ids=["learned", "learned-per-head", "pool", "conv"],
)  # fmt: skip
def test_the_op_equals_the_dense_reference(projection, per_head, window, sinks):
    q, k, v = _qkv()
    e, f, pool = _projections(projection, 3, 16, 4, 4, per_head=per_head)
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False  # row 1 left-padded: its sinks and its slots start at position 4
    kwargs = dict(projection=projection, pool_stride=pool, key_padding_mask=mask, sinks=sinks)
    got = linformer_hybrid_attention(q, k, v, e, f, gamma, window, **kwargs)
    want = linformer_hybrid_reference(q, k, v, e, f, gamma, window, **kwargs)
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-12)


def _one_block_per_pass(monkeypatch):
    """Every pass of the op one query block: the smallest budget (the rows of a pass are recomputed in backward)."""
    monkeypatch.setattr(linformer_hybrid_module, "_PASS_BYTES", 1)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("window", [1, WINDOW, 40])
def test_passes_of_one_block_equal_the_dense_reference(monkeypatch, window, sinks):
    _one_block_per_pass(monkeypatch)
    q, k, v = _qkv()
    e, f, _ = _projections("learned", 3, 13, 4, 4)
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 11:] = mask[1, :4] = False
    kwargs = dict(key_padding_mask=mask, sinks=sinks)
    got = linformer_hybrid_attention(q, k, v, e, f, gamma, window, **kwargs)
    want = linformer_hybrid_reference(q, k, v, e, f, gamma, window, **kwargs)
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("passes", ["one", "one block each"])
def test_gradients_equal_the_references(monkeypatch, passes):
    if passes != "one":
        _one_block_per_pass(monkeypatch)
    q, k, v = (t.requires_grad_() for t in _qkv())
    e, f, _ = _projections("learned", 3, 13, 5, 4)
    e.requires_grad_(), f.requires_grad_()
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 10:] = False
    weights = torch.randn(2, 3, 13, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    weights = weights * mask[:, None, :, None]  # padded queries' outputs are not defined
    grads = []
    for fn in (linformer_hybrid_attention, linformer_hybrid_reference):
        out = fn(q, k, v, e, f, gamma, 4, key_padding_mask=mask, sinks=1)
        grads.append(torch.autograd.grad((out * weights).sum(), (q, k, v, e, f, gamma)))
    for got, want in zip(*grads):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_a_window_over_the_whole_sequence_with_a_tiny_balance_leaves_the_slots_alone():
    """gamma -> 0 takes the window out: plain Linformer attention. gamma -> inf takes the slots out: softmax."""
    q, k, v = _qkv()
    e, f, _ = _projections("learned", 3, 13, 5, 4)
    tiny, huge = torch.full((3,), 1e-30, dtype=torch.float64), torch.full((3,), 1e30, dtype=torch.float64)
    slots = linformer_attention(q, k, v, e, f)  # its slot attention runs in float32
    torch.testing.assert_close(linformer_hybrid_attention(q, k, v, e, f, tiny, 20), slots, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linformer_hybrid_attention(q, k, v, e, f, huge, 20), softmax_reference(q, k, v))


def test_a_row_without_real_keys_outputs_zero_and_its_gradients_are_finite():
    q, k, v = (t.requires_grad_() for t in _qkv(n=8))
    e, f, _ = _projections("learned", 3, 8, 4, 4)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1] = False
    out = linformer_hybrid_attention(
        q, k, v, e, f, torch.ones(3, dtype=torch.float64), 2, key_padding_mask=mask, sinks=1
    )
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_bf16_autocast_computes_in_float32_and_returns_the_inputs_dtype():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(dtype=torch.float32))
    e, f, _ = _projections("learned", 3, 13, 5, 4, dtype=torch.float32)
    gamma = torch.ones(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linformer_hybrid_attention(q, k, v, e, f, gamma, WINDOW, sinks=1)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    want = linformer_hybrid_reference(*(t.double() for t in (q, k, v, e, f, gamma)), WINDOW, sinks=1)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_dropout_drops_probabilities_only_when_asked():
    q, k, v = _qkv(dtype=torch.float32)
    e, f, _ = _projections("learned", 3, 13, 5, 4, dtype=torch.float32)
    gamma = torch.ones(3)
    plain = linformer_hybrid_attention(q, k, v, e, f, gamma, WINDOW)
    torch.manual_seed(0)
    dropped = linformer_hybrid_attention(q, k, v, e, f, gamma, WINDOW, dropout_p=0.5)
    assert not torch.allclose(plain, dropped)
    torch.manual_seed(0)
    assert torch.equal(dropped, linformer_hybrid_attention(q, k, v, e, f, gamma, WINDOW, dropout_p=0.5))


def test_recomputed_passes_drop_the_same_probabilities_in_backward(monkeypatch):
    """Under autograd each pass is recomputed in backward: with dropout, its gradients are those of the forward
    that ran (the same masks), as without recomputation."""
    _one_block_per_pass(monkeypatch)
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float32))
    e, f, _ = _projections("learned", 3, 13, 5, 4, dtype=torch.float32)
    gamma = torch.ones(3, requires_grad=True)
    weights = torch.randn(2, 3, 13, 4, generator=torch.Generator().manual_seed(9))
    results = []
    for recompute in (True, False):
        if not recompute:  # the pass runs under plain autograd, which keeps its own masks
            monkeypatch.setattr(linformer_hybrid_module, "checkpoint", lambda fn, *args, **_: fn(*args))
        torch.manual_seed(0)
        out = linformer_hybrid_attention(q, k, v, e, f, gamma, WINDOW, sinks=1, dropout_p=0.5)
        results.append((out, *torch.autograd.grad((out * weights).sum(), (q, k, v, gamma))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hybrid_window": 0}, ValueError, "hybrid_window must be a positive int"),
        ({"hybrid_window": True}, ValueError, "hybrid_window must be a positive int"),
        ({"sinks": -1}, ValueError, "sinks must be an int >= 0"),
        ({"gamma": torch.ones(2)}, ValueError, r"gamma must be shaped \(heads,\) = \(3,\)"),
        ({"gamma": [1.0, 1.0, 1.0]}, TypeError, "gamma must be a torch.Tensor"),
        ({"gamma": torch.ones(3, dtype=torch.long)}, TypeError, "gamma must be a floating-point tensor"),
        ({"projection": "mean"}, ValueError, "unknown Linformer projection 'mean'"),
        ({"e_proj": None}, ValueError, "the learned projection needs e_proj"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
        ({"key_padding_mask": torch.ones(2, 5)}, ValueError, "key_padding_mask must be shaped"),
    ],
)
def test_the_op_refuses_bad_arguments(kwargs, error, match):
    q, k, v = _qkv()
    e, f, _ = _projections("learned", 3, 13, 5, 4)
    args = dict(e_proj=e, f_proj=f, gamma=torch.ones(3, dtype=torch.float64), hybrid_window=WINDOW)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        linformer_hybrid_attention(q, k, v, **args)


@pytest.mark.parametrize("op", [linformer_hybrid_attention, linformer_hybrid_reference])
def test_the_old_keywords_method_and_window_still_work_with_a_future_warning_until_0_3_0(op):
    q, k, v = _qkv(n=16)
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    want = op(q, k, v, None, None, gamma, WINDOW, projection="pool", pool_stride=4)
    with pytest.warns(FutureWarning, match=r"method= is renamed projection=; .* goes away in 0\.3\.0"):
        with pytest.warns(FutureWarning, match=r"window= is renamed pool_stride=; .* goes away in 0\.3\.0"):
            got = op(q, k, v, None, None, gamma, WINDOW, method="pool", window=4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(("old", "new"), [("method", "projection"), ("window", "pool_stride")])
def test_an_old_keyword_beside_its_new_name_is_a_type_error(old, new):
    q, k, v = _qkv(n=16)
    both = {"projection": "pool", "pool_stride": 4, old: {"method": "pool", "window": 4}[old]}
    with pytest.raises(TypeError, match=f"got both {old}= and {new}=; pass only {new}="):
        linformer_hybrid_attention(q, k, v, None, None, torch.ones(3, dtype=torch.float64), WINDOW, **both)


# -- the GPU form (batched projections, the GPU's pass budget), named on the CPU


def _qkv_leaves(b=2, h=3, n=32, d=16, seed=0):
    """q, k, v as float32 autograd leaves."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).requires_grad_() for _ in range(3))


def _gpu_form(monkeypatch):
    """The hybrid's GPU form on the CPU: batched projections and the GPU's pass budget."""
    monkeypatch.setattr(linformer_hybrid_module, "_gpu_form", lambda device: True)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("projection,shape,pool_stride", LINFORMER_PROJECTIONS)
def test_hybrid_gpu_form_equals_the_reference_gradients_included(monkeypatch, sinks, projection, shape, pool_stride):
    _gpu_form(monkeypatch)
    q, k, v = (x.double().detach().requires_grad_() for x in _qkv_leaves(n=32))
    g = torch.Generator().manual_seed(1)
    e, f = (None if shape is None else torch.randn(shape, generator=g).double().requires_grad_() for _ in range(2))
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64, requires_grad=True)
    mask = padding_left_right(2, 32)
    kwargs = dict(projection=projection, pool_stride=pool_stride, key_padding_mask=mask, sinks=sinks)
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
    q, k, v = _qkv_leaves(n=32)
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
    assert linformer_hybrid_module._blocks_per_pass(blocks, per_block, gpu=True) == blocks
    assert linformer_hybrid_module._blocks_per_pass(blocks, per_block, gpu=False) < 16  # the CPU's passes stay in cache
    assert not linformer_hybrid_module._gpu_form(torch.device("cpu"))
    assert linformer_hybrid_module._gpu_form(torch.device("meta"))


def test_hybrid_bf16_operands_follow_the_float32_op(monkeypatch):
    # on CUDA, bf16 inputs take bf16 operands for the hybrid's products; here the same casts on the CPU
    _gpu_form(monkeypatch)
    q, k, v = (x.bfloat16().detach().requires_grad_() for x in _qkv_leaves(n=32))
    e = (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.3).requires_grad_()
    gamma = torch.tensor([0.5, 1.0, 3.0], requires_grad=True)
    kwargs = dict(key_padding_mask=padding_left_right(2, 32), sinks=1)
    q32, k32, v32 = (x.float().detach().requires_grad_() for x in (q, k, v))
    want = linformer_hybrid_attention(q32, k32, v32, e, None, gamma, 4, **kwargs)
    monkeypatch.setattr(linformer_hybrid_module, "half_operands", lambda v: torch.bfloat16)
    got = linformer_hybrid_attention(q, k, v, e, None, gamma, 4, **kwargs)
    assert got.dtype == torch.bfloat16
    real = kwargs["key_padding_mask"][:, None, :, None].float()
    got_all = (got * real, *grads_in_dtype(got * real, (q, k, v, e, gamma)))
    want_all = (want * real, *grads_in_dtype(want * real, (q32, k32, v32, e, gamma)))
    for name, a, c in zip(("out", "dq", "dk", "dv", "de", "dgamma"), got_all, want_all):
        assert_near(name, a, c, 2e-2)
    assert not torch.equal(got.float(), want.to(torch.bfloat16).float())  # the casts took effect
