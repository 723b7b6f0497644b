"""linearformers-train as a command: exit status, error messages, the end-of-run summary, Trainer's argument names,
and the byte-level BPE tokenizer a causal LM gets by default."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from linearformers.training import train, train_bpe_tokenizer
from linearformers.training.__main__ import main, parse_arguments
from tests.training.conftest import TINY
from tests.training.test_loop import REPO, _args, _env

VENV_BIN = Path(sys.executable).parent
ENTRY_POINTS = {
    "console script": [str(VENV_BIN / "linearformers-train")],
    "python -m": [sys.executable, "-m", "linearformers.training"],
    "example": [sys.executable, str(REPO / "examples" / "train_accelerate.py")],
}


def _tiny_cli(text_file, out):
    return [
        *("--task", "clm", "--train_file", text_file, "--output_dir", str(out), "--config_overrides", TINY),
        *("--block_size", "16", "--max_steps", "2", "--save_steps", "1", "--save_total_limit", "1"),
        *("--tokenizer_vocab_size", "400", "--use_cpu", "--disable_tqdm", "true"),
    ]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_exits_0_and_says_where_the_model_is(entry, text_file, tmp_path):
    """Before, the console script exited 1 after every successful run, with the results dict (the model's repr
    included) on stderr. Also: no "Removed shared tensor" warning for the tied LM head at each checkpoint."""
    if not Path(ENTRY_POINTS[entry][0]).exists():
        pytest.skip(f"{ENTRY_POINTS[entry][0]} is not installed")
    out = tmp_path / "run"
    done = subprocess.run(
        [*ENTRY_POINTS[entry], *_tiny_cli(text_file, out)],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "{'results'" not in done.stderr and "PerformerForCausalLM(" not in done.stderr
    assert "Removed shared tensor" not in done.stderr + done.stdout
    assert f'AutoModelForCausalLM.from_pretrained("{out / "final"}")' in done.stdout
    assert "eval: eval_loss" in done.stdout and str(out / "results.json") in done.stdout


def test_bad_input_exits_2_with_a_one_line_message_and_no_traceback(text_file, tmp_path):
    cli = _tiny_cli(text_file, tmp_path / "run")
    cli[cli.index("clm")] = "translation"
    done = subprocess.run(
        [sys.executable, "-m", "linearformers.training", *cli],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    # --task declares its choices, so argparse names the bad value and the valid ones
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("linearformers-train: error: argument --task: invalid choice: 'translation'")
    )


def test_main_returns_the_exit_status(text_file, tmp_path, capsys):
    assert main(["--task", "clm", "--output_dir", str(tmp_path), "--train_file", "/nope.txt", "--use_cpu"]) == 2
    assert "linearformers-train: error: train file '/nope.txt' does not exist" in capsys.readouterr().err


def test_a_config_override_of_the_wrong_type_exits_2_naming_the_field(text_file, tmp_path, capsys):
    cli = ["--task", "mlm", "--output_dir", str(tmp_path), "--train_file", text_file, "--use_cpu", "true"]
    assert main([*cli, "--config_overrides", "hidden_size=12a"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("linearformers-train: error: Validation error for field 'hidden_size'")
    assert "expected int, got str (value: '12a')" in error and len(error.splitlines()) == 1


def test_the_cli_takes_trainer_names(tmp_path):
    args, training_args = parse_arguments(
        [
            *("--task", "mlm", "--output_dir", str(tmp_path), "--per_device_train_batch_size", "4"),
            *("--lr_scheduler_type", "cosine", "--bf16", "--use_cpu", "--save_steps", "10", "--save_total_limit", "3"),
            *("--eval_strategy", "steps", "--eval_steps", "5", "--tokenizer_name", "tok"),
            *("--resume_from_checkpoint", "true"),
        ]
    )
    assert (args.task, args.tokenizer_name) == ("mlm", "tok")
    assert training_args.per_device_train_batch_size == 4 and training_args.bf16 and training_args.use_cpu
    assert (training_args.save_steps, training_args.save_total_limit, training_args.eval_steps) == (10, 3, 5)
    assert training_args.lr_scheduler_type == "cosine" and training_args.resume_from_checkpoint == "true"


def test_the_bpe_tokenizer_round_trips_code_and_adds_nothing(text_file):
    tokenizer = train_bpe_tokenizer(Path(text_file).read_text().split("\n\n"), vocab_size=500)
    for text in ("def __init__(self):", "    return {'a': [1, 2]}\n\n# é ✓"):
        encoded = tokenizer(text)
        assert tokenizer.decode(encoded["input_ids"]) == text
        assert set(encoded) == {"input_ids", "attention_mask"}  # no token_type_ids, no [CLS] / [SEP]
    assert tokenizer.eos_token == tokenizer.pad_token == tokenizer.bos_token == "<|endoftext|>"


@pytest.fixture(scope="module")
def clm_run(text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("clm")
    common = dict(train_file=text_file, block_size=16, max_steps=2, save_steps=2, tokenizer_vocab_size=400)
    return out, common, train(*_args(out, **common))


def test_a_causal_lm_run_saves_a_generation_ready_tokenizer(clm_run):
    out, _, result = clm_run
    final = Path(result["final_dir"])
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert len(tokenizer) == 400 and tokenizer.eos_token == "<|endoftext|>"
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.eos_token_id
    # tied weights come back tied, although the checkpoints stored the shared tensor once
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator("def __init__(self):", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("def __init__(self):") and "[CLS]" not in text and "[SEP]" not in text
    assert AutoTokenizer.from_pretrained(out / "checkpoint-2").get_vocab() == tokenizer.get_vocab()


def test_causal_lm_blocks_separate_documents_with_end_of_text(text_file):
    from linearformers.training.data import load_raw_dataset, prepare_dataset

    raw = load_raw_dataset(text_file, sample_by="paragraph")
    tokenizer = train_bpe_tokenizer(raw["train"]["text"], vocab_size=400)
    data, _ = prepare_dataset(raw, tokenizer, "clm", 64)
    ids = torch.tensor(data["train"]["input_ids"])
    assert (ids == tokenizer.eos_token_id).sum() > 10
    assert "\n" in tokenizer.decode(ids[0])  # line breaks inside a paragraph are kept


def test_a_resume_reads_the_checkpoint_tokenizer_instead_of_training_another(clm_run, monkeypatch):
    from linearformers.training import loop

    out, common, first = clm_run
    monkeypatch.setattr(loop, "train_bpe_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer again"))
    resumed = train(*_args(out, **{**common, "max_steps": 3, "resume_from_checkpoint": "true"}))
    assert len(resumed["train_loss"]) == 3 and resumed["train_loss"][:2] == first["train_loss"]


def _fails_in_a_library():
    raise ValueError("a library's own failure, mid-run")


def test_a_value_error_from_outside_the_package_keeps_its_traceback(monkeypatch, capsys):
    """Only the package's own checks are one-line usage errors (exit 2); another ValueError is a bug or a library
    failing mid-run, and propagates with its traceback."""
    import linearformers.training.__main__ as cli

    monkeypatch.setattr(cli, "parse_arguments", lambda argv: ())
    monkeypatch.setattr(cli, "train", _fails_in_a_library)
    with pytest.raises(ValueError, match="mid-run"):
        cli.main([])
    assert "linearformers-train: error" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def one_paragraph(text_file, tmp_path_factory) -> str:
    """A text without blank lines: a causal LM's single document."""
    path = tmp_path_factory.mktemp("one") / "one_paragraph.txt"
    lines = [line for line in Path(text_file).read_text().splitlines() if line.strip()]
    path.write_text("\n".join(lines[:300]))
    return str(path)


