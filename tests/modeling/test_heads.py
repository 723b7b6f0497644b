"""The heads' construction: what they own (no unused pooler), what they inherit, what they load."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForQuestionAnswering, AutoModelForTokenClassification, GenerationMixin
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import linearformers as lf
from tests.conftest import FAMILIES, tiny_config

SPAN_HEADS = [AutoModelForTokenClassification, AutoModelForQuestionAnswering]


def _loss(model, auto):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 99, (2, 12), generator=g)
    if auto is AutoModelForTokenClassification:
        return model(ids, labels=torch.randint(0, 3, (2, 12), generator=g)).loss
    return model(ids, start_positions=torch.tensor([1, 4]), end_positions=torch.tensor([3, 9])).loss


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", SPAN_HEADS, ids=lambda a: a.__name__)
def test_token_and_span_heads_give_every_parameter_a_gradient(family, auto):
    """No unused pooler: plain DDP (find_unused_parameters off) and transformers' gradient-checkpointing tests
    need a gradient on every parameter."""
    model = auto.from_config(tiny_config(family, num_labels=3)).train()
    assert model.model.pooler is None
    _loss(model, auto).backward()
    without = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert without == []


def _log_of(fn):
    with CaptureLogger(logging.get_logger("transformers")) as captured:
        result = fn()
    return result, captured.out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", SPAN_HEADS, ids=lambda a: a.__name__)
def test_span_heads_load_a_base_checkpoint_with_a_pooler_silently_about_it(family, auto, tmp_path):
    base = lf.LinformerModel if family == "linformer" else lf.PerformerModel
    encoder = base(tiny_config(family, num_labels=3))
    assert encoder.pooler is not None
    encoder.save_pretrained(tmp_path)
    model, log = _log_of(lambda: auto.from_pretrained(tmp_path))
    assert model.model.pooler is None
    assert "pooler" not in log, log
    for name, tensor in encoder.state_dict().items():
        if not name.startswith("pooler."):
            assert torch.equal(model.model.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", SPAN_HEADS, ids=lambda a: a.__name__)
def test_span_heads_load_their_own_older_checkpoints_that_carry_a_pooler(family, auto, tmp_path):
    """Checkpoints of these heads saved before they dropped the pooler hold model.pooler.* weights."""
    head = auto.from_config(tiny_config(family, num_labels=3))
    head.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.pooler.dense.weight"] = torch.randn(32, 32)
    weights["model.pooler.dense.bias"] = torch.randn(32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, log = _log_of(lambda: auto.from_pretrained(tmp_path))
    assert log.strip() == "", log
    saved = head.state_dict()
    assert model.state_dict().keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("cls", [lf.LinformerForCausalLM, lf.PerformerForCausalLM], ids=lambda c: c.__name__)
def test_causal_lms_list_generation_mixin_among_their_own_bases(cls):
    """transformers' test_inherits_generation_mixin looks at __bases__, not the MRO."""
    assert GenerationMixin in cls.__bases__


@pytest.mark.parametrize(
    "saved,loader",
    [
        ("linformer", lf.PerformerForMaskedLM),
        ("performer", lf.LinformerForMaskedLM),
        ("linformer", lf.PerformerModel),
        ("performer", lf.LinformerForTokenClassification),
    ],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_loading_a_checkpoint_of_the_other_family_raises_naming_both_model_types(saved, loader, tmp_path):
    other = "performer" if saved == "linformer" else "linformer"
    base = lf.LinformerModel if saved == "linformer" else lf.PerformerModel
    base(tiny_config(saved)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"model_type '{saved}'.*model_type '{other}'"):
        loader.from_pretrained(tmp_path)


def test_building_a_model_from_the_other_familys_config_raises_naming_both():
    with pytest.raises(ValueError, match="model_type 'linformer'.*PerformerForMaskedLM.*'performer'"):
        lf.PerformerForMaskedLM(tiny_config("linformer"))
    with pytest.raises(ValueError, match="model_type 'performer'.*LinformerModel.*'linformer'"):
        lf.LinformerModel(tiny_config("performer"))
