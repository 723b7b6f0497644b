"""Checkpoints that a crash never leaves half-named.

A checkpoint is Trainer's own folder ``output_dir/checkpoint-<step>`` (model, optimizer, scheduler, scaler, the RNG
states of every process, ``trainer_state.json``, the tokenizer) plus ``run.json`` (the run's arguments and model
config, which a resume is compared with). Once Trainer has written it, ``CheckpointCallback`` adds ``run.json``,
flushes the folder to disk and only then names it in the ``latest`` pointer, itself replaced atomically. A resume
starts from the checkpoint ``latest`` names, never from a folder whose write a crash or a full disk cut short.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

POINTER = "latest"
RUN_FILE = "run.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# what torch (its zip writer), safetensors and the OS say when a write meets a full disk
_DISK_FULL = ("no space left on device", "unexpected pos", "file write failed", "storagefull")


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders under ``output_dir``, oldest step first."""
    folders = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and _CHECKPOINT.match(p.name)]
    return sorted(folders, key=step_of)


def point_at(output_dir: Path, folder: Path) -> None:
    """Flush ``folder`` to disk, then name it in ``output_dir/latest`` (replaced atomically)."""
    _fsync_tree(folder)
    pointer_tmp = output_dir / f".{POINTER}.tmp"
    pointer_tmp.write_text(folder.name)
    with open(pointer_tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(pointer_tmp, output_dir / POINTER)
    _fsync_dir(output_dir)


def step_of(folder: Path) -> int:
    """The step of a ``checkpoint-<step>`` folder."""
    return int(_CHECKPOINT.match(Path(folder).name).group(1))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or None when there is none.

    Without a pointer (a run of Trainer alone), or where it names a folder that is gone (Trainer prunes old
    checkpoints, ``--save_total_limit``, after writing a new one and before the pointer moves: a crash can fall
    between the two), the newest checkpoint that holds Trainer's last-written file, ``trainer_state.json``."""
    pointer = Path(output_dir) / POINTER
    if pointer.is_file() and (Path(output_dir) / pointer.read_text().strip()).is_dir():
        return Path(output_dir) / pointer.read_text().strip()
    complete = [p for p in checkpoints(output_dir) if (p / "trainer_state.json").is_file()]
    return complete[-1] if complete else None


def remove_incomplete(output_dir: str | Path, after: int) -> None:
    """Delete the checkpoints of steps beyond ``after`` (the step of the checkpoint a run continues from): writes
    that a crash or a full disk cut short, which Trainer would otherwise count, prune by, or resume from."""
    for folder in checkpoints(output_dir):
        if step_of(folder) > after:
            shutil.rmtree(folder, ignore_errors=True)
    (Path(output_dir) / f".{POINTER}.tmp").unlink(missing_ok=True)


def disk_full(error: BaseException, output_dir: Path) -> OSError | None:
    """The OSError (ENOSPC) that names a full disk met while writing a checkpoint, and the checkpoint kept; None for
    any other failure."""
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or any(
        sign in str(error).lower() for sign in _DISK_FULL
    )
    if not full:
        return None
    kept = latest_checkpoint(output_dir)
    return OSError(
        errno.ENOSPC,
        f"no space left on device while writing a checkpoint under {output_dir} ({type(error).__name__}: "
        f"{str(error)[:200]}). "
        + (f"The last complete checkpoint, {kept}, is intact: free" if kept else "There is no earlier one: free")
        + " space (or lower --save_total_limit) and run again"
        + (" with --resume_from_checkpoint true to continue from it." if kept else "."),
    )


def load_run(folder: Path) -> dict | None:
    """The arguments and model config saved with checkpoint ``folder``; None for a checkpoint without them (one
    written by Trainer alone)."""
    path = Path(folder) / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class CheckpointCallback(TrainerCallback):
    """Completes each checkpoint Trainer writes: ``run.json`` (``run``, JSON), a flush to disk, then the pointer."""

    def __init__(self, run: dict) -> None:
        self.run = run

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (folder / RUN_FILE).write_text(json.dumps(self.run, indent=1))
            point_at(Path(args.output_dir), folder)
