"""Checkpoints saved by an earlier version of the model code (tests/fixtures/make_checkpoints.py, at the commit in
tests/fixtures/checkpoints/MADE_AT) load into today's classes with the same outputs: both families, every head, with
and without local heads, and for the causal LMs the same greedy generate() through the cache."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

import linearformers as lf
from tests.fixtures.make_checkpoints import inputs

ROOT = Path(__file__).parents[1] / "fixtures" / "checkpoints"
FOLDERS = sorted(path.name for path in ROOT.iterdir() if path.is_dir())


def test_every_family_head_and_local_setting_has_a_fixture():
    assert len(FOLDERS) == 2 * 7 * 2


@pytest.mark.parametrize("name", FOLDERS)
def test_an_old_checkpoint_loads_with_the_same_outputs(name):
    family, head = name.split("-")[:2]
    folder = ROOT / name
    config = AutoConfig.from_pretrained(folder)
    cls = getattr(lf, family.capitalize() + head)
    model = cls.from_pretrained(folder).eval()
    assert type(model.config) is type(config)
    expected = load_file(folder / "expected.safetensors")
    with torch.no_grad():
        out = model(**inputs(head))
        for key, want in expected.items():
            if key == "generated":
                got = model.generate(**inputs(head), max_new_tokens=4, do_sample=False, pad_token_id=0)
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(out[key], want, rtol=0, atol=0, msg=key)
