"""The bidirectional hybrid's Triton kernel (hybrid_attention(causal=False, backend="triton")) against reference.py's
(n x n) hybrid: window, sinks, the linear keys outside the window, chosen far blocks, one normalizer; forward only,
float32 and bf16 operands.

On a machine without CUDA the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), at
small sizes that cross blocks, frames wider than one block and partial last blocks; with CUDA (``pytest -m cuda``)
at 12 heads x 64, n = 1000.
"""

import pytest
import torch

pytest.importorskip("triton")

from linearformers.ops import hybrid_attention, set_triton_kernels
from linearformers.ops.hybrid import hybrid_backend
from linearformers.ops.reference import hybrid_reference
from tests.ops._triton_cases import CUDA, ON_CPU, TOLERANCE, assert_close, padding_mask, randn


def _inputs(b, h, n, d, m, *, seed, ell):
    """q, k, v, nonnegative features, gamma in [0.5, 1.5) and ℓ (or None), float64 on the CPU, from ``seed``."""
    q, k, v = (randn(b, h, n, d, seed=seed + i, dtype=torch.float64) for i in range(3))
    phi_q, phi_k = (randn(b, h, n, m, seed=seed + 3 + i, dtype=torch.float64).abs() for i in range(2))
    gamma = 0.5 + randn(h, seed=seed + 5, dtype=torch.float64).abs().clamp(max=1.0)
    return q, k, v, phi_q, phi_k, gamma, (randn(b, h, n, seed=seed + 6, dtype=torch.float64) if ell else None)


