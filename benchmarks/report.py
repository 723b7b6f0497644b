"""Tables from the benchmark results: ``benchmarks/README.md`` and the README's generated tables.

    python benchmarks/report.py           # rewrite both from benchmarks/results/*.json
    python benchmarks/report.py --check   # exit 1, naming the file, when either differs from what the results give

Every table comes from one result file and carries that file's stamp (command, commit, device, load average), read
from the JSON: ``header`` for most benchmarks, a ``*_stamp.json`` beside the paired attention ratios (one stamp per
kernel and length, since later paired runs replace only their own keys), a ``header`` per run in files that gather
runs. Nothing here measures; the README's tables sit between ``<!-- generated: NAME -->`` and ``<!-- end -->``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
README = ROOT / "README.md"
# where a run wrote its file says nothing about the figures, and names a folder of the machine it ran on
OUT_FLAG = re.compile(r" --out \S+")
MARKER = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end -->)", re.S)

ATTENTION_KERNELS = {
    "sdpa": "SDPA",
    "sdpa_causal": "SDPA causal",
    "linformer": "Linformer k=256",
    "performer": "Performer m=256",
    "performer_causal": "Performer causal",
    "performer_causal_chunked": "Performer causal, chunked",
    "peer_performer": "performer-pytorch",
    "peer_performer_causal": "performer-pytorch causal",
    "hedgehog": "Hedgehog m=128",
    "hedgehog_causal": "Hedgehog causal",
    "hybrid": "hybrid, window 64",
    "hybrid_causal": "hybrid causal",
}
ATTENTION_LAYERS = {
    "layer_sdpa": "SDPA layer",
    "layer_linformer": "Linformer layer",
    "layer_performer": "Performer layer",
    "layer_peer_linformer": "lucidrains linformer layer",
}
README_SPEED = ("sdpa", "sdpa_causal", "linformer", "performer", "performer_causal")
README_GPU = "h200/gpu_fused_hedgehog.json"  # the README's GPU table: the latest run of the default kernels


# ---------------------------------------------------------------------------------------------------------- stamps
def _load_text(stamp: dict) -> str:
    before, after = stamp.get("load_average_before"), stamp.get("load_average_after")
    parts = []
    if before:
        parts.append(f"{before[0]:.2f} before")
    if after:
        parts.append(f"{after[0]:.2f} after")
    if stamp.get("load"):
        parts.append(stamp["load"])
    return ", ".join(parts) or "unknown"


def stamp_line(stamp: dict | None) -> str:
    """One line: command, commit, device and the 1-minute load average, as the result file records them."""
    stamp = stamp or {}
    command = OUT_FLAG.sub("", stamp.get("command", "unknown"))
    return (
        f"`{command}` · commit {stamp.get('commit', 'unknown')} · {stamp.get('device', 'unknown')} · "
        f"load average: {_load_text(stamp)}"
    )


def _stamps(stamps: list[dict]) -> tuple[list[str], list[dict]]:
    """Numbered stamp lines for a table whose rows come from several runs; returns (lines, distinct stamps)."""
    distinct: list[dict] = []
    for stamp in stamps:
        if stamp not in distinct:
            distinct.append(stamp)
    if len(distinct) == 1:
        return ["Run: " + stamp_line(distinct[0])], distinct
    return [f"{i}. " + stamp_line(stamp) for i, stamp in enumerate(distinct, 1)], distinct


def _table(header: list[str], rows: list[list[str]], align: str = "---") -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([align] * len(header)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------ attention sweep
def _cell(row: dict | None, ref: dict | None) -> str:
    if not row:
        return "skipped"
    ratio = f" ({ref['seconds'] / row['seconds']:.1f}x)" if ref else ""
    return f"{row['seconds']:.3f} s{ratio}, {row['peak_mb']:.0f} MB"


def attention_sweep(data: dict, names: list[str], labels: dict, ref_of) -> list[str]:
    rows = data["rows"]
    names = [name for name in names if name in rows and any(rows[name].values())]
    lengths = sorted({int(n) for name in names for n in rows[name]})
    body = []
    for n in lengths:
        cells = [str(n)]
        for name in names:
            ref = ref_of(name)
            cells.append(_cell(rows[name].get(str(n)), rows[ref].get(str(n)) if ref != name else None))
        body.append(cells)
    return _table(["n", *(labels[name] for name in names)], body)


def _sdpa_of(name: str) -> str:
    return "sdpa_causal" if "causal" in name else "sdpa"


def section_attention(path: Path) -> list[str]:
    data = _read(path)
    rows = data["rows"]
    out = [
        "Kernel only (q, k, v in), forward + backward: seconds (speedup over SDPA of the same masking), peak MB.",
        "",
        *attention_sweep(data, list(ATTENTION_KERNELS), ATTENTION_KERNELS, _sdpa_of),
    ]
    fractions = [name for name in ("performer", "performer_causal", "performer_causal_chunked") if name in rows]
    fractions = [name for name in fractions if any(row and "matmul_fraction" in row for row in rows[name].values())]
    if fractions:
        lengths = sorted({int(n) for name in fractions for n in rows[name]})
        out += [
            "",
            f"FAVOR+ achieved fraction of the measured float32 matmul rate ({data['matmul_gflops']:.0f} GFLOP/s in this "
            "run; FLOPs counted by `favor_flops`):",
            "",
            *_table(
                ["kernel", *map(str, lengths)],
                [
                    [ATTENTION_KERNELS[name]]
                    + [f"{row['matmul_fraction']:.0%}" if (row := rows[name].get(str(n))) else "-" for n in lengths]
                    for name in fractions
                ],
            ),
        ]
    if any(name in rows for name in ATTENTION_LAYERS):
        out += [
            "",
            "Full layer (q / k / v / o projections included): seconds (speedup over the SDPA layer), peak MB.",
            "",
            *attention_sweep(data, list(ATTENTION_LAYERS), ATTENTION_LAYERS, lambda name: "layer_sdpa"),
        ]
    return out


# ------------------------------------------------------------------------------------------------ paired attention
def section_paired(path: Path) -> list[str]:
    ratios = _read(path)
    memory_path = path.with_name(path.stem + "_memory.json")
    stamp_path = path.with_name(path.stem + "_stamp.json")
    memory = _read(memory_path) if memory_path.exists() else {}
    stamps = _read(stamp_path) if stamp_path.exists() else {}
    keys = sorted(ratios, key=lambda key: (key.split("@")[0], int(key.split("@")[1])))
    lines, distinct = _stamps([stamps.get(key, {}) for key in keys])
    body = []
    for key in keys:
        kernel, n = key.split("@")
        found = sorted(ratios[key])
        spread = f" ({found[0]:.2f}-{found[-1]:.2f}x)" if len(found) > 1 else ""
        pairs = memory.get(key, [])
        peak = " ; ".join(f"{ours:.0f} / {sdpa:.0f}" for ours, sdpa in pairs) or "-"
        row = [kernel, n, str(len(found)), f"{statistics.median(found):.2f}x{spread}", peak]
        if len(distinct) > 1:
            row.append(str(distinct.index(stamps.get(key, {})) + 1))
        body.append(row)
    header = ["kernel", "n", "pairs", "speedup over its SDPA: median (range)", "peak MB, kernel / SDPA, each pair"]
    if len(distinct) > 1:
        header.append("run")
    return [*_table(header, body), "", *lines]


# ------------------------------------------------------------------------------------------- feature map backward
def section_feature_map_backward(path: Path) -> list[str]:
    data = _read(path)
    body = []
    for row in data["rows"]:
        a, b = row["composed"], row["softmax_pair"]
        body.append(
            [
                row["kernel"],
                str(row["n"]),
                f"{a[0]['saved_mb']:.0f} → {b[0]['saved_mb']:.0f}",
                ", ".join(f"{x['peak_mb']:.0f} / {y['peak_mb']:.0f}" for x, y in zip(a, b)),
                ", ".join(f"{x['seconds']:.3f} / {y['seconds']:.3f}" for x, y in zip(a, b)),
            ]
        )
    header = [
        "kernel",
        "n",
        "kept for backward, MB: composed → softmax_pair",
        "peak MB, composed / softmax_pair, each pair",
        "seconds, each pair",
    ]
    return [*_table(header, body), "", "Run: " + stamp_line(data.get("header"))]


# -------------------------------------------------------------------------------------------------------- decoding
def section_generation(path: Path) -> list[str]:
    data = _read(path)
    rows = data["rows"]
    body = []
    for c in sorted(rows["performer"], key=int):
        p, li, g = (rows[name][c] for name in ("performer", "linformer", "gpt2"))
        body.append(
            [
                c,
                f"{p['ms_per_token']:.1f}",
                f"{li['ms_per_token']:.1f}",
                f"{g['ms_per_token']:.1f}",
                f"{g['ms_per_token'] / p['ms_per_token']:.2f}x",
                f"{g['ms_per_token'] / li['ms_per_token']:.2f}x",
                f"{p['cache_mb']:.2f} / {li['cache_mb']:.2f} / {g['cache_mb']:.0f}",
                f"{p['peak_rss_mb']:.0f} / {li['peak_rss_mb']:.0f} / {g['peak_rss_mb']:.0f}",
            ]
        )
    header = [
        "context",
        "Performer ms/token",
        "Linformer ms/token",
        "GPT-2 ms/token",
        "GPT-2 / Performer",
        "GPT-2 / Linformer",
        "cache MB (Performer / Linformer / GPT-2)",
        "peak RSS MB (Performer / Linformer / GPT-2)",
    ]
    return [*_table(header, body), "", "Run: " + stamp_line(data.get("header"))]


# -------------------------------------------------------------------------------------------------------- training
def section_training(path: Path) -> list[str]:
    data = _read(path)
    rows = data["rows"]
    models = list(rows)
    compared = [name for name in models if name not in ("identity", "bert")]
    lengths = sorted({int(n) for name in models for n in rows[name]})
    body = []
    for n in lengths:
        ident, bert = rows.get("identity", {}).get(str(n)), rows.get("bert", {}).get(str(n))
        cells = [str(n), f"{ident['tokens_per_s']:.0f}" if ident else "-"]
        for name in compared:
            row = rows[name].get(str(n))
            if not row:
                cells.append("-")
                continue
            ratios = []
            if ident:
                ratios.append(f"{row['tokens_per_s'] / ident['tokens_per_s']:.0%}")
            if bert:
                ratios.append(f"{row['tokens_per_s'] / bert['tokens_per_s']:.2f}x")
            cells.append(f"{row['tokens_per_s']:.0f}" + (f" ({', '.join(ratios)})" if ratios else ""))
        cells.append(f"{bert['tokens_per_s']:.0f}" if bert else "-")
        cells.append(" / ".join(f"{rows[m][str(n)]['peak_mb']:.0f}" if rows[m].get(str(n)) else "-" for m in models))
        body.append(cells)
    header = [
        "n",
        "identity tok/s",
        *(f"{name} tok/s (vs identity, vs BERT)" for name in compared),
        "BERT SDPA tok/s",
        f"peak MB ({' / '.join(models)})",
    ]
    return [*_table(header, body), "", "Run: " + stamp_line(data.get("header"))]


# ------------------------------------------------------------------------------------------------------ conversion
def _runs(data: dict) -> list[dict]:
    """The runs of a conversion result: a file of one run, or of several under ``runs``."""
    return data["runs"] if "runs" in data else [data]


def _mean(values: list[float] | None) -> str:
    return f"{statistics.fmean(values):.3f}" if values else "-"


def conversion_rows(paths: list[Path], detail: bool) -> tuple[list[str], list[list[str]], list[str]]:
    runs = [run for path in paths for run in _runs(_read(path))]
    lines, distinct = _stamps([run.get("header", {}) for run in runs])
    body = []
    for run in runs:
        for row in run["rows"]:
            t = row.get("transfer")
            converted = f"{row['error']:.3f} / {row['cosine']:.4f}"
            if t:
                transferred = f"{row['error_transfer']:.3f} / {row['cosine_transfer']:.4f}"
                steps = f"{t['steps']}" + (f" + {t['finetune_steps']} {t['finetune']}" if t["finetune_steps"] else "")
                seconds = f"{t['seconds'] + t['finetune_seconds']:.0f}"
                fitted = f" → {_mean(t['layer_error_calibrated'])}" if t.get("layer_error_calibrated") else ""
                layers = f"{_mean(t['layer_error_before'])}{fitted} → {_mean(t['layer_error_after'])}"
                stage2 = (
                    f"{t['finetune_loss_before']:.4f} → {t['finetune_loss_after']:.4f}"
                    if t.get("finetune_loss_before") is not None
                    else "-"
                )
            else:
                transferred, steps, seconds, layers, stage2 = "-", "-", "-", "-", "-"
            cells = [row["setting"], converted, transferred, steps, seconds]
            if detail:
                cells[3:3] = [layers, stage2]
            if len(distinct) > 1:
                cells.append(str(distinct.index(run.get("header", {})) + 1))
            body.append(cells)
    header = ["setting", "error / cosine, converted", "error / cosine, transferred", "steps", "seconds"]
    if detail:
        header[3:3] = ["attention error, mean of layers: converted (→ fitted) → stage 1", "stage 2 loss"]
    if len(distinct) > 1:
        header.append("run")
    return header, body, lines


def section_conversion(path: Path) -> list[str]:
    header, body, lines = conversion_rows([path], detail=True)
    return [*_table(header, body), "", *lines]


def section_attention_mass(path: Path) -> list[str]:
    data = _read(path)
    shares = _table(
        ["layer", "window", "[CLS]", "[SEP]", "other keys"],
        [[str(r["layer"]), *(f"{r[key]:.3f}" for key in ("window", "cls", "sep", "other"))] for r in data["shares"]],
    )
    errors = _table(
        ["window", "window only", "+ [CLS]", "+ [CLS] + [SEP]"],
        [[str(r["window"]), *(f"{r[key]:.3f}" for key in ("window_only", "cls", "cls_sep"))] for r in data["errors"]],
    )
    window = data["args"]["shares_window"]
    return [
        f"Mean share of each query's attention, window {window}:",
        "",
        *shares,
        "",
        "Relative error of the last hidden states when every layer keeps exact attention on these keys only:",
        "",
        *errors,
        "",
        "Run: " + stamp_line(data.get("header")),
    ]


def section_hybrid_anatomy(path: Path) -> list[str]:
    data = _read(path)
    top = list(data["layers"][0]["top_keys"])
    body = [
        [
            str(row["layer"]),
            f"{row['hybrid']:.3f}",
            f"{row['exact_far_mass']:.3f}",
            f"{row['exact_far_distribution']:.3f}",
            f"{row['far_mass_original']:.3f} / {row['far_mass_hybrid']:.3f}",
            *(f"{row['top_keys'][g]:.3f}" for g in top),
            f"{data['output']['one_layer'][row['layer']]:.3f}",
        ]
        for row in data["layers"]
    ]
    header = [
        "layer",
        "hybrid",
        "exact far mass",
        "exact far distribution",
        "far mass, original / hybrid",
        *(f"+ {g} far keys exact" for g in top),
        "last hidden states' error, the hybrid in this layer only",
    ]
    out = [*_table(header, body), ""]
    out.append(f"Last hidden states' error with the hybrid in every layer: {data['output']['every_layer']:.3f}.")
    if data.get("probe"):
        out += ["", *_table(
            ["linear part trained on one layer", "m", "attention-output error", "seconds"],
            [[p["form"], str(p["m"]), f"{p['error']:.3f}", f"{p['seconds']:.0f}"] for p in data["probe"]],
        )]  # fmt: skip
    return [*out, "", "Run: " + stamp_line(data.get("header"))]


def section_conversion_gpt2(path: Path) -> list[str]:
    data = _read(path)
    original = data["original"]
    body = [["GPT-2 (original)", "-", "-", "-", f"{original['perplexity']:.2f}", "1.000", "-"]]
    for row in data["rows"]:
        for stage, found in row["stages"].items():
            layers = (
                f"{_mean(found['layer_error_before'])} → {_mean(found['layer_error_after'])}"
                if "layer_error_after" in found
                else "-"
            )
            body.append(
                [
                    row["setting"],
                    stage,
                    str(found.get("steps", "-")),
                    f"{found['seconds']:.0f}" if "seconds" in found else "-",
                    f"{found['perplexity']:.2f}",
                    f"{found['ratio']:.3f}",
                    layers,
                ]
            )
    header = ["model", "stage", "transfer steps", "seconds", "perplexity", "ratio to GPT-2", "attention error, mean"]
    return [*_table(header, body), "", "Run: " + stamp_line(data.get("header"))]


# ------------------------------------------------------------------------------------------------------------- GPU
def _gpu_cell(row: dict | None, ref: dict | None) -> str:
    if not row or row.get("status") != "ok":
        return (row or {}).get("status", "-")
    ratio = f" ({ref['seconds'] / row['seconds']:.2f}x)" if ref and ref.get("status") == "ok" else ""
    return f"{row['seconds'] * 1e3:.2f} ms{ratio}, {row['peak_mb']:.0f} MB"


def section_gpu(path: Path, targets: bool = True) -> list[str]:
    """gpu.py's file: its header stamps the whole file, and each section keeps the command that measured it; then
    the targets it measured (``targets``)."""
    data = _read(path)
    header = {**data.get("header", {}), "load": "not recorded"}
    out = []
    if "attention" in data:
        rows = data["attention"]["rows"]
        lengths = sorted({int(n) for found in rows.values() for n in found})
        body = []
        for name, found in rows.items():
            ref = rows.get("sdpa_causal" if "causal" in name else "sdpa", {})
            same = name in ("sdpa", "sdpa_causal")
            body.append(
                [f"`{name}`", *(_gpu_cell(found.get(str(n)), None if same else ref.get(str(n))) for n in lengths)]
            )
        out += [
            "Attention, forward + backward: time (speedup over SDPA of the same masking), peak MB.",
            "",
            *_table(["kernel", *map(str, lengths)], body),
            "",
            "Run: " + stamp_line({**header, "command": data["attention"].get("command", header.get("command"))}),
            "",
        ]
    if "training" in data:
        rows = data["training"]["rows"]
        body = []
        for name, found in rows.items():
            for n, row in sorted(found.items(), key=lambda item: int(item[0])):
                ok = row.get("status") == "ok"
                tokens = f"{row['tokens_per_s']:,.0f}" if ok else row.get("status", "-")
                peak = f"{row['peak_mb']:,.0f}" if ok else "-"
                body.append([f"`{name}`", n, tokens, peak])
        out += ["Training steps.", "", *_table(["model", "n", "tokens/s", "peak MB"], body), ""]
        out += ["Run: " + stamp_line({**header, "command": data["training"].get("command", header.get("command"))}), ""]
    measured = [t for t in data.get("targets", []) if t.get("verdict") != "not measured"] if targets else []
    if measured:
        out += [*_table(["target", "measured", "verdict"], [[t["target"], t["measured"], t["verdict"]] for t in measured]), ""]  # fmt: skip
    return out[:-1]


def section_host_time(path: Path) -> list[str]:
    """host_time.py's file: per kernel, the CUDA-event time of a forward + backward beside the host's time until
    each call returned and the Triton launches' share; per training step profiled, its time and largest kernels."""
    data = _read(path)
    body, steps = [], []
    for key, row in data["rows"].items():
        if "event_ms" in row:
            launches = row["launches"].values()
            count = sum(item["calls"] for item in launches)
            host = sum(item["calls"] * item["host_us_each"] for item in launches) / 1e3
            name, n = key.rsplit(" ", 1)
            body.append(
                [f"`{name}`", n, f"{row['event_ms']:.2f}", f"{row['host_fwd_ms'] + row['host_bwd_ms']:.2f}",
                 f"{count}, {host:.2f} ms"]
            )  # fmt: skip
        elif "step_ms" in row:
            top = ", ".join(
                f"{k['name'].split('(')[0][:40]} {k['device_us'] / 1e3:.1f} ms" for k in row["top_device_kernels"][:6]
            )
            steps.append(f"- {key}: step {row['step_ms']:.1f} ms; largest device entries: {top}")
    out = [
        "One attention layer's forward + backward (12 heads x 64, batch 1, bf16): CUDA-event time beside the host's "
        "time until the forward and the backward calls returned (ms), and the Triton launches (count, their host "
        "time).",
        "",
        *_table(["kernel", "n", "events", "host", "Triton launches"], body),
    ]
    if steps:
        out += ["", *steps]
    return [*out, "", "Run: " + stamp_line(data.get("header"))]


