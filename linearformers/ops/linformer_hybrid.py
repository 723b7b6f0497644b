"""Sliding-window softmax + Linformer slots inside one head, bidirectional (LoLCATs' hybrid with Linformer's slots as
the part that covers the whole sequence).

Query t takes exact softmax scores on its window W(t) = {s : |s - t| < w} of real keys, on its sinks (the first S
real tokens of its row, wherever they lie; StreamingLLM) and on the k slots of Linformer attention (E K, F V over
the real tokens compacted to the front, :func:`linformer.project_slots`), all in one softmax, the window's and the
sinks' scores weighted by a per-head balance gamma_h:

    out_t = (gamma_h Σ_{s in W(t) ∪ sinks} e^{scale q_t·k_s} v_s + Σ_j e^{scale q_t·(E K)_j} (F V)_j) / (same, 1 for v)

Why: the slots pool n / k tokens each, which blurs the sharp local attention of a pretrained BERT (42-62% of each
all-MiniLM-L6-v2 layer's attention lies within 64 tokens, benchmarks/attention_mass.py); the window keeps that part
exact and leaves the slots the far keys. The slots also see the window's tokens (E cannot leave them out per query),
which gamma and E learn around in attention transfer. [CLS], which most queries attend to from far away, is a sink.

Computed by blocks of B = w queries: in the frame of keys [(c - 1) B, (c + 2) B) around query block c lies every
window key of the block. The blocks go through in passes whose scores stay within 16 MB on the CPU
(hybrid._PASS_BYTES), 512 MB on a GPU (_GPU_PASS_BYTES: one pass at 12 heads x 16K, where many small passes would
leave it waiting on the host; its sequence projections are then one product each, not one per head); under
autograd each pass is checkpointed, so backward keeps only the passes' inputs and makes a pass's scores again when
it reaches it (dropout's RNG state kept, so the masks are the same). A pass scores the window, the slots and the
sinks into one tensor and takes one softmax over it. Each query's softmax is its own, so the passes
give the one-pass result exactly. Under torch.compile the op runs in one pass. Time O(n (3 w + k + S) d); memory
O((n + k) d) plus one pass's scores per head (all of them in one pass, under torch.compile). Everything is computed
in float32 (float64 for float64 inputs) with autocast off; outputs come in v's dtype.
Encoders only: a causal Linformer's slots fill as the sequence goes, which this op does not model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ._checks import check_mask, check_qkv, check_window_sinks_gamma, renamed_keywords
from ._favor_chunked import half_operands
from ._precision import outside_autocast
from .hybrid import _PASS_BYTES, sink_slots
from .linformer import METHODS, _check_learned, project_slots


def _check(q, k, v, e_proj, f_proj, gamma, hybrid_window, sinks, projection, dropout_p):
    check_qkv(q, k, v, same_length=True)
    check_window_sinks_gamma("hybrid_window", hybrid_window, sinks, gamma, q.shape[1])
    if projection not in METHODS:
        raise ValueError(f"unknown Linformer projection {projection!r}; choose one of {METHODS}")
    if projection == "learned":
        if e_proj is None:
            raise ValueError("the learned projection needs e_proj")
        _check_learned(e_proj, "e_proj", q.shape[1], k.shape[2])
        _check_learned(f_proj, "f_proj", q.shape[1], k.shape[2])
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


@renamed_keywords("0.3.0", method="projection", window="pool_stride")
@outside_autocast
def linformer_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e_proj: torch.Tensor | None,
    f_proj: torch.Tensor | None,
    gamma: torch.Tensor,
    hybrid_window: int,
    *,
    projection: str = "learned",
    pool_stride: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    sinks: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Bidirectional sliding-window softmax + Linformer slots (see the module docstring).

    Args:
        q, k, v: (batch, heads, n, head_dim).
        e_proj, f_proj: Linformer's key and value projections, as :func:`linformer.linformer_attention` takes them
            (``f_proj=None`` shares E); projection, pool_stride: its projection ("learned", "pool" or "conv") and the
            kernel = stride of "pool" and "conv".
        gamma: (heads,) positive weight of the window's and the sinks' scores against the slots'.
        hybrid_window: w, the window: keys with |s - t| < w.
        key_padding_mask: (batch, n), True / 1 for real tokens. Padded keys take no part; the slots are formed
            from the real tokens compacted to the front, so padding leaves the real tokens' outputs unchanged.
        sinks: S, the first S real tokens of each row, which every query scores exactly.
        scale: logit scale, head_dim ** -0.5 when None.
        dropout_p: dropout on the attention probabilities, in [0, 1).
    Returns: (batch, heads, n, head_dim) in v's dtype; a query with no real key and no written slot gets 0.
    Gradients reach q, k, v, e_proj, f_proj and gamma.
    """
    f_proj = e_proj if f_proj is None else f_proj
    _check(q, k, v, e_proj, f_proj, gamma, hybrid_window, sinks, projection, dropout_p)
    b, h, n, d = q.shape
    mask = check_mask(key_padding_mask, b, n)
    dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    out_dtype = v.dtype
    half = half_operands(v)  # bf16 operands for the products of bf16 inputs on CUDA
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    e, f = (None if p is None else p.to(dtype) for p in (e_proj, f_proj))
    scale = d**-0.5 if scale is None else scale
    real = torch.ones(b, n, dtype=torch.bool, device=q.device) if mask is None else mask
    log_gamma = gamma.to(dtype).log()[None, :, None, None]

    # the slots (b, h, k, d), written slots only; the sinks' keys and values (b, h, S, d) and where they lie
    gpu = _gpu_form(q.device)
    kp, vp, slot_mask = project_slots(
        k, v, e, f, projection=projection, pool_stride=pool_stride, key_padding_mask=mask, batched=gpu
    )
    sink_k = sink_v = sink_position = sink_seen = None
    if sinks:
        _, slot = sink_slots(real, sinks)  # (b, S, n): token s is sink j
        pick = slot.to(dtype)[:, None]
        sink_k, sink_v = pick @ k, pick @ v
        sink_position = (slot.long() * torch.arange(n, device=q.device)).sum(-1)  # (b, S)
        sink_seen = slot.any(-1)  # (b, S): False where the row has fewer than S real tokens

    # the window, by blocks of B = w queries against frames of 3 B keys, in passes of whole blocks. Each pass gets
    # inputs of its own: its query blocks (one split of q) and its key / value blocks with one block of margin on
    # either side (a cat of per-block views of the padded keys). Slicing q, k, v per pass instead would make the
    # backward of every pass a zero-filled gradient as large as the whole input.
    w = hybrid_window
    blocks = -(-n // w)
    tail = blocks * w - n
    per_block = b * h * w * (3 * w + kp.shape[2] + sinks) * q.element_size()
    step = _blocks_per_pass(blocks, per_block, gpu)
    q_passes = (F.pad(q, (0, 0, 0, tail)) if tail else q).split(step * w, dim=2)
    k_blocks, v_blocks = (F.pad(x, (0, 0, w, w + tail)).split(w, dim=2) for x in (k, v))  # blocks + 2 each
    key_real = F.pad(real, (w, w + tail))  # (b, (blocks + 2) w), False outside [0, n)
    recompute = (
        len(q_passes) > 1
        and torch.is_grad_enabled()
        and any(x.requires_grad for x in (q, k, v, kp, vp, gamma))  # the sinks' keys and values come from k, v
    )
    outs = []
    for index, q_pass in enumerate(q_passes):
        c0 = index * step
        c1 = c0 + q_pass.shape[2] // w
        k_pass, v_pass = (torch.cat(x[c0 : c1 + 2], dim=2) for x in (k_blocks, v_blocks))
        real_pass = key_real[:, c0 * w : (c1 + 2) * w]
        args = (q_pass, c0, log_gamma, k_pass, v_pass, real_pass, kp, vp, slot_mask, sink_k, sink_v)
        args = (*args, sink_position, sink_seen, w, scale, dropout_p, half)
        if recompute:  # keep only the inputs; the pass's scores are made again in backward (RNG state kept)
            outs.append(checkpoint(_pass, *args, use_reentrant=False))
        else:
            outs.append(_pass(*args))
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    return (out[:, :, :n] if tail else out).to(out_dtype)


_GPU_PASS_BYTES = 512 * 2**20  # a GPU's budget of scores per pass: one pass at 12 heads x 16K, window 64, k 256


def _gpu_form(device: torch.device) -> bool:
    """Whether the op takes a GPU's form: batched sequence projections and passes within _GPU_PASS_BYTES. The CPU
    keeps per-head projections and 16 MB passes (hybrid._PASS_BYTES), which stay in its caches; a GPU would spend
    its time on the host launching their many small kernels (and recomputing the checkpointed passes)."""
    return device.type != "cpu"


def _blocks_per_pass(blocks: int, per_block: int, gpu: bool) -> int:
    """Query blocks per pass: as many as keep a pass's scores (``per_block`` bytes a block) within the device's
    budget, at least one. Compiled, one pass: inductor (torch 2.13) miscompiled passes of one block each, with the
    checkpoints (heap corruption) and without them (a CPU bmm checked for a CUDA device)."""
    if torch.compiler.is_compiling():
        return blocks
    return max(1, min(blocks, (_GPU_PASS_BYTES if gpu else _PASS_BYTES) // max(1, per_block)))


def _pass(
    q_pass,
    c0,
    log_gamma,
    k_pass,
    v_pass,
    real_pass,
    kp,
    vp,
    slot_mask,
    sink_k,
    sink_v,
    sink_position,
    sink_seen,
    w,
    scale,
    dropout_p,
    half,
):
    """The outputs of the query blocks c0 .. c0 + nq - 1, q_pass (b, h, nq w, d), rows past n included:
    (b, h, nq w, d). k_pass, v_pass (b, h, (nq + 2) w, d) and real_pass (b, (nq + 2) w): the padded keys of blocks
    c0 - 1 .. c0 + nq. Each query's softmax is its own, so passes over whole blocks compute the one-pass result.
    ``half``: the products' operand dtype (bf16 for bf16 inputs on CUDA: tensor cores, as flash attention's
    products; the scores, the softmax and the sums stay in the working dtype), or None for the working dtype."""

    def mm(equation, x, y):
        return torch.einsum(equation, x, y) if half is None else torch.einsum(equation, x.to(half), y.to(half)).to(x)

    b, h, rows, d = q_pass.shape
    nq, frame = rows // w, 3 * w
    q_pass = q_pass * scale  # (rows x d): cheaper than scaling each score
    k_frames, v_frames = (x.unfold(2, frame, w).transpose(-1, -2) for x in (k_pass, v_pass))  # (b, h, nq, 3 w, d)
    window_scores = mm("bhcid,bhcjd->bhcij", q_pass.view(b, h, nq, w, d), k_frames)
    window_scores = window_scores + log_gamma[..., None]
    t = torch.arange(c0 * w, (c0 + nq) * w, device=q_pass.device).view(nq, w, 1)
    s = (torch.arange(c0, c0 + nq, device=q_pass.device) * w - w).view(nq, 1, 1)
    s = s + torch.arange(frame, device=q_pass.device)
    # real keys of the window; a sink in the window is scored here, once
    key_real = real_pass.unfold(1, frame, w)  # (b, nq, 3 w)
    in_window = ((t - s).abs() < w)[None] & key_real[:, :, None, :]  # (b, nq, w, 3 w)
    # masked scores get a finite floor, not -inf: a row with no key at all then has a finite softmax (zeroed below)
    # and no NaN reaches the gradients of the keys it shares with other rows
    window_scores = window_scores.masked_fill(~in_window[:, None], _FLOOR)
    slot_scores = mm("bhid,bhjd->bhij", q_pass, kp)
    has_key = None  # every slot written: every query sees them
    if slot_mask is not None:
        slot_scores = slot_scores.masked_fill(~slot_mask[:, :, None, :], _FLOOR)
        has_key = in_window.any(-1).view(b, 1, rows, 1) | slot_mask.any(-1)[:, :, None, None]
    scores = [window_scores.reshape(b, h, rows, frame), slot_scores]
    if sink_k is not None:  # the sinks outside each query's window: (b, h, nq w, S)
        far = (t.reshape(-1)[None, :, None] - sink_position[:, None, :]).abs() >= w  # (b, nq w, S)
        usable = far & sink_seen[:, None, :]
        sink_scores = mm("bhid,bhjd->bhij", q_pass, sink_k) + log_gamma
        scores.append(sink_scores.masked_fill(~usable[:, None], _FLOOR))
        has_key = None if has_key is None else has_key | usable.any(-1)[:, None, :, None]

    # one softmax over the three parts, one kernel each way
    probs = torch.softmax(torch.cat(scores, -1), -1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    # one split, not three slices: a slice's backward writes a zero-filled gradient of all the probabilities
    window_probs, slot_probs, *sink_probs = probs.split(
        [frame, kp.shape[2], *([] if sink_v is None else [sink_v.shape[2]])], -1
    )
    out = mm("bhcij,bhcjd->bhcid", window_probs.view(b, h, nq, w, frame), v_frames).reshape(b, h, nq * w, d)
    out = out + mm("bhij,bhjd->bhid", slot_probs, vp)
    if sink_v is not None:
        out = out + mm("bhij,bhjd->bhid", sink_probs[0], sink_v)
    return out if has_key is None else torch.where(has_key, out, torch.zeros_like(out))


_FLOOR = -1e30  # the score of a key a query does not see: exp(_FLOOR - max) is 0 in float32 and float64


__all__ = ["linformer_hybrid_attention"]
