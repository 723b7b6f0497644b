"""Hub export: the model's folder (weights, config with auto_map, flat code: see ``modeling/hub_code.py``) plus the
tokenizer and the model card, written locally (``save_for_hub``) or uploaded in one commit (``push_to_hub``).

``model.save_pretrained`` / ``model.push_to_hub`` write and upload the same model files; these functions add the
tokenizer and the linearformers model card (hyperparameters, framework versions, loading, limits).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import CommitInfo, HfApi
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from ..conversion.long_context import write_sentence_transformers_files
from ..modeling.hub_code import write_hub_files
from .card import render_model_card

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainingArguments


def save_for_hub(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    folder: str | Path,
    *,
    results: dict | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    repo_id: str | None = None,
    training_args: TrainingArguments | Mapping[str, object] | None = None,
) -> Path:
    """Write a folder that loads with ``AutoModelFor*.from_pretrained(folder, trust_remote_code=True)`` on a
    machine without linearformers, and without trust_remote_code where linearformers is installed.

    Contents: what ``model.save_pretrained`` writes (``model.safetensors``, ``config.json`` with ``auto_map``, the
    flat model code), the tokenizer files and ``README.md``, the model card (:func:`render_model_card`; its
    hyperparameters come from ``training_args``). An encoder base model (``PerformerModel`` / ``LinformerModel``) with
    a tokenizer also gets the sentence-transformers files (mean pooling, ``max_seq_length`` the tokenizer's
    ``model_max_length`` within the model's limit), so that ``SentenceTransformer(folder)`` loads it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_hub_files(model.config, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        if not model.config.is_decoder and model.base_model is model:
            limit = model.config.sequence_limit()
            length = tokenizer.model_max_length if limit is None else min(limit[0], tokenizer.model_max_length)
            if length < VERY_LARGE_INTEGER:  # a tokenizer without a limit, for a model without one: no length to give
                write_sentence_transformers_files(folder, model.config.hidden_size, length)
    card = render_model_card(
        model,
        results=results,
        base_model=base_model,
        datasets=datasets,
        license=license,
        repo_id=repo_id,
        training_args=training_args,
    )
    card.save(folder / "README.md")
    return folder


def check_repo_id(repo_id: object) -> None:
    """ValueError unless ``repo_id`` is a valid Hub id of the form ``owner/name``."""
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id must look like 'owner/name', got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"repo_id {repo_id!r} is not a valid Hub id: {error}") from None


def push_to_hub(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
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
    training_args: TrainingArguments | Mapping[str, object] | None = None,
) -> CommitInfo:
    """Export with :func:`save_for_hub` into a temporary folder and upload it to ``repo_id`` in one commit.

    The model files are those ``model.push_to_hub(repo_id)`` uploads (both go through ``model.save_pretrained``);
    this adds the tokenizer and the linearformers model card, which replaces the repository's README.md.
    """
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
            training_args=training_args,
        )
        return api.upload_folder(
            repo_id=repo_id, folder_path=tmp, commit_message=commit_message, create_pr=create_pr, revision=revision
        )
