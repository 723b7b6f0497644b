"""benchmarks/report.py: the benchmark tables are generated from the result files, stamped by them, and cannot drift."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
report = load_script(ROOT / "benchmarks" / "report.py")
stamp = load_script(ROOT / "benchmarks" / "_stamp.py")

STAMP = {
    "command": "python benchmarks/training.py --lengths 512 --out /somewhere/else",
    "commit": "abc1234",
    "device": "Some CPU, 2 cores",
    "load_average_before": [0.5, 0.7, 0.9],
    "load_average_after": [1.25, 1.0, 0.9],
}


def _training(header: dict | None = STAMP) -> dict:
    row = {"tokens_per_s": 100.0, "seconds": 1.0, "peak_mb": 10.0}
    data = {"shape": {}, "rows": {"identity": {"512": row}, "performer": {"512": {**row, "tokens_per_s": 90.0}}}}
    return {"header": header, **data} if header else data


def test_checked_in_pages_equal_what_the_results_give():
    """benchmarks/README.md and the README's generated tables are exactly report.py's output from the checked-in
    results: edit a result or the script without regenerating, and this fails."""
    assert (ROOT / "benchmarks" / "README.md").read_text() == report.benchmarks_readme()
    readme = (ROOT / "README.md").read_text()
    assert readme == report.fill(readme, report.readme_tables())


def test_check_flag_exits_1_and_names_a_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "BENCHMARKS_README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text("stale\n")
    assert report.main(["--check"]) == 1
    assert f"{tmp_path / 'README.md'} differs from what the results give" in capsys.readouterr().out
    assert (tmp_path / "README.md").read_text() == "stale\n"  # --check writes nothing


def test_a_table_carries_the_stamp_of_its_result_file(tmp_path):
    (tmp_path / "training.json").write_text(json.dumps(_training()))
    page = report.benchmarks_readme(tmp_path)
    assert "| 512 | 100 | 90 (90%) | - |" in page
    line = next(line for line in page.splitlines() if line.startswith("Run: "))
    assert line == (
        "Run: `python benchmarks/training.py --lengths 512` · commit abc1234 · Some CPU, 2 cores · "
        "load average: 0.50 before, 1.25 after"
    )  # the --out folder names the machine, not the figures: dropped


def test_a_result_without_a_stamp_says_unknown(tmp_path):
    (tmp_path / "training.json").write_text(json.dumps(_training(header=None)))
    assert "Run: `unknown` · commit unknown · unknown · load average: unknown" in report.benchmarks_readme(tmp_path)


def test_paired_rows_from_two_runs_name_their_run(tmp_path):
    """Later paired runs replace only their own keys, so one file holds several runs: each row names its stamp."""
    other = {**STAMP, "commit": "def5678"}
    (tmp_path / "attention_paired.json").write_text(json.dumps({"performer@4096": [2.0, 3.0], "linformer@4096": [4.0]}))
    (tmp_path / "attention_paired_memory.json").write_text(json.dumps({"linformer@4096": [[10, 20]]}))
    (tmp_path / "attention_paired_stamp.json").write_text(
        json.dumps({"performer@4096": STAMP, "linformer@4096": other})
    )
    page = report.benchmarks_readme(tmp_path)
    assert "| linformer | 4096 | 1 | 4.00x | 10 / 20 | 1 |" in page
    assert "| performer | 4096 | 2 | 2.50x (2.00-3.00x) | - | 2 |" in page
    assert "1. `python benchmarks/training.py --lengths 512` · commit def5678" in page
    assert "2. `python benchmarks/training.py --lengths 512` · commit abc1234" in page


def test_a_result_file_without_a_table_is_refused(tmp_path):
    (tmp_path / "mystery.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no table for \['mystery.json'\]: add them to SECTIONS"):
        report.benchmarks_readme(tmp_path)


def test_fill_replaces_only_between_the_markers():
    text = "keep\n<!-- generated: speed -->\nold\n<!-- end -->\nkeep too\n"
    assert report.fill(text, {"speed": "new\n"}) == "keep\n<!-- generated: speed -->\nnew\n<!-- end -->\nkeep too\n"
    with pytest.raises(ValueError, match=r"no '<!-- generated: NAME -->' .* block for \['conversion'\]"):
        report.fill(text, {"speed": "new\n", "conversion": "x\n"})


def test_stamp_records_command_commit_device_and_load_before_and_after():
    found = stamp.finish_stamp(stamp.start_stamp())
    assert set(found) == {"command", "commit", "device", "load_average_before", "load_average_after"}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert found["commit"].removesuffix("-dirty") == head.stdout.strip()
    assert found["command"].startswith("python ") and len(found["load_average_after"]) == 3
    assert found["device"].endswith(" cores")


def test_stamp_command_is_the_script_and_its_arguments(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "training.py"), "--lengths", "512", "a b"])
    assert stamp.command() == "python benchmarks/training.py --lengths 512 'a b'"


def test_long_document_speed_table_has_each_method_its_median_its_times_and_the_load(tmp_path):
    data = {
        "header": STAMP,
        "settings": {"batch_size": 16, "repeats": 2, "threads": 2, "length": 8192, "model_dir": None},
        "load_before": [1.5, 1.25, 1.0],
        "load_after": [2.0, 1.5, 1.0],
        "rows": [
            {"method": "converted", "length": 8192, "seconds": 1.25, "times": [1.0, 1.5], "added_mb": 229.6},
            {"method": "original-chunked", "length": 8192, "seconds": 1.5, "times": [1.5, 1.5], "added_mb": None},
        ],
    }
    (tmp_path / "long_documents_speed.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "| converted | 1.250 | 1.000, 1.500 | 230 |" in page
    assert "| original-chunked | 1.500 | 1.500, 1.500 | - |" in page  # its memory worker failed
    assert "1.50, 1.25, 1.00 before the timed pairs, 2.00, 1.50, 1.00 after." in page
    assert "2 thread(s), converted without transfer, no far blocks;" in page


def test_long_document_speed_table_on_a_gpu_names_the_device_dtype_and_far_blocks(tmp_path):
    settings = {"batch_size": 16, "repeats": 1, "threads": 2, "length": 8192, "model_dir": None}
    settings.update(device="cuda", dtype="bfloat16", select_blocks=2, select_block_size=32)
    data = {
        "header": STAMP,
        "settings": settings,
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [1.0, 1.0, 1.0],
        "rows": [
            {"method": "converted", "length": 8192, "seconds": 0.04821, "times": [0.04821], "added_mb": 578.4},
            {"method": "original-chunked", "length": 8192, "seconds": 0.01364, "times": [0.01364], "added_mb": 66.0},
        ],
    }
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "long_documents_gpu_bfloat16_8192_far2.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "### `results/h200/long_documents_gpu_bfloat16_8192_far2.json`" in page
    assert "cuda, bfloat16, converted without transfer, far blocks 2 x 32;" in page
    assert "| converted | 0.0482 | 0.0482 | 578 |" in page


def test_long_documents_table_has_each_length_and_method_the_fidelity_and_the_timing(tmp_path):
    row = {"length": 8192, "method": "converted", "passage": {"top1": 0.5, "mrr": 0.625}, "seconds": 9.0}
    data = {
        "header": STAMP,
        "settings": {"lengths": [512, 8192], "passage": 64, "documents_used": 40},
        "rows": [{**row, "halves": {"top1": 0.75, "mrr": 0.8}}],
        "fidelity_cosine_256": 0.99213,
        "timing": [
            {"method": "converted", "length": 8192, "seconds": 1.5, "peak_mb": 812.4, "added_mb": 230.2},
            {"method": "original-chunked", "length": 8192, "seconds": 1.2, "peak_mb": 812.4},
        ],
    }
    (tmp_path / "long_documents.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "| 8192 | converted | 0.500 / 0.625 | 0.750 / 0.800 |" in page
    assert "at 256 tokens, 0.9921." in page
    assert "| converted | 1.500 | 230 | 812 |" in page
    assert "| original-chunked | 1.200 | - | 812 |" in page  # a result from before the memory was measured
    assert "Run: `python benchmarks/training.py --lengths 512` · commit abc1234" in page


def test_long_documents_table_gives_each_draw_of_the_passage_task_when_there_are_several(tmp_path):
    draws = [{"seed": 0, "top1": 0.5, "mrr": 0.6}, {"seed": 1, "top1": 0.75, "mrr": 0.8}]
    row = {"length": 8192, "method": "converted", "passage": {"top1": 0.625, "mrr": 0.7}, "passage_per_seed": draws}
    data = {
        "header": STAMP,
        "settings": {"lengths": [8192], "passage": 64, "documents_used": 40, "seed": 0, "seeds": 2},
        "rows": [{**row, "halves": {"top1": 0.75, "mrr": 0.8}, "seconds": 9.0}],
        "fidelity_cosine_256": 0.99,
        "timing": [],
    }
    (tmp_path / "long_documents.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "| length | method | passage top-1 / MRR, mean of 2 draws | passage top-1, seeds 0..1 |" in page
    assert "| 8192 | converted | 0.625 / 0.700 | 0.500 0.750 | 0.750 / 0.800 |" in page


def test_long_documents_table_gives_the_paired_comparison_where_the_result_has_it(tmp_path):
    row = {"length": 8192, "method": "converted", "passage": {"top1": 0.5, "mrr": 0.6}, "seconds": 9.0}
    paired = {
        "length": 8192, "task": "passage", "top1": {"difference": -0.00625, "low": -0.05, "high": 0.0375},
        "mrr": {"difference": 0.002, "low": -0.02, "high": 0.025}, "ours_only": 11, "theirs_only": 13,
    }  # fmt: skip
    data = {
        "header": STAMP,
        "settings": {"lengths": [8192], "passage": 64, "documents_used": 40},
        "rows": [{**row, "halves": {"top1": 0.75, "mrr": 0.8}}],
        "paired": [paired],
        "fidelity_cosine_256": 0.99,
        "timing": [],
    }
    (tmp_path / "long_documents.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "| 8192 | passage | -0.006 [-0.050, +0.037] | +0.002 [-0.020, +0.025] | 11 / 13 |" in page
    del data["paired"]  # a result from before the comparison: no table, no failure
    (tmp_path / "long_documents.json").write_text(json.dumps(data))
    assert "Paired, on the same queries" not in report.benchmarks_readme(tmp_path)


def test_a_saved_model_read_with_far_blocks_says_so_in_its_speed_table(tmp_path):
    settings = {"batch_size": 4, "repeats": 1, "threads": 2, "length": 8192, "model_dir": "/models/long"}
    settings.update(select_blocks=4, select_block_size=None, converted_select_blocks=4)
    row = {"method": "converted", "length": 8192, "seconds": 2.0, "times": [2.0], "added_mb": 72.0}
    data = {"header": STAMP, "settings": settings, "load_before": [1.0] * 3, "load_after": [1.0] * 3, "rows": [row]}
    (tmp_path / "long_documents_far_blocks_weighted30_read4_speed.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "2 thread(s), the model of `/models/long`, read with far blocks 4; chunks in batches of 4;" in page


def test_saved_models_read_with_far_blocks_get_a_column_for_the_count(tmp_path):
    rows = [
        {"model_dir": "/models/long", "select_blocks": 0, "error": 0.25, "cosine": 0.975},
        {"model_dir": "/models/long", "select_blocks": 4, "error": 0.09375, "cosine": 0.995},
    ]
    data = {"header": STAMP, "args": {"eval_blocks": 8, "block": 256}, "models": rows}
    (tmp_path / "conversion_long_models_read_far_blocks.json").write_text(json.dumps(data))
    page = report.benchmarks_readme(tmp_path)
    assert "| model | read with far blocks | hidden-state error | cosine |" in page
    assert "| `/models/long` | 4 | 0.0938 | 0.9950 |" in page
