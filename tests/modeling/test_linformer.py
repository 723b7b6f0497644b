"""The Linformer models (modeling/linformer.py): LinformerAttention's projections as the model runs them (every
kind covers max_seq_length positions, sharing modes, a k per layer, the layer-shared projection), and the hybrid
(hybrid_window): an exact sliding window (and sinks) beside the slots, in one softmax."""

import copy

import pytest
import torch
import torch._dynamo
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

import linearformers as lf
from linearformers.ops.reference import linformer_hybrid_reference
from tests.conftest import tiny_config
from tests.ops.test_linformer_hybrid import _one_block_per_pass, _qkv


@pytest.mark.parametrize("projection", ["learned", "pool", "conv"])
@pytest.mark.parametrize("position_embedding_type", ["rotary", "sinusoidal"])
def test_inputs_longer_than_max_seq_length_are_refused_by_every_projection(projection, position_embedding_type):
    cfg = tiny_config(
        "linformer",
        projection=projection,
        position_embedding_type=position_embedding_type,
        max_seq_length=16,
        projected_length=4,
    )
    model = AutoModel.from_config(cfg).eval()
    assert model(torch.randint(1, 99, (1, 16))).last_hidden_state.shape == (1, 16, 32)  # n = max_seq_length runs
    with pytest.raises(ValueError, match=r"17 tokens exceeds max_seq_length=16"):
        model(torch.randint(1, 99, (1, 17)))


def test_linformer_longer_than_its_projections_raises_naming_max_seq_length():
    cfg = tiny_config("linformer", position_embedding_type="rotary", max_seq_length=32, projected_length=8)
    model = AutoModel.from_config(cfg)
    with pytest.raises(ValueError, match="max_seq_length=32"):
        model(torch.randint(1, 99, (1, 40)))


@pytest.mark.parametrize("sharing", ["per_head", "headwise", "key_value", "layerwise"])
@pytest.mark.parametrize("projection", ["learned", "pool", "conv"])
def test_linformer_sharing_modes_and_projections_build_and_run(sharing, projection):
    cfg = tiny_config("linformer", sharing=sharing, projection=projection, projected_length=16)
    model = AutoModelForMaskedLM.from_config(cfg)
    ids = torch.randint(1, 99, (2, 40))
    out = model(ids, labels=ids)
    out.loss.backward()
    names = [
        n for n, _ in model.named_parameters() if "proj" in n and ("e_proj" in n or "f_proj" in n or "shared" in n)
    ]
    if projection == "learned" and sharing == "layerwise":
        assert names == ["model.shared_projection"]
    elif projection == "learned":
        per_layer = 1 if sharing == "key_value" else 2
        assert len(names) == 2 * per_layer
    elif projection == "pool":
        assert names == []
    assert all(p.grad is not None for n, p in model.named_parameters() if n in names)


def test_linformer_per_layer_k():
    cfg = tiny_config("linformer", projected_length_per_layer=[8, 16])
    model = AutoModel.from_config(cfg)
    assert model.layers[0].attention.e_proj.shape == (8, 64)
    assert model.layers[1].attention.e_proj.shape == (16, 64)


def test_layerwise_sharing_uses_the_per_layer_k():
    cfg = tiny_config("linformer", sharing="layerwise", projected_length=32, projected_length_per_layer=[8, 8])
    model = AutoModel.from_config(cfg)
    assert model.shared_projection.shape == (8, 64)
    assert model(torch.randint(1, 99, (1, 10))).last_hidden_state.shape == (1, 10, 32)


def test_the_layerwise_projection_is_one_parameter_that_every_layer_reads(tmp_path):
    cfg = tiny_config("linformer", sharing="layerwise", projected_length=8)
    model = lf.LinformerModel(cfg).eval()
    assert [k for k in model.state_dict() if "_proj" in k and ("e_proj" in k or "f_proj" in k or "shared" in k)] == [
        "shared_projection"
    ]
    ids = torch.randint(1, 99, (1, 10))
    with torch.no_grad():
        before = model(ids).last_hidden_state
        model.shared_projection.mul_(2.0)  # read at the call by every layer: the outputs move
        assert not torch.allclose(model(ids).last_hidden_state, before)
    model.save_pretrained(tmp_path)
    for again in (lf.LinformerModel.from_pretrained(tmp_path).eval(), copy.deepcopy(model)):
        for layer in again.layers:  # a loaded or copied model's layers read its own parameter
            assert layer.attention.projections()[0] is again.shared_projection
        with torch.no_grad():
            torch.testing.assert_close(again(ids).last_hidden_state, model(ids).last_hidden_state, rtol=0, atol=0)


# the hybrid (hybrid_window): an exact sliding window (and sinks) beside the slots, in one softmax

WINDOW = 3


def _hybrid(**overrides):
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


def test_layers_own_a_window_balance_at_zero_only_with_a_hybrid_window():
    model = _hybrid(num_local_heads=1, local_window=4, hybrid_sinks=1)
    for layer in model.layers:
        balance = layer.attention.window_balance
        assert isinstance(balance, torch.nn.Parameter) and balance.shape == (3,) and not balance.any()
    assert "hybrid_window=3" in repr(model.layers[0].attention)
    plain = _hybrid(hybrid_window=None)
    assert all(layer.attention.window_balance is None for layer in plain.layers)
    assert not [key for key in plain.state_dict() if "window_balance" in key]  # checkpoints without it unchanged


def test_global_heads_equal_the_reference():
    model = _hybrid(hybrid_sinks=2, sharing="per_head")
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
    model = _hybrid(hybrid_sinks=sinks, initializer_range=0.2)
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
    model = _hybrid(hybrid_sinks=1)
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
    model = _hybrid(hybrid_sinks=1, initializer_range=0.2).train()
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
    eager = _hybrid(hybrid_sinks=1).train()
    _move_balance(eager)
    compiled_model = _hybrid(hybrid_sinks=1).train()
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
    model = _hybrid(hybrid_sinks=1)
    _move_balance(model)
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids).last_hidden_state
    assert torch.isfinite(out.float()).all()


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
