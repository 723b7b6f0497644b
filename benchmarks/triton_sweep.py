"""Launch settings of the causal Triton kernels, swept on a GPU, beside flash SDPA in the same run.

For each setting (chunk C, warps per program, software-pipelining stages, programs per multiprocessor): forward +
backward of causal FAVOR+ (m = 256, softmax map fused) and of ``linear_attention`` on given FAVOR+ features, at each
length; 12 heads x 64, batch 1, bf16, CUDA events, median of ``--repeats`` after ``--warmup`` runs, and the peak
memory above the inputs. The rows are those of benchmarks/gpu.py (``favor_causal/triton``, ``linear_causal/triton``,
``sdpa_causal``), built by its ``build_attention``; fla, whose autotuned kernels tune for minutes on first use,
has its row in gpu.py. Then a profile of one forward + backward of the
default setting per length: the GPU time per kernel and the host time per call, which tells launch-bound from
compute-bound.

Triton compiles every kernel once per (C, warps, stages): ``--jobs`` processes compile the settings first, in
parallel, at a short length (the lengths are runtime values, so the same binaries serve every length), and the
timing process reads Triton's disk cache.

    python benchmarks/triton_sweep.py --out /tmp/sweep                      # H100: compile, then ~1 minute
    python benchmarks/triton_sweep.py --quick --out /tmp/sweep              # the interpreter on a CPU, minutes

Output: ``<out>/triton_sweep.json`` (header with command, commit, device, load; rows; profile; best per length).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # benchmarks/gpu.py: the rows and the header

ROWS = ("favor_causal/triton", "linear_causal/triton")
BASELINES = ("sdpa_causal",)  # fla's autotuned kernels tune for minutes on first use: gpu.py has its row


def settings(quick: bool, forms: bool = False) -> list[dict]:
    """Every (chunk, warps, stages, programs_per_sm) to time; ``forms``: the two forms (see _triton_causal) at the
    default launch settings and their neighbours instead."""
    if forms:
        walk = [dict(form="walk", chunk=64, warps=4, stages=1, programs_per_sm=4)]
        chunks = [
            dict(form="chunks", chunk=c, warps=4, stages=1, programs_per_sm=p, chunk_warps=cw)
            for c, cw, p in ((64, 8, 4), (64, 4, 4), (64, 8, 2), (128, 8, 4), (32, 4, 4))
        ]
        return [dict(s, chunk=16 if quick else s["chunk"]) for s in walk + chunks][: 2 if quick else None]
    if quick:
        return [dict(chunk=c, warps=4, stages=1, programs_per_sm=p) for c, p in ((16, 1), (32, 2))]
    grid = itertools.product((32, 64, 128), (4, 8), (1, 3), (1, 2, 4, 8))  # 3 stages: Triton's default
    return [dict(chunk=c, warps=w, stages=s, programs_per_sm=p) for c, w, s, p in grid]


def compiled_variants(every: list[dict]) -> list[dict]:
    """The settings that compile differently (programs per multiprocessor is a runtime value)."""
    seen, out = set(), []
    for s in every:
        key = (s["chunk"], s["warps"], s["stages"], s.get("form"), s.get("chunk_warps"))
        if key not in seen:
            seen.add(key)
            out.append(dict(s, programs_per_sm=None))
    return out


def apply(setting: dict) -> None:
    from linearformers.ops import _triton_causal

    for key in _triton_causal.TUNING:
        _triton_causal.TUNING[key] = setting.get(key)


def bind(name: str, base, chunk: int | None, device: str):
    """gpu.py's row ``base`` = (fn, inputs, grad), with the chunk given to the call."""
    fn, inputs, grad = base
    if chunk is None:
        return fn, inputs, grad
    from linearformers.ops import draw_random_features, favor_attention, linear_attention

    if name == "favor_causal/triton":
        w = draw_random_features(256, gpu.DIM, seed=0, device=device)

        def fn(q, k, v):
            return favor_attention(q, k, v, w, causal=True, backend="triton", chunk_size=chunk)

    else:

        def fn(pq, pk, v):
            return linear_attention(pq, pk, v, causal=True, backend="triton", chunk_size=chunk)

    return fn, inputs, grad


