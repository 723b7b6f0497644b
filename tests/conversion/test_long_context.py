"""Conversion to a target length: a BERT of P positions into a model that reads N > P tokens, taught by the original
read chunk by chunk (linearformers.conversion.long_context)."""

import json

import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertModel, pipeline

import linearformers  # noqa: F401  (registers the Auto classes)
from linearformers.conversion import long_context
from linearformers.conversion.convert import convert_bert, main
from linearformers.conversion.long_context import (
    ChunkedTeacher,
    chunk_layout,
    extend_positions,
    long_attention_transfer,
)
from linearformers.conversion.transfer import _Batch, softmax_attention_output
from linearformers.hub_cards.export import save_for_hub
from tests.conversion.test_transfer import HEDGEHOG, SCALED, _saved_bert_with_a_tokenizer, quick, tiny_bert

N = 200  # the tiny BERT has 64 positions: N spans four chunks of 62 tokens between [CLS] and [SEP]
FAMILIES = {
    "performer": SCALED,
    "linformer": dict(hybrid_window=4, hybrid_sinks=1, projected_length=8),
}


def _ids(count: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 60, (count, length), generator=torch.Generator().manual_seed(seed))


def test_tiled_positions_keep_the_original_rows_and_give_each_later_position_its_place_in_its_chunk():
    table = torch.randn(64, 8)
    tiled = extend_positions(table, 200, "tile")
    assert tiled.shape == (200, 8)
    torch.testing.assert_close(tiled[:64], table)
    torch.testing.assert_close(tiled[64], table[2])  # 1 + 63 % 62: the 2nd token of the second chunk
    torch.testing.assert_close(tiled[124], table[62])  # the last token of the second chunk
    torch.testing.assert_close(tiled[125], table[1])  # the first of the third


def test_interpolated_positions_stretch_the_table_over_n_rows():
    table = torch.arange(64.0)[:, None].expand(64, 4)
    stretched = extend_positions(table, 127, "interpolate")
    torch.testing.assert_close(stretched[0], table[0])
    torch.testing.assert_close(stretched[-1], table[-1])
    torch.testing.assert_close(stretched[2], torch.full((4,), 1.0))  # halfway steps


def test_chunk_layout_wraps_each_chunk_in_the_rows_first_and_last_token():
    ids = torch.arange(1, 13)[None].repeat(2, 1)  # 12 tokens; row 1 has 9 real ones
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 9:] = False
    layout = chunk_layout(ids, mask, chunk_length=6)  # 4 tokens per chunk between first and last
    assert layout.ids[:3][layout.mask[:3]].tolist() == [1, 2, 3, 4, 5, 12, 1, 6, 7, 8, 9, 12, 1, 10, 11, 12]
    assert layout.ids[3:][layout.mask[3:]].tolist() == [1, 2, 3, 4, 5, 9, 1, 6, 7, 8, 9]
    gathered = layout.gather(layout.ids[..., None])[..., 0]
    assert torch.equal(gathered[mask], ids[mask])  # every real token maps to itself in its chunk


def test_the_chunked_teacher_gives_each_token_its_chunks_hidden_states():
    bert = tiny_bert()
    ids = _ids(1, N)
    states = ChunkedTeacher(bert)(ids).hidden_states
    with torch.no_grad():  # the second chunk: [CLS], tokens 63 .. 124, [SEP]
        chunk = torch.cat([ids[:, :1], ids[:, 63:125], ids[:, -1:]], 1)
        theirs = bert(chunk, output_hidden_states=True).hidden_states
    for ours, reference in zip(states, theirs):
        torch.testing.assert_close(ours[:, 63:125], reference[:, 1:-1])


def test_the_chunked_teacher_is_the_original_on_blocks_it_can_read():
    bert, model = tiny_bert(), convert_bert(tiny_bert(), "performer", max_length=N, **SCALED)[0]
    ids, mask = _ids(2, 64), torch.ones(2, 64, dtype=torch.bool)
    mask[1, 40:] = False
    chunked, plain = _Batch(model, ChunkedTeacher(bert), ids, mask), _Batch(model, bert, ids, mask)
    for ours, theirs in zip(chunked.inputs + chunked.targets, plain.inputs + plain.targets):
        torch.testing.assert_close(ours[mask], theirs[mask])


