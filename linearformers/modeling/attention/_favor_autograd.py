"""FAVOR+ forward and backward by hand: feature maps are recomputed in backward instead of stored.

Autograd through the plain formulation keeps several (n x m) tensors per head alive (projections, exp
outputs, masks), four to eight times the size of q. Here forward saves only q, k, v, the output, its
denominator and, for causal attention, the per-chunk prefix states (m x d each, n / C of them); backward
recomputes phi(q) and phi(k), one at a time. The denominator rides along as an extra column of v ([v, 1]), so
numerator and denominator come out of the same matmul.

Gradients, with out = N / D, N = phi(Q) (phi(K)ᵀ V), D = phi(Q) (phi(K)ᵀ 1), g = dL/dout:
    g_aug = [g / D, -(g · out) / D]                         (n x (d + 1))
    bidirectional: dphi(Q) = g_aug KVᵀ,  dKV = phi(Q)ᵀ g_aug,  dphi(K) = V_aug dKVᵀ,  dV = phi(K) dKV[:, :d]
    causal: the same, with prefix sums running forward for dphi(Q) and suffix sums running backward for
    dphi(K) and dV, each split into whole chunks and a triangular intra-chunk part.
Through the softmax features phi = exp(u + const), du = dphi * phi, and dx = s (du W - x' Σ_m du) for keys
(the -|x'|²/2 term); for queries the per-row terms cancel in out = N / D, so dx = s du W.
"""

from __future__ import annotations

import math

import torch

_TINY = 1e-30


def _features(x, w, half_w_sq, s, kernel, is_query, eps):
    """phi(x) in float32, (b, h, n, m). Row-constant factors of phi(q) are dropped: they cancel in N / D."""
    xs = x * s
    u = torch.matmul(xs, w.T)
    if kernel == "relu":
        return torch.relu_(u).add_(eps), xs
    if is_query:
        u.add_(half_w_sq)
        u.sub_(u.amax(dim=-1, keepdim=True))
    else:
        u.sub_(half_w_sq).sub_(0.5 * xs.pow(2).sum(-1, keepdim=True))
    return u.exp_(), xs


def _feature_grad(dphi, phi, xs, w, s, kernel, is_query, eps):
    """Back through phi(x): returns dL/dx for dL/dphi."""
    if kernel == "relu":
        du = dphi.mul_(phi > eps)
        return torch.matmul(du, w).mul_(s)
    du = dphi.mul_(phi)
    dx = torch.matmul(du, w)
    if not is_query:
        dx.sub_(xs * du.sum(-1, keepdim=True))
    return dx.mul_(s)


def _augment(v, keep):
    """[v, 1] with padded rows zeroed: (b, h, n, d + 1)."""
    ones = torch.ones_like(v[..., :1])
    v_aug = torch.cat([v, ones], dim=-1)
    return v_aug if keep is None else v_aug * keep


def _out_grad(g, out, den):
    # rows whose every visible key is padding have den clamped to _TINY and out = 0: they pass no gradient
    g_num = torch.where(den > _TINY, g / den, torch.zeros_like(g))
    return torch.cat([g_num, -(g_num * out).sum(-1, keepdim=True)], dim=-1)


_ROWS = 256  # bidirectional: feature maps are built this many positions at a time, never for the whole sequence


_CAUSAL_ROWS = 256  # causal: positions per block (a whole number of chunks); one saved state per block


def _row_slices(n):
    return [slice(i, min(i + _ROWS, n)) for i in range(0, n, _ROWS)]


