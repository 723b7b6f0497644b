"""transformers' own ways to save and upload write the same self-contained repository as ``save_for_hub``:
``model.push_to_hub``, ``save_pretrained(push_to_hub=True)``, ``Trainer(push_to_hub=True)`` and
``register_for_auto_class`` + ``save_pretrained``. Only the network is stubbed: each upload lands in a folder laid
out as the Hub cache, and one fresh process that cannot import linearformers loads them all with
``trust_remote_code=True`` (and saves one again, from its remote code)."""

import shutil
from concurrent.futures import Future
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, RepoUrl
from huggingface_hub.errors import EntryNotFoundError
from transformers import AutoModelForMaskedLM, AutoTokenizer, Trainer, TrainingArguments

import linearformers as lf
from linearformers.hub_cards import push_to_hub, save_for_hub
from tests.conftest import tiny_config
from tests.hub_cards.test_export import _isolated_python

COMMIT = "0123456789abcdef0123456789abcdef01234567"

LOADER = """
import sys, torch
try:
    import linearformers
except ImportError:
    pass
else:
    raise SystemExit("linearformers must not be importable here")
import transformers
cache, inputs, out = sys.argv[1:4]
ids = torch.load(inputs)
results = {}
for name, (repo, auto_name, resave) in torch.load(inputs.replace("ids", "jobs")).items():
    try:
        auto = getattr(transformers, auto_name)
        model = auto.from_pretrained(repo, cache_dir=cache, local_files_only=True, trust_remote_code=True).eval()
        if resave:  # save again from the remote code, and load that folder
            model.save_pretrained(resave)
            model = auto.from_pretrained(resave, trust_remote_code=True).eval()
        with torch.no_grad():
            first = model(ids, use_cache=False)[0] if auto_name.endswith("CausalLM") else model(ids)[0]
        results[name] = {"out": first, "class": type(model).__name__, "module": type(model).__module__}
    except Exception as error:  # one broken repository must not hide the others' results
        results[name] = {"error": f"{type(error).__name__}: {error}"}
torch.save(results, out)
"""


class FakeHub:
    """The HfApi calls transformers' PushToHubMixin and Trainer make, writing into a Hub-cache layout."""

    def __init__(self, cache: Path):
        self.cache = cache

    def snapshot(self, repo_id: str) -> Path:
        root = self.cache / ("models--" + repo_id.replace("/", "--"))
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / "main").write_text(COMMIT)
        return root / "snapshots" / COMMIT

    def create_repo(self, api, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, **kwargs):
        for operation in operations:
            target = self.snapshot(repo_id) / operation.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(operation.path_or_fileobj, target)
        return f"https://huggingface.co/{repo_id}/commit/{COMMIT}"

    def upload_folder(self, api, *, repo_id, folder_path, ignore_patterns=(), run_as_future=False, **kwargs):
        def ignored(folder, names):
            return [name for name in names if any(fnmatch(name, pattern) for pattern in ignore_patterns or ())]

        shutil.copytree(folder_path, self.snapshot(repo_id), ignore=ignored, dirs_exist_ok=True)
        if run_as_future:
            done = Future()
            done.set_result(None)
            return done
        return f"https://huggingface.co/{repo_id}/commit/{COMMIT}"


