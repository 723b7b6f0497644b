"""`make demo`: both attention families on random data, accuracy against exact softmax attention and speed.

python -m linearformers.demo
"""

from __future__ import annotations

import time

import torch

from .modeling.attention import (
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


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    heads, dim = 12, 64
    print("linearformers demo: one attention layer, 12 heads x 64, forward pass, float32")
    print(f"{'n':>6} {'kernel':<28} {'rel. error vs softmax':>22} {'time':>9} {'vs SDPA':>8}")
    for n in (1024, 4096):
        q, k, v = (torch.randn(1, heads, n, dim) * 0.5 for _ in range(3))
        w = draw_random_features(256, dim, seed=0)
        eye = torch.eye(n)[:256]  # Linformer slots: a learned E would be trained; here the first 256 tokens
        e = torch.randn(256, n) / 16
        runs = {
            "softmax (SDPA)": (lambda: softmax_attention(q, k, v), False),
            "softmax causal (SDPA)": (lambda: softmax_attention(q, k, v, causal=True), True),
            "performer m=256": (lambda: favor_attention(q, k, v, w), False),
            "performer m=256 causal": (lambda: favor_attention(q, k, v, w, causal=True), True),
            "linformer k=256 (random E)": (lambda: linformer_attention(q, k, v, e), False),
            "linformer k=256 (E = I[:k])": (lambda: linformer_attention(q, k, v, eye), False),
            "linformer k=256 causal": (lambda: causal_linformer_attention(q, k, v, e), True),
            "local window 256 causal": (lambda: local_attention(q, k, v, 256, causal=True), True),
        }
        exact = {False: softmax_attention(q, k, v), True: softmax_attention(q, k, v, causal=True)}
        base = {False: _time(runs["softmax (SDPA)"][0]), True: _time(runs["softmax causal (SDPA)"][0])}
        for name, (fn, causal) in runs.items():
            with torch.no_grad():
                out = fn()
            err = ((out - exact[causal]).norm() / exact[causal].norm()).item()
            seconds = base[causal] if name.startswith("softmax") else _time(fn)
            print(f"{n:>6} {name:<28} {err:>22.3f} {seconds:>8.3f}s {base[causal] / seconds:>7.1f}x")
    print("\nLinformer's E/F are learned in a real model; the errors above are for untrained projections.")


if __name__ == "__main__":
    main()