def test_a_text_without_blank_lines_trains_holding_out_blocks(one_paragraph, tmp_path, capsys):
    """One document cannot be split into train and validation rows (datasets raised "the resulting train set will
    be empty", exit 1): a share of its blocks is held out instead."""
    cli = _tiny_cli(one_paragraph, tmp_path / "run")
    assert main([*cli, "--save_steps", "0"]) == 0, capsys.readouterr().err[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert math.isfinite(results["results"]["eval_loss"])


def test_a_text_of_one_block_exits_2_naming_the_way_out(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("def f(x):\n    return x + 1\n")
    assert main(_tiny_cli(str(text), tmp_path / "run")) == 2
    stderr = capsys.readouterr().err
    error = stderr.strip().splitlines()[-1]  # after the datasets progress bars
    assert "Traceback" not in stderr and stderr.count("linearformers-train: error") == 1
    assert re.match(r"linearformers-train: error: the training text gives [01] block\(s\) of block_size=16", error)
    assert "--validation_file" in error


def test_evaluations_at_eval_steps_are_printed_and_kept_in_results_json(text_file, tmp_path, capsys):
    cli = _tiny_cli(text_file, tmp_path / "run")
    assert main([*cli, "--save_steps", "0", "--eval_strategy", "steps", "--eval_steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert "step 1: eval_loss " in printed and "step 2: eval_loss " in printed
    evaluations = json.loads((tmp_path / "run" / "results.json").read_text())["evaluations"]
    assert [evaluation["step"] for evaluation in evaluations] == [1, 2]
    assert all(set(evaluation) == {"step", "eval_loss", "perplexity"} for evaluation in evaluations)


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_arguments(["--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_opens_with_a_short_usage_a_description_and_an_example(capsys):
    top = _help(capsys).split("options:")[0]
    usage, after = top.splitlines()[:2]  # one line, not the 150 of every option
    assert usage.startswith("usage: linearformers-train --task {mlm,clm,classification}") and after == ""
    assert "Train a Performer or Linformer" in top
    assert "example" in top and "linearformers-train --task clm --train_file train.txt" in top


@pytest.mark.parametrize(
    "flag,replacement",
    [
        ("--per_device_batch_size", "--per_device_train_batch_size"),
        ("--mixed_precision=bf16", "--bf16 or --fp16"),
        ("--lr_scheduler", "--lr_scheduler_type"),
        ("--eval_every", "--eval_strategy steps --eval_steps N"),
        ("--keep-checkpoints", "--save_total_limit"),
    ],
)
def test_a_removed_flag_exits_2_naming_its_replacement(flag, replacement, tmp_path, capsys):
    assert main(["--task", "clm", "--output_dir", str(tmp_path), flag, "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert error.startswith(f"linearformers-train: error: --{flag[2:].split('=')[0].replace('-', '_')} was removed")
    assert f"pass {replacement}" in error


def test_every_removed_flag_points_to_flags_the_command_has():
    from linearformers.training.__main__ import REMOVED_FLAGS, build_parser

    known = set(build_parser()._option_string_actions)
    for replacement in REMOVED_FLAGS.values():
        assert {
            word for word in replacement.replace("(", " ").replace(")", " ").split() if word.startswith("--")
        } <= known
