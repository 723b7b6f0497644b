import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from linearformers.training import ModelDataArguments, latest_checkpoint, load_metric, train
from linearformers.training.checkpoint import CheckpointCallback, checkpoints, step_of
from tests.training.conftest import TINY

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "_ddp_run.py"


# the kernel part of the Performer's --config_overrides: FAVOR+ random features redrawn every 3 forwards, or a
# learned hedgehog map (8 features) inside sliding-window softmax + linear heads (window 4, a learned balance)
RANDOM_FEATURES = "num_features=16,feature_redraw_interval=3"
HEDGEHOG_HYBRID = "feature_map=hedgehog,num_features=8,hybrid_window=4"


def _cli(text_file, out, *extra, attention=RANDOM_FEATURES):
    return [
        "--task",
        "clm",
        "--family",
        "performer",
        "--train_file",
        text_file,
        "--output_dir",
        str(out),
        "--config_overrides",
        f"{TINY},{attention},hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
        "--block_size",
        "32",
        "--max_steps",
        "8",
        "--save_strategy",
        "no",
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
        "--learning_rate",
        "3e-3",
        "--logging_steps",
        "1",
        *extra,
    ]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("RANK", None)
    return env


@pytest.mark.parametrize(
    ("attention", "port"), [(RANDOM_FEATURES, 29533), (HEDGEHOG_HYBRID, 29534)], ids=["favor", "hedgehog-hybrid"]
)
def test_two_processes_match_one_process_with_the_same_global_batch(text_file, tmp_path, attention, port):
    single = tmp_path / "single"
    subprocess.run(
        [
            sys.executable,
            str(WORKER),
            str(single),
            *_cli(text_file, tmp_path / "o1", "--per_device_train_batch_size", "8", attention=attention),
        ],
        check=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
    )
    double = tmp_path / "double"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            str(WORKER),
            str(double),
            *_cli(text_file, tmp_path / "o2", "--per_device_train_batch_size", "4", attention=attention),
        ],
        check=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
    )
    one = torch.load(f"{single}-rank0.pt")
    rank0, rank1 = torch.load(f"{double}-rank0.pt"), torch.load(f"{double}-rank1.pt")
    assert rank0["distributed_type"].endswith("MULTI_CPU") and rank0["num_processes"] == 2
    if attention == RANDOM_FEATURES:
        # 8 training forwards with redraws every 3: features were redrawn twice, the same draw on both ranks (to
        # float32 rounding: each process draws its own, and a QR may sum in another order on another thread count)
        assert len(one["features"]) == 2  # one per layer: the dump must not be empty, or zip below checks nothing
        for a, b, c in zip(rank0["features"], rank1["features"], one["features"]):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a, c)
    else:
        # a learned map has no random features; its parameters and the window balance are DDP-synced weights
        assert one["features"] == rank0["features"] == rank1["features"] == []
        learned = [key for key in one["state"] if ".attention.feature_map." in key or key.endswith("window_balance")]
        assert len([key for key in learned if key.endswith("window_balance")]) == 2
        assert len(learned) == 2 * 5  # per layer: weight, bias, key_weight, key_bias and window_balance
        for key in learned:
            for run in (one, rank0, rank1):
                # moved by more than the tolerance below, so that the rank comparison of these keys means something
                moved = not torch.allclose(run["state"][key], run["initial"][key], rtol=1e-4, atol=1e-5)
                assert moved, f"{key} did not train"
    for key, value in one["initial"].items():  # the same start (float32 tolerance: computed in other processes)
        torch.testing.assert_close(rank0["initial"][key], value, msg=key)
    torch.testing.assert_close(torch.tensor(rank0["loss"]), torch.tensor(one["loss"]), rtol=1e-4, atol=1e-5)
    for key, value in one["state"].items():
        torch.testing.assert_close(rank0["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        torch.testing.assert_close(rank1["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert one["loss"][-1] < one["loss"][0]


def test_fsdp2_two_processes_shard_train_and_save_full_weights(tmp_path):
    """FSDP2 full shard (fully_shard per layer and at the root) over 2 CPU processes with gloo: the same losses
    and weights as one process with the same global batch, identical FAVOR+ redraws on both ranks, and a saved
    checkpoint that holds the full, gathered weights (not one rank's shards) and loads with from_pretrained.

    Accelerate enables FSDP only on accelerators (on CPU it stays MULTI_CPU), so this drives torch's FSDP2
    directly, with the same full-state-dict gather that Accelerate's get_state_dict uses for FSDP2 before Trainer's
    final save_model."""
    from transformers import AutoModelForCausalLM

    worker = Path(__file__).parent / "_fsdp_run.py"
    subprocess.run(
        [sys.executable, str(worker), str(tmp_path / "single"), str(tmp_path / "single-model")],
        check=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "29541",
            str(worker),
            str(tmp_path / "fsdp"),
            str(tmp_path / "fsdp-model"),
        ],
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one = torch.load(tmp_path / "single-rank0.pt")
    rank0, rank1 = torch.load(tmp_path / "fsdp-rank0.pt"), torch.load(tmp_path / "fsdp-rank1.pt")
    assert rank0["sharded"] and rank0["world"] == 2 and not one["sharded"]
    # 5 training forwards with a redraw every 2: both ranks drew the same features as the single process
    for a, b, c in zip(rank0["features"], rank1["features"], one["features"]):  # three processes: float32 tolerance
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)
    torch.testing.assert_close(torch.tensor(rank0["loss"]), torch.tensor(one["loss"]), rtol=1e-4, atol=1e-5)
    assert one["loss"][-1] < one["loss"][0]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp-model").state_dict()
    for key, value in one["state"].items():
        assert rank0["state"][key].shape == value.shape, key  # gathered, not a shard
        torch.testing.assert_close(rank0["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5, msg=f"saved {key}")


def test_resume_after_sigkill_reaches_the_same_weights_and_losses(text_file, tmp_path):
    """A run killed with SIGKILL once it has checkpointed step 8 or later (often in the middle of writing the next
    checkpoint, which then never becomes "latest"), then resumed, ends where an uninterrupted run ends."""
    args = [
        "--task",
        "mlm",
        "--family",
        "linformer",
        "--train_file",
        text_file,
        "--config_overrides",
        TINY + ",projected_length=8",
        "--block_size",
        "32",
        "--max_steps",
        "60",
        "--save_steps",
        "4",
        "--logging_steps",
        "1",
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
        "--per_device_train_batch_size",
        "4",
    ]
    cmd = [sys.executable, "-m", "linearformers.training"]
    subprocess.run(
        [*cmd, *args, "--output_dir", str(tmp_path / "whole")],
        check=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
    )
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [*cmd, *args, "--output_dir", str(killed)],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        folder = latest_checkpoint(killed) if killed.exists() else None
        if folder is not None and (killed / "latest").is_file() and step_of(folder) >= 8:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "the run finished before it was killed"
    subprocess.run(
        [*cmd, *args, "--output_dir", str(killed), "--resume_from_checkpoint", "true"],
        check=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
        capture_output=True,
    )
    from safetensors.torch import load_file

    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(killed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:  # bit for bit: one machine, the same code and thread count compute both runs
        assert torch.equal(a[key], b[key]), key
    losses = [json.loads((run / "results.json").read_text())["train_loss"] for run in (tmp_path / "whole", killed)]
    assert len(losses[0]) == 60 and losses[0] == losses[1]


def test_a_kill_in_the_middle_of_a_checkpoint_write_resumes_from_the_one_before(text_file, tmp_path):
    """SIGKILL while checkpoint-8 is half written: "latest" still names checkpoint-4, the resume deletes the half
    folder and continues from checkpoint-4 to the uninterrupted run's weights and losses, bit for bit."""
    from safetensors.torch import load_file

    args = [
        *("--task", "mlm", "--family", "performer", "--train_file", text_file, "--block_size", "32"),
        *("--config_overrides", TINY + ",num_features=16,feature_redraw_interval=3"),
        *("--max_steps", "12", "--save_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "4"),
        *("--use_cpu", "true", "--disable_tqdm", "true"),
    ]
    cli = [sys.executable, "-m", "linearformers.training"]
    run = dict(env=_env(), cwd=REPO, timeout=300, capture_output=True, text=True)
    subprocess.run([*cli, *args, "--output_dir", str(tmp_path / "whole")], check=True, **run)
    killed = tmp_path / "killed"
    worker = Path(__file__).parent / "_killed_run.py"
    done = subprocess.run([sys.executable, str(worker), "checkpoint-8", *args, "--output_dir", str(killed)], **run)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert (killed / "checkpoint-8" / "model.safetensors").is_file()  # half written: the model, no trainer state
    assert not (killed / "checkpoint-8" / "trainer_state.json").exists()
    assert latest_checkpoint(killed).name == "checkpoint-4"
    subprocess.run([*cli, *args, "--output_dir", str(killed), "--resume_from_checkpoint", "true"], check=True, **run)
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(killed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:  # bit for bit: one machine, the same code and thread count compute both runs
        assert torch.equal(a[key], b[key]), key
    losses = [json.loads((out / "results.json").read_text())["train_loss"] for out in (tmp_path / "whole", killed)]
    assert len(losses[0]) == 12 and losses[0] == losses[1]


def _args(tmp_path, **kw):
    """(ModelDataArguments, TrainingArguments) of a tiny run: ``train(*_args(...))``. Keywords go to whichever
    dataclass has the field."""
    base = dict(
        task="clm",
        output_dir=str(tmp_path),
        config_overrides=TINY,
        block_size=16,
        max_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        save_steps=0,
        learning_rate=5e-4,
        weight_decay=0.01,
        seed=0,
        logging_steps=1,
        report_to="none",
    )
    base.update(kw)
    ours = {name: base.pop(name) for name in list(base) if name in ModelDataArguments.__dataclass_fields__}
    return ModelDataArguments(**ours), TrainingArguments(**base)


def test_bad_input_gets_a_clear_error(tmp_path, text_file):
    with pytest.raises(ValueError, match="unknown task 'translation'"):
        train(*_args(tmp_path, task="translation", train_file=text_file))
    with pytest.raises(ValueError, match="train file '/nope.txt' does not exist"):
        train(*_args(tmp_path, train_file="/nope.txt"))
    csv = tmp_path / "data.csv"
    csv.write_text("sentence,label\nhello there,1\nbye now,0\n" * 20)
    with pytest.raises(ValueError, match="no text column 'text'.*'sentence', 'label'"):
        train(*_args(tmp_path, task="classification", train_file=str(csv)))
    with pytest.raises(ValueError, match="no label column 'target'"):
        train(
            *_args(tmp_path, task="classification", train_file=str(csv), text_column="sentence", label_column="target")
        )
    with pytest.raises(
        ValueError, match="block_size=1024 is beyond what this model supports: max_position_embeddings=512"
    ):
        train(
            *_args(
                tmp_path, train_file=text_file, block_size=1024, config_overrides=TINY + ",max_position_embeddings=512"
            )
        )
    with pytest.raises(ValueError, match="max_seq_length=64"):
        train(
            *_args(
                tmp_path,
                train_file=text_file,
                family="linformer",
                block_size=100,
                config_overrides=TINY + ',position_embedding_type="rotary",max_seq_length=64,projected_length=8',
            )
        )
    with pytest.raises(ValueError, match="not a PerformerConfig field"):
        train(*_args(tmp_path, train_file=text_file, config_overrides="hidden_sise=3"))


def test_a_validation_label_missing_from_train_is_named(tmp_path):
    train_csv, valid_csv = tmp_path / "train.csv", tmp_path / "valid.csv"
    train_csv.write_text("text,label\n" + "good one,pos\nbad one,neg\n" * 10)
    valid_csv.write_text("text,label\ngood,pos\nmeh,other\n")
    with pytest.raises(ValueError, match=r"validation split has labels the train split lacks: \['other'\]"):
        train(*_args(tmp_path, task="classification", train_file=str(train_csv), validation_file=str(valid_csv)))


def test_classification_trains_and_reports_accuracy_and_f1(tmp_path):
    csv = tmp_path / "data.csv"
    rows = (
        ["text,label"]
        + [f"good movie number {i},pos" for i in range(40)]
        + [f"awful film take {i},neg" for i in range(40)]
    )
    csv.write_text("\n".join(rows))
    out = train(
        *_args(
            tmp_path / "out",
            task="classification",
            train_file=str(csv),
            max_steps=30,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
        )
    )
    assert out["results"]["accuracy"] >= 0.75
    assert 0.0 <= out["results"]["f1"] <= 1.0
    assert out["model"].config.id2label == {0: "neg", 1: "pos"}


def test_local_metric_modules_compute_offline():
    assert load_metric("accuracy").compute(predictions=[1, 0, 1], references=[1, 1, 1])["accuracy"] == 2 / 3
    f1 = load_metric("f1").compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])["f1"]
    assert abs(f1 - (0.8 + 2 / 3) / 2) < 1e-9
    with pytest.raises(ValueError, match="unknown metric"):
        load_metric("bleu")
    for name in ("accuracy", "f1"):
        with pytest.raises(ValueError, match=f"{name} needs at least one reference"):
            load_metric(name).compute(predictions=[], references=[])


def test_tensorboard_logging_writes_event_files(tmp_path, text_file):
    train(*_args(tmp_path, train_file=text_file, max_steps=2, report_to="tensorboard"))
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*"))


def _interrupt_after_checkpoint(monkeypatch, step):
    """Make the run raise KeyboardInterrupt right after it has completed the checkpoint of ``step``."""
    original = CheckpointCallback.on_save

    def save_then_stop(self, args, state, control, **kwargs):
        original(self, args, state, control, **kwargs)
        if state.global_step == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(CheckpointCallback, "on_save", save_then_stop)


def test_resume_from_a_checkpoint_on_the_last_batch_of_an_epoch(tmp_path, text_file, monkeypatch):
    """The checkpoint falls on an epoch's last batch: the resumed run starts the next epoch, ends with the
    uninterrupted run's weights, and its results keep the losses from before the interruption."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from linearformers.training.data import load_raw_dataset, prepare_dataset
    from linearformers.training.loop import default_tokenizer

    data, _ = prepare_dataset(
        load_raw_dataset(text_file), AutoTokenizer.from_pretrained(default_tokenizer()), "mlm", 32
    )
    per_epoch = -(-len(data["train"]) // 8)
    common = dict(
        task="mlm",
        train_file=text_file,
        block_size=32,
        per_device_train_batch_size=8,
        max_steps=per_epoch + 3,
        save_steps=per_epoch,
        lr_scheduler_type="constant",
        config_overrides=TINY + ",hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0",
    )
    whole = train(*_args(tmp_path / "whole", **common))
    with monkeypatch.context() as patch:
        _interrupt_after_checkpoint(patch, per_epoch)
        with pytest.raises(KeyboardInterrupt):
            train(*_args(tmp_path / "cut", **common))
    resumed = train(*_args(tmp_path / "cut", resume_from_checkpoint="true", **common))
    assert resumed["train_loss"] == whole["train_loss"]  # bit for bit: one process and machine run both
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "final" / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_checkpoints_of_an_earlier_run_are_never_silently_mixed_or_pruned(tmp_path, text_file):
    common = dict(train_file=text_file, block_size=16, save_steps=2, save_total_limit=2)
    train(*_args(tmp_path, max_steps=6, **common))
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    with pytest.raises(ValueError, match="holds the checkpoints of an earlier run"):
        train(*_args(tmp_path, max_steps=2, **common))
    train(*_args(tmp_path, max_steps=2, overwrite_output_dir=True, **common))
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-2"]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps must be an integer >= 1, got 0"),
        ("num_train_epochs", 0, "pass --max_steps N .N >= 1. or --num_train_epochs > 0"),
        ("save_steps", -1, "save_steps must be a number >= 0"),
        ("eval_steps", -1, "eval_steps must be a number >= 0"),
        ("warmup_steps", -5, "warmup_steps"),
        ("save_total_limit", 0, "save_total_limit must be None .keep every checkpoint. or an integer >= 1, got 0"),
        ("learning_rate", float("nan"), "learning_rate must be a finite number >= 0, got nan"),
        ("max_grad_norm", -1.0, "max_grad_norm must be a finite number >= 0"),
    ],
)
def test_nonsense_numbers_are_refused_before_training(tmp_path, text_file, field, value, message):
    with pytest.raises(ValueError, match=message):
        extra = {"max_steps": -1} if field == "num_train_epochs" else {}
        train(*_args(tmp_path, train_file=text_file, **{field: value}, **extra))


def test_a_malformed_hub_model_id_is_refused_before_training(tmp_path, text_file):
    with pytest.raises(ValueError, match="repo_id must look like 'owner/name', got 'performer-small'"):
        train(*_args(tmp_path, train_file=text_file, push_to_hub=True, hub_model_id="performer-small"))
    assert not (tmp_path / "final").exists()


def test_config_overrides_take_plain_strings_lists_and_reject_items_without_a_value():
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    from linearformers import LinformerConfig
    from linearformers.training.loop import parse_overrides

    parsed = parse_overrides(
        'position_embedding_type=rotary,projected_length_per_layer=[8, 16],sharing="layerwise"', LinformerConfig
    )
    assert parsed == {
        "position_embedding_type": "rotary",
        "projected_length_per_layer": [8, 16],
        "sharing": "layerwise",
    }
    with pytest.raises(ValueError, match="'hidden_size' is not of the form field=value"):
        parse_overrides("hidden_size", LinformerConfig)
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'hidden_size'") as raised:
        LinformerConfig(**parse_overrides("hidden_size=12a", LinformerConfig))
    assert isinstance(raised.value.__cause__, TypeError)
    assert "expected int, got str (value: '12a')" in str(raised.value)


def test_config_overrides_take_a_renamed_fields_old_name_which_the_config_warns_of():
    from linearformers import PerformerConfig
    from linearformers.training.loop import parse_overrides

    parsed = parse_overrides("kernel=relu,num_random_features=16", PerformerConfig)
    assert parsed == {"kernel": "relu", "num_random_features": 16}
    with pytest.warns(FutureWarning, match="kernel is renamed feature_map"):
        config = PerformerConfig(**parsed)
    assert (config.feature_map, config.num_features) == ("relu", 16)
    with pytest.raises(ValueError, match="'kernal', which is not a PerformerConfig field"):
        parse_overrides("kernal=relu", PerformerConfig)


def test_a_max_position_embeddings_override_moves_max_seq_length_as_the_config_does(tokenizer_dir):
    from transformers import AutoTokenizer

    from linearformers import LinformerConfig
    from linearformers.training import new_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = new_config("linformer", "mlm", tokenizer, 128, "max_position_embeddings=2048")
    assert config.max_seq_length == LinformerConfig(max_position_embeddings=2048).max_seq_length == 2048
    assert new_config("linformer", "mlm", tokenizer, 1024).max_seq_length == 1024  # max(block_size, 512)
    assert new_config("linformer", "mlm", tokenizer, 128, "max_seq_length=256").max_seq_length == 256


def test_a_new_classifier_config_carries_the_labels_of_the_data(tokenizer_dir):
    from transformers import AutoTokenizer

    from linearformers.training import label_fields, new_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = new_config("performer", "classification", tokenizer, 64, labels=["neg", "pos"])
    assert (config.num_labels, config.id2label, config.label2id) == (2, {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1})
    assert label_fields(None) == {}


@pytest.fixture
def masking(tokenizer_dir):
    from transformers import AutoTokenizer

    from linearformers.training.loop import SeededMasking

    return SeededMasking(AutoTokenizer.from_pretrained(tokenizer_dir), mlm_probability=0.3, seed=42)


def _blocks(count, length=64):
    return [{"input_ids": list(range(1000 + i, 1000 + i + length))} for i in range(count)]


def test_a_block_is_masked_alike_in_any_batch_and_without_touching_the_global_rng(masking):
    """The mask of a block is a function of the seed, the epoch and its tokens: the same alone or among others (any
    batch size, process or worker), and drawn off the global RNG that dropout uses."""
    state = torch.random.get_rng_state()
    alone = masking(_blocks(1))
    among = masking(_blocks(5))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (alone["labels"] != -100).any()
    assert torch.equal(alone["input_ids"][0], among["input_ids"][0])
    assert torch.equal(alone["labels"][0], among["labels"][0])
    assert not torch.equal(among["labels"][1], among["labels"][2])  # other blocks, other masks


def test_masks_change_with_the_epoch_and_validation_masks_stay(masking):
    from datasets import Dataset
    from transformers import TrainerControl, TrainerState

    first = masking(_blocks(4))["labels"]
    masking.on_epoch_begin(None, TrainerState(epoch=1.0), TrainerControl())
    assert masking.epoch == 1
    assert not torch.equal(masking(_blocks(4))["labels"], first)
    validation = masking.mask_split(Dataset.from_list(_blocks(4)))
    batch = masking(list(validation))
    assert torch.equal(batch["labels"], torch.tensor(validation["labels"]))  # masked once, passed through
    assert torch.equal(batch["input_ids"], torch.tensor(validation["input_ids"]))


def test_resuming_from_a_checkpoint_of_another_config_names_the_checkpoint(tmp_path, text_file):
    """A checkpoint that records no run arguments (an older one) cannot be compared before loading: loading it into
    another model fails, naming the checkpoint."""
    train(*_args(tmp_path, train_file=text_file, max_steps=2, save_steps=2))
    (latest_checkpoint(tmp_path) / "run.json").unlink()
    other = TINY.replace("hidden_size=32", "hidden_size=64")
    with pytest.raises(ValueError, match="cannot resume from checkpoint .*checkpoint-2: RuntimeError"):
        train(
            *_args(tmp_path, train_file=text_file, max_steps=4, resume_from_checkpoint="true", config_overrides=other)
        )


@pytest.fixture(scope="module")
def sentiment_csv(tmp_path_factory) -> str:
    """80 short labelled rows: 76 train (10 steps of 8 an epoch) and 4 held out."""
    path = tmp_path_factory.mktemp("csv") / "sentiment.csv"
    rows = [f"good movie number {i},pos" for i in range(40)] + [f"awful film take {i},neg" for i in range(40)]
    path.write_text("\n".join(["text,label", *rows]))
    return str(path)


def test_activation_checkpointing_trains_to_the_same_losses(tmp_path, text_file):
    """Once refused: Trainer turns it on, and recomputing the activations changes no loss (no dropout here)."""
    common = dict(train_file=text_file, max_steps=3, config_overrides=TINY + ",hidden_dropout_prob=0.0")
    plain = train(*_args(tmp_path / "plain", **common))
    checkpointed = train(*_args(tmp_path / "checkpointed", activation_checkpointing=True, **common))
    assert checkpointed["model"].is_activation_checkpointing and not plain["model"].is_activation_checkpointing
    assert len(plain["train_loss"]) == 3
    torch.testing.assert_close(torch.tensor(checkpointed["train_loss"]), torch.tensor(plain["train_loss"]))


def test_epochs_with_an_evaluation_at_each_epoch_end(tmp_path, sentiment_csv):
    """Once refused: --num_train_epochs without --max_steps, and --eval_strategy epoch."""
    out = train(
        *_args(
            tmp_path,
            task="classification",
            train_file=sentiment_csv,
            max_steps=-1,
            num_train_epochs=2,
            eval_strategy="epoch",
            per_device_train_batch_size=8,
        )
    )
    assert out["steps"] == 2 * 10
    assert [evaluation["step"] for evaluation in out["evaluations"]] == [10, 20]


def test_load_best_model_at_end_keeps_the_checkpoint_of_the_lowest_eval_loss(tmp_path, sentiment_csv):
    """Once refused: the final model is the evaluated checkpoint with the lowest loss, not the last step's (a
    learning rate far too high makes the loss swing)."""
    from safetensors.torch import load_file

    out = train(
        *_args(
            tmp_path,
            task="classification",
            train_file=sentiment_csv,
            max_steps=3,
            eval_strategy="steps",
            eval_steps=1,
            save_steps=1,
            learning_rate=0.5,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
        )
    )
    losses = {evaluation["step"]: evaluation["eval_loss"] for evaluation in out["evaluations"]}
    best = min(losses, key=losses.get)
    assert best != 3, losses  # else the last step's model is the best one too, and the test shows nothing
    assert out["results"]["eval_loss"] == pytest.approx(losses[best])
    final, kept = (
        load_file(tmp_path / "final" / "model.safetensors"),
        load_file(tmp_path / f"checkpoint-{best}" / "model.safetensors"),
    )
    for key in final:
        assert torch.equal(final[key], kept[key]), key
