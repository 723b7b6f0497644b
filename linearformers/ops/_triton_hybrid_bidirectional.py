"""The bidirectional hybrid (:mod:`hybrid`: a window of exact softmax scores, sinks and linear scores in one
normalizer; :mod:`far_blocks`' chosen blocks too) as one Triton kernel, forward only: an encoder's inference over a
long document on a GPU.

    out_t = (alpha_t A_t + beta_t N_t) / (alpha_t Dw_t + beta_t D_t)

Positions fall in blocks of C (a power of two >= 16: 64, or the far blocks' size when blocks are chosen). One
program takes one block c of C queries of one (batch, head) row and makes its whole output:

* the linear keys outside its frame (blocks c - side .. c + side, side = ceil((w - 1) / C), every key of its
  queries' windows) come in through two sums, phi_kᵀ [v, 1] of the blocks before the frame and of those after it,
  each a running sum of per-block sums made before the kernel (one batched product and two cumulative sums), so
  nothing is subtracted and nothing cancels: N_t, D_t start as phi_q,t times them;
* the frame's blocks, one tile of C keys at a time: exact logits where |s - t| < w (real keys), folded into the
  running largest logit c_t, A_t = Σ e^{x - c} v and Dw_t = Σ e^{x - c} with flash attention's rescaling, and
  linear scores phi_q·phi_k on its linear keys outside the window, added to N_t and D_t;
* the chosen far blocks (outside the frame): exact logits on their linear keys, folded in the same way, and their
  own per-block sums taken back out of N_t and D_t (a part of them: the same difference the CPU walk takes);
* the sinks, where they lie outside a query's window (inside it they are window keys);
* then alpha = gamma e^{c - c'}, beta = e^{ℓ - c'}, c' = max(c, ℓ - R) (without ℓ: gamma and 1), as in
  :mod:`hybrid`, and out in v's dtype.

No score, weight or feature product leaves the chip: the kernel reads q, k, v and the features, writes out, and
between the two the only tensors in memory are the per-block sums, O(n / C m d) per row.

No gradients: a call autograd records takes the chunked core (:func:`refusal` says so). Precision as in
:mod:`_triton_causal`: float32 logits, exponents, sums and normalizers, bf16 product operands for bf16 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._precision import outside_autocast

MAX_SINKS = 16
BLOCK = 64  # queries per program without chosen blocks


def block_size(select_blocks: int, select_block_size: int) -> int:
    """C: the far blocks' size when blocks are chosen (a query block chooses for its own queries), else BLOCK."""
    return select_block_size if select_blocks else BLOCK


def refusal(sinks: int, tracked: bool, select_blocks: int = 0, select_block_size: int = 32) -> str | None:
    """Why the bidirectional kernel cannot run this call, beyond what the linear kernels' refusal says (dtypes,
    widths, device), or None when it can."""
    if tracked:
        return (
            "the bidirectional kernel computes no gradients, and autograd records this call (run it under "
            "torch.no_grad(), or take backend='chunked')"
        )
    if sinks > MAX_SINKS:
        return f"it takes at most {MAX_SINKS} sinks, got {sinks}"
    if select_blocks and (
        select_block_size < 16 or select_block_size > 128 or select_block_size & (select_block_size - 1)
    ):
        return f"select_block_size must be a power of two from 16 to 128 (its tile height), got {select_block_size}"
    return None


def _kernel():
    from ._triton_hybrid_bidirectional_kernels import _bidirectional_forward

    return _bidirectional_forward


def block_sums(phi_k: torch.Tensor, v: torch.Tensor, linear: torch.Tensor, block: int, side: int):
    """The per-block sums of the linear keys, phi_kᵀ v (b·h, nb, m, d) and phi_k's (b·h, nb, m), and for each block c
    those of the blocks outside its frame c - side .. c + side (a sum before it plus a sum after it), float32."""
    b, h, n, m = phi_k.shape
    d = v.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    weight = linear[:, None, :, None].to(torch.float32)
    pk = F.pad(phi_k.float() * weight, (0, 0, 0, pad)).view(b * h, nb, block, m)
    vb = F.pad(v.float(), (0, 0, 0, pad)).view(b * h, nb, block, d)
    sums = pk.transpose(-1, -2) @ vb
    z = pk.sum(2)
    gap = side + 1

    def outside(x):  # blocks <= c - gap plus blocks >= c + gap, as running sums from each end
        before = F.pad(x.cumsum(1), (0, 0) * (x.dim() - 2) + (gap, 0))[:, :nb]
        after = F.pad(x.flip(1).cumsum(1).flip(1), (0, 0) * (x.dim() - 2) + (0, gap))[:, gap:]
        return (before + after).contiguous()

    return outside(sums), outside(z), sums.contiguous(), z.contiguous()