class FavorBidirectional(torch.autograd.Function):
    """Bidirectional FAVOR+. Feature maps exist for at most _ROWS positions at a time, in forward and backward:
    extra memory O(_ROWS m) per head instead of O(n m)."""

    @staticmethod
    def forward(ctx, q, k, v, w, keep, kernel, scale, eps):
        s = math.sqrt(scale)
        half_w_sq = 0.5 * w.pow(2).sum(-1)
        n = k.shape[2]
        kv = None
        for rows in _row_slices(n):
            phi_k, _ = _features(k[:, :, rows].float(), w, half_w_sq, s, kernel, False, eps)
            keep_r = None if keep is None else keep[:, :, rows]
            if keep_r is not None:
                phi_k.mul_(keep_r)
            part = torch.matmul(phi_k.transpose(-1, -2), _augment(v[:, :, rows].float(), keep_r))
            kv = part if kv is None else kv.add_(part)  # (b, h, m, d + 1)
        out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        den = torch.empty(*q.shape[:3], 1, dtype=torch.float32, device=q.device)
        for rows in _row_slices(q.shape[2]):
            phi_q, _ = _features(q[:, :, rows].float(), w, half_w_sq, s, kernel, True, eps)
            num = torch.matmul(phi_q, kv)
            den[:, :, rows] = num[..., -1:].clamp_min(_TINY)
            out[:, :, rows] = num[..., :-1] / den[:, :, rows]
        ctx.save_for_backward(q, k, v, w, keep, kv, out, den)
        ctx.settings = (kernel, scale, eps)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, w, keep, kv, out, den = ctx.saved_tensors
        kernel, scale, eps = ctx.settings
        s = math.sqrt(scale)
        half_w_sq = 0.5 * w.pow(2).sum(-1)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dkv = None
        for rows in _row_slices(q.shape[2]):
            g_aug = _out_grad(g[:, :, rows].float(), out[:, :, rows], den[:, :, rows])
            phi_q, qs = _features(q[:, :, rows].float(), w, half_w_sq, s, kernel, True, eps)
            part = torch.matmul(phi_q.transpose(-1, -2), g_aug)  # (b, h, m, d + 1)
            dkv = part if dkv is None else dkv.add_(part)
            dphi_q = torch.matmul(g_aug, kv.transpose(-1, -2))
            dq[:, :, rows] = _feature_grad(dphi_q, phi_q, qs, w, s, kernel, True, eps)
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for rows in _row_slices(k.shape[2]):
            keep_r = None if keep is None else keep[:, :, rows]
            phi_k, ks = _features(k[:, :, rows].float(), w, half_w_sq, s, kernel, False, eps)
            if keep_r is not None:
                phi_k.mul_(keep_r)
            dv_r = torch.matmul(phi_k, dkv[..., :-1])
            dv[:, :, rows] = dv_r if keep_r is None else dv_r * keep_r
            dphi_k = torch.matmul(_augment(v[:, :, rows].float(), keep_r), dkv.transpose(-1, -2))
            dk[:, :, rows] = _feature_grad(dphi_k, phi_k, ks, w, s, kernel, False, eps)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _exclusive_prefix(writes, state):
    """prefix[j] = state + sum_{i<j} writes[j] along dim 2 (a few chunks per block: plain adds, no cumsum).
    Returns (prefix, state after the last chunk)."""
    prefix = torch.empty_like(writes)
    prefix[:, :, 0] = state
    for j in range(1, writes.shape[2]):
        torch.add(prefix[:, :, j - 1], writes[:, :, j - 1], out=prefix[:, :, j])
    return prefix, prefix[:, :, -1] + writes[:, :, -1]


def _exclusive_suffix(grads, carry):
    """suffix[j] = carry + sum_{i>j} grads[i] along dim 2. Returns (suffix, carry + sum of all grads)."""
    suffix = torch.empty_like(grads)
    last = grads.shape[2] - 1
    suffix[:, :, last] = carry
    for j in range(last - 1, -1, -1):
        torch.add(suffix[:, :, j + 1], grads[:, :, j + 1], out=suffix[:, :, j])
    return suffix, suffix[:, :, 0] + grads[:, :, 0]


def _chunks(x, nc, c):
    return x.view(*x.shape[:2], nc, c, x.shape[-1])


