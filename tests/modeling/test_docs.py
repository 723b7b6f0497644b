"""What print(model) and help() show."""

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
from transformers import AutoModel, HfArgumentParser, TrainingArguments

import linearformers
from linearformers import LinformerConfig, PerformerConfig
from linearformers.training.loop import ModelDataArguments
from tests.conftest import tiny_config


def test_print_model_shows_the_performer_attention_settings():
    cfg = tiny_config("performer", num_features=16, feature_map="relu", num_local_heads=1, local_window=4)
    text = repr(AutoModel.from_config(cfg))
    for part in ("num_features=16", "feature_map='relu'", "num_local_heads=1", "local_window=4", "causal=False"):
        assert part in text


def test_print_model_shows_the_linformer_attention_settings():
    cfg = tiny_config("linformer", projected_length=8, sharing="key_value", projection="pool")
    text = repr(AutoModel.from_config(cfg))
    for part in ("projected_length=8", "max_seq_length=64", "sharing='key_value'", "projection='pool'"):
        assert part in text


def test_every_config_field_is_documented_in_the_family_config_docstring():
    for config_class in (LinformerConfig, PerformerConfig):
        undocumented = [f.name for f in dataclasses.fields(config_class) if f.name not in (config_class.__doc__ or "")]
        assert not undocumented, f"{config_class.__name__} docstring lacks {undocumented}"


MODEL_CLASSES = [
    getattr(linearformers, family + suffix)
    for family in ("Linformer", "Performer")
    for suffix in linearformers.AUTO_CLASSES.values()
]


@pytest.mark.parametrize("model_class", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_every_model_class_and_its_forward_have_docstrings(model_class):
    assert (model_class.__doc__ or "").strip(), f"{model_class.__name__} has no docstring of its own"
    forward_doc = model_class.forward.__doc__ or ""
    assert "input_ids" in forward_doc and "attention_mask" in forward_doc


def test_train_help_shows_help_text_and_choices_for_every_own_flag():
    for field in dataclasses.fields(ModelDataArguments):
        assert field.metadata.get("help"), f"--{field.name} has no help text"
    text = HfArgumentParser((ModelDataArguments, TrainingArguments)).format_help()
    for field in dataclasses.fields(ModelDataArguments):
        assert f"--{field.name}" in text
    assert "{mlm,clm,classification}" in text and "{performer,linformer}" in text


def _public_functions():
    """Every public function and method defined in linearformers (modules and names without a leading _)."""
    for info in pkgutil.walk_packages(linearformers.__path__, "linearformers."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj
            elif inspect.isclass(obj):
                for method_name, method in vars(obj).items():
                    if method_name.startswith("_") and method_name != "__init__":
                        continue
                    method = getattr(method, "__func__", getattr(method, "fget", method))
                    # typing.Protocol puts its own __init__ in the class: not ours to annotate
                    if inspect.isfunction(method) and method.__module__ == module.__name__:
                        yield f"{module.__name__}.{name}.{method_name}", inspect.unwrap(method)


def test_every_public_function_has_type_hints():
    missing = []
    for name, function in _public_functions():
        signature = inspect.signature(function)
        for parameter in signature.parameters.values():
            if parameter.name in ("self", "cls") or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            if parameter.annotation is parameter.empty:
                missing.append(f"{name}({parameter.name})")
        if function.__name__ != "__init__" and signature.return_annotation is signature.empty:
            missing.append(f"{name} -> return")
    assert not missing, "missing type hints: " + ", ".join(missing)
