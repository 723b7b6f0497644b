"""LinformerConfig(hybrid_window=w): an exact sliding window (and sinks) beside Linformer's slots, in one softmax."""

import pytest
import torch
import torch._dynamo
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoModel, AutoModelForSequenceClassification

from linearformers import LinformerConfig
from linearformers.conversion.convert import convert_bert
from linearformers.conversion.transfer import attention_transfer
from linearformers.ops import linformer_attention, linformer_hybrid_attention
from linearformers.ops import linformer_hybrid as linformer_hybrid_module
from linearformers.ops.reference import linformer_hybrid_reference, softmax_reference
from tests.conftest import tiny_config
from tests.conversion.test_transfer import _convert_with_a_short_transfer, blocks, quick, tiny_bert

WINDOW = 3


def _model(**overrides):
    overrides.setdefault("hybrid_window", WINDOW)
    torch.manual_seed(0)
    return AutoModel.from_config(tiny_config("linformer", **overrides)).eval()


def _move_balance(model):
    """Balances away from zero and different per head: a reload that re-initialized them would show."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.layers:
            balance = layer.attention.window_balance
            balance.copy_(torch.randn(balance.shape, generator=g))


def _qkv(b=2, h=3, n=13, d=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


def _projections(method, h, n_max, k, d, dtype=torch.float64, per_head=False):
    g = torch.Generator().manual_seed(1)
    if method == "learned":
        shape = (h, k, n_max) if per_head else (k, n_max)
        return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype), None
    if method == "conv":
        window = n_max // k
        return (
            torch.randn(d, d, window, generator=g, dtype=dtype),
            torch.randn(d, d, window, generator=g, dtype=dtype),
            window,
        )
    return None, None, n_max // k


@pytest.mark.parametrize("sinks", [0, 1, 2])
@pytest.mark.parametrize("window", [1, WINDOW, 7, 40])
@pytest.mark.parametrize(
    ("method", "per_head"), [("learned", False), ("learned", True), ("pool", False), ("conv", False)],
    ids=["learned", "learned-per-head", "pool", "conv"],
)  # fmt: skip
def test_the_op_equals_the_dense_reference(method, per_head, window, sinks):
    q, k, v = _qkv()
    e, f, pool = _projections(method, 3, 16, 4, 4, per_head=per_head)
    gamma = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False  # row 1 left-padded: its sinks and its slots start at position 4
    kwargs = dict(method=method, window=pool, key_padding_mask=mask, sinks=sinks)
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
        ({"method": "mean"}, ValueError, "unknown Linformer projection method 'mean'"),
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


def test_layers_own_a_window_balance_at_zero_only_with_a_hybrid_window():
    model = _model(num_local_heads=1, local_window=4, hybrid_sinks=1)
    for layer in model.layers:
        balance = layer.attention.window_balance
        assert isinstance(balance, torch.nn.Parameter) and balance.shape == (3,) and not balance.any()
    assert "hybrid_window=3" in repr(model.layers[0].attention)
    plain = _model(hybrid_window=None)
    assert all(layer.attention.window_balance is None for layer in plain.layers)
    assert not [key for key in plain.state_dict() if "window_balance" in key]  # checkpoints without it unchanged


def test_global_heads_equal_the_reference():
    model = _model(hybrid_sinks=2, sharing="per_head")
    _move_balance(model)
    attention = model.layers[0].attention
    q, k, v = (t.float() for t in _qkv(b=2, h=4, n=9, d=8))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :2] = False
    e, f = attention.projections()
    with torch.no_grad():
        got = attention.global_attention(q, k, v, mask, None, None)
        want = linformer_hybrid_reference(
            *(t.double() for t in (q, k, v, e, f, attention.window_balance.exp())), WINDOW, key_padding_mask=mask,
            sinks=2,
        )  # fmt: skip
    real = mask[:, None].expand(-1, 4, -1)
    torch.testing.assert_close(got.double()[real], want[real], rtol=1e-5, atol=1e-6)  # float32 against float64


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("sinks", [0, 1])
def test_padding_does_not_change_the_real_tokens_outputs(side, sinks):
    model = _model(hybrid_sinks=sinks, initializer_range=0.2)
    _move_balance(model)
    n, pad = 8, 4
    ids = torch.randint(1, 99, (1, n), generator=torch.Generator().manual_seed(2))
    junk = torch.randint(1, 99, (1, pad), generator=torch.Generator().manual_seed(3))
    real, fake = torch.ones(1, n, dtype=torch.long), torch.zeros(1, pad, dtype=torch.long)
    padded = torch.cat([junk, ids] if side == "left" else [ids, junk], 1)
    mask = torch.cat([fake, real] if side == "left" else [real, fake], 1)
    with torch.no_grad():
        alone = model(ids).last_hidden_state
        both = model(padded, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(both[:, pad:] if side == "left" else both[:, :n], alone, rtol=1e-4, atol=1e-5)


def test_save_and_reload_keep_the_balance_and_the_outputs(tmp_path):
    model = _model(hybrid_sinks=1)
    _move_balance(model)
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(4))
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert reloaded.config.hybrid_window == WINDOW and reloaded.config.hybrid_sinks == 1
    for mine, theirs in zip(model.layers, reloaded.layers):
        assert torch.equal(mine.attention.window_balance, theirs.attention.window_balance)
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, reloaded(ids).last_hidden_state)


def test_gradients_reach_the_balance_and_the_projections():
    model = _model(hybrid_sinks=1, initializer_range=0.2).train()
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(5))
    model(ids).last_hidden_state.pow(2).mean().backward()
    for layer in model.layers:
        for p in (layer.attention.window_balance, layer.attention.e_proj, layer.attention.f_proj):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("passes", ["one", "one block each in eager"])
def test_compiled_model_has_no_graph_breaks_and_equals_eager(monkeypatch, passes):
    """Compiled, the op runs in one pass whatever the budget (module comment on inductor); eager may run passes."""
    if passes != "one":
        _one_block_per_pass(monkeypatch)
    eager = _model(hybrid_sinks=1).train()
    _move_balance(eager)
    compiled_model = _model(hybrid_sinks=1).train()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch._dynamo.reset()
    want, got = eager(ids, attention_mask=mask).last_hidden_state, compiled(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.pow(2).mean().backward()
    got.pow(2).mean().backward()
    for mine, theirs in zip(compiled_model.layers, eager.layers):
        torch.testing.assert_close(mine.attention.window_balance.grad, theirs.attention.window_balance.grad)


def test_bf16_autocast_model_forward_is_finite():
    model = _model(hybrid_sinks=1)
    _move_balance(model)
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids).last_hidden_state
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("value", [None, 1, 64])
def test_config_accepts_none_and_positive_windows(value):
    assert LinformerConfig(hybrid_window=value).hybrid_window == value


@pytest.mark.parametrize(("field", "value"), [("hybrid_window", 0), ("hybrid_window", 2.5), ("hybrid_sinks", -1)])
def test_config_refuses_bad_values(field, value):
    with pytest.raises(StrictDataclassFieldValidationError, match=f"field '{field}'"):
        LinformerConfig(**{"hybrid_window": 8, field: value})


def test_config_refuses_sinks_without_a_window_and_a_window_in_a_decoder():
    with pytest.raises(ValueError, match="hybrid_sinks=1 needs a hybrid_window"):
        LinformerConfig(hybrid_sinks=1)
    with pytest.raises(ValueError, match="hybrid_window is for Linformer encoders.*PerformerConfig"):
        LinformerConfig(hybrid_window=8, is_decoder=True)


def test_conversion_and_transfer_train_the_balance_and_the_projections():
    bert = tiny_bert()
    model, report = convert_bert(
        bert, "linformer", projected_length=8, max_seq_length=32, hybrid_window=4, hybrid_sinks=1
    )
    assert "layers.0.attention.window_balance" in report.initialized
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "window_balance" in name}
    transfer = attention_transfer(model, bert, blocks(), args=quick(steps=30))
    assert {"layers.0.attention.window_balance", "layers.1.attention.e_proj"} <= set(transfer.parameters)
    assert all(a < b for b, a in zip(transfer.error_before, transfer.error_after))
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters() if name in before)


def test_the_cli_converts_a_linformer_hybrid(tokenizer_dir, tmp_path):
    out = _convert_with_a_short_transfer(
        tokenizer_dir, tmp_path, "--family", "linformer", "--projected_length", "8", "--max_seq_length", "32",
        "--hybrid_window", "4", "--hybrid_sinks", "1",
    )  # fmt: skip
    loaded = AutoModel.from_pretrained(out)
    assert loaded.config.hybrid_window == 4 and loaded.config.hybrid_sinks == 1
    assert any(layer.attention.window_balance.abs().sum() > 0 for layer in loaded.layers)  # trained, then saved


def test_model_card_names_the_window(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from linearformers.hub_cards import save_for_hub

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModel.from_config(
        tiny_config("linformer", vocab_size=tokenizer.vocab_size, hybrid_window=WINDOW, hybrid_sinks=1)
    )
    card = (save_for_hub(model, tokenizer, tmp_path / "export", repo_id="me/tiny") / "README.md").read_text()
    assert f"window of {WINDOW} tokens to its Linformer slots" in card and "attention sinks" in card


def test_hub_export_loads_with_remote_code_where_the_package_is_missing(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from linearformers.hub_cards import save_for_hub
    from tests.hub_cards.test_export import LOADER, _hub_cache, _isolated_python

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(
        "linformer", vocab_size=tokenizer.vocab_size, hybrid_window=WINDOW, hybrid_sinks=1, num_local_heads=1,
        local_window=4, max_position_embeddings=128, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    _move_balance(model.model)
    folder = save_for_hub(model, tokenizer, tmp_path / "export", repo_id="me/tiny")
    _hub_cache(folder, tmp_path / "cache", "me/tiny")
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    done = _isolated_python(
        script, "me/tiny", str(tmp_path / "cache"), "AutoModelForSequenceClassification", str(tmp_path / "out.pt"),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    assert remote["module"].startswith("transformers_modules"), "loaded the package instead of the remote code"
    with torch.no_grad():
        local = model(remote["ids"])
    torch.testing.assert_close(remote["out"], local[0], rtol=1e-5, atol=1e-6)
