import sysconfig
from pathlib import Path

import pytest

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
    """Real text available offline: a slice of the Python standard library's own source."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join(p.read_text(errors="ignore") for p in sorted(lib.glob("*.py"))[:6])
    path = tmp_path_factory.mktemp("data") / "stdlib.txt"
    path.write_text(text[:60_000])
    return str(path)
