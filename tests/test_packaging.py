"""Packaging: the license, the single-sourced version, py.typed and the changelog."""

import importlib.metadata
import inspect
from pathlib import Path

import pytest

import linearformers
from linearformers.hub_cards import save_for_hub

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_license_metadata_matches_license_file_and_model_cards():
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    assert inspect.signature(save_for_hub).parameters["license"].default == "apache-2.0"


def test_version_lives_in_one_place():
    assert "version" not in PYPROJECT["project"]
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "linearformers.__version__"}


def test_installed_version_equals_package_version():
    assert importlib.metadata.version("linearformers") == linearformers.__version__


def test_py_typed_ships_with_the_package():
    assert (ROOT / "linearformers" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["linearformers"]


def test_changelog_has_unreleased_and_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert f"## [{linearformers.__version__}]" in text


def test_project_urls_name_the_repository():
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Repository", "Issues"} <= set(urls)
    assert all(url.startswith("https://github.com/linearformers/linearformers") for url in urls.values())


def test_the_package_imports_under_python_oo():
    """``python -OO`` strips docstrings; the configs append the shared field docs to theirs, which must not fail."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-OO", "-c", "import linearformers"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_head_of_every_family_loads_through_its_auto_class():
    """The heads and families tables (modeling/registry.py) are what importing the package registers."""
    import transformers

    from linearformers.modeling.registry import FAMILIES, HEADS
    from tests.conftest import tiny_config

    assert set(linearformers.AUTO_CLASSES.values()) == set(HEADS)
    for family in FAMILIES.values():
        assert transformers.AutoConfig.for_model(family.name).__class__ is family.config_class
        for head in HEADS.values():
            config = tiny_config(family.name, is_decoder=head.suffix == "ForCausalLM")
            model = getattr(transformers, head.auto_class).from_config(config)
            assert type(model) is getattr(linearformers, family.class_name(head))
