"""The model code a saved folder carries, so that it loads with ``trust_remote_code=True`` without linearformers.

transformers copies remote code flat: one folder, following only same-folder imports (``from .name import``).
The package's modules are therefore written flat, renamed to unique basenames (``configuration/linformer.py`` ->
``configuration_linformer.py``, ``ops/favor.py`` -> ``ops_favor.py``, ...), with every relative import rewritten
to ``from .<flat name> import ...``. The rewrite reads the package's real source with ``ast``, so the written code
follows the package as it changes.

``write_hub_files`` writes this code and ``auto_map_for``'s ``auto_map`` where the model is published:
``push_to_hub``, ``hub_cards.save_for_hub``, and every ``save_pretrained`` after ``register_for_auto_class``
(``LinearAttentionPreTrainedModel``). This module is itself part of the code it writes: in a Hub repository's flat
copy, saving again copies the flat modules that sit beside it.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from transformers import PreTrainedConfig
from transformers.utils import CONFIG_NAME

from .registry import FAMILIES, HEADS, get_family

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# True in a flat copy (modeling_hub_code.py, loaded with trust_remote_code): there is no package source to read
FLAT_COPY = Path(__file__).stem != "hub_code"
# the modules the written code starts from, each family's (its registry row); everything they import relatively is
# found with ast (remote_modules)
ROOT_MODULES = tuple(sorted(m for f in FAMILIES.values() for m in (f.config_module, f.modeling_module)))


def flat_name(dotted: str) -> str:
    """``ops.favor`` -> ``ops_favor``; ``ops._native`` -> ``ops_native``; ``configuration.linformer`` ->
    ``configuration_linformer``."""
    return "_".join(part.strip("_") for part in dotted.split("."))


def _source_path(dotted: str) -> Path:
    path = PACKAGE_ROOT.joinpath(*dotted.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _resolve(dotted: str, node: ast.ImportFrom) -> str:
    """The package-relative module an ``ImportFrom`` in module ``dotted`` refers to."""
    is_package = _source_path(dotted).name == "__init__.py"
    base = dotted.split(".") if is_package else dotted.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, *(node.module.split(".") if node.module else [])])


def _relative_imports(dotted: str) -> list[tuple[ast.ImportFrom, str]]:
    """Every relative ``from ... import`` in module ``dotted``, with the package-relative module it names."""
    source = _source_path(dotted).read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            target = _resolve(dotted, node)
            if not _source_path(target).exists() or node.module is None:
                raise ValueError(
                    f"{dotted}: `from {'.' * node.level}{node.module or ''} import ...` cannot be flattened for the "
                    "Hub; import names from a module (`from .module import name`)"
                )
            found.append((node, target))
    return found


def remote_modules() -> tuple[str, ...]:
    """The package modules the Hub code needs: ``ROOT_MODULES`` and, transitively, every module they import
    relatively (packages resolve to their ``__init__``), read from the package's current source."""
    seen: list[str] = []
    todo = list(ROOT_MODULES)
    while todo:
        dotted = todo.pop(0)
        if dotted in seen:
            continue
        seen.append(dotted)
        todo += [target for _, target in _relative_imports(dotted)]
    return tuple(sorted(seen))


def flatten_module(dotted: str) -> str:
    """The source of package module ``dotted`` with relative imports rewritten to flat same-folder imports."""
    source = _source_path(dotted).read_text()
    lines = source.splitlines(keepends=True)
    edits = []
    for node, target in _relative_imports(dotted):
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        edits.append((node.lineno, node.end_lineno, node.col_offset, f"from .{flat_name(target)} import {names}\n"))
    for start, end, indent, text in sorted(edits, reverse=True):
        lines[start - 1 : end] = [" " * indent + text]
    return "".join(lines)


def write_remote_code(folder: str | Path) -> list[str]:
    """Write every needed module flat into ``folder``; returns the file names.

    From a flat copy (a model loaded with ``trust_remote_code=True``), the ``.py`` files beside this one are copied
    as they are: transformers keeps each repository's code, with everything it imports, in one folder.
    """
    folder = Path(folder)
    if FLAT_COPY:
        here = Path(__file__).resolve().parent
        names = sorted(path.name for path in here.glob("*.py") if path.name != "__init__.py")
        for name in names:
            if (folder / name).resolve() != here / name:
                shutil.copyfile(here / name, folder / name)
        return names
    modules = remote_modules()
    flat = [flat_name(dotted) for dotted in modules]
    clashes = sorted({name for name in flat if flat.count(name) > 1})
    if clashes:
        raise ValueError(f"modules {clashes} would clash when flattened for the Hub; rename one of them")
    names = []
    for dotted in modules:
        name = flat_name(dotted) + ".py"
        (folder / name).write_text(flatten_module(dotted))
        names.append(name)
    return names


def write_hub_files(config: PreTrainedConfig, folder: str | Path) -> list[str]:
    """Make a saved model folder load with ``trust_remote_code=True``: write the flat code (``write_remote_code``)
    and add ``auto_map_for(config)`` to its ``config.json``; returns the code's file names. The in-memory config is
    left as it was."""
    folder = Path(folder)
    names = write_remote_code(folder)
    config_file = folder / CONFIG_NAME
    if config_file.is_file():
        saved = json.loads(config_file.read_text(encoding="utf-8"))
        saved["auto_map"] = auto_map_for(config)
        # the layout PreTrainedConfig.to_json_file writes
        config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return names


def auto_map_for(config: PreTrainedConfig) -> dict[str, str]:
    """auto_map entries for AutoConfig and every Auto model class of the config's family."""
    family = get_family(config.model_type)
    mapping = {"AutoConfig": f"{flat_name(family.config_module)}.{family.config_class.__name__}"}
    for head in HEADS.values():
        mapping[head.auto_class] = f"{flat_name(family.modeling_module)}.{family.class_name(head)}"
    return mapping
