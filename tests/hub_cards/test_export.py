"""The Hub export loads in a fresh process that cannot import linearformers, from the Hub's own cache layout and from
a plain folder, for every head."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from linearformers.hub_cards import flatten_module, push_to_hub, save_for_hub
from linearformers.modeling.hub_code import flat_name, remote_modules, write_remote_code
from tests.conftest import tiny_config

LOADER = """
import json, sys, torch
try:
    import linearformers
except ImportError:
    pass
else:
    raise SystemExit("linearformers must not be importable here")
import transformers
repo, cache, auto_name, out = sys.argv[1:5]
auto = getattr(transformers, auto_name)
model = auto.from_pretrained(repo, cache_dir=cache, local_files_only=True, trust_remote_code=True).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(repo, cache_dir=cache, local_files_only=True)
ids = tokenizer("Linear attention for long sequences.", return_tensors="pt").input_ids
if auto_name == "AutoModelForMultipleChoice":
    ids = ids[:, None].expand(-1, 2, -1)
with torch.no_grad():
    result = model(ids) if auto_name != "AutoModelForCausalLM" else model(ids, use_cache=False)
first = result[0]
generated = None
if auto_name == "AutoModelForCausalLM":
    generated = model.generate(ids, max_new_tokens=8, do_sample=False).tolist()
torch.save({"out": first, "ids": ids, "class": type(model).__name__, "module": type(model).__module__,
            "generated": generated}, out)
"""


def _hub_cache(folder: Path, cache: Path, repo_id: str) -> None:
    """Lay ``folder`` out exactly as huggingface_hub's cache stores a downloaded repository."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


