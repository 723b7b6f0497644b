"""The model card carries what Trainer's cards carry: the training hyperparameters, the framework versions, and a
link to the source."""

from importlib import metadata

import transformers
import yaml
from transformers import AutoModelForMaskedLM, TrainingArguments

from linearformers.hub_cards import render_model_card
from linearformers.hub_cards.card import source_url
from linearformers.modeling.registry import FAMILIES, HEADS
from tests.conftest import tiny_config


def test_card_lists_the_training_hyperparameters_from_training_arguments(tmp_path):
    model = AutoModelForMaskedLM.from_config(tiny_config("performer"))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=3e-4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=100,
        seed=7,
        optim="adamw_torch",
        lr_scheduler_type="cosine",
        warmup_steps=10,
        report_to="none",
        use_cpu=True,
    )
    card = str(render_model_card(model, training_args=args))
    section = card.split("## Training hyperparameters")[1].split("##")[0]
    for line in (
        "- learning_rate: 0.0003",
        "- train_batch_size: 4",
        "- seed: 7",
        "- gradient_accumulation_steps: 2",
        "- total_train_batch_size: 8",
        "- optimizer: adamw_torch with betas=(0.9, 0.999) and epsilon=1e-08",
        "- lr_scheduler_type: cosine",
        "- lr_scheduler_warmup_steps: 10",
        "- training_steps: 100",
    ):
        assert line in section, (line, section)
    assert "mixed_precision" not in section


def test_card_takes_hyperparameters_from_a_mapping_with_mixed_precision():
    model = AutoModelForMaskedLM.from_config(tiny_config("linformer"))
    args = {"learning_rate": 1e-3, "per_device_train_batch_size": 8, "num_train_epochs": 2, "mixed_precision": "bf16"}
    section = str(render_model_card(model, training_args=args)).split("## Training hyperparameters")[1]
    assert "- mixed_precision_training: bf16" in section and "- num_epochs: 2" in section
    assert "Not recorded" in str(render_model_card(model))


def test_card_lists_framework_versions_and_links_the_source():
    card = str(render_model_card(AutoModelForMaskedLM.from_config(tiny_config("performer"))))
    versions = card.split("## Framework versions")[1].split("##")[0]
    assert f"- transformers {transformers.__version__}" in versions
    for name in ("torch", "datasets", "tokenizers", "linearformers"):
        assert f"- {name} {metadata.version(name)}" in versions
    assert source_url().startswith("https://") and source_url() in card
    assert "pip install ." not in card


def test_every_family_and_head_of_the_registry_gets_its_card():
    import linearformers

    for family in FAMILIES.values():
        for head in HEADS.values():
            model = getattr(linearformers, family.class_name(head))(
                tiny_config(family.name, is_decoder=head.suffix == "ForCausalLM")
            )
            card = str(render_model_card(model))
            meta = yaml.safe_load(card.split("---")[1])
            assert meta["pipeline_tag"] == head.pipeline_tag
            assert family.description in card and f"{head.auto_class}.from_pretrained" in card
