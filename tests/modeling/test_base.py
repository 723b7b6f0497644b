"""The shared stack (modeling/base.py) on both families: every Auto class, padding, causality, checkpointing, inputs
and outputs, and the heads (what they own, inherit and load); PEFT, device_map and torch.compile on top."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationMixin,
)
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import linearformers as lf
from linearformers.modeling import base
from tests.conftest import FAMILIES, tiny_config

ENCODER_AUTOS = [
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoModelForQuestionAnswering,
    AutoModelForMultipleChoice,
]


def _inputs(auto, batch=2, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 3, length) if auto is AutoModelForMultipleChoice else (batch, length)
    return {"input_ids": torch.randint(1, 99, shape, generator=g)}


def _tensors(out):
    return [v for v in out.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", [*ENCODER_AUTOS, AutoModelForCausalLM], ids=lambda a: a.__name__)
def test_every_auto_class_round_trips_with_identical_outputs(family, auto, tmp_path):
    cfg = tiny_config(family, is_decoder=auto is AutoModelForCausalLM, num_local_heads=1, local_window=4)
    model = auto.from_config(cfg).eval()
    assert type(model).__name__.lower().startswith(family)
    inputs = _inputs(auto)
    with torch.no_grad():
        before = model(**inputs, use_cache=False) if auto is AutoModelForCausalLM else model(**inputs)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == family
    again = auto.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        after = again(**inputs, use_cache=False) if auto is AutoModelForCausalLM else again(**inputs)
    saved, loaded = model.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys()
    for key in saved:  # every weight and buffer, FAVOR+ features included, bit for bit
        assert torch.equal(saved[key], loaded[key]), key
    for a, b in zip(_tensors(before), _tensors(after), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # BLAS may reorder sums across calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("position_embedding_type", ["absolute", "rotary", "sinusoidal"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_gives_the_same_outputs_as_each_sequence_alone(family, position_embedding_type, side):
    cfg = tiny_config(family, position_embedding_type=position_embedding_type, num_local_heads=1, local_window=4)
    model = AutoModel.from_config(cfg).eval()
    lengths = [12, 7, 3]
    seqs = [torch.randint(1, 99, (n,)) for n in lengths]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(12 - len(s), 12) if side == "left" else slice(0, len(s))
        ids[i, sl] = s
        mask[i, sl] = 1
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for i, s in enumerate(seqs):
            alone = model(input_ids=s[None]).last_hidden_state[0]
            sl = slice(12 - len(s), 12) if side == "left" else slice(0, len(s))
            torch.testing.assert_close(batched[i, sl], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_does_not_leak_the_future(family):
    cfg = tiny_config(family, is_decoder=True, num_local_heads=1, local_window=4)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(1, 99, (2, 20))
    changed = ids.clone()
    changed[:, 11:] = torch.randint(1, 99, (2, 9))
    with torch.no_grad():
        a = model(ids, use_cache=False).logits
        b = model(changed, use_cache=False).logits
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 11:], b[:, 11:])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoder", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(family, decoder):
    cfg = tiny_config(family, is_decoder=decoder)
    auto = AutoModelForCausalLM if decoder else AutoModelForMaskedLM
    torch.manual_seed(0)
    model = auto.from_config(cfg).train()
    ids = torch.randint(1, 99, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    model(input_ids=ids, labels=ids).loss.backward()
    for name, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)
    assert len(plain) > 10


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoder", [False, True])
def test_chunk_size_feed_forward_gives_the_same_outputs_and_gradients(family, decoder):
    """transformers' chunk_size_feed_forward: the mlp over 7 positions at a time (30 = 4 x 7 + 2, a shorter last
    piece), the same model otherwise."""
    auto = AutoModelForCausalLM if decoder else AutoModelForMaskedLM
    torch.manual_seed(0)
    plain = auto.from_config(tiny_config(family, is_decoder=decoder)).train()
    chunked = auto.from_config(tiny_config(family, is_decoder=decoder, chunk_size_feed_forward=7)).train()
    chunked.load_state_dict(plain.state_dict())
    assert chunked.base_model.layers[0].chunk_size_feed_forward == 7
    calls = []
    chunked.base_model.layers[0].mlp.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    ids = torch.randint(1, 99, (2, 30))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, chunked)]
    assert calls == [7, 7, 7, 7, 2]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for loss in losses:
        loss.backward()
    grads = {n: p.grad for n, p in chunked.named_parameters() if p.grad is not None}
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_token_types_and_position_ids_are_honoured(family):
    model = AutoModel.from_config(tiny_config(family)).eval()
    ids = torch.randint(1, 99, (2, 9))
    with torch.no_grad():
        base = model(input_ids=ids).last_hidden_state
        embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).last_hidden_state
        types = model(input_ids=ids, token_type_ids=torch.ones_like(ids)).last_hidden_state
        shifted = model(input_ids=ids, position_ids=torch.arange(3, 12).expand(2, -1)).last_hidden_state
    torch.testing.assert_close(embeds, base)
    assert not torch.allclose(types, base)
    assert not torch.allclose(shifted, base)


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_and_tuple_outputs(family):
    model = AutoModelForMaskedLM.from_config(tiny_config(family)).eval()
    ids = torch.randint(1, 99, (1, 8))
    out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3  # embeddings + 2 layers
    assert out.hidden_states[0].shape == (1, 8, 32)
    tup = model(ids, return_dict=False)
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], out.logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_raises_a_clear_error(family):
    model = AutoModel.from_config(tiny_config(family))
    with pytest.raises(ValueError, match="never forms the n x n attention matrix"):
        model(torch.randint(1, 99, (1, 8)), output_attentions=True)


def test_four_d_masks_are_refused_with_a_clear_error():
    model = AutoModel.from_config(tiny_config("performer"))
    with pytest.raises(ValueError, match="2-D"):
        model(torch.randint(1, 99, (1, 8)), attention_mask=torch.ones(1, 1, 8, 8))


@pytest.mark.parametrize("family", FAMILIES)
def test_too_long_inputs_raise_an_error_naming_the_limit(family):
    model = AutoModel.from_config(
        tiny_config(family, max_position_embeddings=32, **({"projected_length": 8} if family == "linformer" else {}))
    )
    # the Linformer's limit is max_seq_length, which defaults to max_position_embeddings
    limit = "max_seq_length=32" if family == "linformer" else "max_position_embeddings=32"
    with pytest.raises(ValueError, match=limit):
        model(torch.randint(1, 99, (1, 40)))


def test_the_shared_stack_has_no_family_branch():
    """base.py and layers.py name no family: no family attention class, no model_type dispatch, no family config
    field. Each family binds its attention class on its PreTrainedModel and keeps the rest in its own file."""
    import dataclasses
    import inspect
    import re

    from linearformers.configuration.common import LinearAttentionConfig
    from linearformers.modeling import base, cache, layers

    shared = {field.name for field in dataclasses.fields(LinearAttentionConfig)}
    family_fields = {
        field.name for cls in (lf.LinformerConfig, lf.PerformerConfig) for field in dataclasses.fields(cls)
    } - shared
    assert {"sharing", "projection", "feature_redraw_interval", "num_features"} <= family_fields
    for module in (base, layers):
        source = inspect.getsource(module)
        for name in ("PerformerAttention", "LinformerAttention", "build_attention", "model_type ==", "redraw"):
            assert name not in source, (module.__name__, name)
        for field in sorted(family_fields):
            pattern = rf"\.{field}\b|[\"']{field}[\"']"
            assert not re.search(pattern, source), (module.__name__, field)
    assert lf.PerformerPreTrainedModel.attention_class.__name__ == "PerformerAttention"
    assert lf.LinformerPreTrainedModel.attention_class.__name__ == "LinformerAttention"
    # the cache stores: it computes no attention
    assert "from .attention" not in inspect.getsource(cache)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", [AutoModelForSequenceClassification, AutoModelForMultipleChoice])
def test_pooled_heads_give_the_same_answer_with_left_or_right_padding(family, auto):
    """The pooler reads each row's first real token ([CLS]), not position 0, which left padding fills."""
    torch.manual_seed(0)
    model = auto.from_config(tiny_config(family, num_labels=3)).eval()
    seq = torch.randint(1, 99, (7,))
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    ids[0, :7], mask[0, :7] = seq, 1  # right padding
    ids[1, 3:], mask[1, 3:] = seq, 1  # left padding
    if auto is AutoModelForMultipleChoice:
        ids, mask, alone = ids[:, None], mask[:, None], seq[None, None]
    else:
        alone = seq[None]
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
        single = model(input_ids=alone).logits
    torch.testing.assert_close(padded, single.expand_as(padded), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_sequence_classification_without_a_mask_pools_the_last_non_pad_token(family):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(family, is_decoder=True, num_labels=2))
    model.eval()
    seq = torch.randint(1, 99, (1, 6))
    padded = torch.cat([seq, torch.zeros(1, 3, dtype=torch.long)], 1)  # pad_token_id = 0, no attention_mask
    with torch.no_grad():
        torch.testing.assert_close(model(padded).logits, model(seq).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "problem_type,labels",
    [
        ("single_label_classification", torch.tensor([0, 2])),
        ("multi_label_classification", torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),
        ("regression", torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, 0.0]])),
    ],
)
def test_sequence_classification_problem_types(problem_type, labels):
    cfg = tiny_config("performer", num_labels=3, problem_type=problem_type)
    model = AutoModelForSequenceClassification.from_config(cfg)
    out = model(torch.randint(1, 99, (2, 8)), labels=labels)
    assert out.logits.shape == (2, 3) and out.loss.ndim == 0 and torch.isfinite(out.loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_resize_token_embeddings_keeps_the_lm_head_tied(family):
    model = AutoModelForMaskedLM.from_config(tiny_config(family))
    model.resize_token_embeddings(120)
    assert model.get_input_embeddings().weight.shape[0] == 120
    assert model.lm_head.decoder.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model(torch.randint(100, 120, (1, 6))).logits.shape == (1, 6, 120)
    causal = AutoModelForCausalLM.from_config(tiny_config(family, is_decoder=True))
    causal.resize_token_embeddings(110)
    assert causal.lm_head.weight.data_ptr() == causal.get_input_embeddings().weight.data_ptr()


def test_causal_lm_and_encoder_heads_refuse_the_wrong_stack():
    with pytest.raises(ValueError, match="is_decoder=True"):
        lf.PerformerForCausalLM(tiny_config("performer"))
    with pytest.raises(ValueError, match="bidirectional encoder"):
        lf.LinformerForMaskedLM(tiny_config("linformer", is_decoder=True))


def test_device_map_auto_loads(tmp_path):
    AutoModelForMaskedLM.from_config(tiny_config("performer")).save_pretrained(tmp_path)
    model = AutoModelForMaskedLM.from_pretrained(tmp_path, device_map="auto")
    assert model(torch.randint(1, 99, (1, 6))).logits.shape == (1, 6, 99)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_on_the_documented_target_modules(family):
    peft = pytest.importorskip("peft")
    model = AutoModelForSequenceClassification.from_config(tiny_config(family))
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], task_type="SEQ_CLS"
        ),
    )
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert any("lora_A" in n and "q_proj" in n for n in trainable)
    out = lora(input_ids=torch.randint(1, 99, (2, 8)), labels=torch.tensor([0, 1]))
    out.loss.backward()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoder", [False, True])
