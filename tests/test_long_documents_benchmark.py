"""benchmarks/long_documents.py: its smoke mode (a tiny random BERT converted to 256 tokens, no transfer) runs every
code path and writes the JSON and plot it promises. No quality or timing thresholds checked."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertModel

from tests.conftest import load_script, run_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_documents.py"


def test_long_documents_smoke_scores_every_method_at_every_length_and_times_both(tmp_path):
    out = tmp_path / "long.json"
    done = run_script(SCRIPT, "--smoke", "--threads", "1", "--out", str(out))
    result = json.loads(out.read_text())
    rows = {(row["length"], row["method"]): row for row in result["rows"]}
    assert set(rows) == {
        (n, m) for n in (64, 128, 256) for m in ("original-chunked", "original-truncated", "converted")
    }
    for row in rows.values():
        for task in ("passage", "halves"):
            assert 0 <= row[task]["top1"] <= 1 and 0 < row[task]["mrr"] <= 1
    # a document no longer than the original's positions is one chunk: chunked and truncated embed it alike
    assert rows[64, "original-chunked"]["passage"] == rows[64, "original-truncated"]["passage"]
    assert {row["method"] for row in result["timing"]} == {"converted", "original-chunked"}
    assert all(row["length"] == 256 and row["peak_mb"] > 0 for row in result["timing"])
    assert all(isinstance(row["added_mb"], float) and row["added_mb"] > -1 for row in result["timing"])
    assert -1 <= result["fidelity_cosine_256"] <= 1 and "command" in result["header"]
    assert result["fidelity_error_256"] > 0  # random weights are far from the original
    assert "| 256 | converted |" in done.stdout
    # the converted model against original-chunked on the same queries, per length and task
    assert [(row["length"], row["task"]) for row in result["paired"]] == [
        (n, task) for n in (64, 128, 256) for task in ("passage", "halves")
    ]
    for row in result["paired"]:
        ours, theirs = rows[row["length"], "converted"], rows[row["length"], "original-chunked"]
        for key in ("top1", "mrr"):
            difference = ours[row["task"]][key] - theirs[row["task"]][key]
            assert row[key]["difference"] == pytest.approx(difference)
            assert row[key]["low"] <= row[key]["difference"] <= row[key]["high"]
    assert "converted - original-chunked, same queries" in done.stdout
    # the plot needs the [bench] extra's matplotlib; without it the script writes the JSON alone
    assert out.with_suffix(".png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_speed_mode_times_both_methods_in_turn_and_writes_their_medians(tmp_path):
    out = tmp_path / "speed.json"
    done = run_script(SCRIPT, "--smoke", "--speed", "--threads", "1", "--repeats", "3", "--out", str(out))
    result = json.loads(out.read_text())
    assert [row["method"] for row in result["rows"]] == ["converted", "original-chunked"]
    for row in result["rows"]:
        assert row["length"] == 256 and len(row["times"]) == 3 and row["seconds"] == sorted(row["times"])[1]
        assert isinstance(row["added_mb"], float) and row["added_mb"] > -1
    assert len(result["load_before"]) == len(result["load_after"]) == 3 and "command" in result["header"]
    assert "embed one 256-token document, converted: median" in done.stdout


def test_speed_mode_runs_in_a_given_dtype_with_far_blocks_and_records_both(tmp_path):
    out = tmp_path / "speed.json"
    arguments = ["--dtype", "bfloat16", "--select_blocks", "1", "--select_block_size", "8", "--repeats", "1"]
    run_script(SCRIPT, "--smoke", "--speed", "--threads", "1", *arguments, "--unfused", "--out", str(out))
    result = json.loads(out.read_text())
    assert [row["method"] for row in result["rows"]] == ["converted", "original-chunked", "converted-unfused"]
    settings = result["settings"]
    want = {"device": "cpu", "dtype": "bfloat16", "select_blocks": 1, "select_block_size": 8, "unfused": True}
    assert {key: settings[key] for key in want} == want
    assert settings["converted_select_blocks"] == 1  # what the timed model's config held


def test_a_saved_model_is_read_with_the_far_blocks_asked_in_place_of_its_own(tmp_path):
    script = load_script(SCRIPT)
    original, converted = script.smoke_models(tmp_path, 64, select_blocks=1, select_block_size=8)
    base = ["--speed", "--model_dir", converted, "--original_dir", original]
    for extra, held in (([], 1), (["--select_blocks", "3"], 3), (["--select_blocks", "0"], 0)):
        model = script.load(script.parse_args(base + extra))[2]
        assert (model.config.hybrid_select_blocks, model.config.hybrid_select_block_size) == (held, 8)


def test_the_unfused_method_embeds_as_the_converted_model_and_leaves_the_kernels_switched_on(monkeypatch):
    """converted-unfused: the same model on the chunked core in place of the CPU walk (which the converted method
    takes: head_dim 16), the same embeddings within float32 rounding; the kernel switches are back on afterwards."""
    from linearformers.conversion.convert import convert_bert
    from linearformers.ops import hybrid as hybrid_module
    from linearformers.ops import native_walk_enabled
    from linearformers.ops.backends import triton_kernels_enabled

    script = load_script(SCRIPT)
    tokenizer = script.AutoTokenizer.from_pretrained(script.minilm_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    original = BertModel(config).eval()
    converted, _ = convert_bert(
        original, "performer", max_length=160, feature_map="hedgehog", num_features=16, hybrid_window=8,
        hybrid_sinks=1, hybrid_query_scale=True, hybrid_select_blocks=1, hybrid_select_block_size=32,
    )  # fmt: skip
    walks = []
    walk = hybrid_module.hybrid_bidirectional_forward
    monkeypatch.setattr(hybrid_module, "hybrid_bidirectional_forward", lambda *a, **k: walks.append(1) or walk(*a, **k))
    embed = script.Embedder(tokenizer, original, converted.eval(), 2)
    texts = [list(range(1005, 1150)), list(range(2007, 2090))]
    fused = embed("converted", texts)
    taken = len(walks)
    unfused = embed("converted-unfused", texts)
    assert taken > 0 and len(walks) == taken  # the walk ran for the first, not for the second
    torch.testing.assert_close(unfused, fused, rtol=1e-4, atol=1e-5)
    assert native_walk_enabled() and triton_kernels_enabled()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model_dir", "m", "--unfused"], "apply to --speed"),
        (["--speed", "--unfused", "--compile"], "--unfused takes no --compile"),
        (["--model_dir", "m", "--device", "cuda"], "apply to --speed"),
        (["--model_dir", "m", "--dtype", "bfloat16"], "apply to --speed"),
        (["--model_dir", "m", "--compile"], "apply to --speed"),
        (["--speed", "--select_blocks", "-1"], "--select_blocks must be at least 0"),
        (["--speed", "--select_block_size", "0"], "--select_block_size must be at least 1"),
    ],
)
def test_bad_speed_options_are_refused_by_name(arguments, message, capsys):
    script = load_script(SCRIPT)
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_original_chunked_weights_each_chunk_by_its_tokens():
    """A document of one full chunk and a 2-token tail embeds as the mean of every token state of both chunks, not
    as the mean of the two chunk embeddings (which would give the tail half the weight)."""
    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                   max_position_embeddings=12)
    ).eval()  # fmt: skip
    script = load_script(SCRIPT)
    embed = script.Embedder(SimpleNamespace(cls_token_id=1, sep_token_id=2), bert, None, batch_size=4)
    text = list(range(5, 17))  # 10 tokens fill the first chunk ([CLS] + 10 + [SEP]), 2 make the tail
    chunks = [embed.wrap(text[:10]), embed.wrap(text[10:])]
    with torch.no_grad():
        states = torch.cat([bert(input_ids=torch.tensor([chunk])).last_hidden_state[0] for chunk in chunks])
    torch.testing.assert_close(embed("original-chunked", [text])[0], states.mean(0), atol=1e-5, rtol=1e-5)


def test_added_peak_memory_counts_what_the_call_holds_at_its_peak_and_not_what_it_frees():
    """benchmarks/isolated.py's added_peak_mb, as the memory workers run it (a fresh process whose large allocations
    are mappings of their own): a 64 MB tensor made and freed inside the call counts, a call that makes nothing adds
    about nothing."""
    code = (
        f"import sys, torch; sys.path.insert(0, {str(SCRIPT.parent)!r}); import isolated; "
        "print(isolated.added_peak_mb(lambda: torch.ones(16 * 2**20).sum()), isolated.added_peak_mb(lambda: None))"
    )
    isolated = load_script(SCRIPT.parent / "isolated.py")
    environment = {**os.environ, isolated.MMAP_THRESHOLD_ENV: str(isolated.FOLLOW_TENSORS_THRESHOLD)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=True)
    tensor, nothing = (float(x) for x in done.stdout.split())
    assert 60 <= tensor < 100
    assert nothing < 8


def _bag_embedder():
    """Six documents of 40 tokens and an embedder of them for measure(): a bag of token vectors, so that a document
    shares most tokens with its passage; each method shifted by its name's length."""
    torch.manual_seed(0)
    table = torch.randn(400, 8)
    tokens = [list(range(40 * i, 40 * i + 40)) for i in range(6)]

    class Embed:
        body = 8

        def __call__(self, method, texts):
            return torch.stack([table[torch.tensor(text)].mean(0) + 0.1 * len(method) for text in texts])

    return tokens, Embed()


