"""One attention layer, forward + backward: time and peak memory vs sequence length.

Hidden 768, 12 heads (head_dim 64), float32, batch 1. Kernels (q, k, v in):
  SDPA softmax (bidirectional, causal), Linformer k=256, `linformer_hybrid` (the same slots beside an exact window of
  w = 64 keys and one sink, in one softmax: LinformerConfig(hybrid_window=64, hybrid_sinks=1)), Performer FAVOR+
  m=256 (bidirectional, causal; causal
  also through the chunked backend, `performer_causal_chunked` (`backend="chunked"`), the portable form GPUs run,
  which the native walk replaces on x86-64 CPUs), performer-pytorch FastAttention (bidirectional, causal).
  The learned map: `hedgehog` (bidirectional, causal), a HedgehogFeatureMap of m = 2 head_dim = 128 features
  (phi(x) = [softmax(xW + b), softmax(-(xW + b))], Zhang et al. 2024) computed inside the timed region, then
  `linear_attention` with the default backend; `hybrid` (bidirectional, causal), the same features in
  `hybrid_attention` (LoLCATs): exact softmax on a window of w = 64 keys, the features elsewhere, balanced by
  gamma = exp(a parameter). The map's weights and gamma are parameters: backward computes their gradients too.
Full layers (hidden states in, q/k/v/o projections included): SDPA, Linformer, Performer, lucidrains'
  `linformer` LinformerSelfAttention, and `layer_performer_hedgehog_hybrid` (PerformerAttention with
  feature_map="hedgehog", num_features=128, hybrid_window=64).
Every measurement runs in its own subprocess, so peak memory (ru_maxrss above the process's baseline) belongs to
that configuration alone. Ratios are to SDPA in the same run. The peers are installed for benchmarks only:
`pip install -e .[bench]` (performer-pytorch needs `local-attention<1.10`).

    python benchmarks/attention.py                      # 512 .. 16384 (~15 min on 2 cores without the learned rows)
    python benchmarks/attention.py --quick              # 512 .. 4096
    python benchmarks/attention.py --paired performer_causal --lengths 4096 16384 --pairs 5
                                                        # ratios to SDPA from alternating runs
    python benchmarks/attention.py --paired hybrid_causal --lengths 512 --pairs 1 --repeats 1 --out /tmp/bench
                                                        # a check that a row runs: results go to /tmp/bench
    python benchmarks/attention.py --paired hybrid --lengths 4096 16384 --malloc_mmap_threshold 17179869184
                                                        # every run with glibc's MALLOC_MMAP_THRESHOLD_ raised:
                                                        # freed memory stays mapped (results *_mmap_threshold.*)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from _stamp import finish_stamp, start_stamp
from isolated import add_allocator_argument, apply_allocator_argument, emit, peak_rss_mb, run_isolated

RESULTS = Path(__file__).parent / "results"
HIDDEN, HEADS, DIM = 768, 12, 64
M_FEATURES, K_PROJ, CHUNK = 256, 256, 32
HEDGEHOG_FEATURES, WINDOW = 2 * DIM, 64  # the learned map's m (its default, 2 head_dim) and the hybrid's window
LEARNED = ["hedgehog", "hedgehog_causal", "hybrid", "hybrid_causal"]
KERNELS = [
    "sdpa",
    "sdpa_causal",
    "linformer",
    "linformer_hybrid",
    "performer",
    "performer_causal",
    "performer_causal_chunked",
    "peer_performer",
    "peer_performer_causal",
    *LEARNED,
]
LAYERS = ["layer_sdpa", "layer_linformer", "layer_performer", "layer_peer_linformer", "layer_performer_hedgehog_hybrid"]
# the peers' causal path materializes an O(n m d) prefix tensor: ~9 GB at n=4096; longer would not fit
LIMITS = {"peer_performer_causal": 4096}


def _learned_kernel(name: str) -> torch.nn.Module:
    """``name`` in LEARNED: q, k, v (1, HEADS, n, DIM) -> (1, HEADS, n, DIM), Hedgehog features of q and k, then
    linear attention (``hedgehog``) or the sliding-window hybrid (``hybrid``); ``_causal``: causal masking."""
    from linearformers.ops import HedgehogFeatureMap, hybrid_attention, linear_attention

    causal, hybrid = name.endswith("_causal"), name.startswith("hybrid")

    class LearnedKernel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.feature_map = HedgehogFeatureMap(HEADS, DIM, HEDGEHOG_FEATURES)
            # gamma = exp(balance) > 0, as PerformerAttention's window_balance; starts at 1
            self.balance = torch.nn.Parameter(torch.zeros(HEADS)) if hybrid else None

        def forward(self, q, k, v):
            phi_q, phi_k = self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)
            if self.balance is None:
                return linear_attention(phi_q, phi_k, v, causal=causal)
            return hybrid_attention(q, k, v, phi_q, phi_k, torch.exp(self.balance), WINDOW, causal=causal)

    return LearnedKernel()


def _kernel(name: str, n: int):
    from linearformers.ops import draw_random_features, favor_attention, linformer_attention

    if name in LEARNED:
        return _learned_kernel(name)
    if name.startswith("sdpa"):
        causal = "causal" in name
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "linformer":
        e = torch.randn(K_PROJ, n) / math.sqrt(K_PROJ)
        f = torch.randn(K_PROJ, n) / math.sqrt(K_PROJ)
        return lambda q, k, v: linformer_attention(q, k, v, e, f)
    if name == "linformer_hybrid":
        from linearformers.ops import linformer_hybrid_attention

        e = torch.randn(K_PROJ, n) / math.sqrt(K_PROJ)
        f = torch.randn(K_PROJ, n) / math.sqrt(K_PROJ)
        balance = torch.zeros(HEADS, requires_grad=True)  # gamma's parameter: backward computes its gradient too
        return lambda q, k, v: linformer_hybrid_attention(q, k, v, e, f, torch.exp(balance), WINDOW, sinks=1)
    if name.startswith("performer"):
        # the chunked backend (the portable form GPUs run) that the native walk replaces on x86-64 CPUs
        extra = {"backend": "chunked"} if name.endswith("_chunked") else {}
        w = draw_random_features(M_FEATURES, DIM, seed=0)
        causal = "causal" in name
        return lambda q, k, v: favor_attention(q, k, v, w, causal=causal, chunk_size=CHUNK, **extra)
    from performer_pytorch import FastAttention

    attn = FastAttention(DIM, nb_features=M_FEATURES, causal="causal" in name)
    return attn


def _layer(name: str, n: int):
    from linearformers import LinformerConfig, PerformerConfig
    from linearformers.modeling.linformer import LinformerAttention
    from linearformers.modeling.performer import PerformerAttention

    if name == "layer_peer_linformer":
        from linformer import LinformerSelfAttention

        return LinformerSelfAttention(dim=HIDDEN, seq_len=n, k=K_PROJ, heads=HEADS)
    if name == "layer_sdpa":

        class SdpaLayer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
                self.o = torch.nn.Linear(HIDDEN, HIDDEN)

            def forward(self, x):
                q, k, v = (t.view(1, n, HEADS, DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                return self.o(out.transpose(1, 2).reshape(1, n, HIDDEN))

        return SdpaLayer()
    # no attention dropout: the SDPA layer and the peer run without it
    common = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        max_position_embeddings=max(n, 512),
        attention_probs_dropout_prob=0.0,
    )
    if name == "layer_performer":
        return PerformerAttention(
            PerformerConfig(**common, num_features=M_FEATURES, feature_redraw_interval=None), layer_idx=0
        )
    if name == "layer_performer_hedgehog_hybrid":
        config = PerformerConfig(**common, feature_map="hedgehog", num_features=HEDGEHOG_FEATURES, hybrid_window=WINDOW)
        return PerformerAttention(config, layer_idx=0)
    module = LinformerAttention(LinformerConfig(**common, projected_length=min(K_PROJ, n), max_seq_length=n), 0)
    torch.nn.init.normal_(module.e_proj, std=K_PROJ**-0.5)
    torch.nn.init.normal_(module.f_proj, std=K_PROJ**-0.5)
    return module


def worker(name: str, n: int, repeats: int, threads: int) -> dict:
    """Runs in a subprocess: forward + backward ``repeats`` times after one warm-up."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if name in LAYERS:
        fn = _layer(name, n)
        x = torch.randn(1, n, HIDDEN, requires_grad=True)
        inputs = (x,)
    else:
        fn = _kernel(name, n)
        inputs = tuple(torch.randn(1, HEADS, n, DIM, requires_grad=True) for _ in range(3))
    return forward_backward(fn, inputs, repeats)


