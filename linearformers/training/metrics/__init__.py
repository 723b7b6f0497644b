"""Local evaluate metric modules (evaluate.load("accuracy") needs the Hub; a local folder does not)."""

from pathlib import Path

import evaluate

METRICS_DIR = Path(__file__).parent


def load_metric(name: str) -> evaluate.EvaluationModule:
    """Load one of the shipped metrics ("accuracy", "f1") from its local folder."""
    folder = METRICS_DIR / name
    if not (folder / f"{name}.py").exists():
        available = sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").exists())
        raise ValueError(f"unknown metric {name!r}; the shipped local metrics are {available}")
    return evaluate.load(str(folder))
