"""examples/train_small_gpt2.py: a tiny run end to end gives a GPT-2 folder that loads, scores and converts."""

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

from linearformers.conversion.convert import convert_gpt2
from tests.conftest import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_small_gpt2.py"
TINY_RUN = [
    "--max_steps", "3", "--time_budget", "0", "--block_size", "32", "--batch_size", "2", "--vocab_size", "300",
    "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--n_positions", "64", "--eval_blocks", "6",
    "--max_files_per_split", "3", "--seed", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def tiny_run(script, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("small_gpt2")
    report = script.main(["--output_dir", str(output_dir), *TINY_RUN])
    return output_dir, report


def test_tiny_run_saves_a_gpt2_and_tokenizer_that_load(tiny_run):
    output_dir, report = tiny_run
    assert report["steps"] == 3 and not report["stopped_by_time_budget"]
    assert (output_dir / "model.safetensors").is_file()
    model = GPT2LMHeadModel.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert model.config.n_layer == 1 and model.config.n_embd == 32 and model.config.vocab_size == len(tokenizer) == 300
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    code = "def __init__(self):\n    self._x = {'a': 1}\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code


def test_validation_perplexity_is_exp_of_the_saved_models_mean_token_loss(script, tiny_run):
    output_dir, report = tiny_run
    assert math.isfinite(report["validation_perplexity"]) and report["validation_perplexity"] > 1
    model = GPT2LMHeadModel.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    texts = [json.loads(line)["text"] for line in (output_dir / "validation.jsonl").read_text().splitlines()]
    all_blocks = script.token_blocks(texts, tokenizer, 32, "validation")
    assert len(all_blocks) > 6 == report["validation_blocks"]
    blocks = torch.tensor(script.evenly_spaced(all_blocks, 6)["input_ids"])
    with torch.no_grad():
        logits = model(blocks).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    assert report["validation_perplexity"] == pytest.approx(math.exp(loss.item()), rel=1e-4)


def test_splits_are_disjoint_and_saved_with_the_held_out_text(script, tiny_run):
    output_dir, _ = tiny_run
    splits = json.loads((output_dir / "splits.json").read_text())
    names = [set(splits[name]) for name in ("train", "validation", "test")]
    assert all(len(files) == 3 for files in names)
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert all(script.split_of(path) == name for name in ("train", "validation", "test") for path in splits[name])
    held_out = [json.loads(line) for line in (output_dir / "test.jsonl").read_text().splitlines()]
    assert [row["path"] for row in held_out] == splits["test"]
    root = Path(splits["stdlib"])
    assert held_out[0]["text"] == (root / splits["test"][0]).read_bytes().decode("utf-8", errors="replace")


def test_the_trained_folder_converts_to_a_performer_close_to_it(tiny_run):
    output_dir, _ = tiny_run
    gpt2 = GPT2LMHeadModel.from_pretrained(output_dir).eval()
    model, report = convert_gpt2(str(output_dir), "performer", num_features=256)
    assert type(model).__name__ == "PerformerForCausalLM" and len(report.mapped) > 0
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = gpt2(ids).logits
        out = model.eval()(ids, use_cache=False).logits
    assert ((out - ref).norm() / ref.norm()).item() < 0.05


def test_the_split_of_the_whole_standard_library_is_about_80_10_10(script):
    splits = script.stdlib_splits(Path(sysconfig.get_paths()["stdlib"]), None)
    sizes = {name: len(files) for name, files in splits.items()}
    total = sum(sizes.values())
    assert 0.05 < sizes["validation"] / total < 0.15 and 0.05 < sizes["test"] / total < 0.15
    assert not any("site-packages" in path for files in splits.values() for path in files)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--n_embd", "30", "--n_head", "4"], "not divisible by --n_head"),
        (["--block_size", "1024"], "exceeds --n_positions 512"),
        (["--vocab_size", "100"], "--vocab_size must exceed 257"),
        (["--max_steps", "0"], "--max_steps must be at least 1"),
    ],
)
def test_bad_arguments_raise_a_value_error_naming_them(script, flags, message):
    with pytest.raises(ValueError, match=message):
        script.parse_args(["--output_dir", "unused", *flags])