def forward_backward(fn, inputs: tuple[torch.Tensor, ...], repeats: int) -> dict:
    """Forward + backward of ``fn`` on ``inputs`` ``repeats`` times after one warm-up: the best time, and the peak
    resident memory above this point."""
    # a fixed upstream gradient, as attention inside a model gets: the loss's own ops are not timed
    grad = torch.randn(inputs[0].shape)  # outputs are shaped like the first input
    baseline = peak_rss_mb()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = fn(*inputs)
        out.backward(grad)
        if i:
            times.append(time.perf_counter() - t0)
        for t in inputs:
            t.grad = None
        del out
    return {"seconds": min(times), "peak_mb": peak_rss_mb() - baseline}


def favor_flops(n: int, causal: bool) -> float:
    """Matmul FLOPs of FAVOR+ forward + backward (backward ~ 2x forward), all heads."""
    fwd = 2 * 2 * n * M_FEATURES * DIM  # feature projections of q and k
    fwd += 2 * 2 * n * M_FEATURES * DIM  # phi(k)^T v (per chunk or whole) and phi(q) (kv)
    if causal:
        c = min(CHUNK, n)
        fwd += 2 * n * c * (M_FEATURES + DIM)  # intra-chunk scores and their product with v
    return 3 * fwd * HEADS


