"""Attention transfer: the new attention parameters of a converted model fit to the original's softmax attention."""

import dataclasses
import re

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from linearformers import PerformerConfig
from linearformers.conversion.convert import convert_bert, convert_gpt2, main
from linearformers.conversion.transfer import (
    TransferArguments,
    _reorder_heads,
    attention_transfer,
    calibrate_query_scale,
    choose_local_heads,
    local_head_shares,
    softmax_attention_output,
    text_blocks,
    transfer_parameters,
)
from linearformers.modeling.performer import PerformerModel
from tests.conversion.test_convert import SMALL_BERT

# the BERT of the conversion tests, without its head's label count
TINY_BERT = {k: v for k, v in SMALL_BERT.items() if k != "num_labels"}
TINY_GPT2 = dict(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
HEDGEHOG = dict(feature_map="hedgehog", num_features=16)  # head_dim 8: the map starts at the identity
# the hybrid with a sink and the learned query scale (hybrid_query_scale), which transfer calibrates first
SCALED = dict(hybrid_window=4, hybrid_sinks=1, hybrid_query_scale=True, **HEDGEHOG)


def _sharpen(query: nn.Linear | torch.Tensor, key: nn.Linear | torch.Tensor) -> None:
    """Scale q and k up 8x: a random model's attention is nearly uniform, which any kernel already matches."""
    with torch.no_grad():
        for weight in (query, key):
            (weight.weight if isinstance(weight, nn.Linear) else weight).mul_(8)


def tiny_bert() -> BertModel:
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**TINY_BERT)).eval()
    for layer in bert.encoder.layer:
        _sharpen(layer.attention.self.query, layer.attention.self.key)
    return bert


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(**TINY_GPT2)).eval()
    for block in gpt2.transformer.h:
        _sharpen(*block.attn.c_attn.weight.split(32, dim=1)[:2])  # Conv1D (in, 3 out): q and k columns
    return gpt2


def blocks(count: int = 16, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 60, (count, length), generator=torch.Generator().manual_seed(1))


def quick(**overrides) -> TransferArguments:
    return TransferArguments(**{"steps": 40, "batch_size": 4, "progress": False, **overrides})


def _use_softmax_twins(model) -> None:
    for layer in model.base_model.layers:
        layer.attention.forward = lambda x, mask=None, *rest, attention=layer.attention: softmax_attention_output(
            attention, x, mask
        )


@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_softmax_twins_reproduce_the_originals_hidden_states(convert):
    """The targets are the original's attention outputs: with every layer's attention replaced by its softmax twin,
    the converted model gives the original's hidden states at every layer."""
    source = tiny_bert() if convert == "bert" else tiny_gpt2()
    model, _ = (convert_bert if convert == "bert" else convert_gpt2)(source, "performer", **HEDGEHOG)
    ids = blocks(3, 24)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    keep = mask.bool()
    extra = {"use_cache": False} if convert == "gpt2" else {}
    with torch.no_grad():
        theirs = source(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        linear = model(ids, attention_mask=mask, output_hidden_states=True, **extra).hidden_states
        _use_softmax_twins(model)
        ours = model(ids, attention_mask=mask, output_hidden_states=True, **extra).hidden_states
    assert len(ours) == len(theirs) == 3
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine[keep], reference[keep], rtol=1e-5, atol=1e-5)
    assert (linear[-1][keep] - theirs[-1][keep]).abs().max() > 1e-3  # the linear kernel itself differs