def test_several_seeds_average_the_passage_task_and_keep_each_draw():
    """--seeds S: the passage task is drawn S times (seeds --seed ..), its scores are the mean of the draws, each
    draw's beside them, and the first draw's are what one seed alone gives; the halves task is drawn once."""
    script = load_script(SCRIPT)
    tokens, embed = _bag_embedder()

    def run(seed, seeds):
        args = SimpleNamespace(lengths=[32], passage=4, seed=seed, seeds=seeds)
        return {row["method"]: row for row in script.measure(args, embed, tokens)[0]}

    several, first, second = run(3, 2), run(3, 1), run(4, 1)
    for method, row in several.items():
        draws = [first[method]["passage"], second[method]["passage"]]
        assert [draw["seed"] for draw in row["passage_per_seed"]] == [3, 4]
        for key in ("top1", "mrr"):
            assert row["passage"][key] == pytest.approx((draws[0][key] + draws[1][key]) / 2)
            assert [draw[key] for draw in row["passage_per_seed"]] == [draws[0][key], draws[1][key]]
        assert row["halves"] == first[method]["halves"]
        assert "passage_per_seed" not in first[method]
    # the two draws place the passages differently: averaging them is not one draw counted twice
    assert script.passage_task(tokens, 32, 4, 10, 3) != script.passage_task(tokens, 32, 4, 10, 4)


