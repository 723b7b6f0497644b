"""The Triton causal kernels (backend="triton") against reference.py: given features and the fused FAVOR+ maps,
forward and backward, float32 and bf16 operands.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py
sets before triton is imported), at small sizes with
chunks of 16 so that several chunks, m-blocks and d-blocks are crossed. With CUDA the same comparisons run on the GPU
(``pytest -m cuda``) at real sizes: n = 4099, 12 heads x 64, m = 256, against the chunked PyTorch backend, and at
n = 1000 against a float64 quadratic reference (the n = 4099 one would not fit in host memory).
"""

import contextlib
import faulthandler
import os
import time
import warnings
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from linearformers.ops import (
    _triton_causal,
    draw_random_features,
    favor_attention,
    favor_step,
    linear_attention,
    set_triton_kernels,
)
from linearformers.ops._triton_causal import triton_causal_linear
from linearformers.ops.backends import choose_backend
from linearformers.ops.feature_maps import random_feature_map
from linearformers.ops.reference import favor_reference, linear_reference
from tests.ops._triton_cases import (
    CUDA,
    DTYPES,
    ON_CPU,
    ON_CUDA,
    TOLERANCE,
    assert_close,
    padding_mask,
    randn,
    run_with_grads,
)

DEVICES = [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)]
# CUDA compiles the kernels once per dtype and configuration (float32's, the slowest, for up to half a minute each):
# there bf16 runs everywhere and float32 once, the fused softmax map (and the float32 initial-state test)
CASES = [("cpu", dtype, ON_CPU) for dtype in DTYPES] + [("cuda", torch.bfloat16, ON_CUDA)]
FEATURE_CASES = [pytest.param(dev, dtype, marks=on, id=f"{dev}-{str(dtype)[6:]}") for dev, dtype, on in CASES]
MAP_CASES = [
    pytest.param(dev, dtype, feature_map, marks=on, id=f"{dev}-{str(dtype)[6:]}-{feature_map}")
    for dev, dtype, on in [*CASES, ("cuda", torch.float32, ON_CUDA)]
    for feature_map in ("softmax", "relu")
    if dev == "cpu" or dtype == torch.bfloat16 or feature_map == "softmax"
]
# (batch, heads, m, head_dim, chunk) per device; the CPU's m and head_dim give several m-blocks or d-blocks of 16
SIZES = {"cpu": (2, 1, 48, 32, 16), "cuda": (1, 12, 256, 64, None)}
FAVOR_SIZES = {"cpu": (2, 1, 32, 48, 16), "cuda": (1, 12, 256, 64, None)}
LENGTHS = {"cpu": (1, 13, 37), "cuda": (1000,)}  # one position, less than a chunk, several chunks and a partial one
LONG = 4099  # CUDA: against the chunked backend


