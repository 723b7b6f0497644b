"""The example scripts run end to end (tiny models, a few steps), and FAVOR+ redraws work under Trainer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    Trainer,
    TrainingArguments,
)

from tests.conftest import tiny_config
from tests.training.conftest import TINY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COMMON = [
    "--max_steps",
    "3",
    "--per_device_train_batch_size",
    "4",
    "--use_cpu",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
    "--block_size",
    "32",
]


@pytest.mark.parametrize("script,family", [("run_clm.py", "performer"), ("run_mlm.py", "linformer")])
def test_language_modelling_examples_run(script, family, text_file, tmp_path):
    overrides = TINY + (",projected_length=8" if family == "linformer" else ",num_features=16")
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / script),
            "--family",
            family,
            "--train_file",
            text_file,
            "--output_dir",
            str(tmp_path),
            "--config_overrides",
            overrides,
            *COMMON,
        ],
        check=True,
        cwd=EXAMPLES,
        capture_output=True,
        timeout=300,
    )
    metrics = json.loads((tmp_path / "eval_results.json").read_text())
    assert metrics["perplexity"] > 1
    assert (tmp_path / "model.safetensors").exists()
    if script == "run_clm.py":  # a causal LM gets a byte-level BPE with an end-of-text that generation stops at
        tokenizer = AutoTokenizer.from_pretrained(tmp_path)
        assert tokenizer.eos_token == "<|endoftext|>" and "[CLS]" not in tokenizer.get_vocab()
        assert tokenizer.decode(tokenizer("def __init__(self):")["input_ids"]) == "def __init__(self):"
        config = AutoConfig.from_pretrained(tmp_path)
        assert config.eos_token_id == tokenizer.eos_token_id == GenerationConfig.from_pretrained(tmp_path).eos_token_id


def test_classification_example_reports_accuracy_and_f1(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("sentence,label\n" + "".join(f"nice film {i},pos\nbad film {i},neg\n" for i in range(30)))
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "run_classification.py"),
            "--train_file",
            str(csv),
            "--text_column",
            "sentence",
            "--output_dir",
            str(tmp_path / "out"),
            "--config_overrides",
            TINY,
            *COMMON,
        ],
        check=True,
        cwd=EXAMPLES,
        capture_output=True,
        timeout=300,
    )
    metrics = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert {"eval_accuracy", "eval_f1"} <= metrics.keys()


def test_feature_redraws_follow_the_schedule_under_trainer(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("performer", is_decoder=True, feature_redraw_interval=2))
    ids = torch.randint(1, 99, (6 * 4, 12))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=6,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    first = model.model.layers[0].attention.random_features.clone()
    Trainer(model=model, args=args, train_dataset=data).train()
    # 6 training forwards: draws at forwards 2 and 4 (the 3rd and 5th), so the features are draw number 2
    assert int(model.model.feature_redraws) == 6
    for layer in model.model.layers:
        expected = layer.attention.draw_features(2)
        torch.testing.assert_close(layer.attention.random_features, expected, rtol=0, atol=0)
    assert not torch.equal(model.model.layers[0].attention.random_features, first)


SCRIPT_ARGS = [sys.executable, str(EXAMPLES / "convert_and_finetune.py"), "--max_steps", "2"]


@pytest.mark.parametrize("family", ["performer", "linformer"])
def test_convert_and_finetune_example_runs_as_the_readme_says(family, tmp_path):
    """The README's conversion example: MiniLM converted, fine-tuned two steps, exported and reloaded."""
    done = subprocess.run(
        [*SCRIPT_ARGS, "--family", family, "--output_dir", str(tmp_path / "convert")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"reloaded {family.capitalize()}ForSequenceClassification" in done.stdout