def _result_file(script, tokens, embed, folder, seed, seeds, **settings):
    """A result as run() writes it, from measure() on the bag embedder, written to folder; its path."""
    args = SimpleNamespace(lengths=[32], passage=4, seed=seed, seeds=seeds)
    rows, comparisons = script.measure(args, embed, tokens)
    base = dict(lengths=[32], documents=6, passage=4, batch_size=8, repeats=3, seed=seed, seeds=seeds,
                select_blocks=None, converted_select_blocks=0, documents_used=6, model_dir="m")  # fmt: skip
    result = {
        "header": {"command": f"run {seed}", "commit": "abc1234", "device": "cpu"},
        "settings": {**base, **settings},
        "rows": rows,
        "paired": comparisons,
        "fidelity_cosine_256": 0.9 + seed / 100,
        "fidelity_error_256": 0.2,
        "timing": [{"method": "converted", "length": 32, "seconds": float(seed), "peak_mb": 1.0}],
    }
    path = folder / f"run{seed}-{seeds}.json"
    path.write_text(json.dumps(result))
    return path


def _assert_close(ours, theirs):
    """Nested dicts and lists alike, their floats within float64 rounding."""
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys()
        for key in ours:
            _assert_close(ours[key], theirs[key])
    elif isinstance(ours, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _assert_close(a, b)
    else:
        assert ours == pytest.approx(theirs)


def test_combine_pools_runs_with_disjoint_draws_as_one_run_of_them_all(tmp_path):
    """--combine: draws 3-4 from one run and 5 from another make the result one run of draws 3-5 gives: the same
    ranks, means, draws and paired intervals; the halves task and the fidelity come from the run of the first seed,
    no times are pooled, and each run's stamp is kept. The report renders it with its draws and no time table."""
    script = load_script(SCRIPT)
    tokens, embed = _bag_embedder()
    later, earlier = (_result_file(script, tokens, embed, tmp_path, seed, seeds) for seed, seeds in ((5, 1), (3, 2)))
    whole = json.loads(_result_file(script, tokens, embed, tmp_path, 3, 3).read_text())
    out = tmp_path / "pooled" / "five.json"
    script.main(["--combine", str(later), str(earlier), "--out", str(out)])  # given out of order
    pooled = json.loads(out.read_text())
    assert pooled["settings"]["seed"] == 3 and pooled["settings"]["seeds"] == 3
    for ours, theirs in zip(pooled["rows"], whole["rows"], strict=True):
        assert (ours["length"], ours["method"]) == (theirs["length"], theirs["method"])
        assert ours["passage_ranks"] == theirs["passage_ranks"] and ours["halves_ranks"] == theirs["halves_ranks"]
        assert ours["passage"] == pytest.approx(theirs["passage"])
        assert [d["seed"] for d in ours["passage_per_seed"]] == [3, 4, 5]
        _assert_close(ours["passage_per_seed"], theirs["passage_per_seed"])
    _assert_close(pooled["paired"], whole["paired"])
    assert pooled["fidelity_cosine_256"] == pytest.approx(0.93) and pooled["timing"] == []
    assert [(s["seed"], s["seeds"], s["header"]["command"]) for s in pooled["sources"]] == [
        (3, 2, "run 3"),
        (5, 1, "run 5"),
    ]
    assert {"command", "commit", "device"} <= set(pooled["header"])  # the pooling's own stamp
    report = load_script(SCRIPT.parent / "report.py")
    text = "\n".join(report.section_long_documents(out))
    assert "mean of 3 draws" in text and "seeds 3..5" in text and "-token document" not in text


def test_combine_with_a_gap_between_the_draws_names_each_seed_in_the_report(tmp_path, capsys):
    """Draws 3 and 5, pooled without 4: the pooled result keeps each draw's own seed, the command says they are not
    one range, and the report's per-draw column names them one by one, not as the range 3..4."""
    script = load_script(SCRIPT)
    tokens, embed = _bag_embedder()
    runs = [_result_file(script, tokens, embed, tmp_path, seed, 1) for seed in (3, 5)]
    out = tmp_path / "gapped.json"
    script.main(["--combine", *map(str, runs), "--out", str(out)])
    assert "not one range" in capsys.readouterr().out
    pooled = json.loads(out.read_text())
    assert [draw["seed"] for draw in pooled["rows"][0]["passage_per_seed"]] == [3, 5]
    report = load_script(SCRIPT.parent / "report.py")
    text = "\n".join(report.section_long_documents(out))
    assert "seeds 3, 5" in text and "3..4" not in text


@pytest.mark.parametrize(
    "case, message",
    [
        ("overlap", "both hold the draw of seed 4"),
        ("model", "differ in model_dir"),
        ("speed", "no passage ranks"),
        ("missing", "cannot read"),
    ],
)
def test_combine_refuses_runs_that_cannot_be_pooled_in_one_line(case, message, tmp_path, capsys):
    script = load_script(SCRIPT)
    tokens, embed = _bag_embedder()
    first = _result_file(script, tokens, embed, tmp_path, 3, 2)
    if case == "overlap":
        other = _result_file(script, tokens, embed, tmp_path, 4, 1)
    elif case == "model":
        other = _result_file(script, tokens, embed, tmp_path, 5, 1, model_dir="another")
    elif case == "speed":
        other = tmp_path / "speed.json"
        other.write_text(json.dumps({"header": {}, "settings": {"seed": 0, "seeds": 1}, "rows": [{"seconds": 1}]}))
    else:
        other = tmp_path / "nowhere.json"
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--combine", str(first), str(other), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "arguments, message",
    [(["--combine", "a.json", "--out", "c.json"], "two or more"), (["--combine", "a.json", "b.json"], "and --out"),
     (["--combine", "a.json", "b.json", "--out", "a.json"], "is one of the results")],
)  # fmt: skip
def test_combine_needs_two_results_and_a_new_out(arguments, message, capsys):
    script = load_script(SCRIPT)
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_paired_comparison_gives_the_difference_its_bootstrap_interval_and_the_discordant_queries():
    """paired(ours, theirs): ranks of two methods on the same queries, (draws, documents). The difference is of the
    means; the interval is a bootstrap over documents, so it is a point where every document differs alike and
    covers 0 where they disagree both ways; the discordant counts are the queries one method alone gets first."""
    script = load_script(SCRIPT)
    same = script.paired([[1, 2, 1, 3]], [[1, 2, 1, 3]])
    for key in ("top1", "mrr"):
        assert same[key] == {"difference": 0.0, "low": 0.0, "high": 0.0}
    assert same["ours_only"] == same["theirs_only"] == 0
    # ours first on every query, theirs second: +1 top-1 and +0.5 MRR on every document, whatever the resample
    better = script.paired([[1, 1, 1], [1, 1, 1]], [[2, 2, 2], [2, 2, 2]])
    assert better["top1"] == pytest.approx({"difference": 1.0, "low": 1.0, "high": 1.0})
    assert better["mrr"] == pytest.approx({"difference": 0.5, "low": 0.5, "high": 0.5})
    assert (better["ours_only"], better["theirs_only"]) == (6, 0)
    # half the documents go each way: the mean difference is 0 and the interval holds both signs
    mixed = script.paired([[1, 2] * 20], [[2, 1] * 20])
    assert mixed["top1"]["difference"] == 0.0 and mixed["top1"]["low"] < 0 < mixed["top1"]["high"]
    assert (mixed["ours_only"], mixed["theirs_only"]) == (20, 20)
    # the draws of one document move together: the bootstrap resamples documents, not queries, so a difference
    # carried by one document's draws alone keeps a wide interval however many draws repeat it
    one = script.paired([[1, 2, 2, 2]] * 8, [[2, 2, 2, 2]] * 8)
    assert one["top1"]["difference"] == pytest.approx(0.25) and one["top1"]["low"] == 0.0
    with pytest.raises(ValueError, match="one shape"):
        script.paired([[1, 2]], [[1, 2, 3]])
