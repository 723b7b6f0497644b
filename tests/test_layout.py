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