def test_stage_one_targets_of_a_long_block_are_the_originals_attention_inside_each_chunk():
    bert, model = tiny_bert(), convert_bert(tiny_bert(), "performer", max_length=N, **SCALED)[0]
    ids = _ids(1, N)
    batch = _Batch(model, ChunkedTeacher(bert), ids, torch.ones(1, N, dtype=torch.bool))
    chunk = torch.cat([ids[:, :1], ids[:, 63:125], ids[:, -1:]], 1)
    with torch.no_grad():
        x = bert(chunk, output_hidden_states=True).hidden_states[1]
        target = softmax_attention_output(model.base_model.layers[1].attention, x)
    torch.testing.assert_close(batch.targets[1][:, 63:125], target[:, 1:-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_conversion_accepts_n_tokens_and_refuses_n_plus_one(family):
    model, _ = convert_bert(tiny_bert(), family, max_length=N, **FAMILIES[family])
    with torch.no_grad():
        assert model(_ids(1, N)).last_hidden_state.shape == (1, N, 32)
    limit = "max_seq_length" if family == "linformer" else "max_position_embeddings"
    with pytest.raises(ValueError, match=rf"{N + 1} tokens exceeds {limit}={N}"):
        model(_ids(1, N + 1))


def test_a_long_conversion_runs_its_feed_forward_the_originals_positions_at_a_time():
    model = convert_bert(tiny_bert(), "performer", max_length=N, **SCALED)[0]
    assert model.config.chunk_size_feed_forward == 64  # the tiny BERT's positions
    assert convert_bert(tiny_bert(), "performer", **SCALED)[0].config.chunk_size_feed_forward == 0
    given = convert_bert(tiny_bert(), "performer", max_length=N, chunk_size_feed_forward=0, **SCALED)[0]
    assert given.config.chunk_size_feed_forward == 0


def test_tiled_positions_leave_the_embeddings_of_short_inputs_as_the_originals():
    bert = tiny_bert()
    model, report = convert_bert(bert, "performer", max_length=N, **SCALED)
    ids = _ids(2, 64)
    positions = torch.arange(64)[None].expand(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.embeddings(ids, positions), bert.embeddings(ids))
    assert ("embeddings.position_embeddings.weight[extended]", "embeddings.position_embeddings.weight") in report.mapped


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_model_is_padding_invariant_at_n(family):
    model, _ = convert_bert(tiny_bert(), family, max_length=N, **FAMILIES[family])
    ids, mask = _ids(2, N), torch.ones(2, N, dtype=torch.long)
    mask[1, 150:] = 0
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).last_hidden_state
        alone = model(ids[1:, :150]).last_hidden_state
    torch.testing.assert_close(batched[1, :150], alone[0], rtol=1e-4, atol=1e-4)


def test_a_linformer_converted_long_projects_n_tokens_onto_the_sources_positions_by_default():
    model, _ = convert_bert(tiny_bert(), "linformer", max_length=N)
    assert (model.config.max_seq_length, model.config.projected_length) == (N, 64)
    with pytest.raises(ValueError, match=r"max_seq_length=100 and max_length=200 disagree"):
        convert_bert(tiny_bert(), "linformer", max_length=N, max_seq_length=100)


def test_a_long_conversion_refuses_a_bad_length_or_position_init_by_name():
    with pytest.raises(ValueError, match=r"max_length must be >= 3"):
        convert_bert(tiny_bert(), "performer", max_length=2)
    with pytest.raises(TypeError, match=r"max_length must be an int"):
        convert_bert(tiny_bert(), "performer", max_length=256.0)
    with pytest.raises(ValueError, match=r"long_positions must be one of 'tile', 'interpolate'"):
        convert_bert(tiny_bert(), "performer", max_length=N, long_positions="stretch")
    with pytest.raises(ValueError, match=r"long_positions='interpolate' sets the rows of a long conversion"):
        convert_bert(tiny_bert(), "performer", long_positions="interpolate")


@pytest.mark.parametrize("family", FAMILIES)
def test_long_transfer_fits_the_attention_on_blocks_longer_than_the_source_reads(family):
    bert = tiny_bert()
    model, _ = convert_bert(bert, family, max_length=N, **FAMILIES[family])
    report = long_attention_transfer(model, bert, _ids(12, N), args=quick(steps=20, finetune_steps=2))
    assert sum(report.error_after) < sum(report.error_before)
    assert report.finetune_loss_after is not None
    if family == "performer":  # the query scale is fitted on the teacher's chunks, one residual per layer
        assert len(report.query_scale_residual) == 2


def test_long_steps_train_on_full_length_blocks_beside_the_short_ones_and_report_both_losses():
    """finetune_long_steps: after stage 2 on short blocks, each step's loss is a full-length block's plus a short
    batch's; the report measures both on held-out blocks, and the long loss falls. Read with the hybrid at every
    length, the short loss before the long steps is the one stage 2 ended with."""
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", max_length=N, hybrid_exact_length=None, **SCALED)
    args = quick(steps=5, finetune_steps=2, finetune_long_steps=8, finetune_new_learning_rate=3e-3)
    model.train()
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    report = long_attention_transfer(model, bert, _ids(12, 32), args=args, long_input_ids=_ids(3, N, seed=1))
    assert report.long_finetune_steps == 8 and report.long_finetune_seconds > 0
    assert report.long_finetune_loss_after < report.long_finetune_loss_before
    assert report.long_finetune_short_loss_before == pytest.approx(report.finetune_loss_after, rel=1e-4)
    assert report.long_finetune_short_loss_after is not None
    assert "long fine-tune" in str(report)
    assert model.training and flags == {name: p.requires_grad for name, p in model.named_parameters()}


def test_the_short_batch_of_a_long_step_counts_with_its_weight(monkeypatch):
    """finetune_long_short_weight w: a long step's loss is the long block's plus w times the short batch's (the same
    blocks for every w, from the same seed and the same converted weights)."""
    from linearformers.conversion import long_context

    bert = tiny_bert()
    first_loss = {}

    def first_step(groups, steps, loss_of_step, label, progress):
        with torch.no_grad():
            first_loss[weight] = loss_of_step(0).item()
        return [], 0.0

    monkeypatch.setattr(long_context, "_train", first_step)
    for weight in (0.0, 1.0, 3.0):
        torch.manual_seed(0)
        model, _ = convert_bert(bert, "performer", max_length=N, hybrid_exact_length=None, **SCALED)
        args = quick(steps=1, finetune_steps=1, finetune_long_steps=1, finetune_long_short_weight=weight)
        long_attention_transfer(model, bert, _ids(12, 32), args=args, long_input_ids=_ids(3, N, seed=1))
    short = first_loss[1.0] - first_loss[0.0]
    assert short > 0
    assert first_loss[3.0] - first_loss[0.0] == pytest.approx(3 * short, rel=1e-4)


@pytest.mark.parametrize(
    "weight, error", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError)]
)
def test_a_bad_short_weight_of_the_long_steps_is_refused_by_name(weight, error):
    with pytest.raises(error, match="finetune_long_short_weight"):
        quick(finetune_long_steps=1, finetune_long_short_weight=weight)