@pytest.mark.parametrize(
    "convert, family, overrides",
    [
        ("bert", "performer", HEDGEHOG),
        ("gpt2", "performer", HEDGEHOG),
        ("bert", "linformer", dict(max_seq_length=32, projected_length=8)),
        ("gpt2", "linformer", dict(max_seq_length=32, projected_length=8)),
        ("bert", "performer", dict(hybrid_window=4, **HEDGEHOG)),
        ("gpt2", "performer", dict(hybrid_window=4, **HEDGEHOG)),
        ("bert", "performer", dict(hybrid_window=4, hybrid_sinks=1, **HEDGEHOG)),
    ],
    ids=[
        "hedgehog-encoder",
        "hedgehog-causal-lm",
        "linformer-encoder",
        "linformer-causal-lm",
        "hybrid-hedgehog-encoder",
        "hybrid-hedgehog-causal-lm",
        "hybrid-sink-hedgehog-encoder",
    ],
)
def test_transfer_lowers_every_layers_attention_error(convert, family, overrides):
    source = tiny_bert() if convert == "bert" else tiny_gpt2()
    model, _ = (convert_bert if convert == "bert" else convert_gpt2)(source, family, **overrides)
    # E / F of these tiny random models (k = 8 of n = 32) take the maps' rate: the default, tuned on MiniLM's
    # k = 64 of 256, moves them too little in 60 steps to show
    report = attention_transfer(model, source, blocks(), args=quick(steps=60, projection_learning_rate=1e-2))
    assert len(report.error_before) == len(report.error_after) == 2
    for before, after in zip(report.error_before, report.error_after):
        assert after < 0.97 * before
    assert report.eval_blocks == 4 and report.steps == 60
    text = str(report)
    assert "relative error" in text and f"{report.error_after[1]:8.4f}" in text


def test_a_random_feature_hybrid_trains_its_window_balances_alone():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", hybrid_window=4, num_features=16)
    features = [layer.attention.random_features.clone() for layer in model.layers]
    report = attention_transfer(model, bert, blocks(), args=quick(steps=60))
    assert report.parameters == ["layers.0.attention.window_balance", "layers.1.attention.window_balance"]
    assert all(after < before for before, after in zip(report.error_before, report.error_after))
    assert all(torch.equal(layer.attention.random_features, f) for layer, f in zip(model.layers, features))


def test_linformer_projections_take_their_own_learning_rate():
    """E / F train at projection_learning_rate, local-head biases at learning_rate: with the latter tiny, only the
    projections move."""
    bert = tiny_bert()
    overrides = dict(max_seq_length=32, projected_length=8, num_local_heads=1, local_window=4, local_relative_bias=True)
    model, _ = convert_bert(bert, "linformer", **overrides)
    start = {name: param.detach().clone() for name, param in transfer_parameters(model)}
    attention_transfer(model, bert, blocks(), args=quick(steps=5, learning_rate=1e-30, projection_learning_rate=1e-3))
    moved = {name for name, param in transfer_parameters(model) if not torch.allclose(param, start[name], atol=1e-12)}
    assert moved and all(name.rpartition(".")[-1] in ("e_proj", "f_proj") for name in moved), moved
    assert any(name.endswith("relative_bias") for name in start)
    with pytest.raises(ValueError, match=r"projection_learning_rate must be a finite number > 0"):
        TransferArguments(projection_learning_rate=0.0)


def test_only_the_new_parameters_change_and_flags_modes_and_rng_are_restored():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **HEDGEHOG)
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    model.train()
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    before = {name: t.clone() for name, t in model.state_dict().items()}
    new = {name for name, _ in transfer_parameters(model)}
    rng = torch.get_rng_state()
    attention_transfer(model, bert, blocks(), args=quick(steps=5))
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and not bert.training
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    after = model.state_dict()
    assert new == {
        f"layers.{i}.attention.feature_map.{p}" for i in range(2) for p in ("weight", "bias", "key_weight", "key_bias")
    }
    for name, tensor in after.items():
        if name in new:
            assert not torch.equal(tensor, before[name]), name
        else:
            assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_padded_positions_do_not_change_what_is_learned(convert):
    source = tiny_bert() if convert == "bert" else tiny_gpt2()
    ids = blocks()
    mask = torch.ones_like(ids)
    mask[::3, 20:] = 0
    trained = []
    for pad in (0, 17):  # the same real tokens, different ids at the padded places
        model, _ = (convert_bert if convert == "bert" else convert_gpt2)(source, "performer", **HEDGEHOG)
        report = attention_transfer(model, source, ids.masked_fill(mask == 0, pad), mask, args=quick(steps=5))
        trained.append((report, [p.detach().clone() for _, p in transfer_parameters(model)]))
    (first, params), (second, others) = trained
    assert first.error_before == pytest.approx(second.error_before, rel=1e-5)
    for a, b in zip(params, others):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_finetune_full_lowers_the_next_token_kl():
    gpt2 = tiny_gpt2()
    model, _ = convert_gpt2(gpt2, "performer", **HEDGEHOG)
    report = attention_transfer(
        model, gpt2, blocks(), args=quick(steps=10, finetune_steps=30, finetune_learning_rate=1e-4)
    )
    assert report.finetune == "full" and report.finetune_loss == "next-token KL"
    assert report.finetune_loss_after < 0.9 * report.finetune_loss_before
    assert "fine-tune (full)" in str(report)


