"""The Linformer ops (ops/linformer.py, and the hand-written backward of _linformer_autograd.py): linformer_attention
and causal_linformer_attention against the plain formulas, padding, projections, backends and bad arguments; the
causal chunked form against the reference and its op count; the paths a GPU runs (batched products, no per-block
loop), exercised on the CPU by naming them, and at real sizes on CUDA (``-m cuda``)."""

import pytest
import torch

from linearformers.ops import (
    _linformer_autograd,
    causal_linformer_attention,
    causal_linformer_step,
    linformer_attention,
    linformer_hybrid_attention,
    softmax_attention,
)
from linearformers.ops import linformer as linformer_module
from linearformers.ops._favor_chunked import half_operands
from linearformers.ops.linformer import BACKENDS, CAUSAL_BACKENDS, _choose_backend
from linearformers.ops.reference import causal_linformer_reference, linformer_reference
from tests.ops.helpers import LINFORMER_PROJECTIONS, CountOps, assert_near, grads_in_dtype, padding_left_right


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
    out = linformer_attention(q, k, v, None, projection="pool", pool_stride=4)
    ref = linformer_reference(q, k, v, None, projection="pool", pool_stride=4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_conv_projection_is_a_strided_convolution():
    q, k, v = _qkv(n=32)
    wk, wv = torch.randn(16, 16, 4) * 0.1, torch.randn(16, 16, 4) * 0.1
    out = linformer_attention(q, k, v, wk, wv, projection="conv", pool_stride=4)
    ref = linformer_reference(q, k, v, wk, wv, projection="conv", pool_stride=4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", [linformer_attention, linformer_reference])
def test_the_old_keywords_method_and_window_still_work_with_a_future_warning_until_0_3_0(op):
    q, k, v = _qkv(n=32)
    want = op(q, k, v, None, projection="pool", pool_stride=4)
    with pytest.warns(FutureWarning, match=r"method= is renamed projection=; .* goes away in 0\.3\.0"):
        with pytest.warns(FutureWarning, match=r"window= is renamed pool_stride=; .* goes away in 0\.3\.0"):
            got = op(q, k, v, None, method="pool", window=4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op", [linformer_attention, linformer_reference])
@pytest.mark.parametrize(("old", "new"), [("method", "projection"), ("window", "pool_stride")])
def test_an_old_keyword_beside_its_new_name_is_a_type_error(op, old, new):
    q, k, v = _qkv(n=32)
    both = {"projection": "pool", "pool_stride": 4, old: {"method": "pool", "window": 4}[old]}
    with pytest.raises(TypeError, match=f"got both {old}= and {new}=; pass only {new}="):
        op(q, k, v, None, **both)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "projection,proj,pool_stride",
    [("learned", torch.randn(8, 64), None), ("pool", None, 4), ("conv", torch.randn(16, 16, 4) * 0.1, 4)],
)
def test_padding_changes_nothing_for_real_tokens(side, projection, proj, pool_stride):
    q, k, v = _qkv(b=1, n=22)
    ref = linformer_attention(q, k, v, proj, projection=projection, pool_stride=pool_stride)
    pad = 9
    qp, kp, vp = (_pad(x, pad, side) for x in (q, k, v))
    out = linformer_attention(
        qp, kp, vp, proj, projection=projection, pool_stride=pool_stride, key_padding_mask=_mask(22, pad, side)
    )
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
    with pytest.raises(ValueError, match="unknown Linformer projection 'fft'"):
        linformer_attention(q, k, v, None, projection="fft")
    with pytest.raises(ValueError, match="conv projection weight"):
        linformer_attention(q, k, v, torch.randn(16, 16, 3), projection="conv", pool_stride=4)
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
    q, k, v = (x.requires_grad_() for x in _qkv(n=40))
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(123)
    out = linformer_attention(q, k, v, e, dropout_p=0.3, block_size=16)
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**62, (1,)).item())
    b, h, n = q.shape[:3]
    multiplier = torch.cat(
        [
            _linformer_autograd._dropout_multiplier((b, h, min(16, n - i), 8), 0.3, seed, j, "cpu")
            for j, i in enumerate(range(0, n, 16))
        ],
        dim=2,
    )
    assert 0.1 < (multiplier == 0).float().mean() < 0.5  # dropout really drops
    ref = linformer_reference(q, k, v, e, dropout_multiplier=multiplier)
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
    "projection,proj,pool_stride",
    [("learned", torch.randn(3, 8, 64), None), ("pool", None, 4), ("conv", torch.randn(16, 16, 4) * 0.1, 4)],
)
def test_reference_backend_equals_the_default(masked, projection, proj, pool_stride):
    q, k, v = (x.double() for x in _qkv(n=30))
    proj = None if proj is None else proj.double()
    mask = None
    if masked:
        mask = torch.ones(2, 30, dtype=torch.bool)
        mask[0, :7] = False
        mask[1, 25:] = False
    kwargs = dict(projection=projection, pool_stride=pool_stride, key_padding_mask=mask)
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
    with pytest.raises(ValueError, match="needs a positive pool_stride"):
        linformer_attention(q, k, v, None, projection="pool", backend="reference")
    with pytest.raises(ValueError, match="conv projection weight"):
        linformer_attention(q, k, v, torch.randn(16, 16, 3), projection="conv", pool_stride=4, backend="reference")


