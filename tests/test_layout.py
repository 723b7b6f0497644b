"""The floors' import arrows point one way (docs/design.md, "Floors"): ops imports only torch, and configuration
imports ops but never modeling. Each check runs in a fresh process whose ``linearformers`` is a bare package, so the
package's own ``__init__`` (which imports everything to register the Auto classes) does not hide an upward import."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BARE_PACKAGE = f"""
import sys, types
package = types.ModuleType("linearformers")
package.__path__ = [{str(ROOT / "linearformers")!r}]
sys.modules["linearformers"] = package
"""


def _loaded_after(module: str) -> set[str]:
    code = BARE_PACKAGE + f"import {module}\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_configuration_imports_ops_but_not_modeling():
    loaded = _loaded_after("linearformers.configuration")
    assert "linearformers.ops" in loaded
    assert not {name for name in loaded if name.startswith("linearformers.modeling")}


def test_ops_import_neither_transformers_nor_the_floors_above():
    loaded = _loaded_after("linearformers.ops")
    above = ("linearformers.configuration", "linearformers.modeling", "transformers")
    assert not {name for name in loaded if name.startswith(above)}


def _files_entered(run) -> list[str]:
    """The package's files whose functions ``run`` calls, in the order first entered: benchmarks/forward_files.py's
    trace, which the benchmark prints beside Llama's."""
    import linearformers
    from tests.conftest import load_script

    return load_script(ROOT / "benchmarks" / "forward_files.py").trace(run, linearformers.__file__)[0]


def test_a_hybrid_performer_training_forward_reads_in_the_model_the_family_the_map_and_the_op():
    """docs/design.md, "A forward a reader can follow": the shared stack, the family's attention, the feature map
    and the op, plus the ops' argument checks and autocast guard (and the seed of a redraw that is due); no config
    code, no Triton module on the CPU."""
    import torch

    import linearformers as lf
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    config = tiny_config("performer", is_decoder=True, hybrid_window=4, feature_redraw_interval=1)
    model = lf.PerformerForCausalLM(config).train()
    ids = torch.randint(1, 99, (2, 12))
    model(ids, labels=ids)  # first call: lazy imports
    entered = _files_entered(lambda: model(ids, labels=ids))
    assert set(entered) == {
        "modeling/base.py",
        "modeling/performer.py",
        "ops/feature_maps.py",
        "seeds.py",
        "ops/_precision.py",
        "ops/hybrid.py",
        "ops/_checks.py",
    }
    path = [name for name in entered if name in ("modeling/base.py", "modeling/performer.py", "ops/hybrid.py")]
    assert path == ["modeling/base.py", "modeling/performer.py", "ops/hybrid.py"]


def test_the_forward_files_benchmark_traces_the_hybrid_performer_and_llama_alike(capsys):
    """benchmarks/forward_files.py: the same trace as above, printed for the package and for transformers' Llama."""
    from tests.conftest import load_script

    script = load_script(ROOT / "benchmarks" / "forward_files.py")
    assert script.main([]) == 0
    printed = capsys.readouterr().out
    assert printed.count("4 hold the forward's code") == 2
    assert "models/llama/modeling_llama.py" in printed
    assert "integrations/sdpa_attention.py" in printed