def test_peft_lora_without_target_modules_adapts_q_proj_and_v_proj(family, decoder):
    # PEFT's default target modules come from its table by model_type, where the package registers both families
    peft = pytest.importorskip("peft")
    auto = AutoModelForCausalLM if decoder else AutoModelForSequenceClassification
    model = auto.from_config(tiny_config(family, is_decoder=decoder))
    task_type = "CAUSAL_LM" if decoder else "SEQ_CLS"
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, task_type=task_type))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in lora.named_parameters() if ".lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    ids = torch.randint(1, 99, (2, 8))
    lora(input_ids=ids, labels=ids if decoder else torch.tensor([0, 1])).loss.backward()


def test_torch_compile_matches_eager():
    model = AutoModelForMaskedLM.from_config(tiny_config("performer")).eval()
    ids = torch.randint(1, 99, (1, 8))
    eager = model(ids).logits
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(ids).logits, eager)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoder", [False, True])
def test_half_precision_models_train_with_finite_outputs(family, dtype, decoder):
    cfg = tiny_config(family, is_decoder=decoder, num_local_heads=1, local_window=4, position_embedding_type="rotary")
    auto = AutoModelForCausalLM if decoder else AutoModelForMaskedLM
    model = auto.from_config(cfg, dtype=dtype)
    ids = torch.randint(1, 99, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == dtype
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_torch_compile_with_inductor_matches_eager():
    model = AutoModelForMaskedLM.from_config(tiny_config("performer")).eval()
    ids = torch.randint(1, 99, (2, 16))
    eager = model(ids).logits
    torch.testing.assert_close(torch.compile(model)(ids).logits, eager, rtol=1e-4, atol=1e-5)


# the heads

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


def test_new_tensors_lists_what_the_modules_declare_and_have_by_state_dict_name():
    """A Performer hybrid with a learned map and key scale: per layer the map's tensors, the balance and the key
    scale (no query scale: the module has none), the redraw counter once; nothing the checkpoint would hold."""
    model = lf.PerformerModel(
        tiny_config(
            "performer",
            feature_map="hedgehog",
            hybrid_window=4,
            hybrid_key_scale=True,
            num_local_heads=1,
            local_window=8,
        )
    )
    new = base.new_tensors(model)
    for i in range(2):
        own = {name.removeprefix(f"layers.{i}.attention.") for name in new if name.startswith(f"layers.{i}.")}
        assert own == {
            "feature_map.weight",
            "feature_map.bias",
            "feature_map.key_weight",
            "feature_map.key_bias",
            "window_balance",
            "key_scale_weight",
            "key_scale_bias",
        }
    assert {name for name in new if not name.startswith("layers.")} == {"feature_redraws"}
    assert set(new) <= set(model.state_dict())


def test_new_tensors_names_a_shared_projection_once_under_its_owner():
    model = lf.LinformerForMaskedLM(
        tiny_config("linformer", sharing="layerwise", num_local_heads=1, local_window=8, local_relative_bias=True)
    )
    new = base.new_tensors(model)
    assert {name for name, declared in new.items() if declared.projection} == {"model.shared_projection"}
    assert new["model.shared_projection"].start == "window_means"
    assert new["model.layers.0.attention.relative_bias"] == base.NewTensor(start="zeros")
