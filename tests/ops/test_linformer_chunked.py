"""The causal Linformer's chunked form (issue 16): checked against the reference, and its op count.

``causal_linformer_attention`` computes every chunk at once (per-chunk slot writes by one batched GEMM, an
exclusive cumsum over chunks, inter- and intra-chunk parts by batched GEMMs), so with gradients the number of
dispatched aten ops (GPU kernel launches) does not depend on n. Only the no-grad long prefill walks blocks of
``prefill_block`` positions in Python, on purpose, to bound its memory; the last test documents that contrast.
"""

import pytest
import torch

from linearformers.ops.linformer import (
    CAUSAL_BACKENDS,
    causal_linformer_attention,
    causal_linformer_step,
)
from linearformers.ops.reference import causal_linformer_reference
from tests.ops.helpers import CountOps


def _inputs(b=2, h=3, n=21, d=8, slots=6, n_max=32, dtype=torch.float32, per_head=True, late=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    shape = (h, slots, n_max) if per_head else (slots, n_max)
    e = torch.randn(*shape, generator=g, dtype=torch.float64) / 3
    f = torch.randn(*shape, generator=g, dtype=torch.float64) / 3
    if late:  # the last slot is first written at position `late`: it must join only from there on
        e[..., -1, :late] = 0
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v, e, f))


def _reference(q, k, v, e, f):
    """The oracle: reference.causal_linformer_reference in float64."""
    return causal_linformer_reference(*(t.double() for t in (q, k, v, e, f)))


def _final_state(k, v, e, f):
    """The state after the last position, K̃_n = E[:, :n] K and Ṽ_n = F[:, :n] V, in float64. Written here
    because the reference returns outputs only: it has no state to compare with."""
    n = k.shape[2]
    e_h, f_h = ((p if p.dim() == 3 else p[None]).double()[..., :n] for p in (e, f))  # (h', k, n)
    return torch.einsum("hjs,bhsd->bhjd", e_h, k.double()), torch.einsum("hjs,bhsd->bhjd", f_h, v.double())


def _grads(out, inputs, seed=1):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad((out.double() * weights).sum(), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("chunk_size", [4, 5, 128])  # 21 positions: exact fit never, one chunk for 128
def test_chunked_equals_the_reference_with_gradients(dtype, per_head, chunk_size):
    inputs = _inputs(dtype=dtype, per_head=per_head, late=9)
    out, state = causal_linformer_attention(*inputs, chunk_size=chunk_size, return_state=True)
    ref, ref_state = _reference(*inputs), _final_state(*inputs[1:])
    # the kernels compute in float32 whatever the inputs' dtype (see _precision.py), float64 included
    tol = dict(rtol=1e-4, atol=1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **tol)
    for a, b in zip(state, ref_state):
        torch.testing.assert_close(a.double(), b, **tol)
    for name, a, b in zip("q k v E F".split(), _grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=lambda m, name=name: f"d{name}: {m}")


def test_rows_before_any_slot_is_written_read_zero_and_have_finite_gradients():
    inputs = _inputs(n=12, slots=3)
    e = inputs[3].detach().clone()
    e[..., :, :4] = 0  # no slot written before position 4
    inputs = (*inputs[:3], e.requires_grad_(), inputs[4])
    out = causal_linformer_attention(*inputs, chunk_size=5)
    assert (out[:, :, :4] == 0).all()
    torch.testing.assert_close(out, _reference(*inputs).float(), rtol=1e-4, atol=1e-5)
    assert all(torch.isfinite(g).all() for g in _grads(out, inputs))


def test_continuing_from_a_state_equals_one_pass_and_the_step():
    q, k, v, e, f = _inputs(n=23, late=15)
    whole, whole_state = causal_linformer_attention(q, k, v, e, f, chunk_size=4, return_state=True)
    head, state = causal_linformer_attention(*(t[:, :, :10] for t in (q, k, v)), e, f, chunk_size=4, return_state=True)
    tail, tail_state = causal_linformer_attention(
        *(t[:, :, 10:] for t in (q, k, v)), e, f, chunk_size=4, initial_state=state, start=10, return_state=True
    )
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-5, atol=1e-5)
    for a, b in zip(tail_state, whole_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    step, step_state = causal_linformer_step(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], e, f, state, 10)
    torch.testing.assert_close(step, whole[:, :, 10:11], rtol=1e-5, atol=1e-5)
    _, eleven = causal_linformer_attention(*(t[:, :, :11] for t in (q, k, v)), e, f, return_state=True)
    for a, b in zip(step_state, eleven):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rows_continuing_from_different_positions_equal_each_row_continued_alone():
    """After a left-padded prefill the rows have seen different numbers of real tokens: a per-row ``start``
    continues each row from its own position, as that row alone would continue with an int start."""
    q, k, v, e, f = (t.detach() for t in _inputs(n=20, late=9))
    starts = (10, 6)
    with torch.no_grad():
        alone, states = [], []
        for row, start in enumerate(starts):
            head = (t[row : row + 1, :, :start] for t in (q, k, v))
            _, state = causal_linformer_attention(*head, e, f, chunk_size=4, return_state=True)
            tail = (t[row : row + 1, :, start : start + 7] for t in (q, k, v))
            alone.append(causal_linformer_attention(*tail, e, f, chunk_size=4, initial_state=state, start=start))
            states.append(state)
        state = tuple(torch.cat(parts) for parts in zip(*states))
        new = [torch.stack([t[row, :, start : start + 7] for row, start in enumerate(starts)]) for t in (q, k, v)]
        out, _ = causal_linformer_attention(
            *new, e, f, initial_state=state, start=torch.tensor(starts), return_state=True
        )
        mask = torch.ones(2, 7, dtype=torch.bool)  # all real: a continuation accepts the model's all-True mask
        same = causal_linformer_attention(
            *new, e, f, key_padding_mask=mask, initial_state=state, start=torch.tensor(starts)
        )
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert torch.equal(same, out)


