"""Masked-LM training throughput (tokens/s, forward + backward + AdamW step) and peak memory vs sequence length.

Six models of the same size (hidden 512, 4 layers, 8 heads of 64, intermediate 2048, vocab 30522), batch 1:
  * Performer (m=256) and Linformer (k=256), our BERT-style MaskedLM;
  * `performer_hedgehog`: the Performer with the learned map (feature_map="hedgehog", m=128), and `performer_hybrid`:
    the same map in the sliding-window hybrid (hybrid_window=64: exact softmax on the window, the map elsewhere);
  * "identity": the same stack with attention replaced by identity (each head returns its values): the
    physical bound, what the rest of the model costs;
  * BERT: transformers' BertForMaskedLM with SDPA.
Each measurement runs in its own subprocess (peak memory = ru_maxrss above the process's baseline). Ratios are
to the identity model, measured in one run.

    python benchmarks/training.py                       # 512 .. 16384 (~15 min on 2 cores with the first four models)
    python benchmarks/training.py --lengths 1024 4096 --steps 2
    python benchmarks/training.py --models performer_hybrid --lengths 512 --steps 1 --out /tmp/bench   # a check
    python benchmarks/training.py --models bert performer_hybrid --lengths 4096 --malloc_mmap_threshold 17179869184
                                                        # glibc keeps freed memory mapped (training_mmap_threshold.json)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _stamp import finish_stamp, start_stamp
from isolated import add_allocator_argument, apply_allocator_argument, emit, peak_rss_mb, run_isolated

RESULTS = Path(__file__).parent / "results"
SHAPE = dict(
    vocab_size=30522,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    intermediate_size=2048,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
MODELS = ("identity", "performer", "linformer", "bert", "performer_hedgehog", "performer_hybrid")
# the learned map's m (its default, 2 head_dim) and the hybrid's window
LEARNED = {
    "performer_hedgehog": dict(feature_map="hedgehog", num_features=128),
    "performer_hybrid": dict(feature_map="hedgehog", num_features=128, hybrid_window=64),
}


def build(name: str, n: int):
    from transformers import BertConfig, BertForMaskedLM

    from linearformers import LinformerConfig, LinformerForMaskedLM, PerformerConfig, PerformerForMaskedLM
    from linearformers.modeling.base import LinearAttention

    positions = max(n, 512)
    if name == "bert":
        return BertForMaskedLM(BertConfig(**SHAPE, max_position_embeddings=positions, attn_implementation="sdpa"))
    if name == "linformer":
        return LinformerForMaskedLM(
            LinformerConfig(**SHAPE, max_position_embeddings=positions, max_seq_length=n, projected_length=min(256, n))
        )
    features = LEARNED.get(name, dict(num_features=256, feature_redraw_interval=None))
    model = PerformerForMaskedLM(PerformerConfig(**SHAPE, max_position_embeddings=positions, **features))
    if name == "identity":
        for module in model.modules():
            if isinstance(module, LinearAttention):
                module.global_attention = lambda q, k, v, *args: v  # attention removed: values pass through
    return model


def worker(name: str, n: int, steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build(name, n).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1000, 30000, (1, n))
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]  # ~15% of positions carry a label, as in MLM
    baseline = peak_rss_mb()
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step:
            times.append(time.perf_counter() - t0)
    seconds = min(times)
    return {"tokens_per_s": n / seconds, "seconds": seconds, "peak_mb": peak_rss_mb() - baseline}


def _cell(row: dict | None, ident: dict | None, bert: dict | None) -> str:
    """Table cell: tokens/s (fraction of the identity model, ratio to BERT), each ratio where its reference ran."""
    if not row:
        return "-"
    ratios = []
    if ident:
        ratios.append(f"{row['tokens_per_s'] / ident['tokens_per_s']:.0%}")
    if bert:
        ratios.append(f"{row['tokens_per_s'] / bert['tokens_per_s']:.2f}x")
    return f"{row['tokens_per_s']:.0f}" + (f" ({', '.join(ratios)})" if ratios else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "N"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="default: all")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON (default: %(default)s)")
    add_allocator_argument(parser)
    args = parser.parse_args()
    if args.worker:
        emit(worker(args.worker[0], int(args.worker[1]), args.steps, args.threads))
        return
    suffix = apply_allocator_argument(args)
    stamp = start_stamp()
    models = [name for name in MODELS if name in args.models]
    rows: dict[str, dict[int, dict | None]] = {name: {} for name in models}
    for n in args.lengths:
        for name in models:
            steps = 1 if (name == "bert" and n >= 16384) else args.steps
            arguments = ["--worker", name, n, "--steps", steps, "--threads", args.threads]
            row = rows[name][n] = run_isolated(__file__, arguments, timeout=args.timeout, label=f"{name} n={n}")
            shown = f"{row['tokens_per_s']:8.0f} tok/s, {row['peak_mb']:6.0f} MB" if row else "failed / timed out"
            print(f"n={n:6d} {name:18s} {shown}", flush=True)
    compared = [name for name in models if name not in ("identity", "bert")]
    header = ["n", "identity tok/s", *(f"{name} tok/s (vs identity, vs BERT)" for name in compared), "BERT SDPA tok/s"]
    print("\n| " + " | ".join([*header, f"peak MB ({' / '.join(models)})"]) + " |")
    print("|---" * (len(header) + 1) + "|")
    for n in args.lengths:
        ident, bert = rows.get("identity", {}).get(n), rows.get("bert", {}).get(n)
        cells = [str(n), f"{ident['tokens_per_s']:.0f}" if ident else "-"]
        cells += [_cell(rows[name][n], ident, bert) for name in compared]
        cells.append(f"{bert['tokens_per_s']:.0f}" if bert else "-")
        cells.append(" / ".join(f"{rows[m][n]['peak_mb']:.0f}" if rows[m][n] else "-" for m in models))
        print("| " + " | ".join(cells) + " |")
    print("\nTarget: at n >= 4096 both families reach >= 80% of the identity model's throughput")
    for n in args.lengths:
        ident = rows.get("identity", {}).get(n)
        if n >= 4096 and ident:
            for name in ("performer", "linformer"):
                if rows.get(name, {}).get(n):
                    frac = rows[name][n]["tokens_per_s"] / ident["tokens_per_s"]
                    print(f"  {name} at {n}: {frac:.0%} {'met' if frac >= 0.8 else 'MISSED'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"training{suffix}.json").write_text(
        json.dumps({"header": finish_stamp(stamp), "shape": SHAPE, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