class FavorCausal(torch.autograd.Function):
    """Chunked causal FAVOR+ (chunks of C positions), walked in blocks of about _CAUSAL_ROWS positions so that
    feature maps never exist for the whole sequence. Saves the running state at each block start; backward
    walks the blocks in reverse, carrying the suffix sum. Also returns the final state (S, z), not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, w, keep, kernel, scale, eps, chunk):
        b, h, n, d = v.shape
        c = min(chunk, n)
        pad = (-n) % c
        s = math.sqrt(scale)
        half_w_sq = 0.5 * w.pow(2).sum(-1)
        if keep is not None:
            keep = torch.nn.functional.pad(keep, (0, 0, 0, pad))
        elif pad:
            keep = torch.ones(1, 1, n + pad, 1, device=v.device)
            keep[:, :, n:] = 0
        qf, kf, vf = (_pad_rows(t, pad) for t in (q, k, v))
        state = torch.zeros(b, h, w.shape[0], d + 1, dtype=torch.float32, device=v.device)
        out = torch.empty(b, h, n + pad, d, dtype=torch.float32, device=v.device)
        den = torch.empty(b, h, n + pad, 1, dtype=torch.float32, device=v.device)
        blocks = _blocks(n + pad, c)
        starts = torch.empty(len(blocks), *state.shape, dtype=torch.float32, device=v.device)
        for index, rows in enumerate(blocks):
            starts[index] = state
            keep_r = None if keep is None else keep[:, :, rows]
            phi_k, _ = _features(kf[:, :, rows].float(), w, half_w_sq, s, kernel, False, eps)
            if keep_r is not None:
                phi_k.mul_(keep_r)
            nc = phi_k.shape[2] // c
            pk = _chunks(phi_k, nc, c)
            va = _chunks(_augment(vf[:, :, rows].float(), keep_r), nc, c)
            prefix, state = _exclusive_prefix(torch.matmul(pk.transpose(-1, -2), va), state)  # (b, h, nc, m, d+1)
            phi_q, _ = _features(qf[:, :, rows].float(), w, half_w_sq, s, kernel, True, eps)
            pq = _chunks(phi_q, nc, c)
            scores = torch.matmul(pq, pk.transpose(-1, -2)).tril_()
            num = torch.matmul(scores, va).add_(torch.matmul(pq, prefix)).view(b, h, nc * c, d + 1)
            den_r = num[..., -1:].clamp_min(_TINY)
            den[:, :, rows] = den_r
            out[:, :, rows] = num[..., :-1].div_(den_r)
        ctx.save_for_backward(q, k, v, w, keep, starts, out, den)
        ctx.settings = (kernel, scale, eps, c, pad)
        state_s, state_z = state[..., :-1], state[..., -1]
        ctx.mark_non_differentiable(state_s, state_z)
        return out[:, :, :n].to(v.dtype), state_s, state_z

    @staticmethod
    def backward(ctx, g, _gs, _gz):
        q, k, v, w, keep, starts, out, den = ctx.saved_tensors
        kernel, scale, eps, c, pad = ctx.settings
        s = math.sqrt(scale)
        half_w_sq = 0.5 * w.pow(2).sum(-1)
        b, h, n, d = v.shape
        qf, kf, vf = (_pad_rows(t, pad) for t in (q, k, v))
        gf = _pad_rows(g, pad).float()
        dq = torch.empty(b, h, n + pad, d, dtype=torch.float32, device=v.device)
        dk = torch.empty_like(dq)
        dv = torch.empty_like(dq)
        carry = torch.zeros_like(starts[0])  # gradient reaching the state from all later blocks
        blocks = _blocks(n + pad, c)
        for index in range(len(blocks) - 1, -1, -1):
            rows = blocks[index]
            keep_r = None if keep is None else keep[:, :, rows]
            g_aug = _out_grad(gf[:, :, rows], out[:, :, rows], den[:, :, rows])
            nc = g_aug.shape[2] // c
            g_aug = _chunks(g_aug, nc, c)
            va = _chunks(_augment(vf[:, :, rows].float(), keep_r), nc, c)
            phi_k, ks = _features(kf[:, :, rows].float(), w, half_w_sq, s, kernel, False, eps)
            if keep_r is not None:
                phi_k.mul_(keep_r)
            pk = _chunks(phi_k, nc, c)
            prefix, _ = _exclusive_prefix(torch.matmul(pk.transpose(-1, -2), va), starts[index])
            # queries: dphi_q = g_aug Prefixᵀ + ((g_aug V_augᵀ) ⊙ tril) phi_k
            gv = torch.matmul(g_aug, va.transpose(-1, -2)).tril_()
            dphi_q = torch.matmul(g_aug, prefix.transpose(-1, -2)).add_(torch.matmul(gv, pk))
            del prefix
            phi_q, qs = _features(qf[:, :, rows].float(), w, half_w_sq, s, kernel, True, eps)
            pq = _chunks(phi_q, nc, c)
            # keys and values: the suffix of later chunks' phi_qᵀ g_aug, inside this block and after it
            suffix, carry = _exclusive_suffix(torch.matmul(pq.transpose(-1, -2), g_aug), carry)
            scores = torch.matmul(pq, pk.transpose(-1, -2)).tril_()
            dv_aug = torch.matmul(pk, suffix).add_(torch.matmul(scores.transpose(-1, -2), g_aug))
            dphi_k = torch.matmul(va, suffix.transpose(-1, -2)).add_(torch.matmul(gv.transpose(-1, -2), pq))
            del scores, gv, suffix
            length = nc * c
            dq[:, :, rows] = _feature_grad(dphi_q.view(b, h, length, -1), phi_q, qs, w, s, kernel, True, eps)
            dk[:, :, rows] = _feature_grad(dphi_k.view(b, h, length, -1), phi_k, ks, w, s, kernel, False, eps)
            dv_r = dv_aug.view(b, h, length, -1)[..., :-1]
            dv[:, :, rows] = dv_r if keep_r is None else dv_r * keep_r
        return (
            dq[:, :, :n].to(q.dtype),
            dk[:, :, :n].to(k.dtype),
            dv[:, :, :n].to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _blocks(length: int, c: int) -> list[slice]:
    """Consecutive blocks of a multiple of c positions, about _ROWS each, covering [0, length)."""
    step = c * max(1, _CAUSAL_ROWS // c)
    return [slice(i, min(i + step, length)) for i in range(0, length, step)]
