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
    """phi(x) in float32, (b, h, n, m). The constant and per-row terms of the exponent ride along as extra
    columns of x and w, so the exponent comes out of one matmul. Row-constant factors of phi(q) are dropped:
    they cancel in N / D."""
    xs = x * s
    if kernel == "relu":
        return torch.relu_(torch.matmul(xs, w.T)).add_(eps), xs
    ones = torch.ones_like(xs[..., :1])
    if is_query:  # w·x' + |w|²/2, then minus its row maximum
        u = torch.matmul(torch.cat([xs, ones], -1), torch.cat([w, half_w_sq[:, None]], -1).T)
        u.sub_(u.amax(dim=-1, keepdim=True))
    else:  # w·x' - |x'|²/2 - |w|²/2 = -|w - x'|²/2
        x_aug = torch.cat([xs, xs.pow(2).sum(-1, keepdim=True).mul_(-0.5), ones], -1)
        w_aug = torch.cat([w, torch.ones_like(half_w_sq)[:, None], -half_w_sq[:, None]], -1)
        u = torch.matmul(x_aug, w_aug.T)
    return u.exp_(), xs


def _feature_grad(dphi, phi, xs, w, s, kernel, is_query, eps):
    """Back through phi(x): returns dL/dx for dL/dphi."""
    if kernel == "relu":
        du = dphi.mul_(phi > eps)
        return torch.matmul(du, w).mul_(s)
    du = dphi.mul_(phi)
    if is_query:
        return torch.matmul(du, w).mul_(s)
    # keys: dx = du W - x' Σ_m du; the row sum rides along as an extra column of W
    dx_aug = torch.matmul(du, torch.cat([w, torch.ones_like(w[:, :1])], -1))
    return dx_aug[..., :-1].sub_(xs * dx_aug[..., -1:]).mul_(s)


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


def _to_chunks(x, nc, c):
    """(b, h, nc c, f) -> chunk-major (nc, b h, c, f), contiguous: every chunk's slice is one dense batch."""
    b, h, _, f = x.shape
    return x.unflatten(2, (nc, c)).permute(2, 0, 1, 3, 4).reshape(nc, b * h, c, f)


def _from_chunks(y, target):
    """Write chunk-major y (nc, b h, c, f) into target (b, h, nc c, f) (a view of the result)."""
    b, h, _, f = target.shape
    nc, _, c, _ = y.shape
    target.unflatten(2, (nc, c)).copy_(y.view(nc, b, h, c, f).permute(1, 2, 0, 3, 4))


class FavorCausal(torch.autograd.Function):
    """Chunked causal FAVOR+ (chunks of C positions), walked in blocks of about _CAUSAL_ROWS positions so that
    feature maps never exist for the whole sequence. Inside a block, tensors are chunk-major (nc, b h, C, .):
    the intra-chunk (triangular) parts of all chunks are batched, and the running state S = Σ phi(k) [v, 1]ᵀ is
    carried chunk by chunk with in-place batched GEMMs (baddbmm_) on dense slices, so no per-chunk prefix tensor
    is ever built. Forward saves the state at each block start; backward walks the blocks in reverse,
    rebuilding the state forward inside each block for dphi(Q) and carrying the gradient of the state backward
    for dphi(K) and dV. Also returns the final state (S, z), not differentiable."""

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
        state = torch.zeros(b * h, w.shape[0], d + 1, dtype=torch.float32, device=v.device)
        out = torch.empty(b, h, n + pad, d, dtype=torch.float32, device=v.device)
        den = torch.empty(b, h, n + pad, 1, dtype=torch.float32, device=v.device)
        blocks = _blocks(n + pad, c)
        starts = torch.empty(len(blocks), *state.shape, dtype=torch.float32, device=v.device)
        for index, rows in enumerate(blocks):
            starts[index] = state
            nc = (rows.stop - rows.start) // c
            keep_r = None if keep is None else _to_chunks(keep[:, :, rows].expand(b, h, -1, 1), nc, c)
            pk, _ = _features(_to_chunks(kf[:, :, rows].float(), nc, c), w, half_w_sq, s, kernel, False, eps)
            if keep_r is not None:
                pk.mul_(keep_r)
            pq, _ = _features(_to_chunks(qf[:, :, rows].float(), nc, c), w, half_w_sq, s, kernel, True, eps)
            va = _augment(_to_chunks(vf[:, :, rows].float(), nc, c), keep_r)
            num = torch.matmul(torch.matmul(pq, pk.transpose(-1, -2)).tril_(), va)  # (nc, b h, c, e)
            for j in range(nc):
                num[j].baddbmm_(pq[j], state)
                state.baddbmm_(pk[j].transpose(1, 2), va[j])
            den_r = num[..., -1:].clamp_min(_TINY)
            _from_chunks(den_r, den[:, :, rows])
            _from_chunks(num[..., :-1].div_(den_r), out[:, :, rows])
        ctx.save_for_backward(q, k, v, w, keep, starts, out, den)
        ctx.settings = (kernel, scale, eps, c, pad)
        state = state.view(b, h, *state.shape[1:])
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
        carry = torch.zeros_like(starts[0])  # d(loss)/d(state) from all later positions, (b h, m, e)
        blocks = _blocks(n + pad, c)
        for index in range(len(blocks) - 1, -1, -1):
            rows = blocks[index]
            nc = (rows.stop - rows.start) // c
            keep_r = None if keep is None else _to_chunks(keep[:, :, rows].expand(b, h, -1, 1), nc, c)
            gc = _to_chunks(_out_grad(gf[:, :, rows], out[:, :, rows], den[:, :, rows]), nc, c)
            va = _augment(_to_chunks(vf[:, :, rows].float(), nc, c), keep_r)
            pk, ks = _features(_to_chunks(kf[:, :, rows].float(), nc, c), w, half_w_sq, s, kernel, False, eps)
            if keep_r is not None:
                pk.mul_(keep_r)
            pq, qs = _features(_to_chunks(qf[:, :, rows].float(), nc, c), w, half_w_sq, s, kernel, True, eps)
            gv = torch.matmul(gc, va.transpose(-1, -2)).tril_()  # d(scores), (nc, b h, c, c)
            dphi_q = torch.matmul(gv, pk)
            state = starts[index].clone()
            for j in range(nc):  # forward through the block: the state before each chunk
                dphi_q[j].baddbmm_(gc[j], state.transpose(1, 2))
                state.baddbmm_(pk[j].transpose(1, 2), va[j])
            del state
            dv_aug = torch.matmul(torch.matmul(pq, pk.transpose(-1, -2)).tril_().transpose(-1, -2), gc)
            dphi_k = torch.matmul(gv.transpose(-1, -2), pq)
            del gv
            for j in range(nc - 1, -1, -1):  # backward through the block: the gradient of later chunks
                dv_aug[j].baddbmm_(pk[j], carry)
                dphi_k[j].baddbmm_(va[j], carry.transpose(1, 2))
                carry.baddbmm_(pq[j].transpose(1, 2), gc[j])
            _from_chunks(_feature_grad(dphi_q, pq, qs, w, s, kernel, True, eps), dq[:, :, rows])
            _from_chunks(_feature_grad(dphi_k, pk, ks, w, s, kernel, False, eps), dk[:, :, rows])
            dv_r = dv_aug[..., :-1]
            _from_chunks(dv_r if keep_r is None else dv_r * keep_r, dv[:, :, rows])
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
