"""FAVOR+ forward and backward by hand, for the two kernels that fuse the FAVOR+ feature map into their products:
the blockwise bidirectional kernel (here) and the compiled causal CPU walk (_native, wrapped in _favor_native).

Autograd through the plain formulation keeps several (n x m) tensors per head alive (projections, exp
outputs, masks), four to eight times the size of q. Here forward saves only q, k, v, the output, its
denominator and a few states (the bidirectional sums, or the native walk's state at each block start); backward
recomputes phi(q) and phi(k) block by block. The denominator rides along as an extra column of v ([v, 1]), so
numerator and denominator come out of the same matmul. Blocks are worked in buffers allocated once per call: a
fresh allocation per block would cost page faults on every block.

Gradients, with out = N / D, N = phi(Q) (phi(K)ᵀ V), D = phi(Q) (phi(K)ᵀ 1), g = dL/dout:
    g_aug = [g / D, -(g · out) / D]                         (n x (d + 1))
    bidirectional: dphi(Q) = g_aug KVᵀ,  dKV = phi(Q)ᵀ g_aug,  dphi(K) = V_aug dKVᵀ,  dV = phi(K) dKV[:, :d]
    causal (the native walk): the same, with prefix sums running forward for dphi(Q) and suffix sums running
    backward for dphi(K) and dV, each split into whole chunks and a triangular intra-chunk part.
Through the softmax features phi = exp(u + const), du = dphi * phi, and dx = s (du W - x' Σ_m du) for keys
(the -|x'|²/2 term); for queries the per-row terms cancel in out = N / D, so dx = s du W. The feature formula is
:mod:`feature_maps`'s, rewritten as one GEMM and one exp2 (see _FeatureMap).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._precision import outside_autocast

_TINY = 1e-30
_LOG2E = 1.0 / math.log(2.0)
BIDIRECTIONAL_BLOCK = 256  # default positions per block of the bidirectional kernel: feature maps exist per block


class _FeatureMap:
    """phi for one call. sqrt(scale) is folded into W, and the constant and per-row terms of the exponent ride
    along as extra columns of x and W, so each feature map is one matmul and one exp2 (log2 e folded into W),
    built once per call:

        keys:    w·x' - |x'|²/2 - |w|²/2 = -|w - x'|²/2      x' = sqrt(scale) x
        queries: w·x' + |w|²/2, minus its row maximum       (row-constant factors cancel in N / D)
    """

    def __init__(self, w, scale, feature_map, eps, key_offset=False):
        self.feature_map, self.eps, self.scale = feature_map, eps, scale
        self.ws = w * math.sqrt(scale)  # (m, d)
        half_w_sq = 0.5 * w.pow(2).sum(-1, keepdim=True)
        if feature_map == "relu":  # the same map for queries and keys, with no per-row or constant terms
            zeros = torch.zeros_like(half_w_sq)
            self.wq = torch.cat([self.ws, zeros], -1).T.contiguous()
            self.wk = torch.cat([self.ws, zeros, zeros] + [zeros] * key_offset, -1).T.contiguous()
            self.wk_grad = torch.cat([self.ws, zeros], -1)
            return
        ones = torch.ones_like(half_w_sq)
        # in base 2, exp(u) = 2^(u log2 e): exp2 runs ~1.5x faster than exp on CPU, and the factor rides in W
        self.wq = (torch.cat([self.ws, half_w_sq], -1) * _LOG2E).T.contiguous()  # (d + 1, m)
        # (d + 2, m), and with key_offset a last row that takes the offset (log2 units) off inside the GEMM
        wk = [torch.cat([self.ws, ones, -half_w_sq], -1) * _LOG2E] + [-ones] * key_offset
        self.wk = torch.cat(wk, -1).T.contiguous()
        self.wk_grad = torch.cat([self.ws, ones], -1)  # (m, d + 1): the last column sums du over m

    def into(self, x_aug, out, is_query, adjust=None):
        """phi into ``out`` (..., m) from an augmented x: [x, 1] for queries, [x, -scale |x|²/2, 1, offset] for
        keys (the offset, in log2 units, is subtracted by the GEMM). ``adjust`` (keys): called on the exponents
        before exp2, may shift them further in place."""
        u = torch.matmul(x_aug, self.wq if is_query else self.wk, out=out)
        if self.feature_map == "relu":
            return torch.relu_(u).add_(self.eps)
        if is_query:
            u.sub_(u.amax(dim=-1, keepdim=True))
        elif adjust is not None:
            adjust(u)
        return u.exp2_()

    def grad_into(self, dphi, phi, x_aug, out, is_query):
        """Back through phi into ``out``: (..., d) for queries, (..., d + 1) for keys, whose first d columns
        are dL/dx. dphi is overwritten."""
        du = dphi.mul_(phi > self.eps) if self.feature_map == "relu" else dphi.mul_(phi)
        if is_query:
            return torch.matmul(du, self.ws, out=out)
        torch.matmul(du, self.wk_grad, out=out)
        if self.feature_map != "relu":
            d = out.shape[-1] - 1
            out[..., :d].addcmul_(x_aug[..., :d], out[..., d:], value=-self.scale)
        return out


def _row_slices(n, rows):
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _inverse(den):
    """1 / D, and 0 for rows whose every visible key is padding (D clamped to _TINY, out = 0): they pass no
    gradient."""
    return torch.where(den > _TINY, den.reciprocal(), torch.zeros_like(den))


class _BlockWork:
    """_Work for the bidirectional walk: blocks of block_size positions (one "chunk" each), plus one for a shorter
    last block."""

    def __init__(self, b, h, d, m, device, backward=False):
        self.args = (b, h, d, m, device, backward)
        self.works = {}

    def __call__(self, rows):
        r = rows.stop - rows.start
        if r not in self.works:
            b, h, d, m, device, backward = self.args
            self.works[r] = _Work(b, h, d, m, r, 1, device, backward, key_offset=True)  # keys take a running offset
        return self.works[r]


def _row_max(u, key_weights):
    """Largest exponent of each key row, -inf for padded keys."""
    top = u.amax(dim=-1, keepdim=True)
    return top if key_weights is None else top.masked_fill(key_weights == 0, -math.inf)


def _finite_or_zero(seen):
    return torch.where(torch.isfinite(seen), seen, torch.zeros_like(seen))


def _rescale(before, after):
    """2^(before - after): the factor that moves sums kept relative to maximum ``before`` to ``after`` (<= 1);
    1 while no real key was seen (the sums are still 0, and 2^(0 - after) could overflow)."""
    return torch.where(torch.isfinite(before), torch.exp2(before - after), torch.ones_like(after))


class _RunningMax:
    """The bidirectional walk's key offset: the largest key exponent seen so far per (batch, head), over real
    keys, in log2 units. Every key feature is exp(-|w - x'|² / 2) <= 1, and keys of large norm (|k| scale^½
    beyond ~15) drive all of them below float32's range; a constant per (batch, head) cancels in N / D, so
    the exponents are taken relative to the running maximum and the sums kept so far are rescaled when it
    grows (as flash attention does for softmax). Backward recomputes the features with the final offset."""

    def __init__(self, rows, kv):
        self.kv = kv
        self.seen = torch.full((1, rows, 1, 1), -math.inf, dtype=torch.float32, device=kv.device)
        self.offset = torch.zeros_like(self.seen)  # taken off by the GEMM: the maximum, or 0 while no real key

    def __call__(self, u, key_weights):
        """u: a block's exponents minus the current offset. Moves the offset when the block changes the maximum
        (on CPU only then: most blocks do not, and the GEMM already took the offset off). The walk hands the new
        offset to each block's work space before its GEMM."""
        seen = torch.maximum(self.seen, _row_max(u, key_weights).amax(dim=-2, keepdim=True) + self.offset)
        offset = _finite_or_zero(seen)
        if u.device.type != "cpu" or bool((offset != self.offset).any()):
            u.sub_(offset - self.offset)
            self.kv.mul_(_rescale(self.seen, seen).view(-1, 1, 1))
            self.offset = offset
        self.seen = seen


