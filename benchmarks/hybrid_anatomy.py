"""What the learned hybrid still misses of all-MiniLM-L6-v2's attention after attention transfer, and where.

The best conversion setting of benchmarks/conversion.py (hedgehog m = 64, window 64, one sink, query and key
scales) after stage 1 (attention transfer), on the same 8 held-out evaluation blocks of 256 tokens:

  1. Per layer, on the original's own inputs, the relative error of the attention output (through o_proj) of
       * the hybrid as trained;
       * the hybrid with each query's far mass (its attention outside the window and the sink) set to the
         original's, its far keys keeping the hybrid's distribution ("exact far mass");
       * the hybrid's far mass with the original's distribution over the far keys ("exact far distribution");
     and the mean far mass of both, with the RMS of log(hybrid's far mass / original's).
  2. The last hidden states' relative error with every layer's attention the hybrid, and with one layer's the
     hybrid and every other layer's exact softmax: how much each layer's miss costs at the output.
  3. Per layer, the hybrid's error when the G far keys that take the most of the original's attention (summed over
     the queries, per sequence and head: an oracle choice, no real model knows it) join every query's exact part.
  4. With ``--probe_layer L``: linear parts of other forms trained on layer L alone (the same per-layer loss as
     stage 1, 8 blocks a step, AdamW at ``--probe_lr`` with a cosine schedule, query and key scales from zero),
     512 training blocks cycled, evaluated as in 1: Hedgehog's map with m = 64 and m = 256, unnormalized exponential
     features phi(x) = exp([u, -u]), u = W x + b (m = 256), and Hedgehog's map on u = W x + b + W2 gelu(W1 x).

    python benchmarks/hybrid_anatomy.py --save /tmp/hybrid_stage1        # stage 1 (about 5 min), then 1-3
    python benchmarks/hybrid_anatomy.py --model_dir /tmp/hybrid_stage1 --probe_layer 2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from _stamp import finish_stamp, start_stamp
from conversion import RESULTS, load_minilm, settings
from transformers import get_cosine_schedule_with_warmup

from linearformers import PerformerModel
from linearformers.conversion.convert import convert_bert
from linearformers.conversion.transfer import (
    TransferArguments,
    attention_transfer,
    softmax_attention_output,
)
from linearformers.ops.reference import hybrid_reference

SETTING = "hedgehog+window64+sink+scale+keyscale"


def split_heads(attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(attention._split(proj(x)) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))


def weights(q, k, phi_q, phi_k, gamma, log_scale, config) -> torch.Tensor:
    """The hybrid's attention weights (b, h, n, n): hybrid_reference applied to the identity as values."""
    b, h, n, _ = q.shape
    eye = torch.eye(n, dtype=torch.float32).expand(b, h, n, n)
    return hybrid_reference(
        q.float(),
        k.float(),
        eye,
        phi_q,
        phi_k,
        gamma,
        config.hybrid_window,
        causal=False,
        query_log_scale=log_scale,
        sinks=config.hybrid_sinks,
    )


