"""Attention-kernel microbenchmark (not part of `make demo`, which trains and evaluates real models).

Forward time of each kernel on random inputs, one layer of 12 heads x 64, float32, 2 threads, against PyTorch's
SDPA at the same length and masking. Timings follow the machine's load, so the load average is printed before
and after; on a busy machine re-run it, or use `benchmarks/attention.py` (forward + backward, paired runs).
No accuracy column: on random inputs with untrained projections it says nothing about a trained model.

    python benchmarks/kernel_speed.py     # ~25 s on 2 cores

Not named kernels.py: a script's folder comes first on sys.path, and transformers imports a package named
``kernels`` when it finds one, so that name would shadow it for every script in benchmarks/.
"""

from __future__ import annotations

import os
import time

import torch

from linearformers.ops import (
    causal_linformer_attention,
    draw_random_features,
    favor_attention,
    linformer_attention,
    local_attention,
    softmax_attention,
)


def _time(fn, repeats: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    heads, dim = 12, 64
    print("attention-kernel microbenchmark: random inputs, one layer of 12 heads x 64, forward pass, float32")
    print(f"before: {_load()}")
    if os.getloadavg()[0] > 1.0:
        print("the machine is busy: other processes share these cores, so the timings below are pessimistic")
    print(f"{'n':>6} {'kernel':<26} {'time':>9} {'speed vs SDPA':>14}")
    for n in (1024, 4096):
        q, k, v = (torch.randn(1, heads, n, dim) * 0.5 for _ in range(3))
        w = draw_random_features(256, dim, seed=0)
        e = torch.randn(256, n) / 16  # stands in for Linformer's learned E = F (n -> k = 256)
        runs = {
            "softmax (SDPA)": (lambda: softmax_attention(q, k, v), False),
            "softmax causal (SDPA)": (lambda: softmax_attention(q, k, v, causal=True), True),
            "performer m=256": (lambda: favor_attention(q, k, v, w), False),
            "performer m=256 causal": (lambda: favor_attention(q, k, v, w, causal=True), True),
            "linformer k=256": (lambda: linformer_attention(q, k, v, e), False),
            "linformer k=256 causal": (lambda: causal_linformer_attention(q, k, v, e), True),
            "local window 256 causal": (lambda: local_attention(q, k, v, 256, causal=True), True),
        }
        with torch.no_grad():
            base = {False: _time(runs["softmax (SDPA)"][0]), True: _time(runs["softmax causal (SDPA)"][0])}
            for name, (fn, causal) in runs.items():
                seconds = base[causal] if name.startswith("softmax") else _time(fn)
                print(f"{n:>6} {name:<26} {seconds:>8.3f}s {base[causal] / seconds:>13.2f}x")
    print(f"after: {_load()}")
    print("speed > 1x: faster than SDPA in this run. A quick forward-only look (best of 2); the measured comparison")
    print("is benchmarks/attention.py (forward + backward, best of 3, paired runs), tabled in benchmarks/README.md.")


if __name__ == "__main__":
    main()
