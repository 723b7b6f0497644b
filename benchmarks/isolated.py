"""Each benchmark measurement in a fresh Python process, so that its peak memory (ru_maxrss) belongs to it alone.

A benchmark script runs itself with ``--worker ...``; the worker measures, then prints its row as the last line of
stdout (``emit``), which ``run_isolated`` reads back:

    row = run_isolated(__file__, ["--worker", name, n, "--threads", 2], timeout=300, label=f"{name} n={n}")
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(row: dict) -> None:
    """The worker's side: print ``row`` as the JSON line ``run_isolated`` reads."""
    print(json.dumps(row), flush=True)


def run_isolated(
    script: str | Path, arguments: Sequence[object], *, timeout: float | None = None, label: str = ""
) -> dict | None:
    """Run ``python script *arguments`` in a new process and return the row its worker emitted.

    None, after a line naming ``label`` and the cause (the last line of the worker's stderr), if the worker failed
    or ran past ``timeout`` seconds: a sweep goes on with its other measurements.
    """
    command = [sys.executable, str(script), *(str(argument) for argument in arguments)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"  {label} timed out after {timeout} s", flush=True)
        return None
    if done.returncode != 0:
        print(f"  {label} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])
