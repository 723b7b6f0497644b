"""Each benchmark measurement in a fresh Python process, so that its peak memory (ru_maxrss) belongs to it alone.

A benchmark script runs itself with ``--worker ...``; the worker measures, then prints its row as the last line of
stdout (``emit``), which ``run_isolated`` reads back:

    row = run_isolated(__file__, ["--worker", name, n, "--threads", 2], timeout=300, label=f"{name} n={n}")
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# glibc serves every allocation above this many bytes with its own mmap and returns it to the OS when freed
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"


def add_allocator_argument(parser: argparse.ArgumentParser) -> None:
    """``--malloc_mmap_threshold BYTES``: see :func:`apply_allocator_argument`."""
    parser.add_argument(
        "--malloc_mmap_threshold",
        type=int,
        metavar="BYTES",
        help=f"run every measurement with {MMAP_THRESHOLD_ENV}=BYTES (glibc): allocations below it come from the "
        "heap and stay mapped when freed, instead of one mmap each that the next step faults in again page by page "
        "(e.g. 17179869184; default: the environment's)",
    )


def apply_allocator_argument(args: argparse.Namespace) -> str:
    """Put ``--malloc_mmap_threshold`` in the environment the measurement subprocesses inherit (glibc reads it at
    process start); returns a suffix for result file names: "" without it, else "_mmap_threshold"."""
    if args.malloc_mmap_threshold is None:
        return ""
    if args.malloc_mmap_threshold <= 0:
        raise SystemExit(f"--malloc_mmap_threshold must be > 0, got {args.malloc_mmap_threshold}")
    os.environ[MMAP_THRESHOLD_ENV] = str(args.malloc_mmap_threshold)
    return "_mmap_threshold"


# a fixed glibc mmap threshold (its starting value) turns the dynamic one off: every allocation of this many bytes or
# more is a mapping of its own, returned to the OS when freed, so the resident memory follows the live tensors
FOLLOW_TENSORS_THRESHOLD = 128 * 1024


def _status_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: its peak) in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(f"/proc/self/status has no {field}")


def added_peak_mb(run: Callable[[], object]) -> float:
    """The peak resident memory ``run`` adds to this process, in MB: the peak during it (VmHWM, started afresh by
    writing 5 to /proc/self/clear_refs, Linux) less the resident memory before it. Memory the allocator kept from
    earlier work and hands out again is not counted, so run it in a process started with
    ``MALLOC_MMAP_THRESHOLD_=FOLLOW_TENSORS_THRESHOLD`` (:func:`run_isolated`'s ``environment``)."""
    before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    run()
    return _status_mb("VmHWM") - before


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(row: dict) -> None:
    """The worker's side: print ``row`` as the JSON line ``run_isolated`` reads, with the glibc mmap threshold the
    worker ran under (None: glibc's default)."""
    print(json.dumps({**row, "malloc_mmap_threshold": os.environ.get(MMAP_THRESHOLD_ENV)}), flush=True)


def run_isolated(
    script: str | Path,
    arguments: Sequence[object],
    *,
    timeout: float | None = None,
    label: str = "",
    environment: dict[str, str] | None = None,
) -> dict | None:
    """Run ``python script *arguments`` in a new process (its environment this one's, updated by ``environment``) and
    return the row its worker emitted.

    None, after a line naming ``label`` and the cause (the last line of the worker's stderr), if the worker failed
    or ran past ``timeout`` seconds: a sweep goes on with its other measurements.
    """
    command = [sys.executable, str(script), *(str(argument) for argument in arguments)]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, **(environment or {})},
        )
    except subprocess.TimeoutExpired:
        print(f"  {label} timed out after {timeout} s", flush=True)
        return None
    if done.returncode != 0:
        print(f"  {label} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])