@pytest.mark.parametrize(("device", "dtype"), FEATURE_CASES)
def test_given_features_match_the_reference(device, dtype):
    """linear_attention(backend="triton") on given features: output and dphi_q, dphi_k, dv as the float64
    reference of the same (rounded) inputs, at every length of LENGTHS, with keys padded left and right."""
    b, h, m, d, chunk = SIZES[device]
    for n in LENGTHS[device]:
        pq, pk = (
            torch.rand(b, h, n, m, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (1, 2)
        )
        inputs = [t.to(device=device, dtype=dtype) for t in (pq, pk, randn(b, h, n, d, seed=3, dtype=torch.float64))]
        grad = randn(b, h, n, d, device=device, seed=4, dtype=torch.float64)
        mask = padding_mask(b, n, device)
        got = run_with_grads(
            lambda *x, mask=mask: linear_attention(
                *x, causal=True, key_padding_mask=mask, chunk_size=chunk, backend="triton"
            ),
            inputs,
            grad,
        )
        expected = run_with_grads(
            lambda *x, mask=mask: linear_reference(*x, causal=True, key_padding_mask=mask),
            [t.double() for t in inputs],
            grad,
        )
        assert_close(got, expected, TOLERANCE[dtype], f"n={n}")


@pytest.mark.parametrize(("device", "dtype", "feature_map"), MAP_CASES)
def test_fused_favor_maps_match_the_reference(device, dtype, feature_map):
    """favor_attention(backend="triton"), its feature map computed inside the kernels: output and dq, dk, dv as the
    float64 reference of the same (rounded) inputs, keys padded left and right."""
    b, h, m, d, chunk = FAVOR_SIZES[device]
    n = LENGTHS[device][-1]
    w = draw_random_features(m, d, seed=5, device=device)
    inputs = [randn(b, h, n, d, device=device, seed=s, dtype=dtype) for s in (6, 7, 8)]
    grad = randn(b, h, n, d, device=device, seed=9, dtype=torch.float64)
    mask = padding_mask(b, n, device)
    got = run_with_grads(
        lambda *x: favor_attention(
            *x, w, causal=True, feature_map=feature_map, key_padding_mask=mask, chunk_size=chunk, backend="triton"
        ),
        inputs,
        grad,
    )

    def reference(q, k, v):
        if device == "cpu":
            return favor_reference(q, k, v, w, causal=True, feature_map=feature_map, key_padding_mask=mask)
        # the same attention through float64 features (the log-space reference holds n² m values)
        pq, pk = (
            random_feature_map(x, w.double(), is_query=t, feature_map=feature_map) for x, t in ((q, True), (k, False))
        )
        return linear_reference(pq, pk, v, causal=True, key_padding_mask=mask)

    expected = run_with_grads(reference, [t.double() for t in inputs], grad)
    assert_close(got, expected, TOLERANCE[dtype], feature_map)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_long_sequences_match_the_chunked_backend_on_cuda():
    """n = 4099 (64 chunks and a partial one), 12 heads x 64, m = 256, bf16: the fused softmax map's output and
    gradients as the chunked PyTorch backend's (whose float64 reference would not fit in memory)."""
    dtype = torch.bfloat16
    n, (b, h, m, d, _) = LONG, FAVOR_SIZES["cuda"]
    w = draw_random_features(m, d, seed=5, device="cuda")
    inputs = [randn(b, h, n, d, device="cuda", seed=s, dtype=dtype) for s in (6, 7, 8)]
    grad = randn(b, h, n, d, device="cuda", seed=9, dtype=torch.float64)
    got, expected = (
        run_with_grads(lambda *x, backend=backend: favor_attention(*x, w, causal=True, backend=backend), inputs, grad)
        for backend in ("triton", "chunked")
    )
    assert_close(got, expected, TOLERANCE[dtype], "n=4099")


@pytest.mark.parametrize("device", DEVICES)
def test_initial_state_continues_a_prefill(device):
    """With the state of a first call, a second call gives the full sequence's outputs; the final state is the
    whole sequence's, and gradients reach the initial state as through the chunked backend."""
    b, h, m, d, chunk = SIZES[device]
    n, cut = (37, 5) if device == "cpu" else (1000, 611)  # the continued call crosses segments too
    pq, pk = (torch.rand(b, h, n, m, generator=torch.Generator().manual_seed(s)).to(device) for s in (1, 2))
    v = randn(b, h, n, d, device=device, seed=3, dtype=torch.float32)
    kw = dict(causal=True, chunk_size=chunk, return_state=True, backend="triton")
    full, (s_full, z_full) = linear_attention(pq, pk, v, **kw)
    _, state = linear_attention(pq[:, :, :cut], pk[:, :, :cut], v[:, :, :cut], **kw)
    rest, (s_end, z_end) = linear_attention(pq[:, :, cut:], pk[:, :, cut:], v[:, :, cut:], initial_state=state, **kw)
    torch.testing.assert_close(rest, full[:, :, cut:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_end, s_full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z_end, z_full, rtol=1e-4, atol=1e-4)

    grad = randn(b, h, n - cut, d, device=device, seed=4, dtype=torch.float64)
    inputs = [pq[:, :, cut:], pk[:, :, cut:], v[:, :, cut:], *state]
    got, expected = (
        run_with_grads(
            lambda q, k, x, s, z, backend=backend: linear_attention(
                q, k, x, causal=True, initial_state=(s, z), backend=backend
            ),
            inputs,
            grad,
        )
        for backend in ("triton", "chunked")
    )
    assert_close(got, expected, TOLERANCE[torch.float32], "continued")


@contextlib.contextmanager
def kernel_form(name):
    """The causal kernels' form ``name`` ("chunks" or "walk") inside the block, then the default again."""
    previous = _triton_causal.TUNING["form"]
    _triton_causal.TUNING["form"] = name
    try:
        yield
    finally:
        _triton_causal.TUNING["form"] = previous


@pytest.mark.parametrize(
    "cuda, d, m, ops, form, chunks",
    [
        (True, 64, 256, 1, None, True),  # bf16 on CUDA at the checked widths: the chunk form by default
        (True, 64, 128, 1, None, True),
        (True, 16, 32, 1, None, False),  # a width its compiled kernels got wrong: the walk
        (True, 64, 96, 1, None, False),  # features in tiles of 32
        (True, 64, 256, 0, None, False),  # float32 operands: not checked on a GPU
        (False, 64, 256, 2, None, False),  # the interpreter: the walk unless asked
        (False, 16, 32, 2, "chunks", True),  # asked for: every width interpreted
        (True, 16, 32, 1, "chunks", False),  # asked for on CUDA: the checked widths only
        (True, 64, 256, 1, "walk", False),
    ],
)
def test_the_chunk_form_is_taken_where_it_was_checked_on_a_gpu(cuda, d, m, ops, form, chunks):
    launch = SimpleNamespace(cuda=cuda, d=d, m=m, constants={"XD": d, "OPS": ops})
    with kernel_form(form):
        assert _triton_causal._chunk_form(launch) is chunks


@pytest.mark.parametrize("feature_map", ["softmax", "features"])
@pytest.mark.parametrize("device", DEVICES)
def test_both_forms_give_the_same_outputs_state_and_gradients(device, feature_map):
    """The chunk-parallel form (states stored per chunk) and the walk form (the default) agree: output, final state and
    the gradients of q, k, v and the initial state, with padding, at lengths that cross segments."""
    b, h, m, d, chunk = FAVOR_SIZES[device]
    n = 37 if device == "cpu" else 1000
    q, k, v = (randn(b, h, n, d, device=device, seed=s) for s in (1, 2, 3))
    w = draw_random_features(m, d, seed=4, device=device)
    if feature_map == "features":
        q, k, w = random_feature_map(q, w, is_query=True), random_feature_map(k, w, is_query=False), None
    keep = padding_mask(b, n, device).float()
    scale = d**-0.5 if w is not None else 1.0
    # the initial state: a prefix's, on the scale of what the chunks add (keys' features at offset 0 are small)
    _, s0, z0, _ = triton_causal_linear(q[:, :, :11], k[:, :, :11], v[:, :, :11], w, None, feature_map, scale, 1e-6, 16)
    grad = randn(b, h, n, d, device=device, seed=7, dtype=torch.float64)

    def call(q, k, v, s0, z0):
        out, s, z, _ = triton_causal_linear(q, k, v, w, keep, feature_map, scale, 1e-6, chunk or 64, s0, z0)
        call.state = (s, z)
        return out

    with kernel_form("chunks"):
        got = run_with_grads(call, [q, k, v, s0, z0], grad)
        got_state = call.state
    with kernel_form("walk"):
        expected = run_with_grads(call, [q, k, v, s0, z0], grad)
    assert_close(got, expected, 1e-4, f"{feature_map}: chunks vs walk", ("out", "dq", "dk", "dv", "dS0", "dz0"))
    for a, e in zip(got_state, call.state):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6 * float(e.abs().max()))


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_maps_final_state_is_the_chunked_backends_so_decoding_continues_it(device, feature_map):
    """The state a fused-map prefill returns is at the chunked backend's scale (softmax keys at offset 0, their
    features exp(-|w - k'|²/2) <= 1), so favor_step continues it: the next token's output equals a full call's."""
    b, h, m, d, chunk = FAVOR_SIZES[device]
    n = 37 if device == "cpu" else 1000  # several segments
    q, k, v = (randn(b, h, n + 1, d, device=device, seed=s) for s in (1, 2, 3))
    w = draw_random_features(m, d, seed=4, device=device)
    kw = dict(causal=True, feature_map=feature_map, chunk_size=chunk, return_state=True)
    _, (s_fused, z_fused, m_fused) = favor_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], w, backend="triton", **kw)
    _, (s_chunked, z_chunked, _) = favor_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], w, backend="chunked", **kw)
    for got, want in ((s_fused, s_chunked), (z_fused, z_chunked)):  # softmax states are ~1e-8: a relative atol
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    step, _ = favor_step(
        q[:, :, n:], k[:, :, n:], v[:, :, n:], w, (s_fused, z_fused, m_fused), feature_map=feature_map
    )  # fmt: skip
    full = favor_attention(q, k, v, w, causal=True, feature_map=feature_map, backend="chunked")
    torch.testing.assert_close(step, full[:, :, n:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_keys_of_large_norm_are_redone_with_offsets(device):
    """Keys whose every feature underflows at offset 0 (|k'| ~ 20) are counted as lost by the kernel, and
    favor_attention's redo with per-position offsets still gives the reference's output."""
    b, h, m, d, chunk = FAVOR_SIZES[device]
    n = LENGTHS[device][-1]
    w = draw_random_features(m, d, seed=5, device=device)
    q, v = (randn(b, h, n, d, device=device, seed=s, dtype=torch.float32) for s in (6, 8))
    k = randn(b, h, n, d, device=device, seed=7, dtype=torch.float32, scale=15.0)
    *_, lost = triton_causal_linear(q, k, v, w, None, "softmax", d**-0.5, 0.0, chunk or 64, None, None)
    assert lost.item() > 0  # at offset 0 every feature of these keys underflows
    out = favor_attention(q, k, v, w, causal=True, chunk_size=chunk, backend="triton")
    if device == "cpu":
        expected = favor_reference(q.double(), k.double(), v.double(), w, causal=True)
    else:
        expected = favor_attention(q, k, v, w, causal=True, backend="chunked").double()
    assert (out.double() - expected).abs().max().item() < 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_positions_before_the_first_real_key_are_not_lost(device):
    """Left padding: the positions before a sequence's first real key have D = 0 and are not counted as lost, so
    favor_attention does not redo the call; keys of large norm after them are."""
    b, h, m, d, chunk = FAVOR_SIZES[device]
    n = LENGTHS[device][-1]
    w = draw_random_features(m, d, seed=5, device=device)
    q, k, v = (randn(b, h, n, d, device=device, seed=s, dtype=torch.float32) for s in (6, 7, 8))
    keep = torch.ones(b, n, device=device)
    keep[:, : n // 3] = 0.0
    *_, lost = triton_causal_linear(q, k, v, w, keep, "softmax", d**-0.5, 0.0, chunk or 64, None, None)
    assert lost.item() == 0
    *_, lost = triton_causal_linear(q, k * 15.0, v, w, keep, "softmax", d**-0.5, 0.0, chunk or 64, None, None)
    assert lost.item() == b * h * (n - n // 3)  # every position from the first real key on


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", [None, "chunks"])
def test_compiles_without_graph_break(device, form):
    """The kernels are custom ops: torch.compile(fullgraph=True) takes the whole call, the large-key check
    included, and gives the eager output and gradients; in the chunk form too, whose per-chunk states go from the
    forward op to the backward op (their shapes and dtype from the fake implementation)."""
    if form is not None and device == "cuda":
        pytest.skip("on CUDA the default is the chunk form at these widths")
    b, h, m, d, chunk = FAVOR_SIZES[device]
    w = draw_random_features(m, d, seed=5, device=device)
    inputs = [randn(b, h, 37, d, device=device, seed=s, dtype=torch.float32) for s in (6, 7, 8)]
    grad = randn(b, h, 37, d, device=device, seed=9, dtype=torch.float64)

    def fn(q, k, v):
        return favor_attention(q, k, v, w, causal=True, chunk_size=chunk, backend="triton")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    with kernel_form(form):
        assert_close(
            run_with_grads(compiled, inputs, grad), run_with_grads(fn, inputs, grad), 1e-5, "compiled"
        )  # atomics: any order


@ON_CPU
@pytest.mark.parametrize("form", ["walk", "chunks"])
@pytest.mark.parametrize("feature_map", ["softmax", "features"])
def test_the_custom_ops_fake_shapes_and_dtypes_are_the_kernels(form, feature_map):
    """torch.library.opcheck: the forward op's schema, its fake implementation (shapes and dtypes of every output,
    the chunk form's kept states included) and its autograd registration agree with what the kernels return."""
    q, k, v = (randn(1, 2, 37, 16, seed=s, dtype=torch.float32).requires_grad_() for s in (1, 2, 3))
    w = draw_random_features(32, 16, seed=4)
    if feature_map == "features":
        q, k, w = random_feature_map(q, w, is_query=True), random_feature_map(k, w, is_query=False), None
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    args = (q, k, v, w, None, None, None, feature_map, 0.25 if w is not None else 1.0, 1e-6, 16)
    with kernel_form(form):
        checks = ("test_schema", "test_faketensor", "test_autograd_registration")
        assert set(torch.library.opcheck(_triton_causal._forward_op, args, test_utils=checks).values()) == {"SUCCESS"}


def test_refusals(monkeypatch):
    """backend="triton" says why it cannot run a call; backend=None then takes another backend."""
    v = torch.zeros(1, 1, 8, 32)
    w = torch.randn(32, 32)

    def refused(match, *args, **kwargs):
        with pytest.raises(ValueError, match=match):
            favor_attention(*args, **{"causal": True, "backend": "triton", **kwargs})

    refused("float64", v.double(), v.double(), v.double(), w)
    refused("num_features must be a multiple of 16", v, v, v, torch.randn(24, 32))
    refused("chunk_size must be a power of two", v, v, v, w, chunk_size=24)
    with pytest.raises(ValueError, match="v's head_dim must be a multiple of 16"):
        linear_attention(v[..., :16], v[..., :16], v[..., :24], causal=True, backend="triton")
    previous = set_triton_kernels(False)
    try:
        refused("set_triton_kernels", v, v, v, w)
    finally:
        set_triton_kernels(previous)
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        refused("runs on CUDA tensors", v, v, v, w)
        assert choose_backend(None, v, 32, None, causal=True, inputs=(v, v)) in ("native", "chunked")
    with pytest.raises(TypeError, match="bool"):
        set_triton_kernels(1)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_is_the_causal_default_on_cuda():
    """backend=None on CUDA tensors of tile-sized shapes runs the Triton kernels; other shapes the chunked backend.
    Bidirectional calls take the kernels for a map to fuse, and the chunked backend for given features."""
    v = torch.zeros(1, 1, 8, 64, device="cuda")
    assert choose_backend(None, v, 256, None, causal=True, inputs=(v, v)) == "triton"
    assert choose_backend(None, v[..., :40], 256, None, causal=True, inputs=(v, v)) == "chunked"
    assert choose_backend(None, v, 256, None, causal=False, inputs=(v, v)) == "triton"
    assert choose_backend(None, v, 256, None, causal=False, fused=False, inputs=(v, v)) == "chunked"


def _triton_by_default(original, calls):
    """choose_backend with backend=None turned to "triton" (as on CUDA for causal calls and the bidirectional
    FAVOR+ map; bidirectional given features take it there only when named), except for a continued prefill, which
    the fused FAVOR+ path does not take; each choice is appended to ``calls``."""

    def choose(backend, v, num_features, chunk_size, *, causal, **kwargs):
        chosen = original(backend, v, num_features, chunk_size, causal=causal, **kwargs)
        calls.append("triton" if backend is None and not kwargs.get("state_in") else chosen)
        return calls[-1]

    return choose


@ON_CPU
@pytest.mark.parametrize("decoder", [True, False], ids=["causal-lm", "mlm"])
@pytest.mark.parametrize("feature_map", ["softmax", "relu", "hedgehog"])
def test_a_model_trains_through_the_kernels_with_activation_checkpointing(feature_map, decoder, monkeypatch):
    """A Performer whose attention runs the Triton kernels (here interpreted), with gradient checkpointing on, gives
    the loss and gradients of the same model on the PyTorch backends: the kernels' custom ops recompute under
    torch.utils.checkpoint like any op (their backward reads its saved tensors once, as non-reentrant checkpointing
    requires)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    import linearformers.ops.favor as favor
    import linearformers.ops.linear as linear
    from tests.conftest import tiny_config

    cfg = tiny_config(
        "performer", feature_map=feature_map, is_decoder=decoder, hidden_size=64, num_attention_heads=4, num_features=32
    )
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if decoder else AutoModelForMaskedLM).from_config(cfg).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, 99, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want_loss, want_grads = loss_and_grads()
    calls = []
    for module in (favor, linear):
        monkeypatch.setattr(module, "choose_backend", _triton_by_default(module.choose_backend, calls))
    got_loss, got_grads = loss_and_grads()
    assert "triton" in calls
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()) + 1e-9)


_DDP_RANK_LIMIT_S = 150  # one rank takes about 5 s on 2 cores


def _ddp_worker(rank, world, port, folder, feature_map):
    """One rank: a Performer LM whose attention runs the Triton kernels, under DistributedDataParallel (gloo), on
    its shard of the batch; saves its parameters' gradients after the all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import linearformers.ops.favor as favor
    import linearformers.ops.linear as linear
    from tests.conftest import tiny_config

    # a rank stuck anywhere writes every thread's stack to a file the test reports, and exits
    stacks = open(f"{folder}/rank{rank}.stacks", "w")  # open until the process ends
    faulthandler.dump_traceback_later(_DDP_RANK_LIMIT_S, exit=True, file=stacks)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        calls = []
        for module in (favor, linear):
            module.choose_backend = _triton_by_default(module.choose_backend, calls)
        model = _ddp_model(tiny_config, AutoModelForCausalLM, feature_map)
        ids = _ddp_batch()[2 * rank : 2 * rank + 2]
        ddp = DistributedDataParallel(model)  # kept: its reducer all-reduces during backward
        ddp(ids, labels=ids).loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "triton": "triton" in calls}, f"{folder}/rank{rank}.part")
        os.replace(f"{folder}/rank{rank}.part", f"{folder}/rank{rank}.pt")  # whole, or not there
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ddp_model(tiny_config, cls, feature_map):
    cfg = tiny_config(
        "performer", feature_map=feature_map, is_decoder=True, hidden_size=64, num_attention_heads=4, num_features=32,
        feature_redraw_interval=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return cls.from_config(cfg).train()


def _ddp_batch():
    return torch.randint(3, 99, (4, 21), generator=torch.Generator().manual_seed(1))


@ON_CPU
@pytest.mark.parametrize("feature_map", ["softmax", "hedgehog"])
def test_ddp_through_the_kernels_gives_the_gradient_of_the_whole_batch(feature_map, tmp_path):
    """Two gloo ranks, each running its half of the batch through the Triton kernels (here interpreted) under
    DistributedDataParallel: after the all-reduce every rank holds the mean of the two halves' gradients, as one
    process computes them on the PyTorch backends."""
    import socket

    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.spawn(_ddp_worker, args=(2, port, str(tmp_path), feature_map), nprocs=2, join=False)
    results = [tmp_path / f"rank{rank}.pt" for rank in range(2)]
    # What is checked is the gradients each rank saved. A rank that saved them and then sticks on its way out is
    # stopped, not waited on; a rank that fails says how; one stuck before saving leaves its threads' stacks.
    deadline, error = time.monotonic() + _DDP_RANK_LIMIT_S + 30, None
    try:
        while not all(path.exists() for path in results) and time.monotonic() < deadline:
            if ranks.join(timeout=1):
                break
        saved = time.monotonic()
        while not ranks.join(timeout=1) and time.monotonic() < saved + 30:
            pass
    except Exception as raised:  # a rank exited with an error (join raises it)
        error = raised
    for rank, process in enumerate(ranks.processes):
        if process.is_alive():
            process.kill()
            if results[rank].exists():
                warnings.warn(
                    f"DDP rank {rank} did not exit within 30 s of saving its gradients; stopped", stacklevel=1
                )
    if error is not None or not all(path.exists() for path in results):
        stacks = "\n".join(path.read_text() for path in sorted(tmp_path.glob("rank*.stacks")))
        pytest.fail(f"the DDP ranks did not both save their gradients ({error or 'timed out'}); stacks:\n{stacks}")
    model = _ddp_model(tiny_config, AutoModelForCausalLM, feature_map)
    ids = _ddp_batch()
    loss = (model(ids[:2], labels=ids[:2]).loss + model(ids[2:], labels=ids[2:]).loss) / 2
    loss.backward()
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["triton"]
        assert got["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()) + 1e-9)
