"""Model cards rendered from the config and the training results with huggingface_hub's ModelCard."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from importlib import metadata
from typing import TYPE_CHECKING

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..modeling.registry import HEADS, get_family, head_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel, TrainingArguments

# where the card points for the source: the package metadata's [project.urls] (Repository, else Homepage), else this
SOURCE_URL = "https://github.com/linearformers/linearformers"
FRAMEWORKS = ("linearformers", "transformers", "torch", "datasets", "tokenizers", "huggingface_hub")

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

A {{ family }} {{ kind }} for Hugging Face transformers, built with linearformers: {{ attention_summary }}

## Attention

{{ attention_details }}

## How to load

With the `linearformers` package installed (source: {{ source_url }}; `pip install git+{{ source_url }}`), the
Auto classes know the model; no remote code runs:

```python
import linearformers  # registers "{{ model_type }}" with transformers' Auto classes
from transformers import {{ auto_class }}

model = {{ auto_class }}.from_pretrained("{{ repo }}")
```

Without the package, the repository's own code loads it:

```python
from transformers import {{ auto_class }}

model = {{ auto_class }}.from_pretrained("{{ repo }}", trust_remote_code=True)
```

## Results

{{ results_table }}

## Training hyperparameters

{{ hyperparameters }}

## Framework versions

{{ framework_versions }}

## Limits

{{ limits }}
"""


def source_url() -> str:
    """The project's repository URL from the installed package's metadata, else ``SOURCE_URL``."""
    try:
        urls = metadata.metadata("linearformers").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        urls = []
    named = dict(entry.split(", ", 1) for entry in urls if ", " in entry)
    return named.get("Repository") or named.get("Homepage") or SOURCE_URL


def framework_versions() -> dict[str, str]:
    """Installed versions of linearformers and the libraries it runs on (those not installed are left out)."""
    versions = {}
    for name in FRAMEWORKS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def hyperparameters(training_args: TrainingArguments | Mapping[str, object] | object | None) -> dict[str, object]:
    """The training run's settings, named as in Trainer's model cards, from transformers' ``TrainingArguments``
    (or a dataclass / mapping with its field names); settings the arguments do not hold are left out."""
    if training_args is None:
        return {}
    if hasattr(training_args, "to_dict"):
        args = training_args.to_dict()
    elif dataclasses.is_dataclass(training_args):
        args = dataclasses.asdict(training_args)
    elif isinstance(training_args, Mapping):
        args = dict(training_args)
    else:
        raise TypeError(f"training_args must be TrainingArguments, a dataclass or a mapping, got {training_args!r}")
    found = {
        "learning_rate": args.get("learning_rate"),
        "train_batch_size": args.get("per_device_train_batch_size"),
        "eval_batch_size": args.get("per_device_eval_batch_size"),
        "seed": args.get("seed"),
        "gradient_accumulation_steps": args.get("gradient_accumulation_steps"),
    }
    world_size = getattr(training_args, "world_size", args.get("world_size"))
    if found["train_batch_size"] and world_size:
        found["num_devices"] = world_size
        found["total_train_batch_size"] = (
            found["train_batch_size"] * world_size * (found["gradient_accumulation_steps"] or 1)
        )
    optimizer = args.get("optim")
    if optimizer and str(optimizer).startswith("adam"):
        betas = (args.get("adam_beta1"), args.get("adam_beta2"))
        optimizer = f"{optimizer} with betas={betas} and epsilon={args.get('adam_epsilon')}"
    found["optimizer"] = optimizer
    found["weight_decay"] = args.get("weight_decay") or None
    found["lr_scheduler_type"] = args.get("lr_scheduler_type")
    found["lr_scheduler_warmup_steps"] = args.get("warmup_steps") or None
    if (args.get("max_steps") or 0) > 0:
        found["training_steps"] = args["max_steps"]
    else:
        found["num_epochs"] = args.get("num_train_epochs")
    precision = [name for name in ("bf16", "fp16") if args.get(name)] or [args.get("mixed_precision")]
    found["mixed_precision_training"] = precision[0] if precision[0] not in (None, "no") else None
    return {key: value for key, value in found.items() if value is not None}


def _attention_text(config) -> tuple[str, str, list[str]]:
    """The card's attention summary (the family's description, then the config's own words), details and limits."""
    summary, details, limits = config.describe()
    return get_family(config.model_type).description + summary, details, limits


def render_model_card(
    model: PreTrainedModel,
    *,
    results: dict | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    repo_id: str | None = None,
    training_args: TrainingArguments | Mapping[str, object] | None = None,
) -> ModelCard:
    """A README.md card: YAML metadata (library_name, license, tags, datasets, metrics, pipeline_tag,
    base_model, model-index with ``results``) and prose on the attention, loading, the training hyperparameters
    (from ``training_args``: transformers' ``TrainingArguments`` or a mapping of its field names), the framework
    versions, and limits."""
    config = model.config
    head = head_of(type(model).__name__, get_family(config.model_type)) or HEADS["Model"]
    pipeline_tag = head.pipeline_tag
    name = repo_id.split("/")[-1] if repo_id else f"{config.model_type}-{head.suffix.lower()}"
    results = {k: v for k, v in (results or {}).items() if isinstance(v, int | float)}
    eval_results = [
        EvalResult(
            task_type=pipeline_tag,
            dataset_type=(datasets or ["local"])[0],
            dataset_name=(datasets or ["local text"])[0],
            metric_type=key,
            metric_value=round(float(value), 4),
        )
        for key, value in results.items()
    ]
    card_data = ModelCardData(
        library_name="transformers",
        license=license,
        tags=[config.model_type, "linear-attention", "long-context", "linearformers"],
        datasets=datasets,
        metrics=sorted(results) or None,
        pipeline_tag=pipeline_tag,
        base_model=base_model,
        model_name=name,
        eval_results=eval_results or None,
    )
    summary, details, limits = _attention_text(config)
    table = "\n".join(["| metric | value |", "|---|---|", *(f"| {k} | {v:.4g} |" for k, v in results.items())])
    settings = hyperparameters(training_args)
    return ModelCard.from_template(
        card_data,
        template_str=TEMPLATE,
        title=name,
        family=config.model_type.capitalize(),
        kind="causal language model" if config.is_decoder else f"encoder ({head.suffix})",
        attention_summary=summary,
        attention_details=details,
        model_type=config.model_type,
        auto_class=head.auto_class,
        repo=repo_id or "path/to/this/folder",
        results_table=table if results else "No evaluation results were recorded.",
        hyperparameters="\n".join(f"- {key}: {value}" for key, value in settings.items())
        or "Not recorded: the model was saved without its training arguments.",
        framework_versions="\n".join(f"- {name} {version}" for name, version in framework_versions().items()),
        source_url=source_url(),
        limits="\n".join(f"- {line}" for line in limits)
        + (f"\n- Converted from `{base_model}`: see its card for data and biases." if base_model else ""),
    )
