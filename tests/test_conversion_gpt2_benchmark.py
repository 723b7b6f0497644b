"""benchmarks/conversion_gpt2.py: its smoke mode runs every code path and writes the JSON it promises; its perplexity,
cache size and input checks are right. No timings checked."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tests.conftest import load_script, run_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "conversion_gpt2.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


def test_smoke_runs_every_setting_and_stage(bench, tmp_path):
    out = tmp_path / "result.json"
    done = run_script(SCRIPT, "--smoke", "--out", str(out), timeout=120)
    assert "| model | stage | steps | seconds | perplexity | ratio to original |" in done.stdout
    assert "shared CPU" in done.stdout
    result = json.loads(out.read_text())
    header = result["header"]
    assert header["test_blocks"] == 4 and header["test_tokens_scored"] == 4 * 79
    assert "--smoke" in header["command"] and len(header["load_average_after"]) == 3
    original = result["original"]["perplexity"]
    assert math.isfinite(original) and original > 1
    rows = {row["setting"]: row for row in result["rows"]}
    assert list(rows) == list(bench.SETTINGS) and len(rows) == 7  # every setting, by default
    assert rows["hedgehog+window64+sink"]["overrides"]["hybrid_sinks"] == 1
    assert rows["hedgehog+window64+scale"]["overrides"]["hybrid_query_scale"] is True
    assert rows["hedgehog+window64+scale+keyscale"]["overrides"]["hybrid_key_scale"] is True
    assert list(rows["random-m256"]["stages"]) == ["converted"]  # nothing to transfer
    assert rows["hedgehog"]["overrides"] == {"feature_map": "hedgehog", "num_features": 32}  # 2 x head_dim 16
    for name in list(rows)[1:]:
        stages = rows[name]["stages"]
        assert list(stages) == ["converted", "transfer", "finetune"]
        assert stages["transfer"]["steps"] == 2 and stages["finetune"]["steps"] == 2
        assert stages["finetune"]["mode"] == "lora" and stages["finetune"]["stage1_replayed_exactly"]
    for row in rows.values():
        for scored in row["stages"].values():
            assert scored["ratio"] == pytest.approx(scored["perplexity"] / original)
            assert scored["perplexity"] == pytest.approx(math.exp(scored["nll"]))
    # the random features change the model: its perplexity is not the original's
    assert rows["random-m256"]["stages"]["converted"]["ratio"] != pytest.approx(1.0, abs=1e-4)

    generation = result["generation"]
    assert generation["converted"]["setting"] in rows
    for side in ("original", "converted"):
        assert generation[side]["steps"] == 128 - 8
        assert len(generation[side]["tokens"]) == 128 - 8 + 1
        assert list(generation[side]["cache_bytes"]) == ["38", "128"]  # 8 + 120 / 4, and the end
        assert generation[side]["ms_first_quarter"] > 0 and generation[side]["ms_last_quarter"] > 0
    first, last = generation["converted"]["cache_bytes"].values()
    assert first == last > 0
    first, last = generation["original"]["cache_bytes"].values()
    assert last == first * 128 // 38  # GPT-2's keys and values grow with every token


def test_perplexity_is_exp_of_gpt2_mean_next_token_loss(bench):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    blocks = torch.randint(0, 50, (3, 12))
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss.item()  # the mean over the 3 x 11 predicted tokens
    # batches of 2 and 1 blocks: the mean must be over tokens, not over batches
    assert bench.perplexity(model, blocks, batch_size=2)["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_cache_bytes_counts_gpt2_keys_and_values(bench):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)).eval()
    with torch.no_grad():
        cache = getattr(model(input_ids=torch.randint(0, 50, (1, 5)), use_cache=True), bench.CACHE_FIELD)
    assert bench.cache_bytes(cache) == 2 * 2 * 5 * 16 * 4  # layers x (keys, values) x tokens x hidden x float32


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--model_dir is required"),
        (["--smoke", "--settings", "hedgehog", "softmax"], "unknown settings \\['softmax'\\]"),
        (["--model_dir", "x", "--block", "1"], "--block must be at least 2"),
        (["--model_dir", "x", "--lr", "0"], "--lr must be a finite number > 0"),
        (["--model_dir", "x", "--finetune_settings", "random-m256"], "random-m256 has no new attention"),
    ],
)
def test_bad_options_raise_value_error(bench, argv, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_args(argv)


def test_model_dir_without_held_out_texts_is_refused(bench, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no test.jsonl, validation.jsonl"):
        bench.load_folder(tmp_path)


def test_test_text_shared_with_transfer_text_is_refused(bench, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    row = json.dumps({"path": "abc.py", "text": "x = 1"}) + "\n"
    for name in ("validation.jsonl", "test.jsonl"):
        (tmp_path / name).write_text(row)
    with pytest.raises(ValueError, match="share files \\['abc.py'\\]"):
        bench.load_folder(tmp_path)


def test_block_longer_than_the_model_is_refused(bench, tmp_path):
    args = bench.parse_args(["--smoke", "--block", "256"])  # the smoke GPT-2 has 128 positions
    bench.build_smoke_folder(tmp_path)
    source, tokenizer, validation, test = bench.load_folder(tmp_path, 3)
    with pytest.raises(ValueError, match="--block 256 exceeds the model's n_positions 128"):
        bench.benchmark(args, source, tokenizer, validation, test)