@pytest.mark.parametrize("source_training", [False, True], ids=["eval-source", "training-source"])
def test_a_long_transfer_leaves_the_source_in_its_mode_and_a_second_run_repeats_the_first(source_training):
    """The chunk-wise teacher wraps the user's BERT: its mode is the BERT's, so restoring it after the long steps
    leaves an eval BERT in eval mode (no dropout in what the user runs next), and the same conversion run twice in
    one process gives the same weights."""
    bert = tiny_bert().train(source_training)
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        model, _ = convert_bert(bert, "performer", max_length=N, **SCALED)
        args = quick(steps=2, finetune_steps=1, finetune_long_steps=2)
        long_attention_transfer(model, bert, _ids(12, 32), args=args, long_input_ids=_ids(3, N, seed=1))
        assert bert.training == source_training
        assert all(module.training == source_training for module in bert.modules())
        states.append(model.state_dict())
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (dict(long_input_ids=None), ValueError, "needs long_input_ids"),
        (dict(long_input_ids=_ids(1, N)), ValueError, "at least 2 blocks"),
        (dict(long_input_ids=_ids(2, N - 1)), ValueError, f"model's {N} tokens"),
        (dict(long_input_ids=_ids(2, N).float()), TypeError, "integer tensor"),
    ],
    ids=["missing", "one-block", "wrong-length", "floats"],
)
def test_long_steps_refuse_missing_or_wrong_long_blocks_by_name(call, error, match):
    bert = tiny_bert()
    model, _ = convert_bert(bert, "performer", max_length=N, **SCALED)
    with pytest.raises(error, match=match):
        long_attention_transfer(model, bert, _ids(12, 32), args=quick(steps=1, finetune_long_steps=1), **call)


