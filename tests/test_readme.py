"""Every command in README.md and docs/*.md runs as written, and every relative link resolves: a docs test.

What runs:
- each line of every ```bash block of README.md and docs/*.md, continuation lines joined, comments dropped, `&&` chains followed (`cd` moves
  the working folder). `python`, `linearformers-train` and `accelerate` are this interpreter's and its neighbours in
  the virtual environment's `bin/`;
- the ```python block under the README's "## Usage", as written but for `max_steps=2` (offline: its tokenizer is
  the [dev] extra's MiniLM).

Where: a temporary folder laid out as a fresh clone after `make data` (the repository's `examples/` copied in, and
the data files `make data` writes, made by the same command and then cut to a few kB).

Tiny settings, the one mechanism: in each command the *values* of the size flags listed in `TINY` are replaced
(steps, block size, batch, warm-up, save / eval intervals, attention transfer's steps, blocks and batch, and the
model shape inside `--config_overrides`).
Every other flag and value is passed as written, so a flag the script lacks, a misspelt config field or a data
file that `make data` does not write fails the test.

Not run:
- `make` lines: `make -n TARGET` in the repository checks that the target exists (running them would install
  packages or run the whole suite);
- lines starting with `flock` (the long benchmarks), and any block holding the marker `# docs-test: skip`
  (write the reason after it, e.g. `# docs-test: skip (20 min benchmark)`);
- other ```python blocks (they name placeholder folders, such as "path/to/bert").

What is checked without running: every relative link and image of README.md, docs/*.md and benchmarks/README.md
points at a file of the repository (and a `#anchor` at a heading of that page); README.md stays within 250 lines;
the prose (outside the tables `benchmarks/report.py` generates) names no temporary folder, lock file, load average
or commit.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = [*DOCS, ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 250
BIN = Path(sys.executable).parent
SKIP_MARKER = "# docs-test: skip"
DATA_FILES = ("train.txt", "validation.txt", "train.csv", "validation.csv")

# Old and new spellings of the training flags both listed: the README may use either.
TINY_FLAGS = {
    "--max_steps": "2",
    "--block_size": "32",
    "--per_device_batch_size": "2",
    "--per_device_train_batch_size": "2",
    "--per_device_eval_batch_size": "2",
    "--gradient_accumulation_steps": "1",
    "--warmup_steps": "0",
    "--save_every": "1",
    "--save_steps": "1",
    "--eval_every": "1",
    "--eval_steps": "1",
    "--logging_steps": "1",
    "--transfer_steps": "2",
    "--finetune_steps": "2",
    "--transfer_length": "128",  # above the window of 64, which the query scale's fit needs
    "--transfer_batch_size": "2",
}
TINY_CONFIG = {
    "hidden_size": "32",
    "num_hidden_layers": "1",
    "num_attention_heads": "2",
    "intermediate_size": "64",
    "num_features": "16",
    "projected_length": "16",
    "local_window": "8",
}
TINY = [*TINY_FLAGS, "--config_overrides"]


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [*items, current] if current else items


def tiny_config_overrides(value: str) -> str:
    """The README's overrides with the shape fields replaced by tiny values; every other field kept."""
    items = []
    for item in _split_top_level(value):
        name, _, setting = item.partition("=")
        items.append(f"{name}={TINY_CONFIG.get(name.strip(), setting)}")
    return ",".join(items)


def tiny(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        if token in TINY_FLAGS:
            out[i + 1] = TINY_FLAGS[token]
        elif token == "--config_overrides":
            out[i + 1] = tiny_config_overrides(out[i + 1])
    return out


def blocks(language: str, text: str = README) -> list[tuple[str, str]]:
    """(heading above it, body) of every fenced block in that language."""
    found = []
    for match in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S):
        headings = re.findall(r"^#+ (.+)$", text[: match.start()], flags=re.M)
        found.append((headings[-1] if headings else "", match.group(1)))
    return found


def bash_commands() -> list[tuple[str, str]]:
    """(page: heading, command) of every bash line of README.md and docs/*.md that the test runs."""
    commands = []
    for page in DOCS:
        for heading, body in blocks("bash", page.read_text()):
            if SKIP_MARKER in body:
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith(("#", "flock ")):
                    commands.append((f"{page.relative_to(ROOT)}: {heading}", line))
    return commands


