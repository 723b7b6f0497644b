"""Training never loses work: one run per output_dir, a resume that matches its checkpoint, an unwritable output_dir
or bad data found before training, a full disk named with the last checkpoint kept, mixed precision on CPU."""

import errno
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.testing_utils import CaptureLogger

from linearformers.training import latest_checkpoint, load_raw_dataset, train
from linearformers.training.__main__ import parse_arguments
from linearformers.training.checkpoint import checkpoints, step_of
from tests.training.conftest import TINY
from tests.training.test_loop import REPO, _args, _cli, _env

HOLD_LOCK = (
    "import sys; from linearformers.training.output_dir import lock_output_dir; lock = lock_output_dir(sys.argv[1]); "
    "print('locked', flush=True); sys.stdin.read()"
)


def test_a_locked_output_dir_refuses_another_process_until_its_holder_dies(tmp_path, text_file):
    """A helper process holds the lock: this process can neither lock the folder nor train into it; once the helper
    is killed with SIGKILL the lock is free again (so a run that crashed can be resumed)."""
    from linearformers.training.output_dir import lock_output_dir

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
        cwd=REPO,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            ValueError, match=f"output_dir {re.escape(str(out))} is in use by another training run"
        ) as e:
            lock_output_dir(out)
        assert f"pid {holder.pid}" in str(e.value)
        with pytest.raises(ValueError, match="is in use by another training run"):
            train(*_args(out, train_file=text_file))
        assert not (out / "checkpoints").exists() and not (out / "final").exists()
        holder.kill()
        holder.wait()
        lock_output_dir(out).release()
        train(*_args(out, train_file=text_file, save_steps=1))
        assert latest_checkpoint(out).name == "checkpoint-1"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_resume_into_the_output_dir_of_a_running_training_is_refused(tmp_path, text_file):
    """Two real runs, one output_dir: the second (a --resume, which today would write into the first one's
    checkpoints) is refused while the first trains; after the first is killed, the resume works."""
    out = tmp_path / "run"
    cli = _cli(text_file, out, "--save_strategy", "steps", "--save_steps", "1", "--max_steps", "100000")
    first = subprocess.Popen(
        [sys.executable, "-m", "linearformers.training", *cli],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 240
        while not (out / "latest").is_file():
            assert first.poll() is None and time.time() < deadline, "the first run never wrote a checkpoint"
            time.sleep(0.05)
        with pytest.raises(ValueError, match=f"output_dir {re.escape(str(out))} is in use by another training run"):
            train(*parse_arguments([*cli, "--resume_from_checkpoint", "true", "--max_steps", "2"]))
        assert first.poll() is None, "the first run did not survive the second one"
    finally:
        first.kill()
        first.wait()
    step = step_of(latest_checkpoint(out))
    resumed = train(*parse_arguments([*cli, "--resume_from_checkpoint", "true", "--max_steps", str(step + 1)]))
    assert len(resumed["train_loss"]) == step + 1


def test_resume_refuses_changes_that_break_exactness_naming_each(tmp_path, text_file):
    train(*_args(tmp_path, train_file=text_file, max_steps=2, save_steps=2))
    changed = TINY + ",feature_redraw_interval=3,feature_map=relu"
    with pytest.raises(ValueError) as caught:
        train(
            *_args(
                tmp_path,
                train_file=text_file,
                max_steps=4,
                resume_from_checkpoint="true",
                seed=1,
                block_size=32,
                per_device_train_batch_size=4,
                learning_rate=1e-3,
                config_overrides=changed,
            )
        )
    message = str(caught.value)
    assert str(tmp_path / "checkpoint-2") in message
    for difference in (
        "seed: 0 → 1",
        "block_size: 16 → 32",
        "per_device_train_batch_size: 8 → 4",  # Trainer would skip the steps done in batches of another size
        "feature_redraw_interval: 1000 → 3",
        "feature_map: 'softmax' →",
    ):
        assert difference in message
    assert "learning_rate" not in message  # a legitimate change: warned about, not refused


def test_resume_warns_on_changed_settings_and_the_new_learning_rate_takes_effect(tmp_path, text_file):
    """Resumed with learning rate 0, the weights stay those of the checkpoint: the new rate is the one used."""
    from linearformers.training import loop

    common = dict(train_file=text_file, save_steps=2, lr_scheduler_type="constant")
    train(*_args(tmp_path, max_steps=2, **common))
    before = load_file(tmp_path / "final" / "model.safetensors")
    with CaptureLogger(loop.logger) as captured:
        train(
            *_args(
                tmp_path,
                max_steps=4,
                eval_strategy="steps",
                eval_steps=3,
                learning_rate=0.0,
                resume_from_checkpoint="true",
                **common,
            )
        )
    for change in ("learning_rate: 0.0005 → 0.0", "max_steps: 2 → 4", "eval_strategy: 'no' → 'steps'"):
        assert change in captured.out
    after = load_file(tmp_path / "final" / "model.safetensors")
    for key in before:
        if not key.endswith("feature_redraws"):  # a count of forward passes, not a weight
            assert torch.equal(before[key], after[key]), key


def test_resume_from_a_checkpoint_without_saved_arguments_warns_and_continues(tmp_path, text_file):
    from linearformers.training import loop

    train(*_args(tmp_path, train_file=text_file, max_steps=2, save_steps=2))
    (latest_checkpoint(tmp_path) / "run.json").unlink()
    with CaptureLogger(loop.logger) as captured:
        out = train(*_args(tmp_path, train_file=text_file, max_steps=3, resume_from_checkpoint="true"))
    assert "cannot be compared" in captured.out
    assert len(out["train_loss"]) == 3


def test_an_unwritable_output_dir_is_refused_before_any_data_work(tmp_path, text_file, monkeypatch):
    from linearformers.training import loop

    monkeypatch.setattr(loop, "load_raw_dataset", lambda *a, **k: pytest.fail("data work began"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "run"
    with pytest.raises(ValueError, match=f"output_dir {re.escape(str(target))} is not writable"):
        train(*_args(target, train_file=text_file))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_dir_is_refused_before_any_data_work(tmp_path, text_file, monkeypatch):
    from linearformers.training import loop

    monkeypatch.setattr(loop, "load_raw_dataset", lambda *a, **k: pytest.fail("data work began"))
    target = tmp_path / "run"
    target.mkdir()
    target.chmod(0o555)
    try:
        with pytest.raises(ValueError, match=f"output_dir {re.escape(str(target))} is not writable"):
            train(*_args(target, train_file=text_file))
    finally:
        target.chmod(0o755)


@pytest.mark.parametrize(
    "name,body,message",
    [
        ("one.csv", "text,label\n" + "good one,pos\nbad one,pos\n" * 10, r"holds a single class \['pos'\]"),
        ("gaps.csv", "text,label\n" + "good one,pos\nbad one,neg\nno label,\n" * 10, "empty cells? in label column"),
        ("gaps-int.csv", "text,label\n" + "good one,1\nbad one,0\nno label,\n" * 10, "empty cells? in label column"),
        (
            "gaps.jsonl",
            '{"text": "good", "label": "pos"}\n{"text": "bad", "label": "neg"}\n{"text": "eh", "label": ""}\n' * 10,
            "empty cells? in label column",
        ),
    ],
)
def test_classification_refuses_a_single_class_or_empty_labels(tmp_path, name, body, message):
    data = tmp_path / name
    data.write_text(body)
    with pytest.raises(ValueError, match=message):
        train(*_args(tmp_path / "out", task="classification", train_file=str(data)))


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_mlm_probability_must_lie_strictly_between_0_and_1(tmp_path, text_file, value):
    with pytest.raises(
        ValueError, match=f"mlm_probability must be a probability strictly between 0 and 1, got {value}"
    ):
        train(*_args(tmp_path, task="mlm", train_file=text_file, mlm_probability=value))


@pytest.mark.parametrize("value", [0.0, 1.0, float("nan")])
def test_validation_split_must_lie_strictly_between_0_and_1(text_file, value):
    with pytest.raises(ValueError, match=f"validation_split must be a fraction strictly between 0 and 1, got {value}"):
        load_raw_dataset(text_file, validation_split=value)


@pytest.mark.parametrize(
    "name,content,problem",
    [
        ("empty.txt", b"", "is empty"),
        ("empty.csv", b"", "is empty"),
        ("empty.jsonl", b"", "is empty"),
        ("binary.txt", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, "is not UTF-8 text"),
        ("binary.csv", b"text,label\n" + bytes(range(256)) * 4, "is not UTF-8 text"),
    ],
)
def test_an_empty_or_binary_data_file_is_named(tmp_path, name, content, problem):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"train file '{re.escape(str(path))}' {problem}"):
        load_raw_dataset(str(path))


def test_an_empty_validation_file_is_named(tmp_path, text_file):
    empty = tmp_path / "valid.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"validation file '{re.escape(str(empty))}' is empty"):
        load_raw_dataset(text_file, validation_file=str(empty))


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4416 vs 4312"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_full_disk_during_a_checkpoint_is_named_and_the_last_checkpoint_kept(
    tmp_path, text_file, monkeypatch, failure
):
    from transformers import Trainer

    original = Trainer._save_optimizer_and_scheduler

    def save_optimizer_and_scheduler(self, output_dir):
        if str(output_dir).endswith("checkpoint-4"):  # half of the second checkpoint is written, then the disk is full
            (Path(output_dir) / "optimizer.pt").write_bytes(b"half")
            raise failure
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save_optimizer_and_scheduler)
    with pytest.raises(
        OSError, match=f"no space left on device while writing a checkpoint under {re.escape(str(tmp_path))}"
    ):
        train(*_args(tmp_path, train_file=text_file, max_steps=6, save_steps=2))
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-2"]
    monkeypatch.undo()
    assert (
        len(train(*_args(tmp_path, train_file=text_file, max_steps=3, resume_from_checkpoint="true"))["train_loss"])
        == 3
    )


