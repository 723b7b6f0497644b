"""Per-token decoding latency and cache memory vs context length: Performer / Linformer LMs vs GPT-2 (SDPA + KV cache).

All three models have GPT-2 small's shape (hidden 768, 12 layers, 12 heads, vocab 50257), random weights (speed
only). For each context length the prompt is prefilled (not timed), then ``--steps`` single-token decoding steps
are timed; the median is reported (the mean too, in the JSON). Cache memory is the bytes held by the cache object
after the prefill. Each (model, context) runs in its own process, whose peak RSS (weights + prefill + decoding) is
reported as well.

    flock /tmp/bench.lock python benchmarks/generation.py            # 512 .. 16384, ~15 min on 2 cores
    flock /tmp/bench.lock python benchmarks/generation.py --quick    # 512 and 2048, 8 steps
    python benchmarks/generation.py --contexts 512 2048 --steps 8 --models performer gpt2
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from _stamp import finish_stamp, start_stamp
from isolated import emit, peak_rss_mb, run_isolated
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from linearformers import (
    LinearAttentionCache,
    LinformerConfig,
    LinformerForCausalLM,
    PerformerConfig,
    PerformerForCausalLM,
)
from linearformers.modeling.base import CACHE_FIELD  # transformers' name for the cache: cache from 5.24

RESULTS = Path(__file__).parent / "results"
MODELS = ("performer", "linformer", "gpt2")
COMMON = dict(vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def build(name: str, max_len: int):
    if name == "gpt2":
        cfg = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=max_len, vocab_size=50257)
        return GPT2LMHeadModel(cfg).eval()
    if name == "performer":
        cfg = PerformerConfig(
            **COMMON,
            is_decoder=True,
            max_position_embeddings=max_len,
            num_features=256,
            hidden_act="gelu_new",
            feature_redraw_interval=None,
        )
        return PerformerForCausalLM(cfg).eval()
    cfg = LinformerConfig(
        **COMMON,
        is_decoder=True,
        max_position_embeddings=max_len,
        max_seq_length=max_len,
        projected_length=256,
        sharing="key_value",
        hidden_act="gelu_new",
    )
    return LinformerForCausalLM(cfg).eval()


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        tensors += list(getattr(layer, "recurrent_states", {}).values()) + list(
            getattr(layer, "conv_states", {}).values()
        )
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


@torch.inference_mode()
def measure(model, name: str, context: int, steps: int) -> dict:
    ids = torch.randint(0, 50257, (1, context))
    cache = DynamicCache(config=model.config) if name == "gpt2" else LinearAttentionCache(12)
    chunk = 2048  # prefill by chunks: same cache, bounded activation memory
    if name == "linformer":
        chunk = context  # the causal Linformer prefills in one call, then steps one token at a time
    for start in range(0, context, chunk):
        out = model(ids[:, start : start + chunk], **{CACHE_FIELD: cache}, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    memory = cache_bytes(cache)
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        out = model(token, **{CACHE_FIELD: cache}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if step >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return {
        "ms_per_token": 1000 * statistics.median(times),
        "mean_ms_per_token": 1000 * statistics.fmean(times),
        "cache_mb": memory / 2**20,
    }


def worker(name: str, context: int, steps: int, max_len: int) -> dict:
    """One (model, context) in this process: its row, with the process's peak RSS."""
    torch.manual_seed(0)
    row = measure(build(name, max_len), name, context, steps)
    row["peak_rss_mb"] = peak_rss_mb()
    return row


def run(name: str, context: int, steps: int, max_len: int, threads: int) -> dict:
    arguments = ["--worker", name, context, "--steps", steps, "--max-len", max_len, "--threads", threads]
    row = run_isolated(__file__, arguments, label=f"{name} context {context}")
    if row is None:  # the table, ratios and plot need every row
        raise SystemExit(f"generation benchmark: {name} at context {context} failed (see above)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="contexts 512 and 2048, 8 steps")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "CONTEXT"), help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        emit(worker(args.worker[0], int(args.worker[1]), args.steps, args.max_len))
        return
    stamp = start_stamp()
    stem = "generation"
    if args.quick:
        args.contexts, args.steps, stem = [512, 2048], 8, "generation.quick"  # keeps the full run's files
    # every model gets the same position limit, so a row does not depend on which contexts were asked for
    max_len = max(max(args.contexts), 16384) + 256
    rows = {}
    for name in args.models:
        rows[name] = {}
        for context in args.contexts:
            row = rows[name][context] = run(name, context, args.steps, max_len, args.threads)
            print(
                f"{name:9s} context {context:6d}: {row['ms_per_token']:8.1f} ms/token, "
                f"cache {row['cache_mb']:8.1f} MB, peak RSS {row['peak_rss_mb']:8.0f} MB",
                flush=True,
            )
    if set(args.models) != set(MODELS):
        print(json.dumps(rows, indent=2))
        return  # the table, ratios and plot need all three models
    first = args.contexts[0]
    print(
        "\n| context | Performer ms/token | Linformer ms/token | GPT-2 ms/token | GPT-2 / Performer | "
        "GPT-2 / Linformer | cache MB (Performer / Linformer / GPT-2) | peak RSS MB (Performer / Linformer / GPT-2) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in args.contexts:
        p, li, g = (rows[n][c] for n in ("performer", "linformer", "gpt2"))
        print(
            f"| {c} | {p['ms_per_token']:.1f} | {li['ms_per_token']:.1f} | {g['ms_per_token']:.1f} | "
            f"{g['ms_per_token'] / p['ms_per_token']:.2f}x | {g['ms_per_token'] / li['ms_per_token']:.2f}x | "
            f"{p['cache_mb']:.2f} / {li['cache_mb']:.2f} / {g['cache_mb']:.0f} | "
            f"{p['peak_rss_mb']:.0f} / {li['peak_rss_mb']:.0f} / {g['peak_rss_mb']:.0f} |"
        )
    last = args.contexts[-1]
    flat = rows["performer"][last]["ms_per_token"] / rows["performer"][first]["ms_per_token"]
    print(f"\nPerformer per-token latency {last} vs {first}: {flat:.2f}x (target <= 1.2x)")
    speedup = rows["gpt2"][last]["ms_per_token"] / rows["performer"][last]["ms_per_token"]
    print(f"GPT-2 / Performer per token at {last}: {speedup:.2f}x (target >= 4x)")
    ratios = [rows["gpt2"][c]["ms_per_token"] / rows["performer"][c]["ms_per_token"] for c in args.contexts]
    growing = all(b > a for a, b in itertools.pairwise(ratios))
    print(f"GPT-2 / Performer ratio grows with every context step: {growing}")
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "header": finish_stamp(stamp),
        "threads": args.threads,
        "steps": args.steps,
        "torch": torch.__version__,
        "max_len": max_len,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in (("performer", "Performer (m=256)"), ("linformer", "Linformer (k=256)"), ("gpt2", "GPT-2 SDPA")):
        ax1.plot(args.contexts, [rows[name][c]["ms_per_token"] for c in args.contexts], marker="o", label=label)
        ax2.plot(args.contexts, [rows[name][c]["cache_mb"] for c in args.contexts], marker="o", label=label)
    for ax, ylabel in ((ax1, "ms per generated token"), (ax2, "cache MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Decoding at GPT-2 small size, 2 CPU threads")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