def test_long_steps_are_refused_without_a_long_conversion_or_with_lora():
    with pytest.raises(ValueError, match="pass max_length too"):
        convert_bert(
            tiny_bert(), "performer", transfer=quick(finetune_long_steps=1), transfer_texts=["a b c"], **SCALED
        )
    with pytest.raises(ValueError, match="finetune='full'"):
        quick(finetune_long_steps=1, finetune="lora")


def test_a_long_model_round_trips_through_save_load_and_hub_export(tokenizer_dir, tmp_path):
    _saved_bert_with_a_tokenizer(tokenizer_dir, tmp_path / "bert")
    bert = BertModel.from_pretrained(tmp_path / "bert")
    model, _ = convert_bert(bert, "performer", max_length=N, **HEDGEHOG, hybrid_window=4)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, model_max_length=N)
    ids = torch.randint(1000, 2000, (1, N))
    model.save_pretrained(tmp_path / "saved")
    save_for_hub(model, tokenizer, tmp_path / "hub")
    with torch.no_grad():
        reference = model(ids).last_hidden_state
        for folder in ("saved", "hub"):
            loaded = AutoModel.from_pretrained(tmp_path / folder)
            assert loaded.config.max_position_embeddings == N
            torch.testing.assert_close(loaded(ids).last_hidden_state, reference)
    assert json.loads((tmp_path / "hub" / "sentence_bert_config.json").read_text())["max_seq_length"] == N


def _long_folder(tokenizer_dir, tmp_path, capsys) -> str:
    """A tiny BERT converted by the CLI to N tokens, with 2 transfer steps on blocks of N; the output folder."""
    _saved_bert_with_a_tokenizer(tokenizer_dir, tmp_path / "bert")
    text = tmp_path / "text.txt"
    text.write_text("Linear attention reads long documents at a cost linear in their length. " * 120)
    out = str(tmp_path / "out")
    transfer = ["--transfer_file", str(text), "--transfer_steps", "2", "--transfer_batch_size", "2"]
    main([str(tmp_path / "bert"), out, "--feature_map", "hedgehog", "--num_features", "16", "--hybrid_window", "4",
          "--hybrid_sinks", "1", "--max_length", str(N), *transfer])  # fmt: skip
    assert "relative error of each layer's attention output" in capsys.readouterr().out
    return out


def test_the_cli_converts_to_a_target_length_for_sentence_transformers_and_pipelines(tokenizer_dir, tmp_path, capsys):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    out = _long_folder(tokenizer_dir, tmp_path, capsys)
    assert AutoTokenizer.from_pretrained(out).model_max_length == N
    wrapped = sentence_transformers.SentenceTransformer(out, device="cpu")
    assert wrapped.max_seq_length == N
    text = " ".join(["attention"] * (N + 50))
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModel.from_pretrained(out)
    encoded = tokenizer([text], truncation=True, max_length=N, return_tensors="pt")
    assert encoded["input_ids"].shape == (1, N)
    with torch.no_grad():
        mean = model(**encoded).last_hidden_state.mean(1)
    torch.testing.assert_close(wrapped.encode([text], convert_to_tensor=True), mean, rtol=1e-4, atol=1e-5)
    features = pipeline("feature-extraction", model=out, device="cpu")(" ".join(["attention"] * (N - 2)))
    assert len(features[0]) == N


def test_the_cli_refuses_a_target_length_for_gpt2_in_one_line(tmp_path, capsys):
    from tests.conversion.test_transfer import tiny_gpt2

    tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "gpt2"), str(tmp_path / "out"), "--max_length", "1024"])
    assert exit_.value.code == 2
    assert "--max_length converts BERT encoders" in capsys.readouterr().err.splitlines()[-1]


def test_the_cli_refuses_a_position_init_without_a_target_length_in_one_line(tmp_path, capsys):
    tiny_bert().save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "bert"), str(tmp_path / "out"), "--long_positions", "interpolate"])
    assert exit_.value.code == 2
    assert "give --max_length too" in capsys.readouterr().err.splitlines()[-1]