PRECISION_WORKER = Path(__file__).parent / "_precision_run.py"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_cli_trains_a_performer_and_a_linformer_with_mixed_precision_on_cpu(tmp_path, text_file, precision):
    """A causal Performer and a masked-LM Linformer train in autocast's dtype with finite losses. Accelerate leaves
    fp16 on CPU off without a word; the run turns on autocast and a GradScaler itself."""
    runs = {  # m = 24 is no multiple of 16: the causal Performer takes the PyTorch walk, the one autocast crashed
        "performer": ["--task", "clm", "--config_overrides", TINY + ",num_features=24"],
        "linformer": ["--task", "mlm", "--config_overrides", TINY + ",projected_length=8"],
    }
    worker_args = [str(tmp_path / "dump.json")]
    for family, args in runs.items():
        args += ["--family", family, "--train_file", text_file, "--output_dir", str(tmp_path / family)]
        args += ["--block_size", "32", "--max_steps", "3", "--save_steps", "2", "--logging_steps", "1"]
        worker_args += [*args, "--use_cpu", "true", "--disable_tqdm", "true", f"--{precision}", "true", "---"]
    done = subprocess.run(
        [sys.executable, str(PRECISION_WORKER), *worker_args],
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "dump.json").read_text())
    for family, result in zip(runs, results):
        assert {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision] in result["dtypes"], family
        assert len(result["train_loss"]) == 3
        assert all(math.isfinite(loss) for loss in [*result["train_loss"], result["eval_loss"]]), (family, result)
        if precision == "fp16":  # the loss scale is part of the training state
            assert (tmp_path / family / "checkpoint-2" / "scaler.pt").is_file(), family