def test_dropout_under_compile_is_one_graph_and_drops_each_share_with_probability_p():
    """Under torch.compile the dropout masks come from torch's generator in the graph (no host read of a seed):
    fullgraph=True compiles. With v = 1 each output is the kept share of its row's probabilities / (1 - p): 1 on
    average, spread by the drops; a row of a padded sequence keeps its own slots only (its output stays finite)."""
    q, k, _ = _qkv(n=64)
    v = torch.ones_like(k)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, :40] = False

    def attend(q, k, v, mask):
        return linformer_attention(
            q, k, v, None, projection="pool", pool_stride=4, key_padding_mask=mask, dropout_p=0.5
        )

    torch.manual_seed(0)
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    assert torch.isfinite(out).all()
    shares = out[..., 0]
    assert abs(float(shares.mean()) - 1.0) < 0.2
    assert float(shares.std()) > 0.1  # without dropout every share is exactly 1


# -- the causal chunked form
# causal_linformer_attention computes every chunk at once (per-chunk slot writes by one batched GEMM, an exclusive
# cumsum over chunks, inter- and intra-chunk parts by batched GEMMs), so with gradients the number of dispatched aten
# ops (GPU kernel launches) does not depend on n. Only the no-grad long prefill walks blocks of prefill_block
# positions in Python, on purpose, to bound its memory; test_no_grad_prefill_walks_blocks_in_python_by_design
# documents that contrast.


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


# -- the paths a GPU runs, named on the CPU