def test_the_real_minilm_converts_to_1024_tokens_and_transfers_on_long_blocks(tokenizer_dir):
    """all-MiniLM-L6-v2 (512 positions) to 1024, two transfer steps on blocks of 1024 from a standard-library module."""
    import inspect
    import typing

    from linearformers.conversion.transfer import TransferArguments

    bert = BertModel.from_pretrained(tokenizer_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    args = TransferArguments(steps=2, batch_size=1, progress=False)
    model, report = convert_bert(
        bert, "performer", max_length=1024, feature_map="hedgehog", num_features=64, hybrid_window=64,
        hybrid_sinks=1, hybrid_query_scale=True, transfer=args, transfer_texts=[inspect.getsource(typing)],
        tokenizer=tokenizer,
    )  # fmt: skip
    assert report.transfer.steps == 2 and len(report.transfer.error_after) == 6
    ids = tokenizer([inspect.getsource(typing)], truncation=True, max_length=1024, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(ids).last_hidden_state.shape == (1, 1024, 384)
    with pytest.raises(ValueError, match=r"1025 tokens exceeds max_position_embeddings=1024"):
        model(torch.cat([ids, ids[:, :1]], 1))


def test_a_long_hybrid_reads_the_sources_positions_exactly_and_its_transfer_trains_the_hybrid(monkeypatch):
    """A long conversion's hybrid reads inputs of up to the source's positions exactly (hybrid_exact_length, unless
    given). Transfer and the long steps' long blocks, 32-token blocks that read would cover among them, train the
    hybrid: without the long steps' short term, the same weights as a conversion read with the hybrid at every
    length. The short term, and the held-out short loss the report gives, read the short blocks as saved: exactly.
    The field is back afterwards."""
    bert = tiny_bert()
    assert convert_bert(bert, "performer", max_length=N, **SCALED)[0].config.hybrid_exact_length == 64
    assert (
        convert_bert(bert, "performer", max_length=N, hybrid_exact_length=10, **SCALED)[0].config.hybrid_exact_length
        == 10
    )
    assert convert_bert(bert, "performer", **SCALED)[0].config.hybrid_exact_length is None  # no long conversion
    assert not hasattr(
        convert_bert(bert, "linformer", max_length=N, **FAMILIES["linformer"])[0].config, "hybrid_exact_length"
    )

    def converted(exact, **overrides):
        torch.manual_seed(0)
        model, _ = convert_bert(bert, "performer", max_length=N, hybrid_exact_length=exact, **SCALED)
        args = quick(steps=2, finetune_steps=1, finetune_long_steps=2, **overrides)
        report = long_attention_transfer(model, bert, _ids(12, 32), args=args, long_input_ids=_ids(3, N, seed=1))
        assert model.config.hybrid_exact_length == exact
        return model, report

    states = [converted(exact, finetune_long_short_weight=0.0)[0].state_dict() for exact in (64, None)]
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=0, atol=0, msg=key)

    reads = []  # (the block's length, the field while the loss reads it) at every loss of the long steps

    def spy(function):
        def read(model, teacher, ids, *rest):
            for block in ids if isinstance(ids, list) else [(ids,)]:
                reads.append((block[0].shape[-1], model.config.hybrid_exact_length))
            return function(model, teacher, ids, *rest)

        return read

    for name in ("_distillation_loss", "_mean_distillation_loss"):
        monkeypatch.setattr(long_context, name, spy(getattr(long_context, name)))
    model, report = converted(64)
    assert set(reads) == {(N, None), (32, 64)}
    assert "(read as saved: exactly up to 64 tokens)" in str(report)
    trained = converted(None)[0].state_dict()  # the short term read with the hybrid trains other weights
    assert not torch.equal(
        trained["layers.0.attention.q_proj.weight"], model.state_dict()["layers.0.attention.q_proj.weight"]
    )
    model.eval()
    with torch.no_grad():  # and the reading differs: 32 tokens exactly with the field
        model.config.hybrid_exact_length = None
        hybrid = model(_ids(1, 32)).last_hidden_state
        model.config.hybrid_exact_length = 64
        assert not torch.allclose(model(_ids(1, 32)).last_hidden_state, hybrid, atol=1e-4)
