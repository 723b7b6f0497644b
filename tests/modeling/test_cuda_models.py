"""The models on a CUDA GPU: the same outputs as on the CPU, generate with cache = recompute, and Trainer bf16 steps.

Every test here is marked ``cuda`` and skipped where no CUDA device is visible (``pytest -m cuda`` selects them)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, Trainer, TrainingArguments

from tests.conftest import FAMILIES, tiny_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Attention variants each family runs on CUDA: the defaults, ReLU / learned maps and the hybrids.
VARIANTS = {
    "performer": {
        "softmax": {},
        "relu": {"feature_map": "relu"},
        "hedgehog": {"feature_map": "hedgehog"},
        "hybrid": {"feature_map": "hedgehog", "hybrid_window": 16, "hybrid_sinks": 1},
        "far-blocks": {
            "feature_map": "hedgehog",
            "hybrid_window": 16,
            "hybrid_sinks": 1,
            "hybrid_query_scale": True,
            "hybrid_select_blocks": 2,
            "hybrid_select_block_size": 32,
        },
    },
    "linformer": {"learned": {}, "hybrid": {"hybrid_window": 16, "hybrid_sinks": 1}},
}
CASES = [(family, name) for family in FAMILIES for name in VARIANTS[family]]
# the Linformer hybrid and far-block selection are encoder-only
DECODER_CASES = [case for case in CASES if case not in (("linformer", "hybrid"), ("performer", "far-blocks"))]


def _config(family, variant, **overrides):
    base = dict(hidden_size=128, num_attention_heads=2, intermediate_size=256, max_position_embeddings=2048)
    if family == "linformer":
        base["projected_length"] = 64
    else:
        base["num_features"] = 64
    base.update(VARIANTS[family][variant])
    base.update(overrides)
    return tiny_config(family, **base)


def _model(cls, cfg):
    torch.manual_seed(0)
    return cls.from_config(cfg).eval()


@pytest.mark.parametrize(
    ("family", "variant", "head"), [(*case, "mlm") for case in CASES] + [(*case, "clm") for case in DECODER_CASES]
)
def test_fp32_logits_on_cuda_equal_the_cpus(family, variant, head):
    cls = AutoModelForCausalLM if head == "clm" else AutoModelForMaskedLM
    model = _model(cls, _config(family, variant, is_decoder=head == "clm"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 515), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0 if head == "clm" else 1  # left padding for the decoder
    mask[1, -29:] = 0 if head == "mlm" else 1  # right padding for the encoder
    with torch.no_grad():
        cpu = model(ids, attention_mask=mask).logits
        gpu = model.cuda()(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
    real = mask.bool()
    scale = cpu[real].abs().max()
    assert ((gpu - cpu)[real].abs().max() / scale) < 2e-3


@pytest.mark.parametrize(("family", "variant"), DECODER_CASES)
def test_bf16_autocast_logits_on_cuda_stay_near_fp32(family, variant):
    model = _model(AutoModelForCausalLM, _config(family, variant, is_decoder=True)).cuda()
    ids = torch.randint(3, 99, (2, 1030), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        ref = model(ids).logits.float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(ids).logits.float()
    assert torch.isfinite(low).all()
    assert ((low - ref).abs().max() / ref.abs().max()) < 5e-2


@pytest.mark.parametrize(("family", "variant"), DECODER_CASES)
def test_cached_greedy_on_cuda_equals_recomputed_greedy(family, variant):
    model = _model(AutoModelForCausalLM, _config(family, variant, is_decoder=True, initializer_range=0.2)).cuda()
    ids = torch.randint(3, 99, (2, 70), generator=torch.Generator().manual_seed(3)).cuda()
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, no_repeat_ngram_size=2)
    cached = model.generate(ids, **kwargs)
    recomputed = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", ["mlm", "clm"])
def test_trainer_bf16_steps_on_cuda_lower_the_loss(family, head, tmp_path):
    from datasets import Dataset  # here: the other CUDA tests run on a machine without it

    cls = AutoModelForCausalLM if head == "clm" else AutoModelForMaskedLM
    variant = "softmax" if family == "performer" else "learned"
    model = _model(cls, _config(family, variant, is_decoder=head == "clm")).train()
    ids = torch.randint(3, 99, (16, 256), generator=torch.Generator().manual_seed(4))
    ids[:, 1::2] = ids[:, ::2]  # a learnable pattern: every odd token repeats the one before it
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        num_train_epochs=10,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert next(model.parameters()).device.type == "cuda"
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4, losses