class FavorBidirectional(torch.autograd.Function):
    """Bidirectional FAVOR+. Feature maps exist for at most ``rows`` positions at a time, in forward and backward:
    extra memory O(rows m) per head instead of O(n m), in buffers reused block after block."""

    @staticmethod
    def forward(ctx, q, k, v, w, key_weights, feature_map, scale, eps, rows):
        phi = _FeatureMap(w, scale, feature_map, eps, key_offset=True)
        b, h, n, d = q.shape
        m = w.shape[0]
        kv = torch.zeros(b * h, m, d + 1, dtype=torch.float32, device=v.device)
        work = _BlockWork(b, h, d, m, v.device)
        shift = _RunningMax(b * h, kv) if feature_map != "relu" else None
        block = rows
        for rows in _row_slices(k.shape[2], block):
            wr = work(rows)
            if shift is not None:
                wr.set_offset(shift.offset)
            pk, va, _ = wr.keys(phi, k, v, key_weights, rows, 1, shift)
            kv.baddbmm_(pk[0].transpose(1, 2), va[0])
        offset = None if shift is None else shift.offset
        out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        den = torch.empty(*q.shape[:3], 1, dtype=torch.float32, device=q.device)
        for rows in _row_slices(n, block):
            wr = work(rows)
            num = torch.matmul(wr.queries(phi, q, rows, 1), kv, out=wr.num[:1])
            den_r = num[..., -1:].clamp_min(_TINY)
            _from_chunks(den_r, den[:, :, rows])
            _from_chunks(num[..., :-1].div_(den_r), out[:, :, rows])
        ctx.save_for_backward(q, k, v, w, key_weights, kv, out, den, offset)
        ctx.settings = (feature_map, scale, eps, block)
        return out.to(v.dtype)

    @staticmethod
    @once_differentiable  # backward is hand-written with in-place ops: a second derivative is refused, not wrong
    @outside_autocast  # loss.backward() may be called inside autocast
    def backward(ctx, g):
        q, k, v, w, key_weights, kv, out, den, offset = ctx.saved_tensors
        feature_map, scale, eps, block = ctx.settings
        phi = _FeatureMap(w, scale, feature_map, eps, key_offset=True)
        b, h, n, d = q.shape
        work = _BlockWork(b, h, d, w.shape[0], v.device, backward=True)
        inv = _inverse(den)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros_like(kv)
        for rows in _row_slices(n, block):
            wr = work(rows)
            gc = wr.out_grad(g, out, inv, rows, 1)
            pq = wr.queries(phi, q, rows, 1)
            dkv.baddbmm_(pq[0].transpose(1, 2), gc[0])
            dphi = torch.matmul(gc, kv.transpose(-1, -2), out=wr.dphi[:1])
            _from_chunks(phi.grad_into(dphi, pq, None, wr.scratch[:1], True), dq[:, :, rows])
        dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for rows in _row_slices(k.shape[2], block):
            wr = work(rows)
            if offset is not None:
                wr.set_offset(offset)
            pk, va, key_weights_r = wr.keys(phi, k, v, key_weights, rows, 1)
            dv_r = torch.matmul(pk, dkv[..., :-1], out=wr.scratch[:1])
            _from_chunks(dv_r if key_weights_r is None else dv_r.mul_(key_weights_r), dv[:, :, rows])
            dphi = torch.matmul(va, dkv.transpose(-1, -2), out=wr.dphi[:1])
            dk_r = phi.grad_into(dphi, pk, wr.xk[:1], wr.dx[:1], False)[..., :d]
            _from_chunks(dk_r, dk[:, :, rows])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _to_chunks(x, nc, c):
    """(b, h, nc c, f) -> chunk-major (nc, b h, c, f), contiguous: every chunk's slice is one dense batch."""
    b, h, _, f = x.shape
    return x.unflatten(2, (nc, c)).permute(2, 0, 1, 3, 4).reshape(nc, b * h, c, f)