def section_triton_sweep(path: Path) -> list[str]:
    """triton_sweep.py's file: the five fastest launch settings for the fused softmax map at the middle length, the
    setting the kernels launch with by default, and flash SDPA of the same run."""
    data = _read(path)
    lengths = sorted({int(n) for row in data["rows"] for n in row["lengths"]})
    middle = str(lengths[len(lengths) // 2])
    sdpa = data["baselines"]["sdpa_causal"]

    def cell(found: dict, n: int) -> str:
        c = found.get(str(n), {})
        if c.get("status") != "ok":
            return c.get("status", "-")
        ref = sdpa.get(str(n), {})
        return f"{c['ms']:.2f} ms ({ref['ms'] / c['ms']:.2f}x)" if ref.get("status") == "ok" else f"{c['ms']:.2f} ms"

    def label(s: dict) -> str:
        text = f"C {s['chunk']}, {s['warps']} warps, {s['stages'] or 3} stages, {s['programs_per_sm']} per SM"
        if s.get("form") == "chunks":
            return f"chunk form ({s.get('chunk_warps') or 4} warps), C {s['chunk']}, {s['programs_per_sm']} per SM"
        return f"walk form, {text}" if s.get("form") else text

    favor = [r for r in data["rows"] if r["kernel"] == "favor_causal/triton"]
    ok = [r for r in favor if r["lengths"][middle].get("status") == "ok"]
    ranked = sorted(ok, key=lambda r: r["lengths"][middle]["ms"])[:5]
    ranked += [r for r in favor if r["setting"].get("form") == "walk" and r not in ranked]  # the default form
    linear = {json.dumps(r["setting"], sort_keys=True): r for r in data["rows"] if r["kernel"] != "favor_causal/triton"}
    body = [["flash SDPA, causal", *(f"{sdpa[str(n)]['ms']:.2f} ms" for n in lengths), "-"]]
    for r in ranked:
        twin = linear.get(json.dumps(r["setting"], sort_keys=True), {"lengths": {}})
        body.append(
            [label(r["setting"]), *(cell(r["lengths"], n) for n in lengths), cell(twin["lengths"], int(middle))]
        )
    header = ["causal FAVOR+ m = 256, fused map", *map(str, lengths), f"given features, {middle}"]
    settings = len(favor)
    return [
        f"The {settings} launch settings of the causal kernels (chunk C, warps, pipelining stages, programs per "
        f"multiprocessor), forward + backward, bf16, 12 heads x 64: the five fastest at {middle}, and the walk form where "
        "the run has it (speedup over flash SDPA of the same run).",
        "",
        *_table(header, body),
        "",
        "Run: " + stamp_line(data.get("header")),
    ]


def section_conversion_models(path: Path) -> list[str]:
    """conversion.py --models: saved models measured on the held-out blocks."""
    data = _read(path)
    args = data["args"]
    read = any("select_blocks" in row for row in data["models"])  # each model read with far-block counts given
    exact = any("exact_length" in row for row in data["models"])  # and inputs of up to L tokens read exactly
    body = [
        [f"`{row['model_dir']}`", *([str(row["select_blocks"])] if read else []),
         *([str(row.get("exact_length") or "-")] if exact else []), f"{row['error']:.4f}", f"{row['cosine']:.4f}"]
        for row in data["models"]
    ]  # fmt: skip
    header = [
        "model",
        *(["read with far blocks"] if read else []),
        *(["read exactly up to, tokens"] if exact else []),
        "hidden-state error",
        "cosine",
    ]
    return [
        f"{args['eval_blocks']} held-out blocks of {args['block']} tokens.",
        "",
        *_table(header, body),
        "",
        "Run: " + stamp_line(data.get("header")),
    ]


# -------------------------------------------------------------------------------------------------- long documents
def _added_mb(row: dict) -> str:
    """The memory an embedding adds to its process with the models loaded (long_documents.py), "-" where the result
    predates it or its worker failed."""
    return "-" if row.get("added_mb") is None else f"{row['added_mb']:.0f}"


def _interval(score: dict) -> str:
    return f"{score['difference']:+.3f} [{score['low']:+.3f}, {score['high']:+.3f}]"


def _long_documents_paired(comparisons: list[dict] | None) -> list[str]:
    """long_documents.py's paired comparison, converted less original-chunked on the same queries; nothing for a
    result from before it was made."""
    if not comparisons:
        return []
    body = [
        [str(row["length"]), row["task"], _interval(row["top1"]), _interval(row["mrr"]),
         f"{row['ours_only']} / {row['theirs_only']}"]
        for row in comparisons
    ]  # fmt: skip
    header = ["length", "task", "top-1, converted less original-chunked", "MRR, the same", "first for one alone"]
    return [
        "Paired, on the same queries: the differences with their 95% interval (a bootstrap over the documents), and "
        "the queries that the converted model alone / original-chunked alone retrieves first.",
        "",
        *_table(header, body),
        "",
    ]


def _seeds_label(seeds: list[int]) -> str:
    """``seeds 3..7`` for one range of draws, ``seeds 0, 1, 5`` for draws pooled from runs with gaps between them."""
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"seeds {seeds[0]}..{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def section_long_documents(path: Path) -> list[str]:
    data = _read(path)
    settings = data["settings"]
    draws = settings.get("seeds", 1)
    body = [
        [
            str(row["length"]),
            row["method"],
            f"{row['passage']['top1']:.3f} / {row['passage']['mrr']:.3f}",
            *([" ".join(f"{run['top1']:.3f}" for run in row["passage_per_seed"])] if draws > 1 else []),
            f"{row['halves']['top1']:.3f} / {row['halves']['mrr']:.3f}",
        ]
        for row in data["rows"]
    ]
    header = ["length", "method", "passage top-1 / MRR", "halves top-1 / MRR"]
    if draws > 1:
        header[2] = f"passage top-1 / MRR, mean of {draws} draws"
        header.insert(3, f"passage top-1, {_seeds_label([run['seed'] for run in data['rows'][0]['passage_per_seed']])}")
    timing = [
        [row["method"], f"{row['seconds']:.3f}", _added_mb(row), f"{row['peak_mb']:.0f}"] for row in data["timing"]
    ]
    longest = max(settings["lengths"])
    read = settings.get("select_blocks")
    exact = settings.get("converted_exact_length")
    return [
        f"{settings['documents_used']} documents, passages of {settings['passage']} tokens"
        + (f"; the converted model read with far blocks {read}" if read is not None else "")
        + (f"; the converted model reads inputs of up to {exact} tokens exactly." if exact else "."),
        "",
        *_table(header, body),
        "",
        *_long_documents_paired(data.get("paired")),
        f"Short-text fidelity: mean cosine of the converted model's embeddings to the original's at 256 tokens, "
        f"{data['fidelity_cosine_256']:.4f}"
        + (
            f"; relative error of its last hidden states, {data['fidelity_error_256']:.4f}."
            if "fidelity_error_256" in data
            else "."
        ),
        "",
        *(
            [*_table([f"embed one {longest}-token document", "seconds", "MB added", "process peak MB"], timing), ""]
            if timing
            else []
        ),  # a pooled result (--combine) holds no times
        "Run: " + stamp_line(data.get("header")),
    ]


def section_long_document_speed(path: Path) -> list[str]:
    data = _read(path)
    settings = data["settings"]
    digits = 3 if settings.get("device", "cpu") == "cpu" else 4  # a GPU's times are hundredths of a second
    body = [
        [
            row["method"],
            f"{row['seconds']:.{digits}f}",
            ", ".join(f"{t:.{digits}f}" for t in row["times"]),
            _added_mb(row),
        ]
        for row in data["rows"]
    ]
    where = (
        f"{settings['device']}, {settings['dtype']}"
        if settings.get("device", "cpu") != "cpu"
        else f"{settings['threads']} thread(s)"
    )
    far = settings.get("select_blocks") or 0
    held = settings.get("converted_select_blocks")
    model = (
        f"the model of `{settings['model_dir']}`" + (f", read with far blocks {held}" if held is not None else "")
        if settings.get("model_dir")
        else "converted without transfer"
        + (f", far blocks {far} x {settings['select_block_size']}" if far else ", no far blocks")
    )
    return [
        f"{where}, {model}; chunks in batches of {settings['batch_size']}; load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.2f}' for x in data['load_before'])} before the timed pairs, "
        f"{', '.join(f'{x:.2f}' for x in data['load_after'])} after.",
        "",
        *_table([f"embed one {settings['length']}-token document", "median seconds", "each pair's", "MB added"], body),
        "",
        "Run: " + stamp_line(data.get("header")),
    ]


# -------------------------------------------------------------------------------------------------------- the page
SECTIONS = [
    (
        "attention.json",
        "Attention: the full sweep",
        "One attention layer, forward + backward, hidden 768 = 12 heads x 64, float32, batch 1, 2 threads; Performer "
        "m = 256, Linformer k = 256 (learned E, F); peers `performer-pytorch` 1.1.4 and `linformer` 0.2.3 (the "
        "`bench` extra). Every configuration in its own subprocess, best of 3 timed repeats of forward + "
        "`out.backward(grad)` with a fixed upstream gradient; peak memory is `ru_maxrss` above the subprocess's "
        "baseline. Ratios are to SDPA measured in the same run. performer-pytorch's causal path materializes an O(n m d) "
        "prefix tensor (~9.5 GB at 4096) and is skipped beyond. Plot: `results/attention.png`.",
        section_attention,
    ),
    (
        "attention_paired.json",
        "Attention: paired runs",
        "`--paired` alternates subprocesses of a kernel and its SDPA, so each ratio compares two runs seconds apart "
        "(best of the repeats each): the ratio sees through a shared machine's drift in speed, where the sweep's "
        "seconds do not.",
        section_paired,
    ),
    (
        "attention_paired_learned.json",
        "Attention: the learned map and the hybrid",
        "`hedgehog`, `hedgehog_causal`: a `HedgehogFeatureMap` with m = 128, features computed inside the timed "
        "region, then `linear_attention`; `hybrid`, `hybrid_causal`: the same features in `hybrid_attention` with a "
        "64-token window. Paired against SDPA as above.",
        section_paired,
    ),
    (
        "attention_paired_linformer_hybrid.json",
        "Attention: the Linformer hybrid",
        "`linformer_hybrid`: k = 256 learned slots beside a 64-token window and one sink, against plain `linformer` "
        "with the same k. Paired against SDPA as above.",
        section_paired,
    ),
    (
        "attention_paired_mmap_threshold.json",
        "Attention: glibc's mmap threshold raised",
        "`--malloc_mmap_threshold 17179869184` runs every subprocess with `MALLOC_MMAP_THRESHOLD_` set, so freed "
        "memory stays in the heap instead of being unmapped and faulted in again at the next step. Compare with the "
        "learned-map table above, run with glibc's default; the stamps say which code each ran.",
        section_paired,
    ),
    (
        "feature_map_backward.json",
        "Attention: what the learned map keeps for backward",
        "Each kernel with the Hedgehog map composed of torch's ops and with `softmax_pair` (one autograd function that "
        'keeps only its result), in alternating subprocesses. "Kept for backward" counts the distinct storages '
        "autograd saves in one forward; peak memory and seconds are single runs.",
        section_feature_map_backward,
    ),
    (
        "generation.json",
        "Decoding: per-token latency",
        "Random weights, GPT-2 small shape (hidden 768, 12 layers, 12 heads, vocab 50257); Performer m = 256, "
        "Linformer k = 256 with E = F; GPT-2 is transformers' `GPT2LMHeadModel` with SDPA and its `DynamicCache`. "
        "float32, 2 threads, median of 16 decode steps after an untimed prefill, each (model, context) in its own "
        "process, which also reports its peak RSS. Plot: `results/generation.png`.",
        section_generation,
    ),
    (
        "training.json",
        "Training: masked-LM steps",
        "Forward + backward + AdamW step, batch 1, in tokens/s, and peak memory (RSS above the process baseline, one "
        "subprocess per measurement), for models of one size (hidden 512, 4 layers, 8 heads, intermediate 2048, vocab "
        "30522): Performer (m = 256), Linformer (k = 256), the same stack with attention replaced by identity (each "
        "head returns its values: the bound), and transformers' `BertForMaskedLM` with SDPA.",
        section_training,
    ),
    (
        "training_learned.json",
        "Training: the learned map and the hybrid",
        'The same stack with `feature_map="hedgehog"` (m = 128), and the hybrid with a 64-token window on it.',
        section_training,
    ),
    (
        "training_mmap_threshold.json",
        "Training: glibc's mmap threshold raised",
        "The learned-map run with `--malloc_mmap_threshold 17179869184`; the stamps say which code each ran.",
        section_training,
    ),
    (
        "attention_mass.json",
        "Conversion: where all-MiniLM-L6-v2's attention goes",
        "On the 8 evaluation blocks of the conversion benchmark, per layer, the mean share of each query's softmax "
        "attention in its window (|s − t| < w, [CLS] and [SEP] aside), on [CLS], on [SEP] and on the other keys; then "
        "what exact attention on a window (and [CLS], [SEP]) alone keeps, the other keys dropped and the kept scores "
        "renormalized: what a hybrid's linear part has left to approximate.",
        section_attention_mass,
    ),
    (
        "conversion.json",
        "Conversion: all-MiniLM-L6-v2, every setting",
        "The pretrained all-MiniLM-L6-v2 (6 layers, 12 heads of 32) converted, on 8 held-out blocks of 256 tokens of "
        "Python standard-library source the transfer never saw: the relative error of the last hidden states and the "
        "cosine of the mean-pooled sentence embeddings, converted and after attention transfer on other modules "
        "(batch 8, AdamW, cosine schedule). The attention error is the per-layer attention-output error, mean of "
        "the 6 layers; the stage 2 loss is every layer's hidden-state MSE over the original's mean square.",
        section_conversion,
    ),
    (
        "conversion_layerwise.json",
        "Conversion: one sink, with stage 2",
        "`hybrid_sinks=1` ([CLS] in exact attention), and a plain Linformer, each with layer-wise distillation after "
        "stage 1.",
        section_conversion,
    ),
    (
        "conversion_query_scale.json",
        "Conversion: the query scale",
        "`hybrid_query_scale=True`, fitted by least squares before stage 1, against the same setting without it.",
        section_conversion,
    ),
    (
        "conversion_random_query_scale.json",
        "Conversion: the query scale on random features",
        "The random-feature hybrid with a learned query scale on top of FAVOR+'s own.",
        section_conversion,
    ),
    (
        "conversion_key_scale.json",
        "Conversion: the best setting",
        "The learned map with a 64-token window, one sink, the query and the key scales; stage 2 with the new "
        "attention parameters at 3e-3 and the pretrained weights at 3e-5.",
        section_conversion,
    ),
    (
        "conversion_far_blocks.json",
        "Conversion: far blocks chosen per query block",
        "The best setting with `hybrid_select_blocks=2, hybrid_select_block_size=32`: each block of 32 queries scores "
        "the 2 blocks of 32 far keys its mean query prefers exactly, in the same steps. Other jobs ran beside it "
        "(up to two, a clean-clone suite among them): its times are no measure of speed.",
        section_conversion,
    ),
    (
        "conversion_linformer_hybrid.json",
        "Conversion: a Linformer with a window",
        "`LinformerConfig(hybrid_window=64, hybrid_sinks=1)` at k = 64 = n / 4: the slots beside an exact window and "
        "[CLS], in one softmax.",
        section_conversion,
    ),
    (
        "conversion_local_heads.json",
        "Conversion: local heads in a Linformer",
        "Half the heads local (6 of 12, window 128) and k = 64 for the rest: the last six heads, or the six whose "
        "original attention stays most inside the window (`choose_local_heads`).",
        section_conversion,
    ),
    (
        "hybrid_anatomy.json",
        "Conversion: what the learned hybrid still misses",
        "The best setting after stage 1, taken apart per layer on the original's own inputs: the attention-output "
        "error of the hybrid; with each query's far mass (beyond the window and [CLS]) set to the original's; with "
        "the far mass spread as the original spreads it; and with the G far keys that take most of the original's "
        "attention made exact (an oracle's choice). Then other linear parts trained on one layer alone.",
        section_hybrid_anatomy,
    ),
    (
        "long_documents.json",
        "Conversion: long documents",
        "all-MiniLM-L6-v2 converted to read 8192 tokens (`convert_bert(..., max_length=8192)`, the hybrid of the best "
        "setting; its transfer in `results/long_documents_conversion.txt`) against the original, on the Python "
        "standard library's longest modules cut to each length: the original over [CLS] + 510 tokens + [SEP] chunks, "
        "averaged, each weighted by its tokens; the original truncated to 512 tokens; the converted model over the whole text (mean pooling). "
        "Passage: a passage from beyond each document's first 512 tokens, removed from it, retrieves its document "
        "(at 512 tokens no method sees it); halves: a document's first half retrieves its second half. Time (median "
        "of the repeats after a warm-up) in a fresh process per method, 2 threads; its peak RSS is the whole "
        "process's, with both models loaded, so it does not tell the methods apart.",
        section_long_documents,
    ),
    (
        "long_documents_short_transfer.json",
        "Conversion: long documents, transfer on 256-token blocks",
        "The same model and benchmark, with both stages of the conversion on 256-token blocks (`--transfer_length "
        "256`, 300 + 300 steps; `results/long_documents_short_transfer_conversion.txt`): the map learned where the "
        "original's attention is defined and each step is cheap, the 8192 positions built but never trained past 256.",
        section_long_documents,
    ),
    (
        "long_documents_long_steps.json",
        "Conversion: long documents, long steps after short blocks",
        "The 256-token recipe, then 64 steps each on one 8192-token block (the original chunk-wise) plus a batch of "
        "256-token blocks (`--finetune_long_steps 64`; `results/long_documents_long_steps_conversion.txt`): the far "
        "keys taught while the short batch holds the short-text fit.",
        section_long_documents,
    ),
    (
        "long_documents_long_steps_seeds.json",
        "Conversion: long documents, long steps, five draws of the passages",
        "The long-steps model above, the passage task drawn five times (`--seeds 5`: the passages' places by seeds "
        "0 to 4, seed 0 being the table above's), at the lengths the target is set at: each score is the mean over "
        "5 x 64 queries, and each draw's top-1 beside it.",
        section_long_documents,
    ),
    (
        "long_documents_long_steps_paired.json",
        "Conversion: long documents, long steps, paired on the same queries",
        "The long-steps recipe converted again, on another machine of 2 cores "
        "(`results/long_documents_long_steps_rerun_conversion.txt`: every loss and error as in the first run), and "
        "the passage task at 8192 tokens drawn five times as above, now with every query's rank kept: the converted "
        "model against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_inverse_cloze_paired.json",
        "Conversion: long documents, inverse-cloze steps, paired on the same queries",
        "The long-steps model of the run above after 20 inverse-cloze steps on the standard library's test modules "
        "(`python -m linearformers.conversion.inverse_cloze`; `results/long_documents_inverse_cloze_conversion.txt`), "
        "the same five draws of the passages at 8192 tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_paired.json",
        "Conversion: long documents, the whole recipe in 30 minutes, paired on the same queries",
        "MiniLM converted with fewer steps (150 + 30 + 32 long steps), then 12 inverse-cloze steps: both commands "
        "in 25 min 35 s on the slower machine of 2 cores, alone (`results/long_documents_30min_conversion.txt`); "
        "the same five draws of the passages at 8192 tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_far_blocks_paired.json",
        "Conversion: long documents, the 30-minute recipe with far blocks",
        "The 30-minute recipe with `--hybrid_select_blocks 2 --hybrid_select_block_size 32`: each block of 32 queries "
        "scores the 2 blocks of 32 far keys its mean query prefers exactly (`results/long_documents_far_blocks_"
        "conversion.txt`); the first three draws of the passages at 8192 tokens, against the chunked original on "
        "the same 192 queries. Two other jobs ran beside it (load average 4.5 at the end): its times are no "
        "measure of speed.",
        section_long_documents,
    ),
    (
        "long_documents_far_blocks_weighted_paired.json",
        "Conversion: long documents, far blocks with the short batch weighted in the long steps",
        "The 30-minute recipe with far blocks and `--finetune_long_short_weight 10`: each long step weighs the short "
        "batch's loss ten times (`results/long_documents_far_blocks_weighted_conversion.txt`); the first three draws "
        "of the passages at 8192 tokens, against the chunked original on the same 192 queries.",
        section_long_documents,
    ),
    (
        "long_documents_far_blocks_weighted30_paired.json",
        "Conversion: long documents, far blocks with both short weights at 30",
        "The 30-minute recipe with far blocks, `--finetune_long_short_weight 30` and the inverse cloze's "
        "`--short_weight 30` (`results/long_documents_far_blocks_weighted30_conversion.txt`); the first three draws "
        "of the passages at 8192 tokens, against the chunked original on the same 192 queries.",
        section_long_documents,
    ),
    (
        "long_documents_far_blocks_weighted30_read4_paired.json",
        "Conversion: long documents, the same model read with 4 far blocks",
        "The model above read with 4 far blocks of 32 in place of its 2 (`--select_blocks 4`); the same three draws "
        "of the passages at 8192 tokens, against the chunked original on the same 192 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_read2_paired.json",
        "Conversion: long documents, the 30-minute recipe's model read with 2 far blocks",
        "The 30-minute recipe's model, trained without far blocks, read with 2 far blocks of 32 (`--select_blocks "
        "2`); the first three draws of the passages at 8192 tokens, against the chunked original on the same 192 "
        "queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_read1_paired.json",
        "Conversion: long documents, the 30-minute recipe's model read with 1 far block",
        "The 30-minute recipe's model, trained without far blocks, read with 1 far block of 32 (`--select_blocks "
        "1`); the first three draws of the passages at 8192 tokens, against the chunked original on the same 192 "
        "queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_read1_draws34.json",
        "Conversion: long documents, the 30-minute recipe's model read with 1 far block, draws 3 and 4",
        "The same model and reading on the other two of the 30-minute recipe's five draws (`--seed 3 --seeds 2`), "
        "against the chunked original on the same 128 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_read1_5draws.json",
        "Conversion: long documents, the 30-minute recipe's model read with 1 far block, five draws",
        "The two results above pooled (`--combine`): the five draws of the 30-minute recipe's own result, against "
        "the chunked original on the same 320 queries. The halves task and the short-text fidelity are the first "
        "run's; the times are each run's own.",
        section_long_documents,
    ),
    (
        "conversion_long_models_read_far_blocks.json",
        "Conversion: the 30-minute models read with more far blocks",
        "`conversion.py --models ... --select_blocks 0 1 2 3 4`: the 30-minute recipe's model (`/work/exp35/ict`, "
        "trained without far blocks) and the one with far blocks and both short weights at 30 (`/work/exp40/ict`, "
        "trained with 2), each read with 0 to 4 far blocks of 32 (`from_pretrained(..., "
        "hybrid_select_blocks=K)`) on the 256-token conversion's held-out blocks.",
        section_conversion_models,
    ),
    (
        "conversion_long_models_weighted10.json",
        "Conversion: the 30-minute recipe with the short batch weighted 10, at 256 tokens",
        "`conversion.py --models ... --select_blocks 0 1`: the 30-minute recipe's model (`/work/exp35/ict`) and the "
        "same recipe with `--finetune_long_short_weight 10` (`/work/exp43/ict`), each read with 0 and 1 far block "
        "of 32, on the 256-token conversion's held-out blocks.",
        section_conversion_models,
    ),
    (
        "long_documents_30min_weighted10_paired.json",
        "Conversion: long documents, the 30-minute recipe with the short batch weighted 10",
        "The 30-minute recipe with `--finetune_long_short_weight 10`, no far blocks, rebuilt on the faster machine "
        "(`/work/exp44/ict`; `results/long_documents_30min_weighted10_rebuild_conversion.txt`: every reported loss "
        "as in `results/long_documents_30min_weighted10_conversion.txt`); the five draws of the passages at 8192 "
        "tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_weighted10_cloze30_paired.json",
        "Conversion: long documents, the short batch weighted 10 in the long steps and 30 in the inverse cloze",
        "The same conversion, its inverse cloze run with `--short_weight 30` (`/work/exp44/ict30`; "
        "`results/long_documents_30min_weighted10_rebuild_conversion.txt`); the five draws of the passages at 8192 "
        "tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "conversion_long_models_cloze30.json",
        "Conversion: the short batch weighted 10, then 10 or 30 in the inverse cloze, at 256 tokens",
        "`conversion.py --models ... --select_blocks 0 1`: the 30-minute recipe with `--finetune_long_short_weight "
        "10` after the conversion (`/work/exp44/conv`), after the inverse cloze at its default short weight 10 "
        "(`/work/exp44/ict`) and at `--short_weight 30` (`/work/exp44/ict30`), each read with 0 and 1 far block of "
        "32, on the 256-token conversion's held-out blocks.",
        section_conversion_models,
    ),
    (
        "long_documents_30min_long16_cloze18_paired.json",
        "Conversion: long documents, 16 long steps and 18 inverse-cloze steps at short weight 30",
        "The weight-10 recipe with 16 long steps in place of 32 and 18 inverse-cloze steps in place of 12, the "
        "inverse cloze at `--short_weight 30` (`/work/exp44/ict16`; "
        "`results/long_documents_30min_long16_cloze18_conversion.txt`); the five draws of the passages at 8192 "
        "tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "conversion_long_models_long16_cloze18.json",
        "Conversion: 16 long steps and 18 inverse-cloze steps, at 256 tokens",
        "`conversion.py --models ...`: the model above after the conversion (`/work/exp44/conv16`) and after the "
        "inverse cloze (`/work/exp44/ict16`), read without far blocks, on the 256-token conversion's held-out "
        "blocks.",
        section_conversion_models,
    ),
    (
        "long_documents_30min_long16_cloze30_paired.json",
        "Conversion: long documents, 16 long steps and 30 inverse-cloze steps at short weight 30",
        "The conversion above (16 long steps), its inverse cloze run for 30 steps at `--short_weight 30` "
        "(`/work/exp44/ict16s30`; `results/long_documents_30min_long16_cloze30_conversion.txt`); the five draws of "
        "the passages at 8192 tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "conversion_long_models_long16_cloze30.json",
        "Conversion: 16 long steps and 30 inverse-cloze steps, at 256 tokens",
        "`conversion.py --models ...`: the model above (`/work/exp44/ict16s30`), read without far blocks, on the "
        "256-token conversion's held-out blocks.",
        section_conversion_models,
    ),
    (
        "long_documents_30min_exact512_paired.json",
        "Conversion: long documents, the 30-minute recipe's model reading inputs of up to 512 tokens exactly",
        "The 30-minute recipe's model rebuilt on the faster machine (`/work/exp45/ict1`, the same losses as "
        "`results/long_documents_30min_conversion.txt` to the digits printed), read with `--exact_length 512`: "
        "inputs of up to 512 tokens (here the passages) by exact softmax, the documents by the hybrid; the five "
        "draws of the passages at 8192 tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_exact512_paired_2048.json",
        "Conversion: long documents, the 30-minute recipe's model reading inputs of up to 512 tokens exactly, 2048 "
        "tokens",
        "The recipe converted and trained again by this code, whose saved config reads inputs of up to 512 tokens "
        "exactly (`/work/exp45/new_ict`; `results/long_documents_30min_exact512_conversion.txt`); the five draws of "
        "the passages at 2048 tokens, against the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "conversion_long_models_exact512.json",
        "Conversion: the 30-minute recipe's model reading inputs of up to 512 tokens exactly, at 256 tokens",
        "`conversion.py --models ... --select_blocks 0`: the 30-minute recipe converted and trained again by this "
        "code, whose saved config reads inputs of up to 512 tokens exactly (`/work/exp45/new_ict`; "
        "`results/long_documents_30min_exact512_conversion.txt`), on the 256-token conversion's held-out blocks.",
        section_conversion_models,
    ),
    (
        "conversion_long_models_exact512_weighted.json",
        "Conversion: the short-weight models reading inputs of up to 512 tokens exactly, at 256 tokens",
        "`conversion.py --models ... --select_blocks 0 --exact_length 512`: the weight-10 conversion before its "
        "inverse cloze (`/work/exp44/conv`), after it at short weight 10 (`/work/exp44/ict`) and 30 "
        "(`/work/exp44/ict30`), 16 long and 18 inverse-cloze steps at 30 (`/work/exp44/ict16`), and the 30-minute "
        "recipe's conversion command without `--finetune_long_steps` (`/work/exp45/s2`: stage 1 and stage 2 with the "
        "losses of `results/long_documents_30min_exact512_conversion.txt`), each read with inputs of up to 512 "
        "tokens exact, on the 256-token conversion's held-out blocks (a clean-clone suite ran beside it; these "
        "figures hold no times).",
        section_conversion_models,
    ),
    (
        "conversion_long_models_short_exact.json",
        "Conversion: the 30-minute recipe with its short terms read exactly, at 256 tokens",
        "`conversion.py --models ... --select_blocks 0`: the 30-minute recipe as docs/conversion.md gives it, the "
        "short-text terms of the long steps and of the inverse cloze reading their blocks exactly and the inverse "
        "cloze's `--short_weight 20` (`/work/exp46/ict`; `results/long_documents_30min_short_exact_conversion.txt`), "
        "read as saved, on the 256-token conversion's held-out blocks.",
        section_conversion_models,
    ),
    (
        "long_documents_30min_short_exact_paired.json",
        "Conversion: long documents, the 30-minute recipe with its short terms read exactly",
        "The same model (`/work/exp46/ict`), read as saved: inputs of up to 512 tokens (here the passages) by exact "
        "softmax, the documents by the hybrid; the five draws of the passages at 8192 tokens, against the chunked "
        "original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_short_exact_paired_2048.json",
        "Conversion: long documents, the 30-minute recipe with its short terms read exactly, 2048 tokens",
        "The same model (`/work/exp46/ict`), read as saved; the five draws of the passages at 2048 tokens, against "
        "the chunked original on the same 320 queries.",
        section_long_documents,
    ),
    (
        "long_documents_30min_short_exact_paired_113.json",
        "Conversion: long documents, the 30-minute recipe with its short terms read exactly, 109 modules",
        "The same model (`/work/exp46/ict`), read as saved; the five draws of the passages at 8192 tokens on "
        "`--documents 113`: of the standard library's 113 longest modules, the 109 with at least 8256 tokens (the 64 "
        "of the other runs among them), against the chunked original on the same queries.",
        section_long_documents,
    ),
    (
        "conversion_long_models.json",
        "Conversion: the long models at 256 tokens",
        "`conversion.py --models`: the long-document recipes' models on the 256-token conversion's held-out blocks. "
        "`/work/exp35/ict`: the 30-minute recipe; `/work/exp37/c`, `/work/exp37/ict`: with far blocks, after the "
        "conversion and after the inverse cloze; `/work/exp39/c`, `/work/exp39/ict`: the same with "
        "`--finetune_long_short_weight 10`; `/work/exp40/c`, `/work/exp40/ict`: with `--finetune_long_short_weight "
        "30` and the inverse cloze's `--short_weight 30`.",
        section_conversion_models,
    ),
    (
        "long_documents_30min_paired_2048.json",
        "Conversion: long documents, the whole recipe in 30 minutes, 2048 tokens",
        "The model above, the same five draws of the passages at 2048 tokens; the timing is of one 2048-token "
        "document. Run from a tree whose uncommitted changes were the docs and this report's entries.",
        section_long_documents,
    ),
    (
        "long_documents_speed.json",
        "Conversion: long documents, paired timing",
        "`long_documents.py --speed`: one document of the longest length embedded by the converted model and by the "
        "original over 512-token chunks in turn, in one process, after a warm-up of each; without `--model_dir` the "
        "original converted by the documented settings, no transfer (neither time nor memory depends on the "
        "weights). MB added: the peak resident memory one embedding adds to a fresh process with the models loaded, "
        "where every large allocation is a mapping of its own.",
        section_long_document_speed,
    ),
    (
        "long_documents_far_blocks_speed.json",
        "Conversion: long documents, the model with far blocks, paired timing",
        "`long_documents.py --speed` on the 30-minute recipe's model with far blocks (2 x 32), 2 threads, alone on "
        "the slower machine of 2 cores.",
        section_long_document_speed,
    ),
    (
        "long_documents_far_blocks_weighted30_speed.json",
        "Conversion: long documents, far blocks with both short weights at 30, paired timing",
        "`long_documents.py --speed` on the model with far blocks and both short weights at 30 (2 x 32, its own), 2 "
        "threads, alone on the slower machine of 2 cores; the far blocks chosen by the contraction that reads q and "
        "k in place.",
        section_long_document_speed,
    ),
    (
        "long_documents_far_blocks_weighted30_read4_speed.json",
        "Conversion: long documents, the same model read with 4 far blocks, paired timing",
        "The same paired timing with `--select_blocks 4`: the model read with 4 far blocks of 32 in place of its 2, "
        "run after the one above.",
        section_long_document_speed,
    ),
    (
        "long_documents_30min_read2_speed.json",
        "Conversion: long documents, the 30-minute recipe's model read with 2 far blocks, paired timing",
        "The same paired timing on the 30-minute recipe's model read with 2 far blocks of 32 (`--select_blocks 2`).",
        section_long_document_speed,
    ),
    (
        "long_documents_30min_read1_speed.json",
        "Conversion: long documents, the 30-minute recipe's model read with 1 far block, paired timing",
        "The same paired timing on the 30-minute recipe's model read with 1 far block of 32 (`--select_blocks 1`).",
        section_long_document_speed,
    ),
    (
        "long_documents_30min_read1_speed_repeat.json",
        "Conversion: long documents, the same paired timing repeated",
        "The same command again, right after the one above (single pairs on this shared machine drift by more than "
        "the difference between the methods).",
        section_long_document_speed,
    ),
    (
        "long_documents_30min_read1_speed_third.json",
        "Conversion: long documents, the same paired timing a third time",
        "The same command a third time, right after the two above.",
        section_long_document_speed,
    ),
    (
        "long_documents_30min_speed.json",
        "Conversion: long documents, the 30-minute recipe's model, paired timing",
        "The same paired timing on the 30-minute recipe's model without far blocks, beside the one above. Run from a "
        "tree whose uncommitted change was `long_documents.py`'s GPU options (`--device`, `--dtype`), which leave "
        "its CPU path as it was.",
        section_long_document_speed,
    ),
    (
        "long_documents_speed_2threads.json",
        "Conversion: long documents, paired timing on two threads",
        "The same paired timing with `--threads 2`.",
        section_long_document_speed,
    ),
    (
        "conversion_gpt2.json",
        "Conversion: a small GPT-2",
        "A GPT-2 of 4 layers, hidden 256, 4 heads, vocab 8192 (trained by `examples/train_small_gpt2.py` on the "
        "standard library's source) converted: held-out perplexity on its test split, attention transfer on its "
        "validation split.",
        section_conversion_gpt2,
    ),
    ("conversion_gpt2_sink.json", "Conversion: a small GPT-2 with a sink", "", section_conversion_gpt2),
    ("conversion_gpt2_query_scale.json", "Conversion: a small GPT-2 with the query scale", "", section_conversion_gpt2),
    ("conversion_gpt2_key_scale.json", "Conversion: a small GPT-2 with the key scale", "", section_conversion_gpt2),
]
GPU_INTRO = (
    "`benchmarks/gpu.py` on a GPU: one attention layer (12 heads x 64, batch 1, bf16, forward + backward with a fixed "
    "upstream gradient) against `scaled_dot_product_attention` on the flash backend, and training steps (bf16 "
    "autocast, AdamW, batch 1) against transformers' GPT-2 and BERT with SDPA. CUDA events, median after warm-up; "
    "peak memory from `torch.cuda.max_memory_allocated`; each kernel or model in its own subprocess. "
    '`pip install -e ".[gpu]"` adds flash-linear-attention for its rows; `bash benchmarks/cuda_check.sh tests` runs '
    "`pytest -m cuda` and the compile tests on the GPU, `bash benchmarks/cuda_check.sh bench` the benchmark; "
    "`python benchmarks/gpu.py --device cpu --quick` is a CPU smoke run."
)


def benchmarks_readme(results: Path = RESULTS) -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by benchmarks/report.py from benchmarks/results/*.json: edit the script, not this file. -->",
        "",
        "Each table below comes from one result file in `results/` and is stamped with what that file records: the "
        "command, the commit, the device and the load average (1 minute) before and after. Regenerate this page and "
        "the README's tables with `python benchmarks/report.py`. The CPU figures come from a shared machine: compare "
        "ratios within one table, and treat a single cell as ±10-20%.",
        "",
    ]
    known = {name for name, *_ in SECTIONS}
    for name, title, intro, section in SECTIONS:
        path = results / name
        if not path.exists():
            continue
        lines += [f"## {title}", "", f"`results/{name}`" + (f": {intro}" if intro else ""), "", *section(path), ""]
    gpu = sorted(path for folder in sorted(results.iterdir()) if folder.is_dir() for path in folder.glob("*.json"))
    if gpu:
        lines += ["## GPU", "", GPU_INTRO, ""]
        for path in gpu:
            section = (
                section_triton_sweep
                if path.name == "triton_sweep.json"
                else section_host_time
                if path.name.startswith("host_time")
                else section_long_document_speed
                if path.name.startswith("long_documents")
                else section_gpu
            )
            lines += [f"### `results/{path.parent.name}/{path.name}`", "", *section(path), ""]
    unknown = sorted(
        path.name
        for path in results.glob("*.json")
        if path.name not in known and not path.stem.endswith(("_memory", "_stamp"))
    )
    if unknown:
        raise ValueError(f"benchmarks/report.py has no table for {unknown}: add them to SECTIONS")
    return "\n".join(lines).rstrip() + "\n"


def readme_tables(results: Path = RESULTS) -> dict[str, str]:
    """The README's generated tables, by marker name."""
    sweep = _read(results / "attention.json")
    speed = attention_sweep(sweep, list(README_SPEED), ATTENTION_KERNELS, _sdpa_of)
    speed += ["", "Run: " + stamp_line(sweep.get("header"))]
    files = [
        results / name for name in ("conversion.json", "conversion_key_scale.json", "conversion_linformer_hybrid.json")
    ]
    header, body, lines = conversion_rows(files, detail=False)
    conversion = [*_table(header, body), "", *lines]
    gpu = section_gpu(results / README_GPU, targets=False)
    return {
        "speed": "\n".join(speed) + "\n",
        "gpu_speed": "\n".join(gpu) + "\n",
        "conversion": "\n".join(conversion) + "\n",
    }


def fill(text: str, tables: dict[str, str]) -> str:
    """``text`` with each ``<!-- generated: NAME -->`` ... ``<!-- end -->`` block holding ``tables[NAME]``."""
    missing = sorted(set(tables) - {match.group(2) for match in MARKER.finditer(text)})
    if missing:
        raise ValueError(f"README.md has no '<!-- generated: NAME -->' ... '<!-- end -->' block for {missing}")
    return MARKER.sub(lambda match: match.group(1) + tables[match.group(2)] + match.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    pages = {
        BENCHMARKS_README: benchmarks_readme(),
        README: fill(README.read_text(), readme_tables()),
    }
    stale = [path for path, text in pages.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{_shown(path)} differs from what the results give: run python benchmarks/report.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
        print(f"wrote {_shown(path)}")
    return 0


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())
