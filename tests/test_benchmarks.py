"""Smoke tests of benchmarks/attention.py and benchmarks/training.py: the learned-map and hybrid rows build, run
forward + backward, mask as their names say, and the CLI writes its JSON where --out says. No timings checked."""

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from linearformers.ops import HedgehogFeatureMap
from tests.conftest import load_script, run_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    return load_script(BENCHMARKS / f"{name}.py")


@pytest.fixture(scope="module")
def attention():
    return _load("attention")


@pytest.fixture(scope="module")
def training():
    return _load("training")


@pytest.fixture
def keep_threads():
    """The workers set torch's thread count (each normally runs in its own process): put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_learned_rows_are_listed(attention):
    assert {"hedgehog", "hedgehog_causal", "hybrid", "hybrid_causal"} <= set(attention.KERNELS)
    assert "layer_performer_hedgehog_hybrid" in attention.LAYERS
    assert attention.HEDGEHOG_FEATURES == 2 * attention.DIM and attention.WINDOW == 64


@pytest.mark.parametrize("name", ["hedgehog", "hedgehog_causal", "hybrid", "hybrid_causal"])
def test_learned_kernel(attention, name):
    n = 150  # not a multiple of the window: the hybrid pads its last block
    torch.manual_seed(0)
    fn = attention._kernel(name, n)
    assert isinstance(fn.feature_map, HedgehogFeatureMap)
    assert fn.feature_map.num_features == attention.HEDGEHOG_FEATURES
    assert (fn.balance is not None) == name.startswith("hybrid")
    q, k, v = (torch.randn(1, attention.HEADS, n, attention.DIM, requires_grad=True) for _ in range(3))
    out = fn(q, k, v)
    assert out.shape == v.shape and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    params = [fn.feature_map.weight, fn.feature_map.key_weight] + ([fn.balance] if fn.balance is not None else [])
    for t in (q, k, v, *params):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    # a change to the last position's value reaches the earlier outputs only without causal masking
    with torch.no_grad():
        v2 = v.clone()
        v2[:, :, -1] += 1.0
        moved = (fn(q, k, v2) - out)[:, :, :-1].abs().amax()
    assert (moved == 0) == name.endswith("_causal")


def test_hybrid_rows_differ_from_plain_linear(attention):
    n = 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, attention.HEADS, n, attention.DIM) for _ in range(3))
    torch.manual_seed(1)
    plain = attention._kernel("hedgehog_causal", n)
    hybrid = attention._kernel("hybrid_causal", n)
    with torch.no_grad():
        # the first position sees itself alone: both give v_0 there; later ones weigh the window by softmax
        a, b = plain(q, k, v), hybrid(q, k, v)
    torch.testing.assert_close(a[:, :, 0], v[:, :, 0])
    torch.testing.assert_close(b[:, :, 0], v[:, :, 0])
    assert (a[:, :, 1:] - b[:, :, 1:]).abs().amax() > 1e-3


def test_hybrid_layer_row(attention):
    layer = attention._layer("layer_performer_hedgehog_hybrid", 96)
    config = layer.config
    assert config.feature_map == "hedgehog" and config.hybrid_window == attention.WINDOW
    assert config.num_features == attention.HEDGEHOG_FEATURES
    assert isinstance(layer.feature_map, HedgehogFeatureMap) and layer.window_balance is not None
    assert not layer.causal


@pytest.mark.parametrize("name", ["hedgehog_causal", "hybrid", "layer_performer_hedgehog_hybrid"])
def test_attention_worker(attention, keep_threads, name):
    row = attention.worker(name, 96, 1, 1)
    assert row["seconds"] > 0 and row["peak_mb"] >= 0


@pytest.mark.parametrize("name", ["performer_hedgehog", "performer_hybrid"])
def test_training_models(training, keep_threads, name):
    config = training.build(name, 64).config
    assert config.feature_map == "hedgehog" and config.num_features == 128
    assert config.hybrid_window == (64 if name == "performer_hybrid" else None)
    row = training.worker(name, 64, 1, 1)
    assert row["tokens_per_s"] > 0 and row["seconds"] > 0


def test_attention_paired_cli_writes_to_out(tmp_path):
    done = run_script(
        BENCHMARKS / "attention.py", "--paired", "hybrid_causal", "--lengths", "64",
        "--pairs", "1", "--repeats", "1", "--threads", "1", "--out", str(tmp_path), timeout=120,
    )  # fmt: skip
    assert "hybrid_causal" in done.stdout and "vs sdpa_causal" in done.stdout
    ratios = json.loads((tmp_path / "attention_paired.json").read_text())
    assert list(ratios) == ["hybrid_causal@64"] and len(ratios["hybrid_causal@64"]) == 1
    assert ratios["hybrid_causal@64"][0] > 0
    memory = json.loads((tmp_path / "attention_paired_memory.json").read_text())
    assert list(memory) == ["hybrid_causal@64"] and len(memory["hybrid_causal@64"]) == 1
    assert len(memory["hybrid_causal@64"][0]) == 2 and " MB vs sdpa_causal " in done.stdout


def test_mmap_threshold_reaches_the_workers_and_names_the_results(tmp_path, monkeypatch):
    """--malloc_mmap_threshold puts glibc's MALLOC_MMAP_THRESHOLD_ in the environment of every measurement
    subprocess (each row says what it ran under) and writes its results under their own names."""
    isolated = load_script(BENCHMARKS / "isolated.py")
    monkeypatch.delenv(isolated.MMAP_THRESHOLD_ENV, raising=False)
    parser = argparse.ArgumentParser()
    isolated.add_allocator_argument(parser)
    assert isolated.apply_allocator_argument(parser.parse_args([])) == ""
    assert isolated.MMAP_THRESHOLD_ENV not in os.environ
    with pytest.raises(SystemExit, match="must be > 0"):
        isolated.apply_allocator_argument(parser.parse_args(["--malloc_mmap_threshold", "0"]))
    done = run_script(
        BENCHMARKS / "attention.py", "--paired", "hedgehog", "--lengths", "64", "--pairs", "1", "--repeats", "1",
        "--threads", "1", "--out", str(tmp_path), "--malloc_mmap_threshold", "1073741824", timeout=120,
    )  # fmt: skip
    assert "vs sdpa" in done.stdout
    assert list(json.loads((tmp_path / "attention_paired_mmap_threshold.json").read_text())) == ["hedgehog@64"]
    assert (tmp_path / "attention_paired_mmap_threshold_memory.json").exists()
    assert not (tmp_path / "attention_paired.json").exists()
    row = isolated.run_isolated(BENCHMARKS / "attention.py", ["--worker", "hedgehog", 64, "--repeats", 1])
    assert row["malloc_mmap_threshold"] is None
    monkeypatch.setenv(isolated.MMAP_THRESHOLD_ENV, "1073741824")
    row = isolated.run_isolated(BENCHMARKS / "attention.py", ["--worker", "hedgehog", 64, "--repeats", 1])
    assert row["malloc_mmap_threshold"] == "1073741824"


def test_feature_map_backward_compares_the_two_maps_and_writes_to_out(tmp_path):
    """The composed variant really runs the torch composition (it keeps more for backward than softmax_pair on the
    plain learned map, the same outputs), and the CLI writes its rows where --out says."""
    out = tmp_path / "rows.json"
    done = run_script(
        BENCHMARKS / "feature_map_backward.py", "--kernels", "hedgehog", "hybrid_causal", "--lengths", "64",
        "--pairs", "1", "--repeats", "1", "--threads", "1", "--out", str(out), timeout=180,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["n"]) for r in rows] == [("hedgehog", 64), ("hybrid_causal", 64)]
    plain = rows[0]
    assert plain["softmax_pair"][0]["saved_mb"] < plain["composed"][0]["saved_mb"]
    assert "| hedgehog | 64 |" in done.stdout


def test_the_composed_map_equals_softmax_pair():
    script = _load("feature_map_backward")
    u = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    from linearformers.ops.feature_maps import softmax_pair

    assert torch.equal(script.composed(u), softmax_pair(u))