def test_one_start_for_every_row_is_the_int_start():
    q, k, v, e, f = (t.detach() for t in _inputs(n=16, late=9))
    with torch.no_grad():
        _, state = causal_linformer_attention(*(t[:, :, :9] for t in (q, k, v)), e, f, return_state=True)
        tail = [t[:, :, 9:] for t in (q, k, v)]
        by_int = causal_linformer_attention(*tail, e, f, chunk_size=4, initial_state=state, start=9)
        by_row = causal_linformer_attention(*tail, e, f, chunk_size=4, initial_state=state, start=torch.tensor([9, 9]))
    assert torch.equal(by_row, by_int)


def test_padding_in_a_continuation_and_a_misshapen_start_raise():
    q, k, v, e, f = (t.detach() for t in _inputs(n=12))
    state = tuple(torch.zeros(2, 3, 6, 8) for _ in range(2))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 5] = False
    with pytest.raises(ValueError, match="padding belongs in the first"):
        causal_linformer_attention(q, k, v, e, f, key_padding_mask=mask, initial_state=state, start=4)
    with pytest.raises(ValueError, match=r"start must be an int or a \(batch,\) = \(2,\) integer tensor"):
        causal_linformer_attention(q, k, v, e, f, initial_state=state, start=torch.tensor([4, 4, 4]))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_changes_nothing_for_real_tokens_gradients_included(side):
    q, k, v, e, f = _inputs(b=1, n=13, late=6)
    pad = 6
    junk = [torch.randn(1, 3, pad, 8) * 5 for _ in range(3)]
    cat = (lambda x, j: torch.cat([j, x], 2)) if side == "left" else (lambda x, j: torch.cat([x, j], 2))
    mask = torch.ones(1, 13 + pad, dtype=torch.bool)
    mask[:, :pad] = False if side == "left" else True
    mask[:, 13:] = True if side == "left" else False
    real = slice(pad, None) if side == "left" else slice(0, 13)
    ref, ref_state = causal_linformer_attention(q, k, v, e, f, chunk_size=4, return_state=True)
    out, state = causal_linformer_attention(
        *(cat(x, j) for x, j in zip((q, k, v), junk)), e, f, key_padding_mask=mask, chunk_size=4, return_state=True
    )
    torch.testing.assert_close(out[:, :, real], ref, rtol=1e-5, atol=1e-5)
    other = slice(0, pad) if side == "left" else slice(13, None)
    assert (out[:, :, other] == 0).all()
    for a, b in zip(state, ref_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(out[:, :, real], (q, k, v, e, f)), _grads(ref, (q, k, v, e, f))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_finite_and_close_to_float32(dtype):
    inputs32 = _inputs(n=37, n_max=48, late=20)
    half = tuple(t.detach().to(dtype).requires_grad_() for t in inputs32)
    out = causal_linformer_attention(*half, chunk_size=8)
    ref = causal_linformer_attention(*inputs32, chunk_size=8)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    for a, b in zip(_grads(out, half), _grads(ref, inputs32)):
        assert a.dtype == dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b, rtol=5 * tol, atol=5 * tol)