COMMANDS = bash_commands()


def _env(folder: Path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(folder / ".cache" / "datasets"),
        TOKENIZERS_PARALLELISM="false",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _run(argv: list[str], cwd: Path, env: dict, timeout: int = 300) -> None:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"`{shlex.join(argv)}` in {cwd} exited with {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A folder laid out as a fresh clone after `make data`, with the data cut to a few kB."""
    folder = tmp_path_factory.mktemp("clone")
    shutil.copytree(ROOT / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__", "out*"))
    _run([sys.executable, "-m", "linearformers.training.demo", "--data-only", "--data-dir", "."], folder, _env(folder))
    for name in DATA_FILES:
        path = folder / name
        lines = path.read_text().splitlines()
        keep = 200 if name.endswith(".csv") else 300  # csv: header + balanced labels (pairs alternate)
        path.write_text("\n".join(lines[:keep]) + "\n")
    return folder


def test_readme_has_commands_and_a_usage_snippet():
    assert any("linearformers-train" in command for _, command in COMMANDS)
    assert any(heading == "Usage" for heading, _ in blocks("python"))


def test_make_data_writes_the_data_files(clone):
    for name in DATA_FILES:
        assert (clone / name).stat().st_size > 0, name
    assert (clone / "train.csv").read_text().startswith("text,label\n")


@pytest.mark.parametrize(
    "heading, command", COMMANDS, ids=[shlex.join(shlex.split(c, comments=True))[:70] for _, c in COMMANDS]
)
def test_readme_command_runs(heading, command, clone):
    env, cwd = _env(clone), clone
    tokens = shlex.split(command, comments=True)
    chain = [[]]
    for token in tokens:
        if token == "&&":
            chain.append([])
        else:
            chain[-1].append(token)
    for argv in chain:
        program, *args = argv
        if program == "cd":
            cwd = cwd / args[0]
        elif program == "make":
            _run(["make", "-n", *args], ROOT, env)
        elif program in ("python", "python3"):
            _run([sys.executable, *tiny(args)], cwd, env)
        else:
            executable = BIN / program
            assert executable.exists(), f"README command {program!r} (section {heading!r}) is not in {BIN}"
            _run([str(executable), *tiny(args)], cwd, env)


def test_readme_usage_snippet_runs_offline_as_written(clone):
    """The Usage snippet, only its step count cut to 2, runs offline: its tokenizer ships with the [dev] extra."""
    (snippet,) = [body for heading, body in blocks("python") if heading == "Usage"]
    snippet, count = re.subn(r"max_steps=\d+", "max_steps=2", snippet)
    assert count == 1, "the Usage snippet no longer has exactly one max_steps=N: update this test"
    folder = clone / "usage"
    folder.mkdir()
    (folder / "usage.py").write_text(snippet)
    _run([sys.executable, "usage.py"], folder, _env(clone))
    assert (folder / "out" / "final" / "model.safetensors").is_file()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(heading) for heading in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_resolves(page):
    """A link or image to a file that moved, or to a heading that was renamed, fails here."""
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_pages_are_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(ROOT / "README.md")}
    assert not [page.name for page in DOCS[1:] if page.resolve() not in linked]


def test_readme_stays_short():
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


@pytest.mark.parametrize("page", DOCS, ids=[str(page.relative_to(ROOT)) for page in DOCS])
def test_prose_names_no_machine_state(page):
    """Temporary folders, lock files, load averages and commits belong to the benchmark stamps (the tables
    benchmarks/report.py generates) and to the changelog, not to the prose."""
    text = re.sub(r"<!-- generated: \w+ -->.*?<!-- end -->", "", page.read_text(), flags=re.S)
    found = re.findall(
        r"/tmp/\S*|\bflock /|load average:?(?: about| of| near)? [\d(]|\b(?:at|commit) [0-9a-f]{7}\b", text
    )
    assert not found, f"{page.relative_to(ROOT)}: {found}"