def matmul_rate(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 2048**3 / (time.perf_counter() - t0)


def run(name: str, n: int, repeats: int, threads: int, timeout: int) -> dict | None:
    if n > LIMITS.get(name, n):
        return None
    arguments = ["--worker", name, n, "--repeats", repeats, "--threads", threads]
    return run_isolated(__file__, arguments, timeout=timeout, label=f"{name} n={n}")


def paired(
    names: list[str], lengths: list[int], pairs: int, repeats: int, threads: int, timeout: int
) -> tuple[dict, dict]:
    """Each kernel against its SDPA baseline, in alternating subprocesses, ``pairs`` times per length: a ratio per
    pair, measured within seconds of each other, so drift of the shared machine over minutes cancels. Returns the
    sorted time ratios and, per pair, the peak memory [kernel MB, SDPA MB], by "kernel@n"."""
    out, memory = {}, {}
    for n in lengths:
        for name in names:
            ref = "sdpa_causal" if "causal" in name else "sdpa"
            ratios = []
            for _ in range(pairs):
                a, b = run(ref, n, repeats, threads, timeout), run(name, n, repeats, threads, timeout)
                if a and b:
                    ratios.append(a["seconds"] / b["seconds"])
                    memory.setdefault(f"{name}@{n}", []).append([round(b["peak_mb"]), round(a["peak_mb"])])
                    print(
                        f"n={n:6d} {name:24s} {b['seconds']:.3f} s, {b['peak_mb']:.0f} MB vs {ref} {a['seconds']:.3f} s, "
                        f"{a['peak_mb']:.0f} MB: {ratios[-1]:.2f}x",
                        flush=True,
                    )
            if ratios:
                ratios.sort()
                out[f"{name}@{n}"] = ratios
                print(
                    f"n={n:6d} {name:24s} median {ratios[len(ratios) // 2]:.2f}x, "
                    f"range {ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(ratios)} pairs",
                    flush=True,
                )
    return out, memory


def _fmt(row: dict | None, ref: dict | None) -> str:
    if row is None:
        return "skipped"
    ratio = f" ({ref['seconds'] / row['seconds']:.1f}x)" if ref else ""
    return f"{row['seconds']:.3f} s{ratio}, {row['peak_mb']:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "N"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--quick", action="store_true", help="lengths 512 .. 4096")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the best counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--paired", nargs="+", metavar="NAME", help="only these kernels, each against its SDPA")
    parser.add_argument("--pairs", type=int, default=5, help="with --paired: alternating runs per length")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON and plot (default: %(default)s)")
    add_allocator_argument(parser)
    args = parser.parse_args()
    if args.worker:
        emit(worker(args.worker[0], int(args.worker[1]), args.repeats, args.threads))
        return
    suffix = apply_allocator_argument(args)
    stamp = start_stamp()
    lengths = [512, 1024, 2048, 4096] if args.quick else args.lengths
    if args.paired:
        unknown = sorted(set(args.paired) - set(KERNELS))
        if unknown:
            parser.error(f"--paired takes kernel names from {KERNELS}, not {unknown}")
        ratios, memory = paired(args.paired, lengths, args.pairs, args.repeats, args.threads, args.timeout)
        args.out.mkdir(parents=True, exist_ok=True)
        # kernel@n -> sorted ratios, -> [kernel MB, SDPA MB] per pair, and -> the stamp of the run that measured it;
        # later runs replace their own keys
        stamp = finish_stamp(stamp)
        for name, found in (
            (f"attention_paired{suffix}.json", ratios),
            (f"attention_paired{suffix}_memory.json", memory),
            (f"attention_paired{suffix}_stamp.json", dict.fromkeys(ratios, stamp)),
        ):
            path = args.out / name
            merged = json.loads(path.read_text()) if path.exists() else {}
            path.write_text(json.dumps({**merged, **found}, indent=2))
        return
    rate = matmul_rate(args.threads)
    print(f"float32 matmul rate: {rate / 1e9:.0f} GFLOP/s ({args.threads} threads)", flush=True)
    rows: dict[str, dict[int, dict | None]] = {name: {} for name in KERNELS + LAYERS}
    for n in lengths:
        for name in KERNELS + LAYERS:
            rows[name][n] = run(name, n, args.repeats, args.threads, args.timeout)
            print(f"n={n:6d} {name:24s} {_fmt(rows[name][n], None)}", flush=True)

    def table(names, ref_of):
        print("\n| n | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for n in lengths:
            cells = [_fmt(rows[name][n], rows[ref_of(name)][n] if ref_of(name) != name else None) for name in names]
            print(f"| {n} | " + " | ".join(cells) + " |")

    def sdpa_of(name):
        return "sdpa_causal" if "causal" in name else "sdpa"

    print("\nKernel only, forward + backward: seconds (speedup vs SDPA of the same masking), peak MB")
    table([name for name in KERNELS if name not in LEARNED], sdpa_of)
    print(f"\nLearned map (Hedgehog, m={HEDGEHOG_FEATURES}) and hybrid (window {WINDOW}), kernel only, as above")
    table(LEARNED, sdpa_of)
    print("\nFull layer (q/k/v/o projections included)")
    table(LAYERS, lambda name: "layer_sdpa")
    print("\nFAVOR+ matmul efficiency (fraction of the measured matmul rate)")
    for n in lengths:
        for name in ("performer", "performer_causal", "performer_causal_chunked"):
            row = rows[name][n]
            if row:
                frac = favor_flops(n, "causal" in name) / row["seconds"] / rate
                rows[name][n]["matmul_fraction"] = frac
                print(f"  n={n:6d} {name:24s} {frac:.0%}")
    checks = []
    for n, bi, causal in ((4096, 5, 3), (16384, 15, 10)):
        for name, target, ref in (
            ("linformer", bi, "sdpa"),
            ("performer", bi, "sdpa"),
            ("performer_causal", causal, "sdpa_causal"),
        ):
            row, base = rows[name].get(n), rows[ref].get(n)
            if row and base:
                got = base["seconds"] / row["seconds"]
                checks.append(
                    f"{name} vs {ref} at {n}: {got:.1f}x (target >= {target}x) {'met' if got >= target else 'MISSED'}"
                )
    peer, ours = rows["peer_performer_causal"].get(4096), rows["performer_causal"].get(4096)
    if peer and ours:
        speed, mem = peer["seconds"] / ours["seconds"], ours["peak_mb"] / max(peer["peak_mb"], 1)
        checks.append(
            f"performer_causal vs performer-pytorch causal at 4096: {speed:.1f}x faster (target >= 20x), "
            f"{mem:.3f} of its peak memory (target <= 0.1) {'met' if speed >= 20 and mem <= 0.1 else 'MISSED'}"
        )
    for n in lengths:
        if n >= 4096:
            for name in ("linformer", "performer", "performer_causal"):
                row, ref = rows[name][n], rows["sdpa_causal" if "causal" in name else "sdpa"][n]
                if row and ref:
                    ok = row["peak_mb"] <= ref["peak_mb"]
                    checks.append(
                        f"{name} peak memory at {n}: {row['peak_mb']:.0f} MB vs SDPA {ref['peak_mb']:.0f} MB "
                        f"{'met' if ok else 'MISSED'}"
                    )
    print("\nTargets:")
    for line in checks:
        print("  " + line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"attention{suffix}.json").write_text(
        json.dumps({"header": finish_stamp(stamp), "matmul_gflops": rate / 1e9, "rows": rows}, indent=2)
    )
    _plot(rows, lengths, args.out / f"attention{suffix}.png")


def _plot(rows, lengths, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in KERNELS:
        ns = [n for n in lengths if rows[name].get(n)]
        if ns:
            ax1.plot(ns, [rows[name][n]["seconds"] for n in ns], marker="o", label=name)
            ax2.plot(ns, [max(rows[name][n]["peak_mb"], 1) for n in ns], marker="o", label=name)
    for ax, label in ((ax1, "forward + backward seconds"), (ax2, "peak memory MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle("One attention layer (12 heads x 64, float32, batch 1, 2 CPU threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
