"""The two tables the rest of the package reads: the model families, and the heads every family has.

A family's model classes are named ``family.prefix + head.suffix`` (``Performer`` + ``ForMaskedLM``). Registration
with the Auto classes (``linearformers/__init__.py``), the Hub code's ``auto_map`` (``hub_code.py``), the model card
(``hub_cards/card.py``), conversion from BERT / GPT-2 (``convert.py``) and the training CLI (``training/loop.py``)
all read these tables, so adding a head is one row here, and a family is one row and its own files: its config
(fields, card text, conversion defaults) and its models (attention and the tensors it adds).

Auto classes are named, not imported: this module is part of the Hub code, which imports no more of transformers
than the models need.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..configuration.linformer import LinformerConfig
from ..configuration.performer import PerformerConfig


@dataclass(frozen=True)
class Head:
    """One model head: its class-name suffix, transformers' Auto class and pipeline tag for it, and the BERT / GPT-2
    class that ``convert.py`` converts into it (None: no such source)."""

    suffix: str
    auto_class: str
    pipeline_tag: str
    bert_class: str | None = None
    gpt2_class: str | None = None


@dataclass(frozen=True)
class Family:
    """One attention family: its config class (whose ``model_type`` is the family's name), the prefix of its model
    class names, what the model card says its attention is (its config's ``describe`` adds the settings), and the
    package modules of its config and its models (``configuration.performer``, ``modeling.performer``), from which
    ``hub_code.py`` writes the Hub code."""

    config_class: type
    prefix: str
    description: str
    config_module: str
    modeling_module: str

    @property
    def name(self) -> str:
        return self.config_class.model_type

    def class_name(self, head: Head) -> str:
        """The name of this family's model class for ``head``: ``PerformerForMaskedLM``."""
        return self.prefix + head.suffix


HEADS: dict[str, Head] = {
    head.suffix: head
    for head in (
        Head("Model", "AutoModel", "feature-extraction", bert_class="BertModel"),
        Head("ForMaskedLM", "AutoModelForMaskedLM", "fill-mask", bert_class="BertForMaskedLM"),
        Head("ForCausalLM", "AutoModelForCausalLM", "text-generation", gpt2_class="GPT2LMHeadModel"),
        Head(
            "ForSequenceClassification",
            "AutoModelForSequenceClassification",
            "text-classification",
            bert_class="BertForSequenceClassification",
        ),
        Head(
            "ForTokenClassification",
            "AutoModelForTokenClassification",
            "token-classification",
            bert_class="BertForTokenClassification",
        ),
        Head(
            "ForQuestionAnswering",
            "AutoModelForQuestionAnswering",
            "question-answering",
            bert_class="BertForQuestionAnswering",
        ),
        Head("ForMultipleChoice", "AutoModelForMultipleChoice", "multiple-choice", bert_class="BertForMultipleChoice"),
    )
}

# in the order the training CLI offers them, its default first
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            PerformerConfig,
            "Performer",
            "FAVOR+ attention (Choromanski et al., 2021)",
            "configuration.performer",
            "modeling.performer",
        ),
        Family(
            LinformerConfig,
            "Linformer",
            "Linformer attention (Wang et al., 2020)",
            "configuration.linformer",
            "modeling.linformer",
        ),
    )
}


def get_family(name: str) -> Family:
    """The family called ``name`` (a config's ``model_type``); a ValueError names the families there are."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def head_of(class_name: str, family: Family) -> Head | None:
    """The head of a model class of ``family`` by its name (``PerformerForMaskedLM`` -> ``ForMaskedLM``), else None."""
    if not class_name.startswith(family.prefix):
        return None
    return HEADS.get(class_name.removeprefix(family.prefix))


__all__ = ["FAMILIES", "HEADS", "Family", "Head", "get_family", "head_of"]