@pytest.mark.parametrize("overrides", [HEDGEHOG, SCALED], ids=["hedgehog", "hybrid-query-scale"])
def test_finetune_lora_lowers_the_hidden_state_mse_and_leaves_a_plain_model(overrides, tmp_path):
    pytest.importorskip("peft")
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **overrides)
    keys = set(model.state_dict())
    args = quick(steps=10, finetune_steps=30, finetune="lora", finetune_learning_rate=1e-3, lora_r=4)
    report = attention_transfer(model, bert, blocks(), args=args)
    assert report.finetune_loss == "hidden-state MSE / mean square, every layer"
    assert report.finetune_loss_after < 0.95 * report.finetune_loss_before
    assert set(model.state_dict()) == keys
    assert type(model.layers[0].attention.q_proj) is nn.Linear
    ids = blocks(2, 20)
    model.save_pretrained(tmp_path / "lora")
    loaded = AutoModel.from_pretrained(tmp_path / "lora").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def test_encoder_distillation_weighs_every_layer_by_the_originals_scale():
    """Stage 2's encoder loss: the mean over layers of each layer's MSE over real tokens divided by the original's
    mean square there, computed here by hand from both models' hidden states."""
    from linearformers.conversion.transfer import _distillation_loss

    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **HEDGEHOG)
    ids = blocks(3, 20)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 12:] = False
    with torch.no_grad():
        theirs = bert(ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states[1:]
        ours = model(ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states[1:]
        loss = _distillation_loss(model, bert, ids, mask)
    assert len(theirs) == 2
    want = sum(((o - t)[mask].pow(2).mean() / t[mask].pow(2).mean()) for o, t in zip(ours, theirs)) / len(theirs)
    torch.testing.assert_close(loss, want)


def test_finetune_trains_the_new_attention_parameters_at_their_own_rate():
    """In stage 2 the maps keep the stage-1 learning rate while the pretrained weights take finetune_learning_rate:
    with the latter tiny, the weights hardly move and the maps still do."""
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **HEDGEHOG)
    args = quick(steps=1, finetune_steps=10, finetune_learning_rate=1e-9, learning_rate=1e-2)
    attention_transfer(model, bert, blocks(), args=args)  # stage 1 for one step, then stage 2
    maps = [p.detach().clone() for _, p in transfer_parameters(model)]
    query = model.layers[0].attention.q_proj.weight.detach().clone()
    model2, _ = convert_bert(bert, "performer", **HEDGEHOG)
    attention_transfer(model2, bert, blocks(), args=quick(steps=1, finetune_steps=0, learning_rate=1e-2))
    after_stage1 = [p.detach() for _, p in transfer_parameters(model2)]
    assert max((a - b).abs().max().item() for a, b in zip(maps, after_stage1)) > 1e-3
    assert (query - model2.layers[0].attention.q_proj.weight).abs().max().item() < 1e-6


def test_finetune_new_learning_rate_sets_every_new_parameters_stage_2_rate():
    """With finetune_new_learning_rate tiny, stage 2 leaves the maps where stage 1 put them; the pretrained weights
    still train at finetune_learning_rate."""
    bert = tiny_bert()
    stage1, _ = convert_bert(bert, "performer", hybrid_window=4, **HEDGEHOG)
    attention_transfer(stage1, bert, blocks(), args=quick(steps=1, learning_rate=1e-2))
    model, _ = convert_bert(bert, "performer", hybrid_window=4, **HEDGEHOG)
    args = quick(steps=1, finetune_steps=10, learning_rate=1e-2, finetune_new_learning_rate=1e-12)
    attention_transfer(model, bert, blocks(), args=args)
    for (name, mine), (_, theirs) in zip(transfer_parameters(model), transfer_parameters(stage1)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=name)
    query = model.layers[0].attention.q_proj.weight
    assert (query - stage1.layers[0].attention.q_proj.weight).abs().max().item() > 1e-4
    with pytest.raises(ValueError, match=r"finetune_new_learning_rate must be a finite number > 0"):
        TransferArguments(finetune_new_learning_rate=0.0)
    with pytest.raises(TypeError, match=r"finetune_new_learning_rate must be a number"):
        TransferArguments(finetune_new_learning_rate="3e-3")


def test_bad_arguments_raise_naming_the_problem():
    with pytest.raises(ValueError, match=r"TransferArguments.steps must be >= 1, got 0"):
        TransferArguments(steps=0)
    with pytest.raises(ValueError, match=r"TransferArguments.finetune must be one of 'full', 'lora', got 'qlora'"):
        TransferArguments(finetune="qlora")
    with pytest.raises(ValueError, match=r"learning_rate must be a finite number > 0"):
        TransferArguments(learning_rate=-1.0)
    with pytest.raises(TypeError, match=r"batch_size must be an int"):
        TransferArguments(batch_size=2.5)


def test_nothing_to_train_names_the_ways_to_get_new_parameters():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", num_features=16)
    with pytest.raises(
        ValueError, match=r"no new attention parameters.*feature_map='hedgehog'.*hybrid_window.*linformer"
    ):
        attention_transfer(model, bert, blocks(), args=quick())


def test_bad_blocks_and_models_raise_clear_errors():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **HEDGEHOG)
    ids = blocks()
    with pytest.raises(ValueError, match=r"input_ids hold 60, outside 0 \.\. 59"):
        attention_transfer(model, bert, ids + 1, args=quick())
    with pytest.raises(TypeError, match=r"integer torch.Tensor"):
        attention_transfer(model, bert, ids.float(), args=quick())
    empty = torch.ones_like(ids)
    empty[6] = 0
    with pytest.raises(ValueError, match=r"marks every token of block\(s\) \[6\] as padding"):
        attention_transfer(model, bert, ids, empty, args=quick())
    with pytest.raises(ValueError, match=r"4 blocks; 4 are held out.*leaves none to train on"):
        attention_transfer(model, bert, ids[:4], args=quick())
    with pytest.raises(ValueError, match=r"exceeds max_position_embeddings=64"):
        attention_transfer(model, bert, torch.zeros(8, 65, dtype=torch.long), args=quick())
    rotary = PerformerModel(
        PerformerConfig(**TINY_BERT, position_embedding_type="rotary", **HEDGEHOG, feature_redraw_interval=None)
    )
    with pytest.raises(ValueError, match=r"rotary positions"):
        attention_transfer(rotary, bert, ids, args=quick())
    with pytest.raises(ValueError, match=r"position_embedding_type='rotary'"):
        softmax_attention_output(rotary.layers[0].attention, torch.zeros(1, 4, 32))
    gpt2_model, _ = convert_gpt2(tiny_gpt2(), "performer", **HEDGEHOG)
    with pytest.raises(ValueError, match=r"stage 2 distills next-token distributions.*PerformerModel has no LM head"):
        attention_transfer(gpt2_model.model, tiny_gpt2(), ids, args=quick(finetune_steps=1))


