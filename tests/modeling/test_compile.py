"""torch.compile: no graph breaks in the model code outside the attention kernels; compiled = eager."""

import pytest
import torch
import torch._dynamo
from transformers import AutoModel, AutoModelForCausalLM

import linearformers.modeling.base as base
import linearformers.modeling.linformer as linformer
import linearformers.modeling.performer as performer
from tests.conftest import FAMILIES, tiny_config


def _model(family, decoder, **overrides):
    torch.manual_seed(0)
    if family == "performer":
        overrides.setdefault("feature_redraw_interval", 2)
    cfg = tiny_config(family, is_decoder=decoder, **overrides)
    return (AutoModelForCausalLM if decoder else AutoModel).from_config(cfg).train()


def _inputs():
    ids = torch.randint(1, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


def _plain(q, k, v, *args, **kwargs):
    """A traceable stand-in for a kernel (same output shape), so that only the model code around it is traced."""
    return q * k.mean(-2, keepdim=True) + v


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_model_code_outside_the_kernels_has_no_graph_breaks(family, decoder, monkeypatch):
    kernels = {
        performer: ("favor_attention",),
        linformer: ("linformer_attention", "causal_linformer_attention"),
        base: ("local_attention",),
    }
    for module, names in kernels.items():
        for name in names:
            monkeypatch.setattr(module, name, _plain)
    model = _model(family, decoder, num_local_heads=1, local_window=4)
    ids, mask = _inputs()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]


@pytest.mark.parametrize(("family", "decoder"), [("performer", False), ("linformer", True)])
def test_compiled_training_forwards_equal_eager_ones_and_redraw_on_the_same_schedule(family, decoder):
    eager = _model(family, decoder)
    compiled_model = _model(family, decoder)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    ids, mask = _inputs()
    torch._dynamo.reset()
    for _ in range(3):  # with interval 2, the third forward redraws the Performer features
        want = eager(input_ids=ids, attention_mask=mask)
        got = compiled(input_ids=ids, attention_mask=mask)
        name = "logits" if decoder else "last_hidden_state"
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-5)
    base = compiled_model.model if decoder else compiled_model
    if family == "performer":
        assert int(base.feature_redraws) == 3
    else:  # nothing to redraw, nothing counted
        assert "feature_redraws" not in base.state_dict()
    for mine, theirs in zip(compiled_model.buffers(), eager.buffers()):
        assert torch.equal(mine, theirs)


def test_redraw_counter_does_not_recompile_the_graph(monkeypatch):
    monkeypatch.setattr(performer, "favor_attention", _plain)  # the kernel's own first-call recompiles are not ours
    model = _model("performer", False)
    counts = {"frames": 0}

    def backend(gm, example_inputs):
        counts["frames"] += 1
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    ids, mask = _inputs()
    compiled(input_ids=ids, attention_mask=mask)
    first = counts["frames"]
    for _ in range(4):
        compiled(input_ids=ids, attention_mask=mask)
    assert counts["frames"] == first
    assert int(model.feature_redraws) == 5


