"""How close converted Performer decoders stay to the GPT-2 they come from, and how they decode.

Starts from a GPT2LMHeadModel folder written by ``examples/train_small_gpt2.py`` (model, tokenizer, and its held-out
``validation.jsonl`` / ``test.jsonl``, standard-library files it never trained on) and converts it into
PerformerForCausalLM models (``convert_gpt2``), one per setting:

  * random-m256: FAVOR+ with 256 fixed random features; nothing new to train, so conversion only;
  * hedgehog: a learned feature map (feature_map "hedgehog") of 2 x head_dim features;
  * hedgehog+window64: the same, plus exact softmax on the last 64 keys (hybrid_window=64);
  * random-m256+window64: the random features plus the 64-key window (its per-head balances train);
  * hedgehog+window64+sink: hedgehog+window64 with the first token an attention sink (hybrid_sinks=1).

Quality: held-out perplexity, exp of the mean next-token NLL over every predicted token (block - 1 per block) of
blocks of ``--block`` tokens from test.jsonl, for the original, each model right after conversion, after attention
transfer (LoLCATs stage 1: the new attention parameters fit each layer's attention output to the original's) and,
with ``--finetune_steps``, after stage 2 (KL distillation from the original's next-token distribution, LoRA or all
weights). The transfer text is validation.jsonl, disjoint from both the training and the test files.

Decoding: the best converted model (the lowest perplexity after each setting's last stage) and the original
greedy-generate from a short test prompt up to n_positions tokens, one token per forward call with the cache; each
call is timed, and the cache's bytes are read at two positions (the converted model's state must not grow; GPT-2's
keys and values do). Times are wall clock on a CPU shared with other jobs.

    python benchmarks/conversion_gpt2.py --model_dir /tmp/small_gpt2 --threads 1 --steps 300
    python benchmarks/conversion_gpt2.py --model_dir /tmp/small_gpt2 --finetune_steps 200 --finetune lora
    python benchmarks/conversion_gpt2.py --smoke        # a tiny random GPT-2 in a temp folder, every code path
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F
import transformers
from _stamp import commit, device
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedModel

from linearformers.conversion.convert import convert_gpt2
from linearformers.conversion.transfer import TransferArguments, attention_transfer, text_blocks
from linearformers.modeling.base import CACHE_FIELD  # transformers' name for the cache: cache from 5.24
from linearformers.training import train_bpe_tokenizer

RESULTS = Path(__file__).parent / "results"
SETTINGS = (
    "random-m256",
    "hedgehog",
    "hedgehog+window64",
    "random-m256+window64",
    "hedgehog+window64+sink",
    "hedgehog+window64+scale",
    "hedgehog+window64+scale+keyscale",
)
MODEL_FILES = ("config.json", "test.jsonl", "validation.jsonl")
# --smoke's defaults: small enough to run every code path in seconds (stage 2 included); blocks longer than the
# hybrids' window of 64, so that their linear part runs and the query scale has keys to be calibrated on
SMOKE = dict(block=80, steps=2, batch_size=2, finetune_steps=2, eval_blocks=4, prompt=8)


def settings(head_dim: int) -> dict[str, tuple[dict, bool]]:
    """name -> (convert_gpt2 config overrides, whether it has new attention parameters to transfer)."""
    random = {"num_features": 256, "feature_redraw_interval": None}
    hedgehog = {"feature_map": "hedgehog", "num_features": 2 * head_dim}
    return {
        "random-m256": (random, False),
        "hedgehog": (hedgehog, True),
        "hedgehog+window64": ({**hedgehog, "hybrid_window": 64}, True),
        "random-m256+window64": ({**random, "hybrid_window": 64}, True),
        "hedgehog+window64+sink": ({**hedgehog, "hybrid_window": 64, "hybrid_sinks": 1}, True),
        "hedgehog+window64+scale": ({**hedgehog, "hybrid_window": 64, "hybrid_query_scale": True}, True),
        "hedgehog+window64+scale+keyscale": (
            {**hedgehog, "hybrid_window": 64, "hybrid_query_scale": True, "hybrid_key_scale": True},
            True,
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="folder written by examples/train_small_gpt2.py (required without --smoke)")
    parser.add_argument("--block", type=int, default=256, help="tokens per block, for perplexity and transfer")
    parser.add_argument("--eval_blocks", type=int, default=0, help="test blocks scored, evenly spaced (0: all)")
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300, help="attention-transfer (stage 1) steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="attention-transfer learning rate")
    parser.add_argument("--batch_size", type=int, default=8, help="blocks per transfer / fine-tune step")
    parser.add_argument("--finetune_steps", type=int, default=0, help="stage-2 steps (0: no stage 2)")
    parser.add_argument("--finetune", choices=("lora", "full"), default="lora")
    parser.add_argument("--finetune_lr", type=float, default=1e-4)
    parser.add_argument(
        "--finetune_settings", nargs="+", help="settings that get stage 2 (default: every one that transfers)"
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), help=f"a subset of {', '.join(SETTINGS)}")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens of the timed generation")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of each conversion and of the transfer")
    parser.add_argument("--smoke", action="store_true", help="tiny model and settings: every code path in seconds")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/conversion_gpt2[.smoke].json)")
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke sizes replace the defaults; options given still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the bad option; the limits that need the model are checked once it is loaded."""
    if args.model_dir is None and not args.smoke:
        raise ValueError("--model_dir is required (a folder written by examples/train_small_gpt2.py), or pass --smoke")
    for name in ("block", "steps", "batch_size", "eval_batch_size", "prompt", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("eval_blocks", "finetune_steps"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.block < 2:
        raise ValueError(f"--block must be at least 2 (a block predicts block - 1 tokens), got {args.block}")
    for name in ("lr", "finetune_lr"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise ValueError(f"--{name} must be a finite number > 0, got {getattr(args, name)}")
    for option in ("settings", "finetune_settings"):
        unknown = sorted(set(getattr(args, option) or ()) - set(SETTINGS))
        if unknown:
            raise ValueError(f"--{option}: unknown settings {unknown}; choose from {list(SETTINGS)}")
    if args.finetune_settings and "random-m256" in args.finetune_settings:
        raise ValueError("--finetune_settings: random-m256 has no new attention parameters, so no transfer to go on")


def read_texts(path: Path) -> list[dict]:
    """The ``{"path", "text"}`` rows of a JSON-lines file written by train_small_gpt2.py."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows or not all(isinstance(row, dict) and isinstance(row.get("text"), str) for row in rows):
        raise ValueError(f"{path} must hold one JSON object with a 'text' string per line, as train_small_gpt2 writes")
    return rows


def load_folder(model_dir: Path, limit: int | None = None) -> tuple[GPT2LMHeadModel, object, list[str], list[str]]:
    """The model, tokenizer, validation texts and test texts of a train_small_gpt2 folder (``limit``: first files)."""
    if not model_dir.is_dir():
        raise ValueError(f"--model_dir {str(model_dir)!r} is not a folder; pass one written by train_small_gpt2.py")
    missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"--model_dir {str(model_dir)!r} has no {', '.join(missing)}; pass a folder written by "
            "examples/train_small_gpt2.py (it saves the held-out validation and test texts)"
        )
    validation, test = read_texts(model_dir / "validation.jsonl"), read_texts(model_dir / "test.jsonl")
    shared = {row.get("path") for row in validation} & {row.get("path") for row in test} - {None}
    if shared:
        raise ValueError(f"validation.jsonl and test.jsonl share files {sorted(shared)[:5]}: the test must be unseen")
    splits = model_dir / "splits.json"
    if splits.is_file():  # the test files must not be among those the model trained on
        trained = set(json.loads(splits.read_text()).get("train", ()))
        leaked = sorted(trained & {row.get("path") for row in test + validation})
        if leaked:
            raise ValueError(f"held-out files {leaked[:5]} are in splits.json's train split of {model_dir}")
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [[row["text"] for row in rows[:limit]] for rows in (validation, test)]
    return model, tokenizer, texts[0], texts[1]


def build_smoke_folder(folder: Path) -> None:
    """A random 2-layer GPT-2 (hidden 32, 128 positions) with a BPE tokenizer and held-out texts, in ``folder``."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]
    texts = [path.read_text(encoding="utf-8", errors="replace")[:6000] for path in files]
    tokenizer = train_bpe_tokenizer(texts[:6], vocab_size=400)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=2,
        initializer_range=0.2,  # GPT-2's 0.02 gives near-uniform attention, which every conversion matches exactly
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name, part in (("validation", slice(6, 9)), ("test", slice(9, 12))):
        rows = [{"path": path.name, "text": text} for path, text in zip(files[part], texts[part])]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def evenly_spaced(blocks: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` of the (N, L) ``blocks`` spread evenly over them (all of them for 0 or count >= N)."""
    if count == 0 or count >= blocks.shape[0]:
        return blocks
    return blocks[torch.linspace(0, blocks.shape[0] - 1, count).round().long()]


@torch.no_grad()
def perplexity(model: PreTrainedModel, blocks: torch.Tensor, batch_size: int) -> dict:
    """exp of the mean next-token NLL over every predicted token of ``blocks`` (N, L): N (L - 1) tokens."""
    model.eval()
    total, count = 0.0, 0
    start = time.perf_counter()
    for part in blocks.split(batch_size):
        logits = model(input_ids=part, use_cache=False).logits[:, :-1].float()
        total += F.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten(), reduction="sum").item()
        count += part[:, 1:].numel()
    return {"perplexity": math.exp(total / count), "nll": total / count, "eval_seconds": time.perf_counter() - start}


def cache_bytes(cache) -> int:
    """Bytes of every tensor a cache holds: GPT-2's keys and values, or the linear-attention layers' states."""
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "recurrent_states", {}), getattr(layer, "conv_states", {})):
            tensors += list(states.values())
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


@torch.inference_mode()
def timed_generation(model: PreTrainedModel, prompt: torch.Tensor, total: int) -> dict:
    """Greedy decoding of ``prompt`` (1, p) up to position ``total``: a prefill, then total - p forward calls of one
    token each with the cache (``cache``; ``past_key_values`` before transformers 5.24), each timed. The cache's
    bytes are read after the first quarter of the calls and after the last."""
    model.eval()
    steps = total - prompt.shape[1]
    quarter = steps // 4
    warm = model(input_ids=prompt, use_cache=True)  # untimed warm-up: first-call allocations
    for _ in range(4):
        warm = model(
            input_ids=warm.logits[:, -1:].argmax(-1), **{CACHE_FIELD: getattr(warm, CACHE_FIELD)}, use_cache=True
        )
    out = model(input_ids=prompt, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    tokens, seconds, sizes = [token], [], {}
    for step in range(steps):
        start = time.perf_counter()
        out = model(input_ids=token, **{CACHE_FIELD: getattr(out, CACHE_FIELD)}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        seconds.append(time.perf_counter() - start)
        tokens.append(token)
        if step + 1 in (quarter, steps):  # the cache now holds prompt + step + 1 tokens
            sizes[prompt.shape[1] + step + 1] = cache_bytes(getattr(out, CACHE_FIELD))
    first, last = seconds[:quarter], seconds[-quarter:]
    return {
        "steps": steps,
        "ms_first_quarter": 1000 * statistics.fmean(first),
        "ms_last_quarter": 1000 * statistics.fmean(last),
        "median_ms_first_quarter": 1000 * statistics.median(first),
        "median_ms_last_quarter": 1000 * statistics.median(last),
        "cache_bytes": sizes,
        "tokens": torch.cat(tokens, dim=1)[0].tolist(),
    }


def transfer_row(report, prefix: str = "") -> dict:
    return {
        f"{prefix}steps": report.steps,
        f"{prefix}seconds": report.seconds,
        f"{prefix}layer_error_before": report.error_before,
        f"{prefix}layer_error_after": report.error_after,
    }


def run_setting(name: str, overrides: dict, trainable: bool, source, train_ids, eval_ids, args, measure) -> tuple:
    """Convert, score, transfer (stage 1), score, and with stage 2 fine-tune and score; returns (row, last model)."""
    torch.manual_seed(args.seed)  # the learned feature maps start from the global RNG: same start in any subset
    model, _ = convert_gpt2(source, "performer", **overrides)
    row = {"setting": name, "overrides": overrides, "stages": {"converted": measure(model, name, "converted")}}
    if not trainable:
        return row, model
    stage2 = args.finetune_steps > 0 and name in (args.finetune_settings or SETTINGS)
    converted = copy.deepcopy(model) if stage2 else None
    common = dict(learning_rate=args.lr, batch_size=args.batch_size, seed=args.seed, progress=False)
    report = attention_transfer(model, source, train_ids, args=TransferArguments(steps=args.steps, **common))
    print(report, flush=True)
    row["stages"]["transfer"] = {**measure(model, name, "transfer"), **transfer_row(report)}
    if not stage2:
        return row, model
    # attention_transfer runs stage 2 after its stage 1 only: stage 1 is replayed on a copy of the converted model,
    # with the same seed, so the stage-2 model starts where the one just scored ended (checked below)
    finetune = TransferArguments(
        steps=args.steps,
        finetune_steps=args.finetune_steps,
        finetune=args.finetune,
        finetune_learning_rate=args.finetune_lr,
        **common,
    )
    report2 = attention_transfer(converted, source, train_ids, args=finetune)
    print(report2, flush=True)
    row["stages"]["finetune"] = {
        **measure(converted, name, "finetune"),
        **transfer_row(report2, "transfer_"),
        "steps": report2.finetune_steps,
        "seconds": report2.finetune_seconds,
        "mode": report2.finetune,
        "kl_before": report2.finetune_loss_before,
        "kl_after": report2.finetune_loss_after,
        "stage1_replayed_exactly": report2.error_after == report.error_after,
    }
    return row, converted


def benchmark(args: argparse.Namespace, source: GPT2LMHeadModel, tokenizer, validation, test) -> dict:
    positions = source.config.n_positions
    if args.block > positions:
        raise ValueError(f"--block {args.block} exceeds the model's n_positions {positions}; pass --block {positions}")
    if positions - args.prompt < 4:
        raise ValueError(
            f"--prompt {args.prompt} leaves {positions - args.prompt} positions of n_positions {positions} to "
            "generate; the timing needs at least 4 (a quarter each): pass a shorter --prompt"
        )
    eval_ids = evenly_spaced(text_blocks(tokenizer, test, args.block, wrap=False), args.eval_blocks)
    train_ids = text_blocks(tokenizer, validation, args.block, wrap=False)
    header = {
        "model_dir": str(args.model_dir),
        "model": {"n_layer": source.config.n_layer, "n_embd": source.config.n_embd, "n_head": source.config.n_head},
        "test_blocks": eval_ids.shape[0],
        "test_tokens_scored": eval_ids.shape[0] * (args.block - 1),
        "transfer_blocks": train_ids.shape[0],
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "timing": "wall clock on a shared CPU (other jobs may run on the other cores)",
    }
    print(
        f"{args.model_dir}: GPT-2 {header['model']}; perplexity over {header['test_tokens_scored']} predicted tokens "
        f"of {eval_ids.shape[0]} test blocks of {args.block}; transfer on {train_ids.shape[0]} validation blocks",
        flush=True,
    )
    original = perplexity(source, eval_ids, args.eval_batch_size)
    print(f"original GPT-2          perplexity {original['perplexity']:9.3f}", flush=True)

    def measure(model, name: str, stage: str) -> dict:
        scored = perplexity(model, eval_ids, args.eval_batch_size)
        scored["ratio"] = scored["perplexity"] / original["perplexity"]
        print(f"{name:22s}  {stage:9s} perplexity {scored['perplexity']:9.3f}  x{scored['ratio']:.3f}", flush=True)
        return scored

    table = settings(source.config.n_embd // source.config.n_head)
    rows, best, best_model = [], None, None
    for name in args.settings:
        row, model = run_setting(name, *table[name], source, train_ids, eval_ids, args, measure)
        rows.append(row)
        stage = list(row["stages"])[-1]
        if best is None or row["stages"][stage]["perplexity"] < best[2]:
            best, best_model = (name, stage, row["stages"][stage]["perplexity"]), model
    prompt = eval_ids[:1, : args.prompt]
    generation = {
        "prompt_tokens": args.prompt,
        "positions": positions,
        "original": timed_generation(source, prompt, positions),
        "converted": {"setting": best[0], "stage": best[1], **timed_generation(best_model, prompt, positions)},
    }
    a, b = generation["original"]["tokens"], generation["converted"]["tokens"]
    generation["greedy_tokens_agreeing"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    for side in ("original", "converted"):
        generation[side]["text"] = tokenizer.decode(generation[side]["tokens"])
    result = {"header": header, "args": vars(args), "original": original, "rows": rows, "generation": generation}
    print_tables(result)
    return result


def print_tables(result: dict) -> None:
    header, args, gen = result["header"], result["args"], result["generation"]
    print(
        f"\nGPT-2 ({header['model']['n_layer']} layers, hidden {header['model']['n_embd']}) -> PerformerForCausalLM; "
        f"held-out perplexity on {header['test_blocks']} test blocks of {args['block']} tokens; transfer: "
        f"{args['steps']} steps (batch {args['batch_size']}, lr {args['lr']})"
        + (f", stage 2: {args['finetune_steps']} {args['finetune']} steps" if args["finetune_steps"] else "")
        + f"; {args['threads']} CPU thread(s), times on a shared CPU"
    )
    print("| model | stage | steps | seconds | perplexity | ratio to original |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| GPT-2 (original) | - | - | - | {result['original']['perplexity']:.2f} | 1.000 |")
    for row in result["rows"]:
        for stage, scored in row["stages"].items():
            steps = f"{scored['steps']}" if "steps" in scored else "-"
            seconds = f"{scored['seconds']:.0f}" if "steps" in scored else "-"
            print(
                f"| {row['setting']} | {stage} | {steps} | {seconds} | {scored['perplexity']:.2f} | "
                f"{scored['ratio']:.3f} |"
            )
    print(
        f"\ngreedy decoding, prompt {gen['prompt_tokens']} test tokens, one token per call with the cache up to "
        f"position {gen['positions']}; mean ms per call over the first and the last quarter of "
        f"{gen['original']['steps']} calls ({args['threads']} thread(s) on a shared CPU: other jobs ran beside it)"
    )
    print("| model | ms/token first quarter | ms/token last quarter | last / first | cache bytes (position: bytes) |")
    print("|---|---:|---:|---:|---|")
    for label, side in (("GPT-2 (original), KV cache", gen["original"]), (None, gen["converted"])):
        label = label or f"{side['setting']} ({side['stage']}), fixed state"
        sizes = ", ".join(f"{position}: {size:,}" for position, size in side["cache_bytes"].items())
        print(
            f"| {label} | {side['ms_first_quarter']:.2f} | {side['ms_last_quarter']:.2f} | "
            f"{side['ms_last_quarter'] / side['ms_first_quarter']:.2f} | {sizes} |"
        )
    sizes, grown = (list(gen[side]["cache_bytes"].values()) for side in ("converted", "original"))
    print(
        f"converted cache constant: {sizes[0] == sizes[-1]}; original KV cache grows: "
        f"{grown[0] < grown[-1]}; "
        f"greedy tokens agreeing from the start: {gen['greedy_tokens_agreeing']} of {len(gen['original']['tokens'])}"
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark with the command-line options ``argv`` (default sys.argv[1:]); returns what it writes."""
    given = sys.argv[1:] if argv is None else argv
    args = parse_args(given)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        if args.model_dir is None:
            args.model_dir = scratch  # a random tiny GPT-2 (--smoke), gone when the run ends
            build_smoke_folder(Path(scratch))
        source, tokenizer, validation, test = load_folder(Path(args.model_dir), 3 if args.smoke else None)
        result = benchmark(args, source, tokenizer, validation, test)
    result["header"]["command"] = " ".join(["python", "benchmarks/conversion_gpt2.py", *given])
    result["header"]["commit"], result["header"]["device"] = commit(), device()
    result["header"]["load_average_before"] = load_before
    result["header"]["load_average_after"] = os.getloadavg()
    out = Path(args.out or RESULTS / f"conversion_gpt2{'.smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nload average (1, 5, 15 min) before {load_before}, after {result['header']['load_average_after']}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