def _not_on_the_hub(*args, **kwargs):
    raise EntryNotFoundError("no README.md yet")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, tokenizer_dir):
    """Every way of saving, each into its own repository; the fresh process's results, by scenario."""
    tmp = tmp_path_factory.mktemp("push")
    hub = FakeHub(tmp / "cache")
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    models, jobs, errors = {}, {}, {}
    with pytest.MonkeyPatch.context() as patch:
        for name in ("create_repo", "create_commit", "upload_folder"):
            method = getattr(hub, name)
            patch.setattr(HfApi, name, lambda api, *a, _method=method, **k: _method(api, *a, **k))
        patch.setattr(ModelCard, "load", _not_on_the_hub)
        # registration is class-wide: undone when the fixture ends
        for cls in (lf.LinformerForTokenClassification, lf.PerformerForSequenceClassification, lf.LinformerForMaskedLM):
            patch.setattr(cls, "_hub_code_registered", False)

        def scenario(name, repo, auto_name, build, resave=None):
            torch.manual_seed(0)
            try:
                models[name] = build()
            except Exception as error:
                errors[name] = f"{type(error).__name__}: {error}"
            else:
                jobs[name] = (repo, auto_name, resave)

        def method_push():
            model = lf.PerformerForMaskedLM(tiny_config("performer"))
            model.push_to_hub("me/method")
            return model

        def save_and_push():
            model = lf.LinformerForCausalLM(tiny_config("linformer", is_decoder=True))
            model.save_pretrained(tmp / "save", push_to_hub=True, repo_id="me/save")
            return model

        def trainer_push():  # Trainer calls nothing on the model but save_pretrained: the code comes by registration
            lf.PerformerForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
            model = lf.PerformerForSequenceClassification(tiny_config("performer"))
            data = [{"input_ids": row, "labels": i % 2} for i, row in enumerate(torch.randint(1, 99, (4, 12)))]
            args = TrainingArguments(
                output_dir=str(tmp / "trainer"),
                push_to_hub=True,
                hub_model_id="me/trainer",
                max_steps=2,
                per_device_train_batch_size=2,
                save_strategy="no",
                report_to="none",
                use_cpu=True,
            )
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
            trainer.push_to_hub()
            return model

        def trainer_checkpoint_push():  # hub_strategy "every_save": the checkpoint's push is the repo's state
            lf.LinformerForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")
            model = lf.LinformerForMaskedLM(tiny_config("linformer"))
            data = [{"input_ids": row, "labels": row} for row in torch.randint(1, 99, (4, 12))]
            args = TrainingArguments(
                output_dir=str(tmp / "trainer_checkpoint"),
                push_to_hub=True,
                hub_model_id="me/trainer_checkpoint",
                hub_strategy="every_save",
                max_steps=1,
                per_device_train_batch_size=2,
                save_strategy="steps",
                save_steps=1,
                report_to="none",
                use_cpu=True,
            )
            Trainer(model=model, args=args, train_dataset=data).train()
            return model

        def registered(folder):
            def build():
                lf.LinformerForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
                model = lf.LinformerForTokenClassification(tiny_config("linformer"))
                model.save_pretrained(tmp / "registered")
                save_for_hub(model, AutoTokenizer.from_pretrained(tokenizer_dir), tmp / "registered_export")
                return model

            return build

        scenario("method", "me/method", "AutoModelForMaskedLM", method_push)
        scenario("save_pretrained", "me/save", "AutoModelForCausalLM", save_and_push)
        scenario("trainer", "me/trainer", "AutoModelForSequenceClassification", trainer_push)
        scenario("trainer_checkpoint", "me/trainer_checkpoint", "AutoModelForMaskedLM", trainer_checkpoint_push)
        scenario("registered", str(tmp / "registered"), "AutoModelForTokenClassification", registered(tmp))
        if "registered" in jobs:
            models["registered_export"] = models["registered"]
            jobs["registered_export"] = (str(tmp / "registered_export"), "AutoModelForTokenClassification", None)
        if "method" in jobs:
            models["resaved"] = models["method"]
            jobs["resaved"] = ("me/method", "AutoModelForMaskedLM", str(tmp / "resaved"))
            push_to_hub(models["method"], AutoTokenizer.from_pretrained(tokenizer_dir), "me/function")
    torch.save(ids, tmp / "ids.pt")
    torch.save(jobs, tmp / "jobs.pt")
    script = tmp / "load.py"
    script.write_text(LOADER)
    done = _isolated_python(script, str(hub.cache), str(tmp / "ids.pt"), str(tmp / "out.pt"), cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(tmp / "out.pt")
    results.update({name: {"error": error} for name, error in errors.items()})
    return {"results": results, "models": models, "ids": ids, "hub": hub}


def _check_loads_remotely(pushed, name):
    remote = pushed["results"][name]
    assert "error" not in remote, remote.get("error")
    model = pushed["models"][name].eval()
    assert remote["class"] == type(model).__name__
    assert remote["module"].startswith("transformers_modules"), "loaded the package instead of the remote code"
    with torch.no_grad():
        local = model(pushed["ids"], use_cache=False) if model.config.is_decoder else model(pushed["ids"])
    torch.testing.assert_close(remote["out"], local[0], rtol=1e-5, atol=1e-6)


def test_model_push_to_hub_uploads_code_that_loads_without_the_package(pushed):
    _check_loads_remotely(pushed, "method")


def test_save_pretrained_with_push_to_hub_uploads_code_that_loads_without_the_package(pushed):
    _check_loads_remotely(pushed, "save_pretrained")


def test_trainer_push_to_hub_uploads_code_that_loads_without_the_package(pushed):
    _check_loads_remotely(pushed, "trainer")


def test_trainer_checkpoint_pushes_upload_code_that_loads_without_the_package(pushed):
    _check_loads_remotely(pushed, "trainer_checkpoint")


def test_register_for_auto_class_then_save_pretrained_and_save_for_hub_load_without_the_package(pushed):
    _check_loads_remotely(pushed, "registered")
    _check_loads_remotely(pushed, "registered_export")


def test_a_model_loaded_from_remote_code_saves_a_folder_that_loads_again(pushed):
    _check_loads_remotely(pushed, "resaved")


def test_push_to_hub_function_uploads_the_method_files_plus_tokenizer_and_card(pushed):
    method = pushed["hub"].snapshot("me/method")
    function = pushed["hub"].snapshot("me/function")
    model_files = {p.name for p in method.iterdir()} - {"README.md"}
    assert {"config.json", "model.safetensors", "modeling_performer.py"} <= model_files
    assert model_files <= {p.name for p in function.iterdir()}
    # the same config (auto_map included); the code files are compared by name only: both are written from the
    # package's source at the time of the push
    assert (method / "config.json").read_text() == (function / "config.json").read_text()
    assert "tokenizer.json" in {p.name for p in function.iterdir()}
    assert "linear-attention" in (function / "README.md").read_text()


def test_save_pretrained_writes_code_and_auto_map_only_after_register_for_auto_class(tmp_path, monkeypatch):
    model = AutoModelForMaskedLM.from_config(tiny_config("linformer"))
    model.save_pretrained(tmp_path / "plain")
    assert not list((tmp_path / "plain").glob("*.py"))
    assert not hasattr(lf.LinformerConfig.from_pretrained(tmp_path / "plain"), "auto_map")
    monkeypatch.setattr(lf.LinformerForMaskedLM, "_hub_code_registered", False)
    lf.LinformerForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")
    model.save_pretrained(tmp_path / "registered")
    config = lf.LinformerConfig.from_pretrained(tmp_path / "registered")
    assert len(config.auto_map) == 8 and config.auto_map["AutoModel"] == "modeling_linformer.LinformerModel"
    assert not hasattr(model.config, "auto_map")
    assert (tmp_path / "registered" / "modeling_linformer.py").is_file()
    assert (tmp_path / "registered" / "configuration_linformer.py").is_file()


def test_a_registered_config_saves_its_models_with_the_code_again_and_again(tmp_path, monkeypatch):
    # transformers' custom_object_save would follow the package's nested imports and fail; registration is recorded
    monkeypatch.setattr(lf.PerformerConfig, "_hub_code_registered", False)
    lf.PerformerConfig.register_for_auto_class()
    model = lf.PerformerModel(tiny_config("performer"))
    for folder in ("first", "second"):
        model.save_pretrained(tmp_path / folder)
        assert (tmp_path / folder / "modeling_performer.py").is_file()
        assert "AutoModel" in lf.PerformerConfig.from_pretrained(tmp_path / folder).auto_map
    with pytest.raises(ValueError, match="AutoNothing is not a valid auto class"):
        lf.PerformerConfig.register_for_auto_class("AutoNothing")


def test_trainer_output_dir_and_checkpoints_hold_no_code(tmp_path):
    model = lf.PerformerForMaskedLM(tiny_config("performer"))
    data = [{"input_ids": row, "labels": row} for row in torch.randint(1, 99, (4, 12))]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model()
    assert (tmp_path / "checkpoint-1" / "model.safetensors").is_file()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.py")) == []
