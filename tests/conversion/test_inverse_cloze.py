"""Inverse-cloze steps on a converted long encoder (linearformers.conversion.inverse_cloze)."""

import random
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertModel

import linearformers  # noqa: F401  (registers the Auto classes)
from linearformers.conversion import inverse_cloze
from linearformers.conversion.convert import convert_bert
from linearformers.conversion.inverse_cloze import (
    InverseClozeArguments,
    _cut,
    document_tokens,
    inverse_cloze_finetune,
    main,
)
from linearformers.conversion.transfer import _mean_distillation_loss, text_blocks
from tests.conversion.test_transfer import HEDGEHOG, _saved_bert_with_a_tokenizer

N = 200  # the converted model's length; the tiny BERT has 64 positions
TINY = dict(
    steps=3,
    length=128,
    batch_size=2,
    passages=2,
    passage_length=8,
    skip=32,
    queue=4,
    short_length=32,
    eval_documents=2,
    learning_rate=1e-3,
    new_learning_rate=1e-3,
    progress=False,
)


def _documents(count: int = 8) -> list[str]:
    """The standard library's first top-level modules of at least 8,000 characters: real text, offline."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = (path.read_text(encoding="utf-8", errors="replace") for path in sorted(stdlib.glob("*.py")))
    return [text for text in texts if len(text) >= 8000][:count]


@pytest.fixture
def converted(tokenizer_dir, tmp_path):
    """(model converted to N tokens without transfer, its source BERT, tokenizer, the BERT's folder)."""
    _saved_bert_with_a_tokenizer(tokenizer_dir, tmp_path / "bert")
    bert = BertModel.from_pretrained(tmp_path / "bert").eval()
    model, _ = convert_bert(bert, "performer", max_length=N, **HEDGEHOG, hybrid_window=4, hybrid_sinks=1)
    return model, bert, AutoTokenizer.from_pretrained(tokenizer_dir), tmp_path / "bert"


@pytest.mark.parametrize("seed", range(20))
def test_cut_takes_disjoint_passages_past_skip_and_keeps_the_rest_of_the_document_in_order(seed):
    args = InverseClozeArguments(**TINY)
    row = list(range(1000, 1000 + args.document_tokens))  # every token distinct: where each went is visible
    queries, document = _cut(row, args, random.Random(seed), 1, 2)
    assert len(queries) == args.passages and len(document) == args.length
    assert document[0] == 1 and document[-1] == 2
    passages = [query[1:-1] for query in queries]
    assert all(query[0] == 1 and query[-1] == 2 and len(query) == args.passage_length + 2 for query in queries)
    taken = [token for passage in passages for token in passage]
    assert len(set(taken)) == len(taken)  # no overlap
    assert all(token - 1000 >= args.skip for token in taken)  # past the first skip tokens
    assert all(passage == list(range(passage[0], passage[0] + args.passage_length)) for passage in passages)
    assert document[1:-1] == [token for token in row if token not in set(taken)]  # the rest, in order


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(steps=0), ValueError, "steps"),
        (dict(batch_size=1), ValueError, "batch_size"),
        (dict(skip=126), ValueError, "skip"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(short_weight=-1.0), ValueError, "short_weight"),
        (dict(learning_rate="fast"), TypeError, "learning_rate"),
        (dict(progress=1), TypeError, "progress"),
    ],
)
def test_arguments_are_checked_by_name(overrides, error, match):
    with pytest.raises(error, match=match):
        InverseClozeArguments(**{**TINY, **overrides})


def test_documents_too_short_are_left_out(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = document_tokens(tokenizer, ["word " * 50, "word " * 500], 100)
    assert [len(row) for row in rows] == [100]
    with pytest.raises(TypeError, match="list of strings"):
        document_tokens(tokenizer, "one text", 100)


def test_the_steps_train_every_weight_report_both_sides_and_leave_flags_mode_and_rng(converted):
    model, bert, tokenizer, _ = converted
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    model.embeddings.word_embeddings.weight.requires_grad_(False)  # a flag the run must restore
    model.train()
    bert.train()  # the source's mode is the caller's: it must come back as it was
    rng = torch.random.get_rng_state()
    report = inverse_cloze_finetune(model, bert, tokenizer, _documents(), _documents(2), **_args())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert not model.training and not model.embeddings.word_embeddings.weight.requires_grad and bert.training
    moved = [name for name, param in model.named_parameters() if not torch.equal(param, before[name])]
    assert "layers.0.attention.feature_map.weight" in moved and "layers.0.attention.q_proj.weight" in moved
    assert report.steps == 3 and len(report.losses) == 3 and report.documents == len(_documents()) - 2
    assert report.eval_documents == 2 and 0.0 <= report.top1_before <= 1.0 and 0.0 <= report.top1_after <= 1.0
    assert report.short_loss_before > 0 and report.short_loss_after > 0
    assert "a passage retrieves its document" in str(report)


def _args(**overrides) -> dict:
    return {"args": InverseClozeArguments(**{**TINY, **overrides})}


def test_a_second_run_repeats_the_first_and_the_distillation_term_adds_to_the_loss(converted, tokenizer_dir):
    model, bert, tokenizer, _ = converted
    model.config.hybrid_exact_length = None  # read exactly, the untrained conversion is the original: no loss to add
    start = {name: param.detach().clone() for name, param in model.state_dict().items()}
    texts, short = _documents(), _documents(2)
    first = inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args())
    after = {name: param.detach().clone() for name, param in model.state_dict().items()}
    model.load_state_dict(start)
    second = inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args())
    assert first.losses == second.losses  # same process: the same seeds give the same run
    for name, param in model.state_dict().items():
        torch.testing.assert_close(param, after[name], rtol=0, atol=0)
    model.load_state_dict(start)
    alone = inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args(short_weight=0.0))
    assert alone.losses[0] < first.losses[0]  # the first step's loss, with and without the distillation term