LOCAL = dict(num_local_heads=1, local_window=4)
DROPOUT = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)  # the configs' defaults
WHOLE_MODELS = {  # every configuration README.md says compiles whole: id -> (family, decoder, overrides)
    "performer-encoder-local": ("performer", False, LOCAL),
    "performer-causal-local": ("performer", True, LOCAL),
    "performer-encoder-relu": ("performer", False, dict(feature_map="relu")),
    "linformer-encoder-local": ("linformer", False, LOCAL),
    "linformer-causal-local": ("linformer", True, LOCAL),
    "linformer-encoder-pool": ("linformer", False, dict(projection="pool")),
    "linformer-encoder-conv": ("linformer", False, dict(projection="conv")),
    "performer-encoder-dropout": ("performer", False, DROPOUT),
    "performer-causal-dropout": ("performer", True, DROPOUT),
    "linformer-encoder-dropout": ("linformer", False, DROPOUT),
    "linformer-causal-dropout": ("linformer", True, DROPOUT),
}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", WHOLE_MODELS)
def test_whole_models_compile_without_graph_breaks_kernels_included(name, padded):
    """Under torch.compile the attention takes the chunked backend (no data-dependent branch: the large-key
    fallback of causal FAVOR+ is a torch.cond), the Linformer keeps its slot masks without asking whether they
    are all True, and its dropout draws from torch's generator on the device, so a whole model in training mode,
    kernels included, is one graph, with and without padding. One layer: every layer runs the same code."""
    family, decoder, overrides = WHOLE_MODELS[name]
    model = _model(family, decoder, num_hidden_layers=1, **overrides)
    ids, mask = _inputs()
    if not padded:
        mask = torch.ones_like(mask)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_encoder_with_dropout_trains_under_fullgraph_compile(family):
    """fullgraph=True raises on any graph break; forward and backward run, and dropout is on (two forwards of
    the same batch differ)."""
    model = _model(family, False, **DROPOUT)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids, mask = _inputs()
    torch._dynamo.reset()
    first = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    first.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    second = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(first, second)


def test_the_kernels_query_nothing_about_autocast_under_compile(monkeypatch):
    """Dynamo of some torch versions (2.11) cannot trace torch.amp.is_autocast_available: under compile the
    kernels' autocast guard must not call it (nor is_autocast_enabled), or fullgraph=True fails. Here both are
    replaced by functions that break the graph, and the compiled kernel still equals eager inside autocast."""
    from linearformers.ops import draw_random_features, favor_attention

    def untraceable(original):
        def query(*args, **kwargs):
            torch._dynamo.graph_break()
            return original(*args, **kwargs)

        return query

    w = draw_random_features(32, 16, seed=0)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    want = favor_attention(q, k, v, w, causal=True, backend="chunked")
    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable(torch.amp.is_autocast_available))
    monkeypatch.setattr(torch, "is_autocast_enabled", untraceable(torch.is_autocast_enabled))
    compiled = torch.compile(lambda *x: favor_attention(*x, causal=True), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(q, k, v, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key_scale", [1.0, 40.0], ids=["moderate-keys", "large-keys"])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_favor_attention_equals_eager_with_gradients(causal, key_scale):
    """fullgraph=True: one graph; keys of large norm take the offsets fallback inside it (torch.cond)."""
    from linearformers.ops import draw_random_features, favor_attention

    w = draw_random_features(32, 16, seed=0)

    def attend(q, k, v, mask):
        return favor_attention(q, k, v, w, causal=causal, key_padding_mask=mask)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    k = k * key_scale
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :5] = False
    torch._dynamo.reset()
    results = []
    for fn in (compiled, attend):
        inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
        out = fn(*inputs, mask)
        results.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
    # large keys: near one-hot attention, dq and dk ~0 up to float32's cancellation in dk = s (du W - k' Σ du),
    # ~1e-5 of the largest gradient in any backend (bidirectional: compiled takes "chunked", eager "blockwise")
    scale = max(float(t.abs().max()) for t in results[1]) * (10 if key_scale > 1 else 1)
    for got, want in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)


def test_inductor_compiles_causal_favor_on_head_split_views_with_gradients():
    """What a model's attention hands the op: q, k, v as (b, h, n, d) views of (b, n, h, d) projections, and an
    upstream gradient laid out the same way. Inductor compiles the large-key fallback's torch.cond and its backward
    (whose two branches must give gradients laid out alike) and matches eager."""
    from linearformers.ops import draw_random_features, favor_attention

    w = draw_random_features(32, 16, seed=0)

    def attend(q, k, v):
        return favor_attention(q, k, v, w, causal=True).transpose(1, 2).sum(-1)  # back to (b, n, h)

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 21, 4, 16, generator=g) for _ in range(3))  # (b, n, h, d)
    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(attend, fullgraph=True), attend):
        inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
        out = fn(*(t.transpose(1, 2) for t in inputs))
        results.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
