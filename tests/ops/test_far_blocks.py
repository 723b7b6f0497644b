"""Far-block selection in the bidirectional hybrid (ops/far_blocks.py through hybrid_attention's select_blocks):
against reference.hybrid_reference, with padding, sinks, lengths that do not fill their blocks, more blocks asked
than there are, gradients, the inference paths of the CPU core, and bad inputs."""

import pytest
import torch

from linearformers.ops import hybrid as hybrid_module
from linearformers.ops._native import available as native_available
from linearformers.ops.far_blocks import _block_means, choose_far_blocks, far_gap
from linearformers.ops.hybrid import hybrid_attention
from linearformers.ops.reference import hybrid_reference, softmax_reference

B, H, D, M = 2, 3, 8, 6


def _inputs(n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(3))
    phi_q, phi_k = (torch.rand(B, H, n, M, generator=g, dtype=dtype) for _ in range(2))
    gamma = torch.tensor([0.3, 1.0, 2.5], dtype=dtype)
    ell = torch.randn(B, H, n, generator=g, dtype=dtype)
    return q, k, v, phi_q, phi_k, gamma, ell


def _mask(n):
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, -5:] = False
    mask[1, -1:] = False
    return mask


def _real(out, mask):
    return out if mask is None else out[mask[:, None, :, None].expand_as(out)]


@pytest.mark.parametrize("passes", ["one-pass", "passes-of-1-block", "passes-recomputed"])
@pytest.mark.parametrize(
    ("n", "window", "sinks", "blocks", "size", "padded"),
    [
        (40, 4, 0, 2, 4, False),
        (43, 4, 1, 3, 4, True),  # 43 does not fill its blocks of 4
        (37, 6, 2, 1, 5, True),
        (30, 3, 1, 50, 3, False),  # more blocks asked than there are: every far block
        (29, 8, 1, 2, 7, True),
    ],
)
def test_selection_equals_the_reference_with_its_gradients(n, window, sinks, blocks, size, padded, passes, monkeypatch):
    if passes != "one-pass":
        monkeypatch.setattr(hybrid_module, "_blocks_per_pass", lambda *args: min(1, args[4]))
    if passes == "passes-recomputed":  # each pass checkpointed under autograd, as long inputs get
        monkeypatch.setattr(hybrid_module, "_RECOMPUTE_BYTES", 0)
    x = [t.clone().requires_grad_() for t in _inputs(n)]
    mask = _mask(n) if padded else None
    kw = dict(causal=False, key_padding_mask=mask, sinks=sinks, select_blocks=blocks, select_block_size=size)
    q, k, v, phi_q, phi_k, gamma, ell = x
    out = hybrid_attention(q, k, v, phi_q, phi_k, gamma, window, query_log_scale=ell, **kw)
    ref = hybrid_reference(q, k, v, phi_q, phi_k, gamma, window, query_log_scale=ell, **kw)
    torch.testing.assert_close(_real(out, mask), _real(ref, mask))
    plain = hybrid_reference(q, k, v, phi_q, phi_k, gamma, window, query_log_scale=ell, causal=False,
                             key_padding_mask=mask, sinks=sinks)  # fmt: skip
    assert (_real(ref - plain, mask).abs().max() > 1e-3).item(), "the choice changed nothing: a test that can't fail"
    g = torch.randn_like(out)
    if mask is not None:
        g = g * mask[:, None, :, None]
    grads = torch.autograd.grad(out, x, g)
    ref_grads = torch.autograd.grad(ref, x, g)
    for name, a, b in zip(("q", "k", "v", "phi_q", "phi_k", "gamma", "ell"), grads, ref_grads):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inference_paths_of_the_cpu_core_equal_the_reference(dtype):
    """Under no_grad the core takes its in-place pass (float64) or ATen's fused window softmax (float32, with ℓ);
    both give the normalizer the chosen keys are added to."""
    n, window = 70, 8
    x = _inputs(n, dtype)
    mask = _mask(n)
    kw = dict(causal=False, key_padding_mask=mask, sinks=1, select_blocks=3, select_block_size=8)
    with torch.no_grad():
        out = hybrid_attention(*x[:6], window, query_log_scale=x[6], **kw)
    ref = hybrid_reference(*(t.double() for t in x[:6]), window, query_log_scale=x[6].double(), **kw)
    tol = {} if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(_real(out, mask).double(), _real(ref, mask), **tol)