def _isolated_python(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The venv's python without site processing (-S): the editable install's .pth finder never runs, so
    linearformers cannot be imported; transformers and torch come from an explicit site-packages path."""
    site = sysconfig.get_paths()["purelib"]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": site, "HF_HUB_OFFLINE": "1", "HOME": str(cwd)}
    return subprocess.run(
        [sys.executable, "-S", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _load_remote(folder: Path, auto_name: str, tmp_path: Path) -> dict:
    """LOADER's results for the exported ``folder`` loaded by ``auto_name`` with trust_remote_code in a process where
    the package cannot be imported; checks that the remote code, not the package, was loaded."""
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    done = _isolated_python(
        script, str(folder), str(tmp_path / "cache"), auto_name, str(tmp_path / "out.pt"), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    assert remote["module"].startswith("transformers_modules"), "loaded the package instead of the remote code"
    return remote


def assert_causal_lm_loads_as_remote_code(model, tokenizer, tmp_path: Path) -> None:
    """Export a causal LM with save_for_hub, load the folder with trust_remote_code in a process where the package
    cannot be imported, and check the remote copy's logits and greedy generation against ``model``."""
    folder = save_for_hub(model, tokenizer, tmp_path / "export", results={"accuracy": 0.5}, repo_id="me/tiny")
    remote = _load_remote(folder, "AutoModelForCausalLM", tmp_path)
    with torch.no_grad():
        local = model(remote["ids"], use_cache=False)
    torch.testing.assert_close(remote["out"], local[0], rtol=1e-5, atol=1e-6)
    assert remote["generated"] == model.generate(remote["ids"], max_new_tokens=8, do_sample=False).tolist()


@pytest.mark.parametrize(
    "family,auto,decoder,layout",
    [
        ("performer", AutoModelForMaskedLM, False, "hub_cache"),
        ("linformer", AutoModelForSequenceClassification, False, "hub_cache"),
        ("performer", AutoModelForCausalLM, True, "hub_cache"),
        ("linformer", AutoModelForCausalLM, True, "hub_cache"),
        ("performer", AutoModelForTokenClassification, False, "hub_cache"),
        ("linformer", AutoModelForQuestionAnswering, False, "hub_cache"),
        ("performer", AutoModelForMultipleChoice, False, "hub_cache"),
        ("linformer", AutoModel, False, "hub_cache"),
        # a plain folder (save_for_hub's output, a local clone): transformers loads its config code and its model
        # code as two module copies, so nothing may depend on the config's class identity
        ("performer", AutoModelForCausalLM, True, "folder"),
        ("linformer", AutoModelForTokenClassification, False, "folder"),
        ("performer", AutoModelForQuestionAnswering, False, "folder"),
    ],
)
def test_export_loads_with_remote_code_where_the_package_is_missing(
    family, auto, decoder, layout, tokenizer_dir, tmp_path
):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(
        family,
        vocab_size=tokenizer.vocab_size,
        is_decoder=decoder,
        num_local_heads=1,
        local_window=4,
        max_position_embeddings=128,
    )
    model = auto.from_config(config).eval()
    folder = save_for_hub(model, tokenizer, tmp_path / "export", results={"accuracy": 0.5}, repo_id="me/tiny")
    repo = "me/tiny"
    if layout == "hub_cache":
        _hub_cache(folder, tmp_path / "cache", repo)
    else:
        repo = str(folder)
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    done = _isolated_python(
        script, repo, str(tmp_path / "cache"), auto.__name__, str(tmp_path / "out.pt"), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    assert remote["class"] == type(model).__name__
    assert remote["module"].startswith("transformers_modules"), "loaded the package instead of the remote code"
    with torch.no_grad():
        local = model(remote["ids"], use_cache=False) if decoder else model(remote["ids"])
    torch.testing.assert_close(remote["out"], local[0], rtol=1e-5, atol=1e-6)
    if decoder:
        assert remote["generated"] == model.generate(remote["ids"], max_new_tokens=8, do_sample=False).tolist()


def test_export_loads_without_remote_code_when_the_package_is_installed(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForMaskedLM.from_config(tiny_config("linformer", vocab_size=tokenizer.vocab_size)).eval()
    folder = save_for_hub(model, tokenizer, tmp_path / "export")
    again = AutoModel.from_pretrained(folder)  # no trust_remote_code: the registered class wins
    assert type(again).__module__.startswith("linearformers")
    ids = torch.randint(1, 99, (1, 8))
    reloaded = AutoModelForMaskedLM.from_pretrained(folder).eval()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_export_of_a_hybrid_with_far_blocks_loads_with_remote_code(tokenizer_dir, tmp_path):
    """The far-block choice (ops/far_blocks.py) travels with the exported code: the remote copy gives the outputs."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(
        "performer", vocab_size=tokenizer.vocab_size, max_position_embeddings=128, feature_map="hedgehog",
        hybrid_window=3, hybrid_sinks=1, hybrid_query_scale=True, hybrid_select_blocks=2, hybrid_select_block_size=2,
    )  # fmt: skip
    model = AutoModel.from_config(config).eval()
    folder = save_for_hub(model, tokenizer, tmp_path / "export", results={"accuracy": 0.5}, repo_id="me/tiny")
    assert (folder / "ops_far_blocks.py").exists()
    remote = _load_remote(folder, "AutoModel", tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(remote["out"], model(remote["ids"])[0], rtol=1e-5, atol=1e-6)


def test_export_folder_holds_weights_config_auto_map_tokenizer_card_and_code(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_config(tiny_config("performer", is_decoder=True, vocab_size=tokenizer.vocab_size))
    folder = save_for_hub(
        model,
        tokenizer,
        tmp_path,
        results={"perplexity": 7.5, "eval_loss": 2.0},
        base_model="gpt2",
        datasets=["python-stdlib"],
    )
    names = {p.name for p in folder.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "README.md",
        "tokenizer.json",
        "modeling_performer.py",
        "configuration_performer.py",
        "ops_favor.py",
    } <= names
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_performer.PerformerConfig"
    assert auto_map["AutoModelForMaskedLM"] == "modeling_performer.PerformerForMaskedLM"
    assert len(auto_map) == 8
    for name in names:
        if name.endswith(".py"):
            code = (folder / name).read_text()
            imports = [line.strip() for line in code.splitlines() if line.strip().startswith(("from ", "import "))]
            assert not [line for line in imports if "linearformers" in line or line.startswith("from ..")], name
    card = (folder / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "apache-2.0"
    assert "performer" in meta["tags"]
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["base_model"] == "gpt2"
    assert meta["datasets"] == ["python-stdlib"]
    results = meta["model-index"][0]["results"][0]["metrics"]
    assert {"type": "perplexity", "value": 7.5} in results
    assert "m=32" in card and "trust_remote_code=True" in card and "import linearformers" in card


def test_flattening_rewrites_every_relative_import():
    code = flatten_module("modeling.linformer")
    assert "from .configuration_linformer import LinformerConfig" in code
    assert "from .ops_linformer import slot_first_writes" in code
    assert "from .." not in code


def test_remote_modules_follow_the_package_imports_transitively(tmp_path):
    modules = remote_modules()
    # reached only through favor.py, which the models import through ops' __init__
    assert "ops._favor_blockwise" in modules and "ops._favor_native" in modules and "ops" in modules
    written = set(write_remote_code(tmp_path))
    assert written == {flat_name(m) + ".py" for m in modules}
    for name in written:
        for line in (tmp_path / name).read_text().splitlines():
            if line.strip().startswith("from ."):
                assert line.strip().split()[1][1:] + ".py" in written, (name, line)


def test_push_to_hub_uploads_the_export(monkeypatch, tokenizer_dir):
    from huggingface_hub import HfApi

    calls = {}

    def fake_create_repo(self, repo_id, **kwargs):
        calls["create"] = (repo_id, kwargs)

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):
        calls["upload"] = (repo_id, sorted(p.name for p in Path(folder_path).iterdir()), kwargs)
        return "https://huggingface.co/me/tiny/commit/abc"

    monkeypatch.setattr(HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", fake_upload_folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForMaskedLM.from_config(tiny_config("performer", vocab_size=tokenizer.vocab_size))
    push_to_hub(model, tokenizer, "me/tiny", private=True, create_pr=True)
    assert calls["create"] == ("me/tiny", {"private": True, "exist_ok": True})
    repo_id, files, kwargs = calls["upload"]
    assert repo_id == "me/tiny" and kwargs["create_pr"] is True
    assert {"model.safetensors", "config.json", "README.md", "modeling_performer.py"} <= set(files)
    with pytest.raises(ValueError, match="owner/name"):
        push_to_hub(model, tokenizer, "tiny")


OLD_CONFIG_LOADER = """
import json, sys, warnings
import transformers
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    model = transformers.AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
c = model.config
print(json.dumps({"fields": [c.feature_map, c.num_features, c.feature_eps], "module": type(model).__module__,
                  "warned": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]}))
"""


def test_exported_code_loads_a_config_json_with_the_old_keys_where_the_package_is_missing(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config("performer", vocab_size=tokenizer.vocab_size, feature_map="relu", num_features=16)
    folder = save_for_hub(AutoModel.from_config(config), tokenizer, tmp_path / "export", repo_id="me/tiny")
    saved = json.loads((folder / "config.json").read_text())
    for old, new in {
        "kernel": "feature_map",
        "num_random_features": "num_features",
        "kernel_eps": "feature_eps",
    }.items():
        saved[old] = saved.pop(new)
    (folder / "config.json").write_text(json.dumps(saved))
    script = tmp_path / "load.py"
    script.write_text(OLD_CONFIG_LOADER)
    done = _isolated_python(script, str(folder), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded["module"].startswith("transformers_modules"), "loaded the package instead of the remote code"
    assert loaded["fields"] == ["relu", 16, config.feature_eps]
    assert any("kernel is renamed feature_map" in message for message in loaded["warned"])