def _op_count(n, masked, grad=True, prefill_block=None):
    """Aten ops dispatched by forward (+ backward) at b = h = 1, d = 16, k = 16 slots."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g).requires_grad_(grad) for _ in range(3))
    e, f = ((torch.randn(16, n, generator=g) / n**0.5).requires_grad_(grad) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(1, n, dtype=torch.bool)
        mask[:, : n // 8] = False
    with CountOps() as counter, torch.set_grad_enabled(grad):
        out, _state = causal_linformer_attention(
            q, k, v, e, f, key_padding_mask=mask, return_state=True, prefill_block=prefill_block
        )
        if grad:
            out.sum().backward()
    return counter.count


@pytest.mark.parametrize("masked", [False, True])
def test_training_op_count_does_not_depend_on_n(masked):
    # every chunk at once: the kernel launches of forward + backward are the same at 2048 and 16384 positions
    assert _op_count(2048, masked) == _op_count(16384, masked)


def test_no_grad_prefill_walks_blocks_in_python_by_design():
    # The contrast: without gradients a long prompt is walked in prefill_block-position blocks (1024 by default;
    # memory bounded by one block's per-chunk states and logits), so its op count grows with n / prefill_block.
    # One block of any n gives back a constant count. If the prefill ever becomes one batched pass, replace this.
    assert _op_count(4096, False, grad=False) > _op_count(1024, False, grad=False)
    one_block = 1 << 20
    assert _op_count(4096, False, grad=False, prefill_block=one_block) == _op_count(
        1024, False, grad=False, prefill_block=one_block
    )
    assert _op_count(1024, False, grad=False, prefill_block=256) > _op_count(1024, False, grad=False)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("per_head", [True, False])
def test_reference_and_chunked_backends_agree_with_gradients(masked, per_head):
    inputs = _inputs(dtype=torch.float64, per_head=per_head, late=9)
    mask = None
    if masked:
        mask = torch.ones(2, 21, dtype=torch.bool)
        mask[0, :4] = False  # left padding in the first row, right padding in the second
        mask[1, 17:] = False
    ref = causal_linformer_attention(*inputs, key_padding_mask=mask, backend="reference")
    chunked = causal_linformer_attention(*inputs, key_padding_mask=mask, backend="chunked", chunk_size=4)
    default = causal_linformer_attention(*inputs, key_padding_mask=mask, chunk_size=4)
    assert ref.dtype == chunked.dtype == torch.float64
    # the reference backend is the reference function itself (float64 in, float64 out)
    torch.testing.assert_close(ref, causal_linformer_reference(*inputs, key_padding_mask=mask), rtol=0, atol=0)
    assert torch.equal(chunked, default)  # None chooses the chunked form
    tol = dict(rtol=1e-4, atol=1e-5)  # the chunked form computes in float32
    torch.testing.assert_close(chunked, ref, **tol)
    for name, a, b in zip("q k v E F".split(), _grads(chunked, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("masked", [False, True])
def test_small_prefill_block_equals_the_default_without_gradients(masked):
    q, k, v, e, f = (t.detach() for t in _inputs(n=29, late=13))
    mask = None
    if masked:
        mask = torch.ones(2, 29, dtype=torch.bool)
        mask[1, :6] = False
    with torch.no_grad():
        whole, whole_state = causal_linformer_attention(
            q, k, v, e, f, key_padding_mask=mask, chunk_size=4, return_state=True
        )
        blocks, block_state = causal_linformer_attention(
            q, k, v, e, f, key_padding_mask=mask, chunk_size=4, return_state=True, prefill_block=8
        )  # 4 blocks: 8, 8, 8, 5 (the last one short, and not a whole number of chunks)
        # a continued prefill walks its blocks from `start`
        head, state = causal_linformer_attention(*(t[:, :, :11] for t in (q, k, v)), e, f, return_state=True)
        tail = causal_linformer_attention(
            *(t[:, :, 11:] for t in (q, k, v)), e, f, chunk_size=3, initial_state=state, start=11, prefill_block=5
        )
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)
    for a, b in zip(block_state, whole_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if not masked:
        torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-5, atol=1e-5)


def test_bad_backend_and_sizes_raise_value_errors():
    q, k, v, e, f = _inputs(n=12)
    with pytest.raises(ValueError, match=r"unknown causal Linformer backend 'native'.*'reference', 'chunked'"):
        causal_linformer_attention(q, k, v, e, f, backend="native")
    assert CAUSAL_BACKENDS == ("reference", "chunked")
    for bad in (0, -4, 2.0, True, "8"):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            causal_linformer_attention(q, k, v, e, f, chunk_size=bad)
        with pytest.raises(ValueError, match="prefill_block must be a positive int"):
            causal_linformer_attention(q, k, v, e, f, prefill_block=bad)
    state = tuple(torch.zeros(2, 3, 6, 8) for _ in range(2))
    with pytest.raises(ValueError, match="no initial_state"):
        causal_linformer_attention(q, k, v, e, f, backend="reference", initial_state=state, start=4)
    with pytest.raises(ValueError, match="no start"):
        causal_linformer_attention(q, k, v, e, f, backend="reference", start=4)
    with pytest.raises(ValueError, match="no return_state"):
        causal_linformer_attention(q, k, v, e, f, backend="reference", return_state=True)