@pytest.mark.skipif(not native_available(), reason="the native CPU kernels do not build here")
def test_the_native_walk_gives_the_normalizer_the_chosen_keys_are_added_to():
    """backend "native": the compiled walk returns each query's log normalizer beside its output (head_dim and
    features multiples of 16, float32, inference)."""
    g = torch.Generator().manual_seed(5)
    n, window = 150, 16
    q, k, v = (torch.randn(B, H, n, 16, generator=g) for _ in range(3))
    phi_q, phi_k = (torch.rand(B, H, n, 16, generator=g) for _ in range(2))
    gamma, ell = torch.tensor([0.3, 1.0, 2.5]), torch.randn(B, H, n, generator=g)
    mask = _mask(n)
    kw = dict(causal=False, key_padding_mask=mask, sinks=1, select_blocks=3, select_block_size=16)
    with torch.no_grad():
        out = hybrid_attention(q, k, v, phi_q, phi_k, gamma, window, query_log_scale=ell, backend="native", **kw)
    ref = hybrid_reference(*(t.double() for t in (q, k, v, phi_q, phi_k, gamma)), window,
                           query_log_scale=ell.double(), **kw)  # fmt: skip
    torch.testing.assert_close(_real(out, mask).double(), _real(ref, mask), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not native_available(), reason="the native CPU kernels do not build here")
@pytest.mark.parametrize("blocks", [1, 3, 40])
def test_the_native_walk_scores_its_own_blocks_of_32(blocks):
    """Blocks of 32, the walk's own: the walk takes the choice and scores the chosen keys in its blocks, with
    Hedgehog's map made in the walk too (hedgehog_hybrid_attention)."""
    from linearformers.ops.feature_maps import HedgehogFeatureMap
    from linearformers.ops.hybrid import hedgehog_hybrid_attention

    g = torch.Generator().manual_seed(6)
    n, window, d, m = 300, 20, 16, 32
    q, k, v = (torch.randn(B, H, n, d, generator=g) for _ in range(3))
    mask = _mask(n)
    gamma = torch.tensor([0.3, 1.0, 2.5])
    fm = HedgehogFeatureMap(H, d, m, separate=True)
    with torch.no_grad():
        for p in fm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        qs, ks = (
            (torch.randn(H, d, generator=g) * 0.2, torch.randn(H, generator=g)),
            (torch.randn(H, d, generator=g) * 0.2, torch.randn(H, generator=g)),
        )
        r = 5.0 * torch.tanh(((k * ks[0][None, :, None]).sum(-1) + ks[1][None, :, None]) / 5.0)
        phi_q, phi_k = fm(q, is_query=True), fm(k, is_query=False) * torch.exp(r)[..., None]
        ell = (q * qs[0][None, :, None]).sum(-1) + qs[1][None, :, None]
        kw = dict(causal=False, key_padding_mask=mask, sinks=1, select_blocks=blocks, select_block_size=32)
        walk = hybrid_attention(q, k, v, phi_q, phi_k, gamma, window, query_log_scale=ell, backend="native", **kw)
        fused = hedgehog_hybrid_attention(
            q, k, v, (fm.weight, fm.bias, fm.key_weight, fm.key_bias), gamma, window, key_padding_mask=mask,
            query_scale=qs, key_scale=ks, key_scale_bound=5.0, sinks=1, select_blocks=blocks,
        )  # fmt: skip
    args = (*(t.double() for t in (q, k, v, phi_q, phi_k, gamma)), window)
    ref = hybrid_reference(*args, query_log_scale=ell.double(), **kw)
    plain = hybrid_reference(*args, query_log_scale=ell.double(), **(kw | dict(select_blocks=0)))
    for out in (walk, fused):
        torch.testing.assert_close(_real(out, mask).double(), _real(ref, mask), atol=2e-5, rtol=2e-5)
    assert _real(ref - plain, mask).abs().max() > 1e-3


