"""Where causal FAVOR+ spends its time: the figures behind docs/design.md, "Causal FAVOR+ on x86-64 CPUs".

One forward + backward of `favor_attention(causal=True)` at the attention benchmark's shape (12 heads x 64, m = 256,
chunk 32, float32, 2 threads), through the chunked backend (`backend="chunked"`: every chunk at once in batched
products, the portable form GPUs run and the fallback off x86-64), then through the native walk
(`backend="native"`, ops/_native, one opaque call per direction) for comparison:
  1. torch.profiler on the chunked backend, ops grouped by input shape, with the GFLOP/s of each matmul group;
  2. the Python and dispatch overhead: the same call on tiny tensors (1 head x 4, m = 8), whose ops cost ~nothing;
  3. exp against exp2 on one block of features (8 chunks x 12 heads x 32 x 256), the choice in `_FeatureMap`.

    python benchmarks/favor_profile.py            # n = 4096
    python benchmarks/favor_profile.py --n 16384
    python benchmarks/favor_profile.py --n 256 --chunk 64
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import profile

from linearformers.ops import draw_random_features, favor_attention

_MATMULS = ("aten::baddbmm_", "aten::bmm", "aten::mm")


def _step(n: int, heads: int, dim: int, m: int, backend: str, chunk: int):
    q, k, v = (torch.randn(1, heads, n, dim, requires_grad=True) for _ in range(3))
    g = torch.randn(1, heads, n, dim)
    w = draw_random_features(m, dim, seed=0)

    def step():
        favor_attention(q, k, v, w, causal=True, chunk_size=chunk, backend=backend).backward(g)
        for t in (q, k, v):
            t.grad = None

    return step


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _flops(op: str, shapes) -> float:
    """FLOPs of one matmul call from its input shapes: a @ b (baddbmm_ lists the accumulated output first)."""
    a, b = (shapes[1], shapes[2]) if op == "aten::baddbmm_" else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=32, help="chunk_size of both backends (default 32)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    step = _step(args.n, 12, 64, 256, "chunked", args.chunk)
    total = _best(step, 3)
    print(f"causal FAVOR+ n={args.n}, chunked backend: {total:.3f} s forward + backward (best of 3)")
    with profile(record_shapes=True) as prof:
        step()
    events = prof.key_averages(group_by_input_shape=True)
    profiled = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"\nunder the profiler: {profiled:.3f} s; matmul groups and the biggest other ops:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:16]:
        seconds = e.self_cpu_time_total / 1e6
        rate = ""
        if e.key in _MATMULS and e.input_shapes:
            rate = f"  {_flops(e.key, e.input_shapes) * e.count / seconds / 1e9:5.0f} GFLOP/s"
        share = seconds / profiled
        print(f"  {e.key:16s} x{e.count:4d}  {seconds * 1e3:7.1f} ms  {share:4.0%}{rate}  {e.input_shapes[:3]}")

    overhead = _best(_step(args.n, 1, 4, 8, "chunked", args.chunk), 5)
    print(
        f"\nPython and dispatch (same backend on tiny tensors): {overhead * 1e3:.1f} ms, "
        f"{overhead / total:.0%} of the call"
    )

    native_step = _step(args.n, 12, 64, 256, "native", args.chunk)
    try:
        native = _best(native_step, 3)
    except ValueError as err:  # not built here, switched off, or a chunk that is not a multiple of 16
        print(f"native walk: not run ({err})")
    else:
        print(f"native walk: {native:.3f} s forward + backward (best of 3), {total / native:.2f}x the chunked backend")

    x = torch.randn(8, 12, 32, 256) * 3
    y = torch.empty_like(x)
    copy = _best(lambda: y.copy_(x), 200)
    t_exp = _best(lambda: y.copy_(x).exp_(), 200) - copy
    t_exp2 = _best(lambda: y.copy_(x).exp2_(), 200) - copy
    print(f"exp {t_exp * 1e6:.0f} us, exp2 {t_exp2 * 1e6:.0f} us on one block of features: exp2 {t_exp / t_exp2:.2f}x")


if __name__ == "__main__":
    main()