def test_the_steps_refuse_what_cannot_run_by_name(converted):
    model, bert, tokenizer, _ = converted
    texts, short = _documents(), _documents(2)
    with pytest.raises(ValueError, match="documents have the"):
        inverse_cloze_finetune(model, bert, tokenizer, texts[:3], short, **_args())
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args(length=N + 1))
    with pytest.raises(ValueError, match="short_length"):
        inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args(short_length=65))
    with pytest.raises(TypeError, match="converted linearformers encoder"):
        inverse_cloze_finetune(bert, bert, tokenizer, texts, short, **_args())
    with pytest.raises(TypeError, match="InverseClozeArguments"):
        inverse_cloze_finetune(model, bert, tokenizer, texts, short, args=dict(TINY))


def test_the_cli_trains_a_converted_folder_into_a_new_one_that_keeps_its_other_files(converted, tmp_path, capsys):
    model, _, tokenizer, bert_dir = converted
    model.save_pretrained(tmp_path / "long")
    tokenizer.save_pretrained(tmp_path / "long")
    (tmp_path / "long" / "modules.json").write_text("[]")  # stands for the sentence-transformers files
    files = []
    for index, text in enumerate(_documents()):
        files.append(tmp_path / f"doc{index}.py")
        files[-1].write_text(text)
    short = tmp_path / "short.txt"
    short.write_text(" ".join(_documents(2)))
    flags = [f"--{name}={value}" for name, value in TINY.items() if name != "progress"]
    main([str(tmp_path / "long"), str(tmp_path / "out"), "--original", str(bert_dir), "--short_file", str(short),
          "--documents", *map(str, files), *flags, "--no_progress"])  # fmt: skip
    assert "a passage retrieves its document" in capsys.readouterr().out
    assert (tmp_path / "out" / "modules.json").read_text() == "[]"
    trained = AutoModel.from_pretrained(tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").vocab_size == tokenizer.vocab_size
    assert not torch.equal(trained.layers[0].attention.q_proj.weight, model.layers[0].attention.q_proj.weight)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda argv, tmp: argv.__setitem__(1, argv[0]), "is the input folder"),
        (lambda argv, tmp: argv.__setitem__(0, str(tmp)), "holds no config.json"),
        (lambda argv, tmp: argv.append(str(tmp / "missing.py")), "is not a file"),
        (lambda argv, tmp: argv.append("--steps=0"), "steps"),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line(converted, tmp_path, capsys, change, match):
    model, _, _, bert_dir = converted
    model.save_pretrained(tmp_path / "long")
    (tmp_path / "doc.py").write_text(_documents(1)[0])
    (tmp_path / "short.txt").write_text(_documents(1)[0])
    argv = [str(tmp_path / "long"), str(tmp_path / "out"), "--original", str(bert_dir), "--short_file",
            str(tmp_path / "short.txt"), "--documents", str(tmp_path / "doc.py")]  # fmt: skip
    change(argv, tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_the_steps_train_the_hybrid_and_hold_the_exact_read_of_short_blocks_to_the_original(converted, monkeypatch):
    """A long conversion reads its source's positions exactly (hybrid_exact_length). The inverse cloze's passages
    and documents train the hybrid: without the distillation term, the run of the same model read with the hybrid
    at every length. The term, and the held-out short loss the report gives, read the short blocks as saved:
    exactly. The field is back afterwards."""
    model, bert, tokenizer, _ = converted
    limit = bert.config.max_position_embeddings
    assert model.config.hybrid_exact_length == limit
    start = {name: param.detach().clone() for name, param in model.state_dict().items()}
    texts, short = _documents(), _documents(2)
    runs, states = [], []
    for exact in (limit, None):
        model.load_state_dict(start)
        model.config.hybrid_exact_length = exact
        runs.append(inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args(short_weight=0.0)))
        assert model.config.hybrid_exact_length == exact
        states.append({name: param.detach().clone() for name, param in model.state_dict().items()})
    assert runs[0].losses == runs[1].losses and runs[0].top1_before == runs[1].top1_before
    for name, param in states[0].items():
        torch.testing.assert_close(states[1][name], param, rtol=0, atol=0)

    reads = {"_embed": set(), "_distillation_loss": set()}  # the field while each reads

    def spy(name):
        function = getattr(inverse_cloze, name)

        def read(model, *rest):
            reads[name].add(model.config.hybrid_exact_length)
            return function(model, *rest)

        return read

    for name in reads:
        monkeypatch.setattr(inverse_cloze, name, spy(name))
    model.load_state_dict(start)
    model.config.hybrid_exact_length = limit
    report = inverse_cloze_finetune(model, bert, tokenizer, texts, short, **_args())
    assert reads == {"_embed": {None}, "_distillation_loss": {limit}}
    assert model.config.hybrid_exact_length == limit
    assert f"(read as saved: exactly up to {limit} tokens)" in str(report)
    model.load_state_dict(start)  # the held-out short loss before the steps: the exact read's, not the hybrid's
    blocks = text_blocks(tokenizer, short, TINY["short_length"], wrap=True)[: TINY["batch_size"]]
    held = [(blocks, torch.ones_like(blocks, dtype=torch.bool))]
    assert report.short_loss_before == pytest.approx(_mean_distillation_loss(model, bert, held), rel=1e-5)
    model.config.hybrid_exact_length = None
    assert report.short_loss_before != pytest.approx(_mean_distillation_loss(model, bert, held), rel=1e-2)