def test_text_blocks_wrap_bert_blocks_in_cls_and_sep(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = ["linear attention reads long documents in linear time."] * 6
    tokens = tokenizer(texts[0], add_special_tokens=False).input_ids
    wrapped = text_blocks(tokenizer, texts, 10, wrap=True)
    assert wrapped.shape == (6 * len(tokens) // 8, 10)
    assert (wrapped[:, 0] == tokenizer.cls_token_id).all() and (wrapped[:, -1] == tokenizer.sep_token_id).all()
    assert wrapped[0, 1:9].tolist() == (tokens * 2)[:8]
    plain = text_blocks(tokenizer, texts, 10, wrap=False)
    assert plain.shape == (6 * len(tokens) // 10, 10)
    assert plain.flatten().tolist() == (tokens * 6)[: plain.numel()]
    (tmp_path / "text.txt").write_text(" ".join(texts), encoding="utf-8")
    assert text_blocks(tokenizer, tmp_path / "text.txt", 10, wrap=True).shape[0] >= 1
    with pytest.raises(ValueError, match=r"fewer than one block of 98"):
        text_blocks(tokenizer, texts[:1], 100, wrap=True)
    with pytest.raises(ValueError, match=r"is not a file"):
        text_blocks(tokenizer, str(tmp_path / "missing.txt"), 10, wrap=True)


def test_text_blocks_refuses_an_empty_list_by_name(tokenizer_dir):
    """The tokenizer raised an IndexError on it."""
    with pytest.raises(ValueError, match=r"texts is an empty list"):
        text_blocks(AutoTokenizer.from_pretrained(tokenizer_dir), [], 10, wrap=True)


def _saved_bert_with_a_tokenizer(tokenizer_dir, folder):
    """A tiny random BertModel with all-MiniLM-L6-v2's WordPiece vocabulary, saved with that tokenizer."""
    torch.manual_seed(0)
    config = BertConfig(**{**TINY_BERT, "vocab_size": 30522, "hidden_size": 16, "num_attention_heads": 2})
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)


def test_the_cli_runs_the_transfer_before_saving(tokenizer_dir, tmp_path, capsys):
    _saved_bert_with_a_tokenizer(tokenizer_dir, tmp_path / "bert")
    text = tmp_path / "text.txt"
    text.write_text("Performers approximate softmax attention with positive random features. " * 60)
    source, out = str(tmp_path / "bert"), str(tmp_path / "out")
    common = ["--transfer_file", str(text), "--transfer_steps", "5", "--transfer_batch_size", "2"]
    main([source, out, "--feature_map", "hedgehog", "--num_features", "16", *common, "--transfer_length", "32"])
    printed = capsys.readouterr().out
    assert "BertModel -> PerformerModel" in printed and "relative error of each layer's attention output" in printed
    import linearformers  # noqa: F401

    loaded = AutoModel.from_pretrained(out)
    assert loaded.config.feature_map == "hedgehog" and type(loaded).__name__ == "PerformerModel"
    assert AutoTokenizer.from_pretrained(out).cls_token_id == 101
    with pytest.raises(SystemExit):
        main([source, str(tmp_path / "failed"), "--num_features", "16", *common])
    assert "no new attention parameters" in capsys.readouterr().err
    assert not (tmp_path / "failed").exists()  # nothing written when the transfer fails
    with pytest.raises(SystemExit):
        main([source, str(tmp_path / "flags"), "--transfer_steps", "5"])
    assert "needs --transfer_file" in capsys.readouterr().err


LOCAL = dict(projected_length=32, max_seq_length=32, num_local_heads=2)  # k = n: E = F = I, the Linformer is exact


def test_local_head_shares_are_the_originals_attention_inside_the_window():
    """Checked against BERT's own attention probabilities (eager attention, output_attentions), with padding."""
    bert = tiny_bert()
    bert.set_attn_implementation("eager")
    model, _ = convert_bert(bert, "linformer", **LOCAL, local_window=8)
    ids = blocks(3, 32)
    mask = torch.ones_like(ids)
    mask[2, 20:] = 0
    shares = local_head_shares(model, bert, ids, mask, batch_size=2)
    with torch.no_grad():
        probs = bert(ids, attention_mask=mask, output_attentions=True).attentions  # per layer (b, h, n, n)
    distance = torch.arange(32)[:, None] - torch.arange(32)[None, :]
    inside = (distance.abs() <= 4).float()
    real = mask.bool()
    for layer, p in enumerate(probs):
        want = ((p * inside).sum(-1).permute(0, 2, 1)[real]).mean(0)  # (h,) over real queries
        assert shares[layer] == pytest.approx(want.tolist(), abs=1e-5)


def test_choose_local_heads_moves_the_most_local_heads_last_and_keeps_the_function():
    bert = tiny_bert()
    ids = blocks(8, 32)
    model, _ = convert_bert(bert, "linformer", **LOCAL, local_window=6)
    before = local_head_shares(model, bert, ids)
    chosen = choose_local_heads(model, bert, ids, batch_size=4)
    after = local_head_shares(model, bert, ids)
    for layer, heads in enumerate(chosen):
        want = sorted(sorted(range(4), key=lambda h: before[layer][h])[-2:])
        assert heads == want
        order = [h for h in range(4) if h not in heads] + heads
        assert after[layer] == pytest.approx([before[layer][h] for h in order], abs=1e-6)
        assert min(after[layer][2:]) >= max(after[layer][:2])
    # the same reordering on a model whose every head is exact (k = n, a window over all 16 tokens): same function
    exact, _ = convert_bert(bert, "linformer", **LOCAL, local_window=32)
    ids = blocks(4, 16)
    with torch.no_grad():
        reference = bert(ids).last_hidden_state
        torch.testing.assert_close(exact(ids).last_hidden_state, reference, rtol=1e-4, atol=1e-5)
        choose_local_heads(exact, bert, ids)  # all shares ~1 here: whatever it picks, the function stays
        torch.testing.assert_close(exact(ids).last_hidden_state, reference, rtol=1e-4, atol=1e-5)
        for layer in exact.layers:
            _reorder_heads(layer.attention, [3, 1, 0, 2])
        torch.testing.assert_close(exact(ids).last_hidden_state, reference, rtol=1e-4, atol=1e-5)


def test_transfer_can_choose_the_local_heads_first():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "linformer", **LOCAL, local_window=6)
    report = attention_transfer(model, bert, blocks(16, 32), args=quick(steps=3, choose_local_heads=True))
    assert report.local_heads is not None and len(report.local_heads) == 2
    assert all(len(heads) == 2 for heads in report.local_heads)
    assert "local heads chosen by locality" in str(report)
    plain, _ = convert_bert(bert, "linformer", projected_length=16, max_seq_length=32)
    with pytest.raises(ValueError, match=r"has none: convert with num_local_heads"):
        attention_transfer(plain, bert, blocks(16, 32), args=quick(steps=3, choose_local_heads=True))
    with pytest.raises(TypeError, match=r"choose_local_heads must be True or False"):
        TransferArguments(choose_local_heads=1)


def _convert_with_a_short_transfer(tokenizer_dir, tmp_path, *flags: str):
    """The conversion CLI on a saved tiny BERT with ``flags`` and 2 transfer steps on blocks of 32; the output folder."""
    _saved_bert_with_a_tokenizer(tokenizer_dir, tmp_path / "bert")
    text = tmp_path / "text.txt"
    text.write_text("Linear attention keeps a fixed-size state, whatever the length of the sequence. " * 60)
    out = tmp_path / "out"
    transfer = ["--transfer_file", str(text), "--transfer_steps", "2", "--transfer_batch_size", "2"]
    main([str(tmp_path / "bert"), str(out), *flags, *transfer, "--transfer_length", "32"])
    return out


def test_the_cli_chooses_local_heads(tokenizer_dir, tmp_path, capsys):
    out = _convert_with_a_short_transfer(
        tokenizer_dir, tmp_path, "--family", "linformer", "--projected_length", "8", "--max_seq_length", "32",
        "--num_local_heads", "1", "--local_window", "8", "--choose_local_heads",
    )  # fmt: skip
    assert "local heads chosen by locality" in capsys.readouterr().out
    import linearformers  # noqa: F401

    loaded = AutoModel.from_pretrained(out)
    assert loaded.config.num_local_heads == 1 and loaded.config.local_window == 8


def _log_mass_targets(attention, x, mask, window, sinks, causal):
    """Per real query with linear keys, written out key by key: (q_t with a 1 appended, l*_t) per head."""
    g = attention.num_global
    with torch.no_grad():
        q = attention._split(attention.q_proj(x))[:, :g].double()
        k = attention._split(attention.k_proj(x))[:, :g].double()
        phi_q, phi_k = attention.feature_map(q.float(), is_query=True), attention.feature_map(k.float(), is_query=False)
        if attention.key_scale_weight is not None:  # the keys' learned scale, written out
            raw = (k.float() * attention.key_scale_weight[None, :, None, :]).sum(-1) + attention.key_scale_bias[:, None]
            phi_k = phi_k * torch.exp(20.0 * torch.tanh(raw / 20.0))[..., None]
    rows = [[] for _ in range(g)]
    for b in range(x.shape[0]):
        real = [s for s in range(x.shape[1]) if mask[b, s]]
        sink = set(real[:sinks])
        for t in real:
            far = [s for s in real if s not in sink and (t - s >= window if causal else abs(t - s) >= window)]
            if not far:
                continue
            for h in range(g):
                exact = torch.logsumexp(torch.stack([q[b, h, t] @ k[b, h, s] for s in far]) / 8**0.5, 0)
                mass = sum(float(phi_q[b, h, t] @ phi_k[b, h, s]) for s in far)
                rows[h].append((torch.cat([q[b, h, t], q.new_ones(1)]), float(exact) - torch.tensor(mass).log().item()))
    return rows


@pytest.mark.parametrize("keyed", [False, True], ids=["", "key-scale"])
@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_calibrate_query_scale_is_the_least_squares_fit_of_the_log_mass(convert, keyed):
    """Against a key-by-key computation of l*_t = log Σ_far exp(q·k / sqrt(d)) - log Σ_far phi(q)·phi(k) and
    torch.linalg.lstsq, with padding, a sink, and (for GPT-2) the causal window; with a key scale (set away from
    zero), phi(k) carries it, as in the hybrid."""
    source = tiny_bert() if convert == "bert" else tiny_gpt2()
    model, _ = (convert_bert if convert == "bert" else convert_gpt2)(
        source, "performer", **SCALED, hybrid_key_scale=keyed
    )
    if keyed:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in model.base_model.layers:
                for param in (layer.attention.key_scale_weight, layer.attention.key_scale_bias):
                    param.copy_(0.3 * torch.randn(param.shape, generator=g))
    ids = blocks(3, 16)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    residuals = calibrate_query_scale(model, source, ids, mask, batch_size=2, ridge=0.0)
    assert len(residuals) == 2 and all(r > 0 for r in residuals)
    with torch.no_grad():
        hidden = source.base_model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for layer, x in zip(model.base_model.layers, hidden):
        if layer.pre_norm:
            x = layer.attention_norm(x)
        attention = layer.attention
        rows = _log_mass_targets(attention, x, mask.bool(), 4, 1, convert == "gpt2")
        for h, samples in enumerate(rows):
            features = torch.stack([f for f, _ in samples])
            targets = torch.tensor([y for _, y in samples], dtype=torch.float64)
            want = torch.linalg.lstsq(features, targets[:, None]).solution[:, 0]
            got = torch.cat([attention.query_scale_weight[h], attention.query_scale_bias[h : h + 1]]).double()
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_transfer_calibrates_the_query_scale_before_stage_1_and_trains_it():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **SCALED)
    report = attention_transfer(model, bert, blocks(), args=quick(steps=30))
    assert "layers.0.attention.query_scale_weight" in report.parameters
    assert "layers.1.attention.query_scale_bias" in report.parameters
    assert report.error_calibrated is not None and report.query_scale_residual is not None
    assert all(c < b for b, c in zip(report.error_before, report.error_calibrated))
    assert all(a < c for c, a in zip(report.error_calibrated, report.error_after))
    assert "calibrated" in str(report) and "query scale fitted by least squares" in str(report)
    off, _ = convert_bert(bert, "performer", **SCALED)
    unscaled = attention_transfer(off, bert, blocks(), args=quick(steps=1, calibrate_query_scale=False))
    assert unscaled.error_calibrated is None and "calibrated" not in str(unscaled)
    plain, _ = convert_bert(bert, "performer", hybrid_window=4, **HEDGEHOG)  # nothing to calibrate: no-op
    assert attention_transfer(plain, bert, blocks(), args=quick(steps=1)).error_calibrated is None


