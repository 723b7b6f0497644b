"""Linformer forward and backward by hand, in the style of flash attention over the k slots.

Autograd through ``softmax(Q Kpᵀ) Vp`` keeps the (n x k) probabilities per head, and cutting it into query
blocks with checkpointing costs a zero-filled gradient of the whole of q per block (slice backward) plus the
concatenation of the blocks. Here:

* :class:`SlotAttention` walks the queries in blocks of ``rows`` (an argument, ``_ROWS`` by default). Forward
  saves q, Kp, Vp, the output and the per-row log-sum-exp; backward recomputes each block's probabilities from
  the log-sum-exp and writes dq into place. Extra memory is O(rows k) per head whatever n is.
* :class:`SequenceProjection` computes E x for every (batch, head) with one (k x n) @ (n x d) product each,
  reading x in place: no permuted copy of x, no broadcast copy of E, and dx written into place in backward.

Gradients, with P = softmax(S), S = scale · Q Kpᵀ (masked slots at -inf), g = dL/dout:
    dVp = Pᵀ g,   dS = P ⊙ (g Vpᵀ - rowsum(g ⊙ out)),   dQ = scale · dS Kp,   dKp = scale · dSᵀ Q
    (projection)  dx = Eᵀ d(Ex),   dE = Σ_batch,head d(Ex) xᵀ
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._precision import outside_autocast

_ROWS = 256  # default query rows per block of SlotAttention (linformer_attention's block_size=None)


def _row_slices(n: int, rows: int = _ROWS) -> list[slice]:
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _block_logits(q_rows, kp, bias, scale):
    logits = torch.matmul(q_rows, kp.transpose(-1, -2)).mul_(scale)  # (b, h, rows, k)
    if bias is not None:
        logits.add_(bias)
    return logits


def _dropout_multiplier(shape, p, seed, block, device):
    """The dropout multiplier (0 or 1 / (1 - p)) of one query block, regenerated identically in backward."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + block)
    # uniform draws compared with p: half the cost of bernoulli_ on CPU
    return torch.rand(shape, generator=generator, device=device).ge_(p).mul_(1.0 / (1.0 - p))


class SlotAttention(torch.autograd.Function):
    """softmax(q kpᵀ · scale + bias) vp in float32, walked in query blocks; bias is (b, 1|h, 1, k) or None
    (0 for usable slots, -inf for slots no real token wrote). A row with no usable slot gets zeros.

    Dropout on the probabilities draws each block's mask from a generator seeded by (a seed taken from torch's
    global generator, the block index), so backward regenerates the same mask instead of storing it. ``rows``:
    queries per block (a positive int; the result does not depend on it, up to rounding, except through the
    dropout masks, which are drawn per block)."""

    @staticmethod
    def forward(ctx, q, kp, vp, bias, scale, dropout_p=0.0, rows=_ROWS):
        b, h, n, _ = q.shape
        seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
        out = torch.empty(b, h, n, vp.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, n, 1, dtype=torch.float32, device=q.device)
        for index, block in enumerate(_row_slices(n, rows)):
            logits = _block_logits(q[:, :, block].float(), kp, bias, scale)
            top = logits.amax(-1, keepdim=True).clamp_min(-1e30)  # finite even for a row with no usable slot
            probs = logits.sub_(top).exp_()
            total = probs.sum(-1, keepdim=True).clamp_min_(1e-30)
            if dropout_p > 0:
                probs.mul_(_dropout_multiplier(probs.shape, dropout_p, seed, index, q.device))
            out[:, :, block] = torch.matmul(probs, vp).div_(total)
            lse[:, :, block] = total.log_().add_(top)
        ctx.save_for_backward(q, kp, vp, bias, out, lse)
        ctx.settings = (scale, dropout_p, seed, rows)
        return out

    @staticmethod
    @once_differentiable  # backward is hand-written with in-place ops: a second derivative is refused, not wrong
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g):
        q, kp, vp, bias, out, lse = ctx.saved_tensors
        scale, dropout_p, seed, rows = ctx.settings
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dkp = torch.zeros(kp.shape, dtype=torch.float32, device=q.device)
        dvp = torch.zeros(vp.shape, dtype=torch.float32, device=q.device)
        g = g.float()
        for index, block in enumerate(_row_slices(q.shape[2], rows)):
            q_rows, g_rows = q[:, :, block].float(), g[:, :, block]
            probs = _block_logits(q_rows, kp, bias, scale).sub_(lse[:, :, block]).exp_()
            dprobs = torch.matmul(g_rows, vp.transpose(-1, -2))
            if dropout_p > 0:
                multiplier = _dropout_multiplier(probs.shape, dropout_p, seed, index, q.device)
                dvp.add_(torch.matmul((probs * multiplier).transpose(-1, -2), g_rows))
                dprobs.mul_(multiplier)
            else:
                dvp.add_(torch.matmul(probs.transpose(-1, -2), g_rows))
            # rowsum(P ⊙ dP) = rowsum(g ⊙ out), dropout included
            delta = (g_rows * out[:, :, block]).sum(-1, keepdim=True)
            ds = dprobs.sub_(delta).mul_(probs).mul_(scale)
            dq[:, :, block] = torch.matmul(ds, kp)
            dkp.add_(torch.matmul(ds.transpose(-1, -2), q_rows))
        return dq.to(q.dtype), dkp.to(kp.dtype), dvp.to(vp.dtype), None, None, None, None


class SequenceProjection(torch.autograd.Function):
    """E x along the sequence: x (b, h, n, d), E (k, n) or per head (h, k, n), n <= E's columns; -> (b, h, k, d)."""

    @staticmethod
    def forward(ctx, x, proj):
        b, h, n, d = x.shape
        e = proj[..., :n].to(x.dtype)
        out = torch.empty(b, h, e.shape[-2], d, dtype=x.dtype, device=x.device)
        for i in range(b):
            for j in range(h):
                torch.mm(e if e.dim() == 2 else e[j], x[i, j], out=out[i, j])
        ctx.save_for_backward(x, proj)
        return out

    @staticmethod
    @once_differentiable  # backward is hand-written with in-place ops: a second derivative is refused, not wrong
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g):
        x, proj = ctx.saved_tensors
        b, h, n, _ = x.shape
        e = proj[..., :n].to(x.dtype)
        g = g.to(x.dtype).contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x, memory_format=torch.contiguous_format)
            for i in range(b):
                for j in range(h):
                    torch.mm((e if e.dim() == 2 else e[j]).t(), g[i, j], out=dx[i, j])
        dproj = None
        if ctx.needs_input_grad[1]:
            de = torch.zeros(e.shape, dtype=x.dtype, device=x.device)
            xc = x.contiguous()
            for i in range(b):
                for j in range(h):
                    (de if de.dim() == 2 else de[j]).addmm_(g[i, j], xc[i, j].t())
            dproj = torch.zeros(proj.shape, dtype=proj.dtype, device=proj.device)
            dproj[..., :n] = de
        return dx, dproj