def test_every_far_key_chosen_gives_exact_softmax():
    """Blocks of one key, as many as there are and gamma = 1: every key outside the window is chosen, so each query
    takes exact softmax over all the real keys whatever the features."""
    n, window = 20, 3
    q, k, v, phi_q, phi_k, _, ell = _inputs(n)
    mask = _mask(n)
    out = hybrid_attention(
        q, k, v, phi_q, phi_k, torch.ones(H, dtype=q.dtype), window, causal=False, key_padding_mask=mask,
        query_log_scale=ell, select_blocks=n, select_block_size=1,
    )  # fmt: skip
    ref = softmax_reference(q, k, v, causal=False, key_padding_mask=mask)
    torch.testing.assert_close(_real(out, mask), _real(ref, mask))


def test_padding_at_the_end_changes_no_real_output():
    n, window = 45, 4
    x = _inputs(n)
    kw = dict(causal=False, sinks=1, select_blocks=2, select_block_size=4)
    short = hybrid_attention(*x[:6], window, query_log_scale=x[6], **kw)
    g = torch.Generator().manual_seed(1)
    longer = [torch.cat([t, torch.randn(*t.shape[:2], 7, *t.shape[3:], generator=g, dtype=t.dtype).abs()], 2)
              for t in (*x[:5], x[6][..., None])]  # fmt: skip
    mask = torch.ones(B, n + 7, dtype=torch.bool)
    mask[:, n:] = False
    out = hybrid_attention(*longer[:5], x[5], window, query_log_scale=longer[5][..., 0], key_padding_mask=mask, **kw)
    torch.testing.assert_close(out[:, :, :n], short)


def test_choices_lie_beyond_every_window_and_hold_linear_keys():
    n, window, size = 64, 6, 4
    q, k = _inputs(n)[:2]
    valid = torch.ones(B, n, dtype=torch.bool)
    linear = valid.clone()
    linear[:, 8:12] = False  # a block with no linear key is never chosen
    index, real = choose_far_blocks(q, k, valid, linear, window, 3, size)
    query_block = torch.arange(n // size)[None, None, :, None]
    assert bool(((index - query_block).abs() >= far_gap(window, size))[real].all())
    assert not bool((index == 2)[real].any())
    assert far_gap(window, size) == 3  # |i - j| 4 - 3 >= 6 first at |i - j| = 3


def test_choices_from_the_models_strided_views_equal_those_from_contiguous_copies():
    # q and k as the model hands them: views (b, h, n, d) of one (b, n, 3 h d) projection; 45 leaves a block part
    # filled, and padding and a sink leave blocks part linear
    n, window, size = 45, 6, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, n, 3 * H * D, generator=g, dtype=torch.float64)
    q, k, _ = (t.view(B, n, H, D).transpose(1, 2) for t in x.split(H * D, -1))
    assert not q.is_contiguous()
    valid = _mask(n)
    linear = valid.clone()
    linear[:, 0] = False
    strided = choose_far_blocks(q, k, valid, linear, window, 3, size)
    packed = choose_far_blocks(q.contiguous(), k.contiguous(), valid, linear, window, 3, size)
    assert torch.equal(strided[1], packed[1])  # which choices are real: from the counts of linear keys alone
    # the chosen blocks' scores, not their indices: blocks whose scores tie within rounding may swap places
    q_mean, _ = _block_means(q.contiguous(), valid, size)
    k_mean, _ = _block_means(k.contiguous(), linear, size)
    scores = q_mean @ k_mean.transpose(-1, -2)
    torch.testing.assert_close(
        scores.gather(-1, strided[0])[strided[1]], scores.gather(-1, packed[0])[packed[1]], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(causal=True), ValueError, "bidirectional"),
        (dict(query_log_scale=None), ValueError, "query_log_scale"),
        (dict(backend="triton"), ValueError, "select_block_size must be a power of two from 16 to 128"),
        (dict(select_blocks=-1), ValueError, "select_blocks must be >= 0"),
        (dict(select_block_size=0), ValueError, "select_block_size must be >= 1"),
        (dict(select_blocks=2.0), TypeError, "select_blocks must be an int"),
        (dict(select_block_size=True), TypeError, "select_block_size must be an int"),
    ],
)
def test_bad_selection_arguments_are_refused(kwargs, error, match):
    q, k, v, phi_q, phi_k, gamma, ell = _inputs(16)
    call = dict(causal=False, query_log_scale=ell, select_blocks=2, select_block_size=4) | kwargs
    with pytest.raises(error, match=match):
        hybrid_attention(q, k, v, phi_q, phi_k, gamma, 4, **call)