def test_transfer_trains_the_key_scale_with_the_maps():
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", **SCALED, hybrid_key_scale=True)
    report = attention_transfer(model, bert, blocks(), args=quick(steps=30))
    assert {"layers.0.attention.key_scale_weight", "layers.1.attention.key_scale_bias"} <= set(report.parameters)
    for layer in model.base_model.layers:
        assert layer.attention.key_scale_weight.abs().sum() > 0 and layer.attention.key_scale_bias.abs().sum() > 0
    assert all(a < b for b, a in zip(report.error_before, report.error_after))


def test_query_scale_calibration_refuses_what_it_cannot_do():
    bert = tiny_bert()
    plain, _ = convert_bert(bert, "performer", hybrid_window=4, **HEDGEHOG)
    with pytest.raises(ValueError, match=r"has none: convert a Performer with hybrid_window=W and hybrid_query"):
        calibrate_query_scale(plain, bert, blocks(4, 16))
    scaled, _ = convert_bert(bert, "performer", **SCALED)
    with pytest.raises(ValueError, match=r"ridge must be a finite number >= 0"):
        calibrate_query_scale(scaled, bert, blocks(4, 16), ridge=-1.0)
    with pytest.raises(ValueError, match=r"no query with a key outside its window"):
        calibrate_query_scale(scaled, bert, blocks(4, 4))  # 4 tokens, window 4: every key is in the window
    with pytest.raises(TypeError, match=r"calibrate_query_scale must be True or False"):
        TransferArguments(calibrate_query_scale="yes")


def test_the_cli_converts_with_a_query_scale_and_calibrates_it(tokenizer_dir, tmp_path, capsys):
    out = _convert_with_a_short_transfer(
        tokenizer_dir, tmp_path, "--feature_map", "hedgehog", "--num_features", "16", "--hybrid_window", "4",
        "--hybrid_query_scale", "--hybrid_key_scale",
    )  # fmt: skip
    assert "query scale fitted by least squares" in capsys.readouterr().out
    import linearformers  # noqa: F401

    loaded = AutoModel.from_pretrained(out)
    assert loaded.config.hybrid_query_scale is True and loaded.config.hybrid_key_scale is True
    assert loaded.layers[0].attention.query_scale_bias.abs().sum() > 0  # calibrated, then saved
    assert loaded.layers[0].attention.key_scale_bias.abs().sum() > 0  # trained, then saved


def test_cli_offers_a_flag_for_every_transfer_argument(capsys):
    """Named by the field's metadata ``flag`` (else the field); a bool is a switch, ``--no_name`` where True."""
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    for f in dataclasses.fields(TransferArguments):
        name = f.metadata.get("flag", f.name)
        flag = f"--no_{name}" if f.default is True else f"--{name}"
        assert re.search(rf"{flag}\b", usage), flag


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
