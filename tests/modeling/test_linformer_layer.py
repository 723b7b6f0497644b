"""LinformerAttention as the model runs it: its projections cover max_seq_length positions, whichever kind."""

import pytest
import torch
from transformers import AutoModel

from tests.conftest import tiny_config


@pytest.mark.parametrize("projection", ["learned", "pool", "conv"])
@pytest.mark.parametrize("position_embedding_type", ["rotary", "sinusoidal"])
def test_inputs_longer_than_max_seq_length_are_refused_by_every_projection(projection, position_embedding_type):
    cfg = tiny_config(
        "linformer",
        projection=projection,
        position_embedding_type=position_embedding_type,
        max_seq_length=16,
        projected_length=4,
    )
    model = AutoModel.from_config(cfg).eval()
    assert model(torch.randint(1, 99, (1, 16))).last_hidden_state.shape == (1, 16, 32)  # n = max_seq_length runs
    with pytest.raises(ValueError, match=r"17 tokens exceeds max_seq_length=16"):
        model(torch.randint(1, 99, (1, 17)))
