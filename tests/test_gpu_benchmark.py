"""Smoke test of benchmarks/gpu.py on CPU: it runs end to end and writes the JSON it promises. No timings checked."""

import json
from pathlib import Path

from tests.conftest import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def test_gpu_benchmark_cpu_quick(tmp_path):
    done = run_script(SCRIPT, "--device", "cpu", "--quick", "--out", str(tmp_path), timeout=120)
    assert "Targets (H100)" in done.stdout
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert set(result) >= {"header", "attention", "training", "targets"}
    header = result["header"]
    for key in ("device", "torch", "transformers", "fla", "command", "timing", "memory"):
        assert key in header
    assert header["device_type"] == "cpu" and "--quick" in header["command"]
    lengths = {"64", "128"}

    rows = result["attention"]["rows"]
    names = ("sdpa", "sdpa_causal", "favor/auto", "favor_causal/auto", "favor_causal/chunked", "linformer/auto")
    # linear_causal: linear_attention on precomputed FAVOR+ features, the same inputs as the fla row
    learned = ("hedgehog/auto", "hedgehog_causal/auto", "hybrid", "hybrid_causal/auto", "linformer_hybrid")
    for name in (
        *names,
        *learned,
        "linformer/sdpa",
        "linformer_causal/auto",
        "linear_causal/auto",
        "linear_causal/chunked",
    ):
        assert set(rows[name]) == lengths
        for row in rows[name].values():
            assert row["status"] == "ok" and row["seconds"] > 0 and row["peak_mb"] is None  # no memory on CPU
    assert {row["status"] for row in rows["fla_causal"].values()} <= {"not installed", "unavailable"}
    for name in rows:  # each backend this checkout has: measured, or recorded as refused
        for row in rows[name].values():
            assert row["status"] in {"ok", "unavailable", "not installed"}, (name, row)
    assert set(result["attention"]["ratios"]["favor_causal/auto"]) == lengths

    rows = result["training"]["rows"]
    assert set(rows) == {"gpt2", "performer_clm", "linformer_clm", "bert", "performer_mlm", "linformer_mlm"}
    for by_n in rows.values():
        assert set(by_n) == lengths
        assert all(row["status"] == "ok" and row["tokens_per_s"] > 0 for row in by_n.values())
    ratios = result["training"]["ratios"]
    assert "tokens_per_s_vs_gpt2" in ratios["performer_clm"]["128"]
    assert "tokens_per_s_vs_bert" in ratios["performer_mlm"]["128"]

    verdicts = {t["verdict"] for t in result["targets"]}
    assert verdicts == {"not measured"}  # the H100 targets need 16K / 64K on a GPU


def test_host_time_cpu_smoke(tmp_path):
    """benchmarks/host_time.py on the CPU: each kernel's row (event time, host times, launches, top ops) and a
    profiled training step reach its JSON; a kernel it cannot build is recorded, not raised."""
    script = SCRIPT.parent / "host_time.py"
    done = run_script(
        script, "--device", "cpu", "--kernels", "sdpa_causal", "favor_causal/chunked", "no_such_kernel",
        "--lengths", "64", "--repeats", "1", "--models", "performer_clm", "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    rows = json.loads((tmp_path / "host_time.json").read_text())["rows"]
    for name in ("sdpa_causal 64", "favor_causal/chunked 64"):
        row = rows[name]
        assert row["event_ms"] > 0 and row["host_fwd_ms"] > 0 and row["host_bwd_ms"] > 0, row
        assert row["top_host_ops"] and row["launches"] == {}
    assert rows["no_such_kernel 64"]["status"].startswith("ValueError: unknown attention kernel")
    assert rows["train performer_clm 64"]["step_ms"] > 0
    assert "wrote" in done.stdout
