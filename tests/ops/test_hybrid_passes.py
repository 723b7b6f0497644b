"""How the CPU hybrid core splits its work (test_hybrid.py runs every test in one pass and in passes)."""

import pytest
import torch

from linearformers.ops import hybrid as hybrid_module


def test_the_cpu_core_runs_in_passes_whose_scores_stay_under_the_byte_cap():
    cap, per_block = hybrid_module._PASS_BYTES, 1 * 12 * 64 * 192 * 4  # b, h, blk, frame, float32
    step = hybrid_module._blocks_per_pass(1, 12, 64, 192, 256, 4, torch.device("cpu"))
    assert 1 <= step < 256 and step * per_block <= cap < (step + 1) * per_block
    assert hybrid_module._blocks_per_pass(64, 12, 64, 192, 256, 4, torch.device("cpu")) == 1  # at least one block
    assert hybrid_module._blocks_per_pass(1, 1, 4, 12, 3, 4, torch.device("cpu")) == 3  # never more than there are
    assert hybrid_module._blocks_per_pass(1, 12, 64, 192, 256, 4, torch.device("cuda")) == 256  # one pass off the CPU
    assert hybrid_module._blocks_per_pass(0, 12, 64, 192, 256, 4, torch.device("cpu")) == 256  # empty batch


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(0, 2), (1, 0)], ids=["empty-batch", "no-heads"])
def test_empty_inputs_give_empty_outputs(shape, causal):
    b, h = shape
    q, phi = torch.randn(b, h, 8, 4), torch.rand(b, h, 8, 3)
    out = hybrid_module.hybrid_attention(q, q, q, phi, phi, torch.ones(h), 4, causal=causal)
    assert out.shape == (b, h, 8, 4)
