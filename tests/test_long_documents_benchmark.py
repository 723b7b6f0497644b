"""benchmarks/long_documents.py: its smoke mode (a tiny random BERT converted to 256 tokens, no transfer) runs every
code path and writes the JSON and plot it promises. No quality or timing thresholds checked."""

import importlib.util
import json
from pathlib import Path

from tests.conftest import run_script

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
    assert -1 <= result["fidelity_cosine_256"] <= 1 and "command" in result["header"]
    assert "| 256 | converted |" in done.stdout
    # the plot needs the [bench] extra's matplotlib; without it the script writes the JSON alone
    assert out.with_suffix(".png").exists() == (importlib.util.find_spec("matplotlib") is not None)