def measure(fn, inputs, grad, device: str, warmup: int, repeats: int) -> dict:
    meter = gpu.Meter(device)
    base = meter.reset()

    def once():
        fn(*inputs).backward(grad)
        for t in inputs:
            t.grad = None

    times = [meter.time(once) for _ in range(warmup + repeats)][warmup:]
    return {"ms": 1e3 * statistics.median(times), "peak_mb": meter.peak_mb(base)}


def row(name: str, base, setting: dict | None, a: argparse.Namespace) -> dict:
    """One cell: ``base`` the row's (fn, inputs, grad) from gpu.build_attention, built once per length."""
    try:
        if setting is not None:
            apply(setting)
        fn, inputs, grad = bind(name, base, setting and setting["chunk"], a.device)
        result = {"status": "ok", **measure(fn, inputs, grad, a.device, a.warmup, a.repeats)}
    except Exception as err:  # a setting that does not fit (registers, shared memory) is a row, not a crash
        result = {"status": "error", "message": f"{err.__class__.__name__}: {str(err).strip()[:300]}"}
    finally:
        if setting is not None:
            apply({})
        if a.device == "cuda":
            torch.cuda.empty_cache()
    return result


def base_row(name: str, n: int, a: argparse.Namespace):
    """gpu.py's (fn, inputs, grad) for a row, or the reason it cannot run."""
    try:
        return gpu.build_attention(name, n, a.device, a.dtype, 256, 256)
    except gpu.Unavailable as err:
        return str(err)


