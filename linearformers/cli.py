"""What the package's command lines (``linearformers-train``, ``python -m linearformers.conversion.convert``) share:
an output folder proven writable before any work, and one line, not a traceback, for the package's own checks."""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # linearformers/


def check_writable(folder: str | Path, name: str, saved: str) -> None:
    """Create ``folder`` and write and remove a probe file in it, or raise a ValueError naming it (as ``name``, the
    argument that chose it) and what could not be ``saved`` there. The folders the probe created are removed again:
    a run that fails later leaves nothing behind."""
    folder = Path(folder)
    created = [path for path in (folder, *folder.parents) if not path.exists()]  # the deepest first
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"{name} {folder} is not writable ({type(error).__name__}: {error.strerror or error}); {saved} could not "
            f"be saved there. Fix its permissions or choose another {name}."
        ) from error
    finally:
        for path in created:
            with contextlib.suppress(OSError):  # not created after all, or no longer empty: another process's
                path.rmdir()


def raised_by_linearformers(error: BaseException) -> bool:
    """Whether ``error`` was raised in this package's own code: its ValueErrors are the checks of arguments, data,
    checkpoints and output folders, each naming the problem, which the user fixes, so one line says it all."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE)
