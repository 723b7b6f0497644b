"""Hub export: weights (safetensors), config with auto_map, tokenizer, model card and self-contained code.

transformers copies remote code flat: one folder, following only same-folder imports (``from .name import``).
The package's modules are therefore written flat, renamed to unique basenames (``configuration/linformer.py`` ->
``configuration_linformer.py``, ``modeling/attention/favor.py`` -> ``attention_favor.py``, ...), with every
relative import rewritten to ``from .<flat name> import ...``. The rewrite reads the package's real source with
``ast``, so the export follows the code as it changes.
"""

from __future__ import annotations

import ast
import json
import tempfile
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .card import render_model_card

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = PACKAGE_ROOT.name
# the modules the exported code starts from; everything they import relatively is found with ast (remote_modules)
ROOT_MODULES = ("configuration.linformer", "configuration.performer", "modeling.linformer", "modeling.performer")
AUTO_SUFFIXES = {
    "AutoModel": "Model",
    "AutoModelForMaskedLM": "ForMaskedLM",
    "AutoModelForCausalLM": "ForCausalLM",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
    "AutoModelForTokenClassification": "ForTokenClassification",
    "AutoModelForQuestionAnswering": "ForQuestionAnswering",
    "AutoModelForMultipleChoice": "ForMultipleChoice",
}


def flat_name(dotted: str) -> str:
    """``modeling.attention.favor`` -> ``attention_favor``; ``configuration.linformer`` -> ``configuration_linformer``."""
    parts = dotted.split(".")
    if parts[0] == "modeling" and len(parts) > 1 and parts[1] == "attention":
        parts = parts[1:]
    name = "_".join(part.strip("_") for part in parts)
    return name


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
    """Write every needed module flat into ``folder``; returns the file names."""
    folder = Path(folder)
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


def auto_map_for(config) -> dict[str, str]:
    """auto_map entries for AutoConfig and every Auto model class of the config's family."""
    family = type(config).__name__.removesuffix("Config")
    module = f"modeling_{config.model_type}"
    mapping = {"AutoConfig": f"configuration_{config.model_type}.{type(config).__name__}"}
    for auto, suffix in AUTO_SUFFIXES.items():
        mapping[auto] = f"{module}.{family}{suffix}"
    return mapping


def save_for_hub(
    model,
    tokenizer,
    folder: str | Path,
    *,
    results: dict | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    repo_id: str | None = None,
) -> Path:
    """Write a folder that loads with ``AutoModelFor*.from_pretrained(folder, trust_remote_code=True)`` on a
    machine without linearformers, and without trust_remote_code where linearformers is installed.

    Contents: ``model.safetensors``, ``config.json`` (with ``auto_map``), the tokenizer files, ``README.md``
    (the model card) and the flat model code.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_remote_code(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map_for(model.config)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = render_model_card(
        model, results=results, base_model=base_model, datasets=datasets, license=license, repo_id=repo_id
    )
    card.save(folder / "README.md")
    return folder


def check_repo_id(repo_id) -> None:
    """ValueError unless ``repo_id`` is a valid Hub id of the form ``owner/name``."""
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id must look like 'owner/name', got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"repo_id {repo_id!r} is not a valid Hub id: {error}") from None


def push_to_hub(
    model,
    tokenizer,
    repo_id: str,
    *,
    results: dict | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    private: bool = False,
    create_pr: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload linearformers model",
    token: str | None = None,
):
    """Export with :func:`save_for_hub` into a temporary folder and upload it to ``repo_id``."""
    check_repo_id(repo_id)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_for_hub(
            model,
            tokenizer,
            tmp,
            results=results,
            base_model=base_model,
            datasets=datasets,
            license=license,
            repo_id=repo_id,
        )
        return api.upload_folder(
            repo_id=repo_id, folder_path=tmp, commit_message=commit_message, create_pr=create_pr, revision=revision
        )