def profile(n: int, a: argparse.Namespace) -> dict:
    """GPU time per kernel and host time per call of one forward + backward (default setting)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn, inputs, grad = gpu.build_attention(ROWS[0], n, a.device, a.dtype, 256, 256)

    def once():
        fn(*inputs).backward(grad)
        for t in inputs:
            t.grad = None

    for _ in range(3):
        once()
    if a.device == "cuda":
        torch.cuda.synchronize()
    host = time.perf_counter()
    once()  # host time: the call returns when everything is enqueued
    host = time.perf_counter() - host
    if a.device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        once()
        if a.device == "cuda":
            torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        if device_us:
            kernels.append({"name": e.key[:120], "calls": e.count, "device_us": device_us})
    kernels.sort(key=lambda k: -k["device_us"])
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return {"host_ms": 1e3 * host, "aten_ops": ops, "kernels": kernels[:20],
            "device_ms_total": sum(k["device_us"] for k in kernels) / 1e3}  # fmt: skip


def compile_only(indices: list[int], a: argparse.Namespace) -> None:
    """Compile the settings' kernels: one short forward + backward of each row (the segments' pass included)."""
    variants = compiled_variants(settings(a.quick, a.forms))
    for i in indices:
        s = variants[i]
        for name in ROWS:
            base = base_row(name, 16 * s["chunk"], a)
            r = row(name, base, s, argparse.Namespace(**{**vars(a), "warmup": 0, "repeats": 1}))
            print(f"compiled {s} {name}: {r['status']} {r.get('message', '')}", flush=True)


def precompile(a: argparse.Namespace, argv: list[str]) -> float:
    """Compile every variant in ``--jobs`` processes; returns the seconds it took."""
    start = time.perf_counter()
    if a.jobs == 0:  # compiled already (--precompile-only), or compiled on first use
        return 0.0
    count = len(compiled_variants(settings(a.quick, a.forms)))
    jobs = [list(range(j, count, a.jobs)) for j in range(min(a.jobs, count))]
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv, "--compile-only", ",".join(map(str, idx))]) for idx in jobs
    ]
    for p in procs:
        p.wait()
    return time.perf_counter() - start


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=gpu.RESULTS)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--jobs", type=int, default=8, help="processes that compile the settings first (0: none)")
    p.add_argument("--quick", action="store_true", help="the interpreter on a CPU: two settings, length 64")
    p.add_argument("--forms", action="store_true", help="the two forms near the default settings, not the grid")
    p.add_argument("--precompile-only", action="store_true", help="compile the settings' kernels, then stop")
    p.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.lengths, a.warmup, a.repeats = [64], 0, 1
        torch.set_num_threads(1)
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    return a


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.compile_only is not None:
        compile_only([int(i) for i in a.compile_only.split(",")], a)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "triton_sweep.json"
    path.write_text("{}")  # writable before the long part
    load = os.getloadavg()
    header = gpu.make_header(argparse.Namespace(device=a.device, quick=a.quick))
    header.update(command="python benchmarks/" + " ".join([Path(__file__).name, *argv]), load_average_before=load)
    result = {"header": header, "compile_s": precompile(a, argv), "baselines": {}, "rows": [], "profile": {}}
    print(f"compiled in {result['compile_s']:.0f} s", flush=True)
    if a.precompile_only:
        return
    for n in a.lengths[:2]:  # first: a sweep cut short by a timeout keeps it
        result["profile"][str(n)] = profile(n, a)
        print(f"profile {n}: {json.dumps(result['profile'][str(n)])}", flush=True)
    cells: dict[tuple[str, str, str], dict] = {}
    for n in a.lengths:
        for name in BASELINES:
            base = base_row(name, n, a)
            cell = {"status": "unavailable", "message": base} if isinstance(base, str) else row(name, base, None, a)
            result["baselines"].setdefault(name, {})[str(n)] = cell
            print(f"{name:22s} {n}: {cell}", flush=True)
            del base
        for name in ROWS:
            base = base_row(name, n, a)
            for i, s in enumerate(settings(a.quick, a.forms)):
                cells[name, str(i), str(n)] = row(name, base, s, a)
            del base
            gpu._free(a.device, True)
        partial = [{"setting": s, "kernel": name, "n": n, **cells[name, str(i), str(n)]}
                   for i, s in enumerate(settings(a.quick, a.forms)) for name in ROWS]  # fmt: skip
        result.setdefault("partial", []).extend(partial)
        path.write_text(json.dumps(result, indent=1))
        for name in ROWS:
            ok = sorted((c["ms"], s) for c, s in ((c, c["setting"]) for c in partial if c["kernel"] == name)
                        if c["status"] == "ok")  # fmt: skip
            print(f"length {n} {name}: best {[(round(ms, 2), s) for ms, s in ok[:3]]}", flush=True)
    for i, s in enumerate(settings(a.quick, a.forms)):
        for name in ROWS:
            lengths = {str(n): cells[name, str(i), str(n)] for n in a.lengths}
            result["rows"].append({"setting": s, "kernel": name, "lengths": lengths})
            text = ", ".join(f"{n}: {c['ms']:.2f}" if "ms" in c else f"{n}: {c['status']}" for n, c in lengths.items())
            print(f"{name:22s} {s}  {text}", flush=True)
    result.pop("partial", None)
    best = {}
    for name in ROWS:
        for n in map(str, a.lengths):
            ok = [(r["lengths"][n]["ms"], r["setting"]) for r in result["rows"]
                  if r["kernel"] == name and r["lengths"][n]["status"] == "ok"]  # fmt: skip
            if ok:
                ms, s = min(ok, key=lambda t: t[0])
                sdpa = result["baselines"]["sdpa_causal"][n].get("ms")
                best[f"{name} {n}"] = {"ms": ms, "setting": s, "vs_sdpa": sdpa / ms if sdpa else None}
    result["best"] = best
    result["header"]["load_average_after"] = os.getloadavg()
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({"best": best, "profile": result["profile"]}, indent=1))


if __name__ == "__main__":
    main()