def exact_parts(n: int, window: int, sinks: int) -> torch.Tensor:
    """(n, n) bool: the keys each query attends to exactly (its window and the sinks), no padding."""
    t = torch.arange(n)
    near = (t[:, None] - t[None, :]).abs() < window
    near[:, :sinks] = True
    return near


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def output(attention, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, _, n, _ = v.shape
    return attention.o_proj((w.to(v.dtype) @ v).transpose(1, 2).reshape(b, n, -1))


@torch.no_grad()
def layer_table(model, inputs: list[torch.Tensor], top_keys: list[int]) -> list[dict]:
    """Sections 1 and 3, per layer."""
    rows = []
    config = model.config
    for index, layer in enumerate(model.layers):
        attention = layer.attention
        q, k, v = split_heads(attention, inputs[index])
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        p = scores.softmax(-1)
        exact = output(attention, p, v)
        phi_q, phi_k, log_scale = attention.hybrid_features(q, k, None)
        gamma = torch.exp(attention.window_balance)
        w = weights(q, k, phi_q, phi_k, gamma, log_scale, config)
        near = exact_parts(q.shape[2], config.hybrid_window, config.hybrid_sinks)
        far = ~near
        mass_p, mass_w = (p * far).sum(-1, keepdim=True), (w * far).sum(-1, keepdim=True)
        p_near = p * near / (p * near).sum(-1, keepdim=True)
        p_far, w_far = p * far / mass_p.clamp_min(1e-30), w * far / mass_w.clamp_min(1e-30)
        row = {
            "layer": index,
            "hybrid": rel(output(attention, w, v), exact),
            "exact_far_mass": rel(output(attention, (1 - mass_p) * p_near + mass_p * w_far, v), exact),
            "exact_far_distribution": rel(output(attention, (1 - mass_w) * p_near + mass_w * p_far, v), exact),
            "far_mass_original": mass_p.mean().item(),
            "far_mass_hybrid": mass_w.mean().item(),
            "log_far_mass_rms": (mass_w.clamp_min(1e-12).log() - mass_p.clamp_min(1e-12).log())
            .pow(2)
            .mean()
            .sqrt()
            .item(),
            "top_keys": {},
        }
        column = (p * far).sum(-2)  # (b, h, n): the original's far attention each key takes
        for count in top_keys:
            chosen = torch.zeros_like(column, dtype=torch.bool)
            chosen.scatter_(-1, column.topk(count, dim=-1).indices, True)
            exact_part = near | chosen[:, :, None, :]
            logits = scores.masked_fill(~exact_part, -math.inf)
            top = logits.amax(-1, keepdim=True)
            a = gamma[None, :, None, None] * torch.exp(logits - top)
            linear = torch.exp(log_scale[..., None] - top) * (phi_q @ phi_k.transpose(-1, -2)) * ~exact_part
            mixed = (a + linear) / (a + linear).sum(-1, keepdim=True)
            row["top_keys"][count] = rel(output(attention, mixed, v), exact)
        rows.append(row)
    return rows


@torch.no_grad()
def output_errors(model, ids: torch.Tensor, reference: torch.Tensor) -> dict:
    """Section 2: the last hidden states' error, every layer the hybrid, then one layer the hybrid at a time."""

    def exact_forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        return softmax_attention_output(self, hidden_states, attention_mask)

    def error(approximate: set[int]) -> float:
        with ExitStack() as stack:
            for index, layer in enumerate(model.layers):
                if index not in approximate:
                    patched = exact_forward.__get__(layer.attention)
                    stack.enter_context(mock.patch.object(layer.attention, "forward", patched))
            return rel(model(input_ids=ids).last_hidden_state, reference)

    every = set(range(len(model.layers)))
    # no layer the hybrid: the original itself, up to rounding (checks that the swap is the original's attention)
    return {"every_layer": error(every), "one_layer": [error({i}) for i in sorted(every)], "no_layer": error(set())}


class ProbeMap(torch.nn.Module):
    """A linear part for the probe: phi_q, phi_k and the queries' log scale, as hybrid_features gives them."""

    def __init__(self, form: str, heads: int, head_dim: int, m: int, hidden: int = 64):
        super().__init__()
        self.form, half = form, m // 2

        def projection() -> torch.nn.Parameter:
            w = torch.zeros(heads, head_dim, half)
            r = min(head_dim, half)
            w[:, range(r), range(r)] = 1.0
            if half > r:
                w[:, :, r:].normal_(0.0, 0.02)
            return torch.nn.Parameter(w)

        self.w = torch.nn.ParameterList([projection(), projection()])  # queries, keys
        self.b = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(heads, half)) for _ in range(2)])
        if form == "mlp":
            self.w1 = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(heads, head_dim, hidden) / math.sqrt(head_dim)) for _ in range(2)]
            )
            self.w2 = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(heads, hidden, half)) for _ in range(2)])
        self.query_scale = torch.nn.Parameter(torch.zeros(heads, head_dim + 1))
        self.key_scale = torch.nn.Parameter(torch.zeros(heads, head_dim + 1))

    def _u(self, x: torch.Tensor, side: int) -> torch.Tensor:
        u = torch.einsum("bhnd,hdf->bhnf", x, self.w[side]) + self.b[side][None, :, None]
        if self.form == "mlp":
            hidden = F.gelu(torch.einsum("bhnd,hde->bhne", x, self.w1[side]))
            u = u + torch.einsum("bhne,hef->bhnf", hidden, self.w2[side])
        return torch.cat([u, -u], -1)

    @staticmethod
    def _affine(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhnd,hd->bhn", x, weight[:, :-1]) + weight[:, -1][None, :, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        u_q, u_k = self._u(q, 0), self._u(k, 1)
        log_scale = self._affine(q, self.query_scale)
        key_scale = 20 * torch.tanh(self._affine(k, self.key_scale) / 20)
        if self.form == "exp":  # maxima taken off for range, and put back through the queries' log scale
            top_q, top_k = u_q.amax(-1).detach(), u_k.amax((-1, -2)).detach()
            phi_q, phi_k = torch.exp(u_q - top_q[..., None]), torch.exp(u_k - top_k[..., None, None])
            log_scale = log_scale + top_q + top_k[..., None] - math.log(u_q.shape[-1])
        else:
            half = u_q.shape[-1] // 2
            phi_q, phi_k = (torch.cat([u[..., :half].softmax(-1), u[..., half:].softmax(-1)], -1) for u in (u_q, u_k))
        return phi_q, phi_k * torch.exp(key_scale)[..., None], log_scale


def probe(model, teacher, layer_index: int, train_ids, eval_input, steps: int, lr: float) -> list[dict]:
    """Section 4: each form trained on one layer, per-layer loss on the original's inputs."""
    attention = model.layers[layer_index].attention
    config = model.config
    heads, head_dim = attention.num_heads, attention.head_dim
    with torch.no_grad():
        train_qkv = [
            split_heads(attention, teacher(input_ids=part, output_hidden_states=True).hidden_states[layer_index])
            for part in train_ids.split(8)
        ]
        eval_qkv = split_heads(attention, eval_input)

    def run(form_map, balance, q, k, v):
        phi_q, phi_k, log_scale = form_map(q, k)
        return output(attention, weights(q, k, phi_q, phi_k, torch.exp(balance), log_scale, config), v)

    def exact(q, k, v):
        return output(attention, (q @ k.transpose(-1, -2) * head_dim**-0.5).softmax(-1), v)

    rows = []
    for form, m in (("hedgehog", 64), ("hedgehog", 256), ("exp", 256), ("mlp", 64)):
        torch.manual_seed(0)
        form_map = ProbeMap(form, heads, head_dim, m)
        balance = torch.nn.Parameter(torch.zeros(heads))  # gamma = exp(balance), as window_balance
        params = [*form_map.parameters(), balance]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        schedule = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
        start = time.perf_counter()
        for step in range(steps):
            q, k, v = train_qkv[step % len(train_qkv)]
            with torch.no_grad():
                target = exact(q, k, v)
            loss = F.mse_loss(run(form_map, balance, q, k, v), target)
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            error = rel(run(form_map, balance, *eval_qkv), exact(*eval_qkv))
        row = {"form": form, "m": m, "error": error, "seconds": time.perf_counter() - start}
        print(f"| {form} | {m} | {error:.3f} | {row['seconds']:.0f} s |", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="a model saved by --save (skips stage 1)")
    parser.add_argument("--save", help="where to save the model after stage 1")
    parser.add_argument("--steps", type=int, default=300, help="stage-1 steps")
    parser.add_argument("--lr", type=float, default=3e-2, help="stage-1 learning rate")
    parser.add_argument("--block", type=int, default=256, help="tokens per block, [CLS] and [SEP] included")
    parser.add_argument("--eval_blocks", type=int, default=8)
    parser.add_argument("--top_keys", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--probe_layer", type=int, help="train other linear parts on this layer (section 4)")
    parser.add_argument("--probe_steps", type=int, default=300)
    parser.add_argument("--probe_lr", type=float, default=3e-2)
    parser.add_argument("--probe_blocks", type=int, default=512, help="training blocks of the probe, cycled")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "hybrid_anatomy.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stamp = start_stamp()
    n = args.block
    teacher, eval_ids, train_ids = load_minilm(n, args.eval_blocks)
    if args.model_dir:
        model = PerformerModel.from_pretrained(args.model_dir).eval()
    else:
        family, overrides, _ = settings(n)[SETTING]
        model, _ = convert_bert(teacher, family, **overrides)
        transfer = TransferArguments(steps=args.steps, learning_rate=args.lr, progress=False)
        print(attention_transfer(model, teacher, train_ids, args=transfer), flush=True)
        if args.save:
            model.save_pretrained(args.save)
    model.eval()
    with torch.no_grad():
        hidden = teacher(input_ids=eval_ids, output_hidden_states=True).hidden_states
    result = {"args": vars(args), "setting": SETTING}
    result["layers"] = layer_table(model, list(hidden[:-1]), args.top_keys)
    print(f"\n{SETTING} after stage 1, {len(eval_ids)} held-out blocks of {n}: per-layer attention-output error")
    print(
        "| layer | hybrid | exact far mass | exact far distribution | far mass, original / hybrid | "
        "RMS log far-mass ratio | " + " | ".join(f"+ top {g} far keys exact" for g in args.top_keys) + " |"
    )
    print("|---:" * (6 + len(args.top_keys)) + "|")
    for row in result["layers"]:
        print(
            f"| {row['layer']} | {row['hybrid']:.3f} | {row['exact_far_mass']:.3f} | "
            f"{row['exact_far_distribution']:.3f} | {row['far_mass_original']:.3f} / {row['far_mass_hybrid']:.3f} | "
            f"{row['log_far_mass_rms']:.3f} | " + " | ".join(f"{row['top_keys'][g]:.3f}" for g in args.top_keys) + " |"
        )
    result["output"] = output_errors(model, eval_ids, hidden[-1])
    errors = result["output"]
    print(
        f"\nlast hidden states' relative error: every layer the hybrid {errors['every_layer']:.3f}; none "
        f"{errors['no_layer']:.1e} (every layer's attention exact: the original, up to rounding)"
    )
    print("| the hybrid in layer | " + " | ".join(str(i) for i in range(len(model.layers))) + " |")
    print("|---|" + "---:|" * len(model.layers))
    print("| error, every other layer exact | " + " | ".join(f"{e:.3f}" for e in result["output"]["one_layer"]) + " |")
    if args.probe_layer is not None:
        print(
            f"\nlinear parts trained on layer {args.probe_layer} alone, {args.probe_steps} steps at lr {args.probe_lr}"
        )
        print("| form | m | attention-output error | time |\n|---|---:|---:|---:|")
        probe_ids = train_ids[8 : 8 + args.probe_blocks]  # the first 8 are stage 1's held-out blocks
        result["probe"] = probe(
            model, teacher, args.probe_layer, probe_ids, hidden[args.probe_layer], args.probe_steps, args.probe_lr
        )
    result = {"header": finish_stamp(stamp), **result}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
