"""Atomic training checkpoints.

A checkpoint is Accelerate's state (model, optimizer, scheduler, RNG states of every process) plus
``progress.json`` (optimizer step, epoch, micro-batches consumed in that epoch) and ``run.json`` (the run's arguments
and model config, which a resume is compared with). It is written into a hidden temporary folder, flushed to disk,
renamed into place, and only then named by the ``latest`` pointer, itself replaced atomically. A crash at any point
leaves the previous checkpoint and pointer intact; a failed write (a full disk, say) also removes what it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from accelerate import Accelerator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

POINTER = "latest"
RUN_FILE = "run.json"
TOKENIZER_FOLDER = "tokenizer"
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


def _publish(root: Path, tmp: Path, final: Path, progress: dict, run: dict | None, tokenizer) -> None:
    """Complete the state Accelerate wrote into ``tmp``, flush it, rename it to ``final`` and point ``latest`` at it."""
    (tmp / "progress.json").write_text(json.dumps(progress))
    if run is not None:
        (tmp / RUN_FILE).write_text(json.dumps(run, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / TOKENIZER_FOLDER)
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / f".{POINTER}.tmp"
    pointer_tmp.write_text(final.name)
    with open(pointer_tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(pointer_tmp, root / POINTER)
    _fsync_dir(root)


def _pointed_at(root: Path) -> str | None:
    pointer = root / POINTER
    return pointer.read_text().strip() if pointer.is_file() else None


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    return any(sign in str(error).lower() for sign in _DISK_FULL)


class _TiedWeightsFilter(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {...} while saving" when the removed names are tied weights (an LM
    head tied to the input embeddings): safetensors stores a shared tensor once, and loading ties them again, so
    the warning asks the user to check something that is expected at every checkpoint."""

    def __init__(self, tied: set[str]) -> None:
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        message, sign = record.getMessage(), "Removed shared tensor {"
        if sign not in message:
            return True
        start = message.index(sign) + len(sign)
        names = message[start : message.index("}", start)].replace("'", "").split(", ")
        return not all(name.removeprefix("module.").removeprefix("_orig_mod.") in self.tied for name in names)


def _tied_keys(accelerator: Accelerator) -> set[str]:
    tied = set()
    for model in accelerator._models:
        keys = getattr(accelerator.unwrap_model(model), "_tied_weights_keys", None) or {}
        tied.update(keys)  # a dict {tied: source} in transformers 5
    return tied


@contextlib.contextmanager
def _expected_tied_weights_quiet(accelerator: Accelerator) -> Iterator[None]:
    target = logging.getLogger("accelerate.utils.other")
    quiet = _TiedWeightsFilter(_tied_keys(accelerator))
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


def save_checkpoint(
    accelerator: Accelerator,
    root: str | Path,
    progress: dict,
    keep: int | float = 2,
    run: dict | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write checkpoint ``step-<step>`` under ``root`` atomically; keep the newest ``keep`` (``math.inf``: all). All
    processes call it.

    ``run`` (JSON: the run's arguments and model config) is saved as ``run.json`` for a resume to compare with, and
    ``tokenizer`` in ``tokenizer/``, which a resume reads instead of building the tokenizer again. A write that fails
    removes what it wrote, and ``latest`` still names the previous checkpoint; a full disk raises an OSError (ENOSPC)
    that says so and names both folders.
    """
    if not (keep == math.inf or (isinstance(keep, int) and not isinstance(keep, bool))) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (the checkpoint just written is always kept), got {keep!r}")
    root = Path(root)
    name = f"step-{progress['step']:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        with _expected_tied_weights_quiet(accelerator):
            accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _publish(root, tmp, final, progress, run, tokenizer)
    except Exception as error:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            (root / f".{POINTER}.tmp").unlink(missing_ok=True)
            if _pointed_at(root) != name:  # renamed but never named by "latest": not a checkpoint
                shutil.rmtree(final, ignore_errors=True)
        if not _is_disk_full(error):
            raise
        kept = _pointed_at(root)
        raise OSError(
            errno.ENOSPC,
            f"no space left on device while writing checkpoint {final} ({type(error).__name__}: {str(error)[:200]}). "
            + (
                f"The last complete checkpoint, {root / kept}, is intact: free"
                if kept
                else "There is no earlier one: free"
            )
            + " space (or lower --save_total_limit) and run again"
            + (" with --resume_from_checkpoint true to continue from it." if kept else "."),
        ) from error
    if accelerator.is_main_process:
        # prune the oldest of this run's line: never the folder just written (which "latest" names), and never
        # a higher-numbered folder, which is not this run's to delete
        earlier = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name < name)
        drop = 0 if keep == math.inf else max(len(earlier) - (keep - 1), 0)
        for path in earlier[:drop]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or None when there is none."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    folder = Path(root) / pointer.read_text().strip()
    if not (folder / "progress.json").is_file():
        raise ValueError(f"checkpoint pointer {pointer} names {folder}, which is incomplete or missing")
    return folder


def load_run(folder: Path) -> dict | None:
    """The arguments and model config saved with checkpoint ``folder``; None for a checkpoint written before they
    were saved."""
    path = Path(folder) / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_checkpoint(accelerator: Accelerator, folder: Path) -> dict:
    """Restore Accelerate's state from ``folder`` and return its progress. A checkpoint that does not fit the model
    (another config or family) or is damaged raises a ValueError naming the folder, with the cause attached."""
    try:
        accelerator.load_state(str(folder))
        return json.loads((folder / "progress.json").read_text())
    except Exception as error:
        raise ValueError(
            f"cannot resume from checkpoint {folder}: {type(error).__name__}: {str(error)[:500]} (was it written by "
            "a run with another model config or family, or is it damaged?)"
        ) from error