def _qkv_leaves(b=2, h=3, n=30, d=16, seed=0, dtype=torch.float32, device="cpu"):
    """q, k, v as autograd leaves."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("projection,shape,pool_stride", LINFORMER_PROJECTIONS)
def test_sdpa_backend_equals_the_reference_gradients_included(masked, projection, shape, pool_stride):
    q, k, v = _qkv_leaves()
    g = torch.Generator().manual_seed(1)
    e, f = (None if shape is None else (torch.randn(shape, generator=g) * 0.3).requires_grad_() for _ in range(2))
    kwargs = dict(
        projection=projection, pool_stride=pool_stride, key_padding_mask=padding_left_right(2, 30) if masked else None
    )
    out = linformer_attention(q, k, v, e, f, backend="sdpa", **kwargs)
    ref = linformer_reference(q, k, v, e, f, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    inputs = tuple(x for x in (q, k, v, e, f) if x is not None)
    for name, a, c in zip("qkvef", grads_in_dtype(out, inputs), grads_in_dtype(ref, inputs)):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_sdpa_backend_dropout_gradients_follow_the_forward_mask():
    # with E = I (k = n) the slots are the tokens, and values that are the identity show the dropped probabilities;
    # the same seed draws the same mask for other values, which must then equal the reference under that mask
    b, h, n, d = 2, 3, 8, 16
    q, k, v = _qkv_leaves(b, h, n, d)
    eye = torch.eye(n)
    probe = torch.zeros(b, h, n, d)
    probe[..., :n] = eye
    torch.manual_seed(5)
    shown = linformer_attention(q, k, probe, eye, dropout_p=0.3, backend="sdpa")
    multiplier = (shown[..., :n] != 0).float() / 0.7
    assert 0.1 < (multiplier == 0).float().mean() < 0.5  # dropout really drops
    torch.manual_seed(5)
    out = linformer_attention(q, k, v, eye, dropout_p=0.3, backend="sdpa")
    ref = linformer_reference(q, k, v, eye, dropout_multiplier=multiplier)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, a, c in zip("qkv", grads_in_dtype(out, (q, k, v)), grads_in_dtype(ref, (q, k, v))):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"gradient of {name}: {m}")
    torch.manual_seed(6)
    assert not torch.allclose(linformer_attention(q, k, v, eye, dropout_p=0.3, backend="sdpa"), out)


def test_sdpa_backend_gives_zeros_for_a_row_of_padding_only():
    q, k, v = _qkv_leaves()
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1] = False  # no real token: no slot written
    out = linformer_attention(q, k, v, e, key_padding_mask=mask, backend="sdpa")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], linformer_attention(q, k, v, e, key_padding_mask=mask, backend="reference")[0])
    assert all(bool(x.isfinite().all()) for x in grads_in_dtype(out, (q, k, v, e)))


def test_sdpa_backend_masks_slots_no_real_token_wrote():
    q, k, v = (x[:, :, :20] for x in _qkv_leaves())  # identity E at k = 32 on 20 tokens: slots 20..31 stay empty
    eye = torch.eye(32)
    out = linformer_attention(q, k, v, eye, backend="sdpa")
    ref = linformer_reference(q, k, v, eye)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("per_head", [False, True])
def test_sdpa_backend_op_count_does_not_grow_with_the_length(per_head):
    def count(n):
        q, k, v = _qkv_leaves(n=n)
        shape = (3, 8, 1024) if per_head else (8, 1024)
        e = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with CountOps() as ops:
            out = linformer_attention(q, k, v, e, backend="sdpa")
            out.sum().backward()
        return ops.count

    assert count(64) == count(512)  # the blockwise backend walks 256-row blocks: its count grows with n


def test_sdpa_backend_keeps_bf16_and_follows_float32():
    q, k, v = _qkv_leaves()
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.3
    out = linformer_attention(*(x.bfloat16() for x in (q, k, v)), e, backend="sdpa")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), linformer_attention(q, k, v, e, backend="reference"), rtol=0.05, atol=0.05)


def test_sdpa_backend_compiles_whole_and_equals_the_reference():
    q, k, v = _qkv_leaves(b=1, h=2, n=32)
    e = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    mask = padding_left_right(2, 32)[1:]  # right padding

    def attend(q, k, v, e):
        return linformer_attention(q, k, v, e, key_padding_mask=mask, backend="sdpa")

    out = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v, e)  # a graph break raises
    ref = linformer_attention(q, k, v, e, key_padding_mask=mask, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, c in zip(grads_in_dtype(out, (q, k, v, e)), grads_in_dtype(ref, (q, k, v, e))):
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-3)


def test_default_backend_is_blockwise_on_the_cpu_and_sdpa_elsewhere():
    assert _choose_backend(None, torch.empty(1)) == "blockwise"
    assert _choose_backend(None, torch.empty(1, device="meta")) == "sdpa"
    assert _choose_backend("blockwise", torch.empty(1, device="meta")) == "blockwise"
    with pytest.raises(ValueError, match="unknown Linformer backend 'flash'"):
        _choose_backend("flash", torch.empty(1))


def test_causal_bf16_operands_follow_the_float32_reference(monkeypatch):
    # on CUDA, bf16 inputs take bf16 operands for the products (tensor cores); here the same casts on the CPU
    monkeypatch.setattr(linformer_module, "half_operands", lambda v: torch.bfloat16)
    q, k, v = (x.bfloat16().detach().requires_grad_() for x in _qkv_leaves(n=40))
    e = (torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(1)) * 0.3).requires_grad_()
    mask = padding_left_right(2, 40)
    out = causal_linformer_attention(q, k, v, e, key_padding_mask=mask, chunk_size=16)
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (x.float().detach().requires_grad_() for x in (q, k, v))
    ref = causal_linformer_reference(q32, k32, v32, e, e, key_padding_mask=mask)
    got, want = (out, *grads_in_dtype(out, (q, k, v, e))), (ref, *grads_in_dtype(ref, (q32, k32, v32, e)))
    for name, a, c in zip(("out", "dq", "dk", "dv", "de"), got, want):
        assert_near(name, a, c, 2e-2)  # bf16 operands: ~2^-8 of each product's scale


def test_causal_products_stay_float32_off_cuda():
    assert half_operands(torch.empty(1, dtype=torch.bfloat16)) is None
    assert half_operands(torch.empty(1, dtype=torch.bfloat16, device="meta")) is None  # CUDA only


def test_causal_rows_before_any_slot_is_written_read_nothing_and_keep_gradients_finite():
    q, k, v = _qkv_leaves(n=20)
    e = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    e[:, :3] = 0  # positions 0..2 write no slot: their queries have nothing to read
    e.requires_grad_()
    f = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()  # F writes from position 0
    out = causal_linformer_attention(q, k, v, e, f, chunk_size=8)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    ref = causal_linformer_reference(q, k, v, e, f)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, c in zip(grads_in_dtype(out, (q, k, v, e, f)), grads_in_dtype(ref, (q, k, v, e, f))):
        assert bool(a.isfinite().all())
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


# -- on CUDA, at real sizes (the Linformer hybrid's too)

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
        assert_near(name, a, c, tolerance)


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
        assert_near(name, a, c, 3e-2)


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