def _compare(n, window, sinks, ell, padded, blocks, block, dtype, device, sizes):
    b, h, d, m = sizes
    q, k, v, phi_q, phi_k, gamma, log_scale = _inputs(b, h, n, d, m, seed=7, ell=ell)
    mask = padding_mask(b, n) if padded else None
    options = dict(causal=False, sinks=sinks, select_blocks=blocks, select_block_size=block)
    # the kernel on the inputs rounded to ``dtype``, the reference in float64 on those same values
    rounded = [t.to(dtype) for t in (q, k, v, phi_q, phi_k)]
    ell_rounded = None if log_scale is None else log_scale.to(dtype)
    with torch.no_grad():
        got = hybrid_attention(
            *(t.to(device) for t in rounded), gamma.float().to(device), window, backend="triton",
            key_padding_mask=None if mask is None else mask.to(device),
            query_log_scale=None if ell_rounded is None else ell_rounded.to(device), **options,
        )  # fmt: skip
    expected = hybrid_reference(
        *(t.double() for t in rounded), gamma.float().double(), window, key_padding_mask=mask,
        query_log_scale=None if ell_rounded is None else ell_rounded.double(), **options,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == expected.shape
    what = f"n={n} w={window} S={sinks} K={blocks} B={block}"
    assert_close([got.double().cpu()], [expected], TOLERANCE[dtype], what)


CASES = [
    (37, 8, 1, False, True, 0, 32),  # one partial block of 64; a sink; padding left and right
    (37, 8, 2, True, True, 0, 32),  # ℓ: features on the softmax's scale
    (150, 12, 1, True, False, 0, 32),  # three blocks of 64, no padding
    (150, 5, 1, True, True, 2, 16),  # far blocks of 16: a window that is not a power of two
    (1, 8, 1, False, False, 0, 32),  # one position
    (200, 70, 3, True, True, 3, 32),  # a frame of five blocks of 32 (window > block); three far blocks
    (130, 64, 0, False, True, 0, 32),  # window of one block exactly, no sink, a last block of 2
]


@ON_CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize(("n", "window", "sinks", "ell", "padded", "blocks", "block"), CASES)
def test_the_bidirectional_hybrid_kernel_matches_the_reference(n, window, sinks, ell, padded, blocks, block, dtype):
    """The output of the (n x n) reference, far blocks included, in float32 and with bf16 operands."""
    _compare(n, window, sinks, ell, padded, blocks, block, dtype, "cpu", (2, 2, 32, 32))


@ON_CPU
def test_the_kernel_reads_queries_keys_and_features_of_other_widths():
    """head_dim 16, value dim 48 and 48 features: tiles padded to powers of two, masked on load."""
    b, h, n, window = 2, 2, 90, 10
    q, k, _, phi_q, phi_k, gamma, log_scale = _inputs(b, h, n, 16, 48, seed=3, ell=True)
    v = randn(b, h, n, 48, seed=9, dtype=torch.float64)
    mask = padding_mask(b, n)
    options = dict(causal=False, key_padding_mask=mask, sinks=1, select_blocks=1)
    with torch.no_grad():
        got = hybrid_attention(*(t.float() for t in (q, k, v, phi_q, phi_k, gamma)), window, backend="triton",
                               query_log_scale=log_scale.float(), **options)  # fmt: skip
    expected = hybrid_reference(q, k, v, phi_q, phi_k, gamma, window, query_log_scale=log_scale, **options)
    assert_close([got.double()], [expected], TOLERANCE[torch.float32], "widths 16 / 48 / 48")


def test_the_backend_a_bidirectional_call_takes_and_why_triton_refuses(monkeypatch):
    """A recorded call, more than 16 sinks or a far-block size that is no tile height are refused, saying why;
    hybrid_attention names the refusal; backend=None keeps CPU tensors off the kernel."""
    x = torch.zeros(1, 2, 8, 32)
    call = (x, x, x, x, x)

    def refused(match, *, sinks=0, tracked=False, blocks=0, block=32):
        with pytest.raises(ValueError, match=match):
            hybrid_backend("triton", *call, 8, sinks, False, False, tracked, None, blocks, block)

    refused("computes no gradients", tracked=True)
    refused("at most 16 sinks", sinks=17)
    refused("select_block_size must be a power of two from 16 to 128", blocks=2, block=24)
    refused("select_block_size must be a power of two from 16 to 128", blocks=2, block=256)
    leaves = [t.clone().requires_grad_() for t in call]
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: the bidirectional kernel"):
        hybrid_attention(*leaves, torch.ones(2), 4, causal=False, backend="triton")
    previous = set_triton_kernels(False)
    try:
        refused("set_triton_kernels")
    finally:
        set_triton_kernels(previous)
    if not CUDA:
        assert hybrid_backend(None, *call, 8, 0, False, False) in ("native", "chunked")
        monkeypatch.delenv("TRITON_INTERPRET")
        refused("runs on CUDA tensors")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize(("ell", "blocks"), [(False, 0), (True, 0), (True, 2)], ids=["paper", "scale", "far"])
def test_the_bidirectional_hybrid_kernel_matches_the_reference_on_cuda(ell, blocks, dtype):
    """n = 1000, 12 heads x 64, m = 128, window 64, one sink, padding: against the float64 reference."""
    _compare(1000, 64, 1, ell, True, blocks, 32, dtype, "cuda", (2, 12, 64, 128))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_kernel_is_the_bidirectional_default_on_cuda_where_nothing_is_recorded():
    """backend=None: the kernel for inference, the chunked core where autograd records the call; compiled whole."""
    x = torch.zeros(1, 2, 8, 64, device="cuda")
    assert hybrid_backend(None, x, x, x, x, x, 64, 1, False, False) == "triton"
    assert hybrid_backend(None, x, x, x, x, x, 64, 1, False, False, True) == "chunked"
    q, k, v, phi_q, phi_k, gamma, log_scale = (
        t.float().cuda() for t in _inputs(1, 12, 1000, 64, 128, seed=2, ell=True)
    )

    def fn(q, k, v, phi_q, phi_k, gamma, log_scale):
        return hybrid_attention(q, k, v, phi_q, phi_k, gamma, 64, causal=False, query_log_scale=log_scale, sinks=1,
                                select_blocks=2)  # fmt: skip

    with torch.no_grad():
        eager = fn(q, k, v, phi_q, phi_k, gamma, log_scale)
        compiled = torch.compile(fn, fullgraph=True)(q, k, v, phi_q, phi_k, gamma, log_scale)
    assert_close([compiled.double()], [eager.double()], 1e-4, "compiled")


@ON_CPU
@pytest.mark.parametrize("blocks", [0, 2], ids=["window", "far-blocks"])
def test_an_encoder_through_the_kernel_gives_the_chunked_cores_hidden_states(monkeypatch, blocks):
    """A Performer encoder with the hybrid (Hedgehog's map, window, a sink, the query and key scales), its attention
    sent to the kernel under the interpreter: the hidden states of the same model on the chunked core, padding
    included."""
    from transformers import AutoModel

    from linearformers.ops import hybrid as hybrid_module
    from linearformers.ops import set_native_walk
    from tests.conftest import tiny_config

    config = tiny_config(
        "performer", hidden_size=64, num_attention_heads=4, num_features=32, feature_map="hedgehog",
        hybrid_window=8, hybrid_sinks=1, hybrid_query_scale=True, hybrid_key_scale=True, max_position_embeddings=128,
        hybrid_select_blocks=blocks, hybrid_select_block_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    ids = torch.randint(3, 99, (2, 100), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -23:] = 0
    taken = []
    chooser = hybrid_module.hybrid_backend

    def to_the_kernel(*args, **kwargs):
        taken.append(chooser(*args, **kwargs))
        return "triton"

    previous = set_native_walk(False)  # the model's fused CPU path off: its attention goes through hybrid_attention
    try:
        with torch.no_grad():
            chunked = model(ids, attention_mask=mask).last_hidden_state
            monkeypatch.setattr(hybrid_module, "hybrid_backend", to_the_kernel)
            kernel = model(ids, attention_mask=mask).last_hidden_state
    finally:
        set_native_walk(previous)
    assert taken == ["chunked"] * config.num_hidden_layers  # what the CPU would have taken: the kernel ran instead
    real = mask.bool()
    torch.testing.assert_close(kernel[real], chunked[real], rtol=1e-4, atol=1e-5)


@ON_CPU
def test_the_kernels_custom_op_keeps_its_schema_and_its_fake():
    """torch.library.opcheck: the op mutates nothing it does not declare, and its fake gives the real output's
    metadata (what torch.compile traces it by)."""
    from linearformers.ops._triton_hybrid_bidirectional import _forward_op

    b, h, n = 1, 2, 20
    q, k, v, phi_q, phi_k, _, log_scale = (
        t.float() for t in _inputs(b, h, n, 16, 16, seed=4, ell=True) if t is not None
    )
    no_sink = torch.full((b, 16), -1, dtype=torch.int32)
    none_chosen = torch.full((1,), -1, dtype=torch.int32)
    args = (q, k, v, phi_q, phi_k, torch.ones(h), log_scale, torch.ones(b, n), torch.ones(b, n), no_sink, none_chosen,
            4, 0.25, 16)  # fmt: skip
    results = torch.library.opcheck(_forward_op, args, test_utils=("test_schema", "test_faketensor"))
    assert results == {"test_schema": "SUCCESS", "test_faketensor": "SUCCESS"}
