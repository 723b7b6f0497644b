"""Checkpoints saved by an earlier version of the model code (tests/fixtures/make_checkpoints.py, at the commit in
tests/fixtures/checkpoints/MADE_AT) load into today's classes with the same outputs: both families, every head, with
and without local heads, and for the causal LMs the same greedy generate() through the cache.

The stored outputs were computed on another machine: other BLAS kernels sum in another order, so today's outputs
may differ from them by float32 rounding (up to ~1e-7 seen between an AMD and an Intel CPU). They are compared with
float32's tolerance, which a real change of the model code exceeds by orders of magnitude."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

import linearformers as lf
from tests.fixtures.make_checkpoints import inputs

ROOT = Path(__file__).parents[1] / "fixtures" / "checkpoints"
FOLDERS = sorted(path.name for path in ROOT.iterdir() if path.is_dir())
RTOL, ATOL = 1.3e-6, 1e-5  # torch.testing's float32 defaults


def assert_same_output(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=key)


def assert_same_greedy_tokens(model, head: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Greedy tokens are equal, or part where two logits tie to float32's tolerance (rounding picks either)."""
    if torch.equal(got, want):
        return
    assert got.shape == want.shape
    step = int((got != want).any(0).nonzero()[0])  # the first generated position where they part
    prompt = inputs(head)
    mask = torch.cat([prompt["attention_mask"], torch.ones_like(want[:, prompt["input_ids"].shape[1] :])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=want[:, :step], attention_mask=mask[:, :step]).logits[:, -1]
    for row in (got[:, step] != want[:, step]).nonzero()[:, 0]:
        mine, stored = logits[row, got[row, step]], logits[row, want[row, step]]
        assert_same_output(mine, stored, f"logits of tokens {int(got[row, step])} and {int(want[row, step])}")


def test_every_family_head_and_local_setting_has_a_fixture():
    assert len(FOLDERS) == 2 * 7 * 2


def test_the_comparison_passes_rounding_noise_and_fails_a_real_change():
    """Another machine's rounding (a relative 1e-7) passes; a change of 1e-4, far below any bug's, fails."""
    want = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(0))
    assert_same_output(want * (1 + 1e-7 * torch.randn(want.shape)), want, "noise")
    with pytest.raises(AssertionError):
        assert_same_output(want + 1e-4, want, "changed")


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
                assert_same_greedy_tokens(model, head, got, want)
            else:
                assert_same_output(out[key], want, key)