_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor pq, Tensor pk, Tensor gamma, Tensor? ell, Tensor valid, Tensor linear, "
    "Tensor sink_pos, Tensor chosen, int window, float scale, int block) -> Tensor"
)


def _forward(q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, chosen, window, scale, block):
    """out (b, h, n, d) in v's dtype; valid, linear (b, n) float 0 / 1, sink_pos (b, MAX_SINKS) int32 (-1: none),
    chosen (b·h, n / block, K) int32 (-1: none; one element when none are chosen)."""
    b, h, n, d = v.shape
    xd, m = q.shape[-1], pq.shape[-1]
    side = -(-(window - 1) // block)
    out_s, out_z, sums, z = block_sums(pk, v, linear, block, side)
    nb = out_z.shape[1]
    picks = chosen.shape[-1] if chosen.dim() == 3 else 0
    out = torch.empty_like(v)
    ops = (1 if v.device.type == "cuda" else 2) if v.dtype == torch.bfloat16 else 0

    def p2(x):
        return 1 << (x - 1).bit_length()

    _kernel()[(b * h, nb)](
        q, k, v, pq, pk, ell if ell is not None else out_z, gamma, valid, linear, sink_pos, out_s, out_z, sums, z,
        chosen, out, n, h, window, side, scale, XD=xd, XDP=p2(xd), D=d, DP=p2(d), M=m, MP=p2(m), C=block,
        SP=MAX_SINKS, PICKS=picks, HAS_ELL=ell is not None, OPS=ops, PREC="tf32" if ops == 1 else "ieee",
        num_warps=8 if block >= 64 else 4, num_stages=1,
    )  # fmt: skip
    return out


def _forward_fake(q, k, v, pq, pk, gamma, ell, valid, linear, sink_pos, chosen, window, scale, block):
    return torch.empty_like(v, memory_format=torch.contiguous_format)


# one custom op: torch.compile keeps the kernel and its host-side sums whole
_forward_op = torch.library.custom_op(
    "linearformers::triton_bidirectional_hybrid", _forward, mutates_args=(), schema=_SCHEMA
)
_forward_op.register_fake(_forward_fake)


@outside_autocast
def triton_bidirectional_hybrid(
    q, k, v, phi_q, phi_k, gamma, window, *, valid, linear, sink_pos, query_log_scale, scale, chosen=None, block=BLOCK
):
    """The bidirectional hybrid through the kernel (module docstring). q, k (b, h, n, d_k), v (b, h, n, d), phi_q,
    phi_k (b, h, n, m), gamma (h,), ℓ (b, h, n) or None; valid (b, n) bool (real keys), linear (b, n) bool (the real
    keys that may join the linear part: not the sinks), sink_pos (b, S) int64 positions of the sinks (-1: none);
    chosen (b, h, n / block, K) int64 key blocks of ``block`` per query block (-1: none) or None. No gradients.
    Returns (b, h, n, d) in v's dtype."""
    b = v.shape[0]
    q, k, v, phi_q, phi_k = (t.contiguous() for t in (q, k, v, phi_q, phi_k))
    picked = (
        chosen.to(torch.int32).flatten(0, 1).contiguous()
        if chosen is not None and chosen.shape[-1]
        else torch.full((1,), -1, dtype=torch.int32, device=v.device)  # read by no program: a real pointer all the same
    )
    pos = torch.full((b, MAX_SINKS), -1, dtype=torch.int32, device=v.device)
    pos[:, : sink_pos.shape[1]] = sink_pos.to(torch.int32)
    ell = None if query_log_scale is None else query_log_scale.contiguous()
    return _forward_op(
        q, k, v, phi_q, phi_k, gamma.contiguous(), ell, valid.float().contiguous(), linear.float().contiguous(), pos,
        picked, int(window), float(scale), int(block),
    )  # fmt: skip
