"""The stamp every benchmark result carries: what ran, on which code, on which machine, under what load.

`benchmarks/report.py` prints it above each table, so a figure says where it came from without prose around it:

    stamp = start_stamp()           # at the start: command, commit, device, load average before
    ...                             # the measurements
    result = {"header": finish_stamp(stamp), "rows": rows}   # load average after, added at the end

The load average goes with each figure because the machines these run on may be shared: a slow row on a loaded
machine then explains itself.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command() -> str:
    """The command line as typed from the repository root: ``python benchmarks/x.py --flag value``."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


# the code a measurement runs; edits elsewhere (docs, results) do not make a stamp -dirty
CODE = ("linearformers", "benchmarks/*.py", "benchmarks/*.sh")


def commit() -> str:
    """The short hash of HEAD, with ``-dirty`` when the package or the benchmark scripts differ from it; "unknown"
    outside a git clone."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        clean = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", *CODE], cwd=ROOT, capture_output=True
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head if clean == 0 else f"{head}-dirty"


def device() -> str:
    """The CPU's model name and core count (Linux reads it from /proc/cpuinfo)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return [round(value, 2) for value in os.getloadavg()]


def start_stamp() -> dict:
    return {"command": command(), "commit": commit(), "device": device(), "load_average_before": load_average()}


def finish_stamp(stamp: dict) -> dict:
    return {**stamp, "load_average_after": load_average()}