def _from_chunks(y, target):
    """Write chunk-major y (nc, b h, c, f) into target (b, h, nc c, f) (a view of the result)."""
    b, h, _, f = target.shape
    nc, _, c, _ = y.shape
    target.unflatten(2, (nc, c)).copy_(y.view(nc, b, h, c, f).permute(1, 2, 0, 3, 4))


class _Work:
    """Chunk-major work space of the blockwise kernel for one block, (nc, b h, C, .), allocated once per call and
    reused block after block: fresh allocations of this size cost page faults on every block."""

    def __init__(self, b, h, d, m, c, nc, device, backward=False, key_offset=False):
        new = lambda f: torch.empty(nc, b * h, c, f, dtype=torch.float32, device=device)  # noqa: E731
        self.b, self.h, self.d, self.c = b, h, d, c
        self.xq, self.xk, self.va = new(d + 1), new(d + 2 + key_offset), new(d + 1)
        self.xq[..., d] = 1
        self.xk[..., d : d + 2] = 1
        if key_offset:
            self.xk[..., d + 2] = 0  # 0 until set_offset
        self.pq, self.pk = new(m), new(m)
        if backward:
            self.gc, self.scratch, self.dx, self.dphi = new(d + 1), new(d), new(d + 1), new(m)
        else:
            self.num = new(d + 1)
        self._each = {}

    def load(self, buf, x, rows, nc):
        """Copy rows of x (b, h, L, f) into the first nc chunks of buf, chunk-major, as float32."""
        f = x.shape[-1]
        view = buf[:nc, ..., :f].unflatten(1, (self.b, self.h))  # (nc, b, h, c, f)
        view.copy_(x[:, :, rows].unflatten(2, (nc, self.c)).permute(2, 0, 1, 3, 4))
        return buf[:nc]

    def chunks(self, x, rows, nc):
        """Rows of a (b|1, h|1, L, 1) tensor as chunk-major (nc, b h, c, 1) (small: one column)."""
        return _to_chunks(x[:, :, rows].expand(self.b, self.h, -1, 1), nc, self.c)

    def set_offset(self, offset):
        """Take (b h,) key offsets (log2 units) off every key exponent from now on, inside the feature GEMM."""
        self.xk[..., self.d + 2] = offset.view(1, -1, 1)

    def keys(self, phi, k, v, key_weights, rows, nc, adjust=None):
        """phi(k) (padded keys zeroed), [v, 1] (padded rows zeroed) and the chunk-major mask for one block.
        ``adjust``: see _FeatureMap.into; called as adjust(exponents, mask)."""
        d = self.d
        xk = self.load(self.xk, k, rows, nc)
        if phi.feature_map != "relu":
            xk[..., d : d + 1] = torch.linalg.vector_norm(xk[..., :d], dim=-1, keepdim=True).square_()
            xk[..., d : d + 1] *= -0.5 * phi.scale
        key_weights_r = None if key_weights is None else self.chunks(key_weights, rows, nc)

        def exponents(u):
            if adjust is not None:
                adjust(u, key_weights_r)
            if key_weights_r is not None:  # before exp2: a padded key may sit far above the real keys' offset (inf x 0)
                u.masked_fill_(key_weights_r == 0, -math.inf)

        pk = phi.into(xk, self.pk[:nc], False, exponents)
        va = self.load(self.va, v, rows, nc)
        if key_weights is not None:
            if phi.feature_map == "relu":  # bounded features: zeroed after the map
                pk.mul_(key_weights_r)
            va[..., :d].mul_(key_weights_r)
            va[..., d:] = key_weights_r
        else:
            va[..., d] = 1
        return pk, va, key_weights_r

    def queries(self, phi, q, rows, nc):
        return phi.into(self.load(self.xq, q, rows, nc), self.pq[:nc], True)

    def out_grad(self, g, out, inv, rows, nc):
        """g_aug = [g / D, -(g · out) / D] for one block; inv = 1 / D, 0 where every visible key is padding."""
        d = self.d
        gc = self.load(self.gc, g, rows, nc)
        gc[..., :d].mul_(self.chunks(inv, rows, nc))
        scratch = self.load(self.scratch, out, rows, nc).mul_(gc[..., :d])
        torch.sum(scratch, -1, keepdim=True, out=gc[..., d:]).neg_()
        return gc
