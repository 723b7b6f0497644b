// Bidirectional sliding-window softmax + linear attention inside one head (ops/hybrid.py's module docstring), forward
// only, on the CPU: the inference of an encoder over a long document. One (batch, head) row at a time per thread, in
// blocks of BLK queries, every product in tile.h's GEMM on operands that stay in L1/L2:
//   1. per key block: its features phi_k^T (m x BLK; given, or Hedgehog's map made here with the learned key scale),
//      zero for keys outside the linear part (padding, sinks), and its sums phi_k^T [v, 1];
//   2. walking the blocks backward, the suffix states: for block c, the sums of the blocks from c + side + 1 on;
//   3. walking forward with the prefix of the blocks up to c - side - 1, per query block: its features phi_q^T (and
//      l_t, given or made here), its linear scores on every key outside its frame through prefix + suffix (one
//      product), its linear scores on the frame blocks that hold keys outside some of its queries' windows (masked to
//      those keys), and its exact window scores against the frame (masked to each query's window and the real keys)
//      with the sinks it sees outside its window; then the stabilized sum of the parts, normalized.
// The frame of block c is the key blocks c - side .. c + side, side = ceil((w - 1) / BLK): every key of its queries'
// windows. Scores are made transposed (keys x queries) and features as (m x BLK) blocks, so that the masks, maxima,
// exponentials and Hedgehog's softmaxes run eight positions at a time with no horizontal reductions, and every
// product reads its operands in place through strides (q, k, v as the model's strided views).
// The stabilizer is the definition's c'_t = max(c_t, l_t - R) (c_t the largest window or sink logit, 0 where there
// is none); without l the linear scores are taken as they are. The PyTorch core (_hybrid_core) computes the same
// outputs on every device and is what the tests hold this walk to, with the quadratic reference.
#include "tile.h"

namespace {

constexpr int BLK = 32;  // queries per block; key blocks have the same size

inline int round_up(int x) { return (x + NR - 1) / NR * NR; }

// lanes of the queries t0 + tg .. t0 + tg + 7 within distance < window of key s: all ones where so
inline __m256 near_mask(int t0, int tg, int s, int window) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i dist = _mm256_abs_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(t0 + tg - s)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(window), dist));
}

// rows 0 .. rows - 1 of x (row stride xr, K wide, K a multiple of 8) as B = x^T (K x BLK) packed in panels of NR
// (pack_b's layout), columns past rows 0: eight rows at a time through an 8 x 8 transpose in registers
void pack_rows_t(const float* x, long xr, int rows, int K, float* dst) {
  for (int j0 = 0; j0 < BLK; j0 += 8) {
    float* panel = dst + (long)(j0 / NR) * K * NR + j0 % NR;
    for (int kk = 0; kk < K; kk += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; i++) r[i] = j0 + i < rows ? _mm256_loadu_ps(x + (j0 + i) * xr + kk) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                           _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                           _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                           _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int k = 0; k < 8; k++) _mm256_storeu_ps(panel + (long)(kk + k) * NR, c[k]);
    }
  }
}

struct Row {  // one (batch, head) row's inputs
  const float *q, *k, *v, *ell, *valid, *linear, *sink_k, *sink_v, *sink_valid;
  const int64_t *sink_pos, *chosen;  // chosen: (nb, picks) key blocks per query block, -1 for none; or null
  long qr, kr, vr;  // the row strides of q, k, v
  float gamma;
};

struct Scratch {
  float *sv, *sz, *fv, *fz;  // per key block: its sums; the suffix states of the query block
  float *pkt;                // per key block, phi_k^T (m x BLK), linear keys only (the others' columns 0)
  float *pre_v, *pre_z, *wv, *wz, *bpack, *xt, *pqt, *lt, *et, *lin, *lden, *num, *cm, *slog, *dw, *ut, *dots, *ellb;
  float* sel;  // the chosen far blocks' logits, then weights, (keys x queries) per block
};

// Hedgehog's map, one block: x^T packed (d x BLK, from pack_rows_t) -> phi^T (m x BLK): u^T = W^T x^T + b (W^T read
// in place from W, d x m / 2 row-major), then per column (position) [softmax(u), softmax(-u)] times factor[t]
// (null: 1), eight positions at a time. ut: (round_up(m / 2) x BLK) scratch.
void hedgehog_block(const float* xt, const float* wt, const float* bias, const float* factor, int d, int m,
                    float* ut, float* phit) {
  const int half = m / 2;
  const __m256 l2e = _mm256_set1_ps(LOG2E);
  gemm_pb(half, BLK, d, wt, 1, half, xt, ut, BLK, false);
  for (int tg = 0; tg < BLK; tg += 8) {
    __m256 hi = _mm256_set1_ps(-INFINITY), lo = _mm256_set1_ps(INFINITY);
    for (int j = 0; j < half; j++) {
      const __m256 x = _mm256_add_ps(_mm256_loadu_ps(ut + j * BLK + tg), _mm256_set1_ps(bias[j]));
      _mm256_storeu_ps(ut + j * BLK + tg, x);
      hi = _mm256_max_ps(hi, x);
      lo = _mm256_min_ps(lo, x);
    }
    __m256 s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps();
    for (int j = 0; j < half; j++) {
      const __m256 x = _mm256_loadu_ps(ut + j * BLK + tg);
      const __m256 e1 = exp2_ps_bounded(_mm256_mul_ps(_mm256_sub_ps(x, hi), l2e));
      const __m256 e2 = exp2_ps_bounded(_mm256_mul_ps(_mm256_sub_ps(lo, x), l2e));
      _mm256_storeu_ps(phit + j * BLK + tg, e1);
      _mm256_storeu_ps(phit + (half + j) * BLK + tg, e2);
      s1 = _mm256_add_ps(s1, e1);
      s2 = _mm256_add_ps(s2, e2);
    }
    const __m256 f = factor ? _mm256_loadu_ps(factor + tg) : _mm256_set1_ps(1.0f);
    const __m256 f1 = _mm256_div_ps(f, s1), f2 = _mm256_div_ps(f, s2);
    for (int j = 0; j < half; j++) {
      _mm256_storeu_ps(phit + j * BLK + tg, _mm256_mul_ps(_mm256_loadu_ps(phit + j * BLK + tg), f1));
      float* second = phit + (half + j) * BLK + tg;
      _mm256_storeu_ps(second, _mm256_mul_ps(_mm256_loadu_ps(second), f2));
    }
  }
}

// given features, one block: rows t0 .. t0 + rows - 1 of phi (n x m) -> phi^T (m x BLK) times factor[t] (null: 1),
// columns past rows 0
void transpose_block(const float* phi, int rows, int m, const float* factor, float* phit) {
  for (int i = 0; i < m; i++)
    for (int t = 0; t < BLK; t++) phit[i * BLK + t] = t < rows ? phi[(long)t * m + i] * (factor ? factor[t] : 1.0f) : 0.0f;
}

// x = exp(R tanh(x / R)) times keep, eight at a time (BLK values), tanh(y) = 1 - 2 / (e^2y + 1)
void bounded_exp(float* x, const float* keep, float bound) {
  const __m256 two_l2e = _mm256_set1_ps(2.0f * LOG2E / bound), r_l2e = _mm256_set1_ps(bound * LOG2E);
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  for (int t = 0; t < BLK; t += 8) {
    const __m256 e = exp2_ps(_mm256_mul_ps(_mm256_loadu_ps(x + t), two_l2e));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    _mm256_storeu_ps(x + t, _mm256_mul_ps(_mm256_loadu_ps(keep + t), exp2_ps(_mm256_mul_ps(th, r_l2e))));
  }
}

struct Maps {  // map_code 1's weights for this head, or nulls; the learned scales' (a, b), or nulls
  const float *wq, *bq, *wk, *bk, *qa, *ka;
  float qb, kb, bound;
};

// 1. per key block j: phi_k^T into pkt (linear keys only), sv_j = phi_k^T v (m x d), sz_j = phi_k's column sums (m)
void key_blocks(const Row& r, const Maps& f, const float* pk, const float* linear,
                const Scratch& w, int n, int d, int m, int nb) {
  const long md = (long)m * d, mb = (long)m * BLK;
  for (int j = 0; j < nb; j++) {
    const int s0 = j * BLK, nk = n - s0 < BLK ? n - s0 : BLK;
    float* keep = w.dots + BLK;  // the keys' factors: linear (0 / 1), times exp(r_s) with the key scale
    for (int t = 0; t < BLK; t++) keep[t] = t < nk ? linear[s0 + t] : 0.0f;
    float* phit = w.pkt + j * mb;
    if (f.wk) {
      pack_rows_t(r.k + s0 * r.kr, r.kr, nk, d, w.xt);  // k^T, K = d, N = BLK
      if (f.ka) {
        gemm_pb(1, BLK, d, f.ka, 0, 1, w.xt, w.dots, BLK, false);
        for (int t = 0; t < BLK; t++) w.dots[t] += f.kb;
        bounded_exp(w.dots, keep, f.bound);
        memcpy(keep, w.dots, sizeof(float) * BLK);
      }
      hedgehog_block(w.xt, f.wk, f.bk, keep, d, m, w.ut, phit);
    } else {
      transpose_block(pk + (long)s0 * m, nk, m, keep, phit);
    }
    gemm(m, d, nk, phit, BLK, 1, r.v + s0 * r.vr, r.vr, 1, w.sv + j * md, d, false, w.bpack);
    for (int i = 0; i < m; i++) w.sz[(long)j * m + i] = sum(phit + i * BLK, BLK);
  }
}

// 2. fv_c, fz_c: the sums of the key blocks from c + side + 1 on (zero for the last blocks)
void suffix_states(const Scratch& w, int d, int m, int nb, int side) {
  const long md = (long)m * d;
  memset(w.fv + (nb - 1) * md, 0, sizeof(float) * md);
  memset(w.fz + (long)(nb - 1) * m, 0, sizeof(float) * m);
  for (int c = nb - 2; c >= 0; c--) {
    const int src = c + side + 1;
    float *fv = w.fv + c * md, *fz = w.fz + (long)c * m;
    const float *nv = fv + md, *nz = fz + m;
    if (src < nb) {
      const float *sv = w.sv + src * md, *sz = w.sz + (long)src * m;
      for (long i = 0; i < md; i++) fv[i] = nv[i] + sv[i];
      for (int i = 0; i < m; i++) fz[i] = nz[i] + sz[i];
    } else {
      memcpy(fv, nv, sizeof(float) * md);
      memcpy(fz, nz, sizeof(float) * m);
    }
  }
}

// 3. one query block c: out rows t0 .. t0 + nq - 1
void query_block(const Row& r, const Maps& f, const float* pq, const Scratch& w, float* out, long out_row, float* lse,
                 int c, int n, int d, int m, int nb, int side, int window, int sinks, int picks, float scale,
                 float headroom) {
  const long md = (long)m * d, mb = (long)m * BLK;
  const int t0 = c * BLK, nq = n - t0 < BLK ? n - t0 : BLK;
  pack_rows_t(r.q + t0 * r.qr, r.qr, nq, d, w.xt);  // q^T, K = d, N = BLK
  const float* ell = nullptr;  // the block's l_t, BLK of them (0 past nq), in ellb
  if (f.qa) {  // l_t = q_t . a + b
    gemm_pb(1, BLK, d, f.qa, 0, 1, w.xt, w.ellb, BLK, false);
    for (int t = 0; t < BLK; t++) w.ellb[t] += f.qb;
    ell = w.ellb;
  } else if (r.ell) {
    for (int t = 0; t < BLK; t++) w.ellb[t] = t < nq ? r.ell[t0 + t] : 0.0f;
    ell = w.ellb;
  }
  if (f.wq)
    hedgehog_block(w.xt, f.wq, f.bq, nullptr, d, m, w.ut, w.pqt);
  else
    transpose_block(pq + (long)t0 * m, nq, m, nullptr, w.pqt);
  // the keys outside the frame: phi_q (prefix + suffix)
  for (long i = 0; i < md; i++) w.wv[i] = w.pre_v[i] + w.fv[c * md + i];
  for (int i = 0; i < m; i++) w.wz[i] = w.pre_z[i] + w.fz[(long)c * m + i];
  // the chosen far blocks leave the linear part: they lie outside the frame, so in the state, whose sums they
  // give back (ops/far_blocks.py)
  const int64_t* chosen = r.chosen ? r.chosen + (long)c * picks : nullptr;
  for (int i = 0; chosen && i < picks; i++) {
    if (chosen[i] < 0) continue;
    const float* bv = w.sv + chosen[i] * md;
    const float* bz = w.sz + chosen[i] * m;
    for (long e = 0; e < md; e++) w.wv[e] -= bv[e];
    for (int e = 0; e < m; e++) w.wz[e] -= bz[e];
  }
  gemm(nq, d, m, w.pqt, 1, BLK, w.wv, d, 1, w.lin, d, false, w.bpack);
  {
    __m256 acc[BLK / 8];
    for (int tg = 0; tg < BLK / 8; tg++) acc[tg] = _mm256_setzero_ps();
    for (int i = 0; i < m; i++) {
      const __m256 zi = _mm256_set1_ps(w.wz[i]);
      for (int tg = 0; tg < BLK / 8; tg++)
        acc[tg] = _mm256_fmadd_ps(zi, _mm256_loadu_ps(w.pqt + i * BLK + 8 * tg), acc[tg]);
    }
    for (int tg = 0; tg < BLK / 8; tg++) _mm256_storeu_ps(w.lden + 8 * tg, acc[tg]);
  }
  // the frame blocks holding keys outside some query's window: their linear scores on those keys alone
  bool packed = false;
  const int j0 = c - side > 0 ? c - side : 0, j1 = c + side < nb - 1 ? c + side : nb - 1;
  for (int j = j0; j <= j1; j++) {
    const int off = j > c ? j - c : c - j;
    if (off * BLK + BLK - 1 < window) continue;  // every key of block j is in every query's window
    if (!packed) {
      pack_b(w.pqt, BLK, 1, m, BLK, w.bpack);  // phi_q^T as B, K = m, N = BLK
      packed = true;
    }
    const int s0 = j * BLK, nk = n - s0 < BLK ? n - s0 : BLK;
    gemm_pb(nk, BLK, m, w.pkt + j * mb, 1, BLK, w.bpack, w.et, BLK, false);  // (keys x queries)
    for (int s = 0; s < nk; s++) {
      float* row = w.et + (long)s * BLK;
      for (int tg = 0; tg < BLK; tg += 8) {
        const __m256 x = _mm256_andnot_ps(near_mask(t0, tg, s0 + s, window), _mm256_loadu_ps(row + tg));
        _mm256_storeu_ps(row + tg, x);
        _mm256_storeu_ps(w.lden + tg, _mm256_add_ps(_mm256_loadu_ps(w.lden + tg), x));
      }
    }
    gemm(nq, d, nk, w.et, 1, BLK, r.v + s0 * r.vr, r.vr, 1, w.lin, d, true, w.bpack + m * BLK);
  }
  // the window: exact logits against the frame, (keys x queries), times scale
  const int f0 = j0 * BLK, f1 = (j1 + 1) * BLK < n ? (j1 + 1) * BLK : n, nf = f1 - f0;
  gemm_pb(nf, BLK, d, r.k + f0 * r.kr, r.kr, 1, w.xt, w.lt, BLK, false);
  float* sink_max = w.ellb + 2 * BLK;
  for (int t = 0; t < BLK; t++) w.cm[t] = sink_max[t] = -INFINITY;
  for (int t = 0; t < nq; t++) {  // the sinks each query sees outside its window
    const int pos = t0 + t;
    for (int i = 0; i < sinks; i++) {
      const long dist = pos - r.sink_pos[i];
      const bool sees = r.sink_valid[i] != 0.0f && (dist >= window || -dist >= window);
      const float x = sees ? scale * dot(r.q + pos * r.qr, r.sink_k + (long)i * d, d) : -INFINITY;
      w.slog[t * sinks + i] = x;
      sink_max[t] = x > sink_max[t] ? x : sink_max[t];
    }
  }
  // the largest window logit of each query, unscaled (scale > 0): rows whose key is in every query's window need
  // no mask, groups of eight queries that all lie too far from the key are skipped
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  const int all_in0 = t0 + BLK - window, all_in1 = t0 + window - 1;  // keys in [all_in0, all_in1]: in every window
  for (int s = 0; s < nf; s++) {
    if (r.valid[f0 + s] == 0.0f) continue;
    const float* row = w.lt + (long)s * BLK;
    const bool all_in = f0 + s >= all_in0 && f0 + s <= all_in1;
    for (int tg = 0; tg < BLK; tg += 8) {
      __m256 x = _mm256_loadu_ps(row + tg);
      if (!all_in) {
        const __m256 near = near_mask(t0, tg, f0 + s, window);
        if (_mm256_testz_ps(near, near)) continue;
        x = _mm256_blendv_ps(minus_inf, x, near);
      }
      _mm256_storeu_ps(w.cm + tg, _mm256_max_ps(_mm256_loadu_ps(w.cm + tg), x));
    }
  }
  // the chosen far blocks' exact logits (keys x queries), their linear keys' into the largest logit too
  for (int i = 0; chosen && i < picks; i++) {
    if (chosen[i] < 0) continue;
    const int s0 = (int)chosen[i] * BLK, nk = n - s0 < BLK ? n - s0 : BLK;
    float* block = w.sel + (long)i * BLK * BLK;
    gemm_pb(nk, BLK, d, r.k + s0 * r.kr, r.kr, 1, w.xt, block, BLK, false);
    for (int s = 0; s < nk; s++) {
      if (r.linear[s0 + s] == 0.0f) continue;
      for (int tg = 0; tg < BLK; tg += 8)
        _mm256_storeu_ps(w.cm + tg, _mm256_max_ps(_mm256_loadu_ps(w.cm + tg), _mm256_loadu_ps(block + s * BLK + tg)));
    }
  }
  // c'_t into cm; the window's weights are exp(scale x - c'_t + log gamma) = 2^(x scale log2 e - shift_t), shift_t
  // in ut
  const float log2_gamma = r.gamma > 0.0f ? log2f(r.gamma) : -INFINITY;
  for (int t = 0; t < BLK; t++) {
    float cc = fmaxf(scale * w.cm[t], sink_max[t]);  // -inf stays -inf
    cc = isfinite(cc) ? cc : 0.0f;
    if (ell && t < nq) cc = fmaxf(cc, ell[t] - headroom);
    w.cm[t] = cc;
    w.ut[t] = cc * LOG2E - log2_gamma;  // +inf where gamma is 0: weights 0
    w.dw[t] = 0.0f;
  }
  const __m256 l2e = _mm256_set1_ps(LOG2E), scale_l2e = _mm256_set1_ps(scale * LOG2E), zero = _mm256_setzero_ps();
  for (int s = 0; s < nf; s++) {
    float* row = w.lt + (long)s * BLK;
    if (r.valid[f0 + s] == 0.0f) {
      memset(row, 0, sizeof(float) * BLK);
      continue;
    }
    const bool all_in = f0 + s >= all_in0 && f0 + s <= all_in1;
    for (int tg = 0; tg < BLK; tg += 8) {
      const __m256 u = _mm256_fmsub_ps(_mm256_loadu_ps(row + tg), scale_l2e, _mm256_loadu_ps(w.ut + tg));
      __m256 p;
      if (all_in) {
        p = exp2_ps_bounded(u);
      } else {
        const __m256 near = near_mask(t0, tg, f0 + s, window);
        p = _mm256_testz_ps(near, near) ? zero : _mm256_and_ps(exp2_ps_bounded(u), near);
      }
      _mm256_storeu_ps(row + tg, p);
      _mm256_storeu_ps(w.dw + tg, _mm256_add_ps(_mm256_loadu_ps(w.dw + tg), p));
    }
  }
  gemm(nq, d, nf, w.lt, 1, BLK, r.v + f0 * r.vr, r.vr, 1, w.num, d, false, w.bpack);
  for (int i = 0; chosen && i < picks; i++) {  // the chosen blocks' weights, as the window's
    if (chosen[i] < 0) continue;
    const int s0 = (int)chosen[i] * BLK, nk = n - s0 < BLK ? n - s0 : BLK;
    float* block = w.sel + (long)i * BLK * BLK;
    for (int s = 0; s < nk; s++) {
      float* row = block + (long)s * BLK;
      if (r.linear[s0 + s] == 0.0f) {  // padding or a sink: not a linear key, so not chosen
        memset(row, 0, sizeof(float) * BLK);
        continue;
      }
      for (int tg = 0; tg < BLK; tg += 8) {
        const __m256 p =
            exp2_ps_bounded(_mm256_fmsub_ps(_mm256_loadu_ps(row + tg), scale_l2e, _mm256_loadu_ps(w.ut + tg)));
        _mm256_storeu_ps(row + tg, p);
        _mm256_storeu_ps(w.dw + tg, _mm256_add_ps(_mm256_loadu_ps(w.dw + tg), p));
      }
    }
    gemm(nq, d, nk, block, 1, BLK, r.v + s0 * r.vr, r.vr, 1, w.num, d, true, w.bpack);
  }
  for (int tg = 0; tg < BLK; tg += 8) {  // the linear part's factor exp(l_t - c'_t), 1 without l
    const __m256 fl = ell ? exp2_ps(_mm256_mul_ps(
                                           _mm256_sub_ps(_mm256_loadu_ps(ell + tg), _mm256_loadu_ps(w.cm + tg)), l2e))
                                     : _mm256_set1_ps(1.0f);
    _mm256_storeu_ps(w.ellb + BLK + tg, fl);
  }
  for (int t = 0; t < nq; t++) {  // (window + sinks + linear numerators) / their denominators, into the row
    float* o = out + (t0 + t) * out_row;
    float* acc = w.num + (long)t * d;
    const float* ln = w.lin + (long)t * d;
    const float fl = w.ellb[BLK + t];
    float den = w.dw[t] + fl * w.lden[t];
    for (int e = 0; e < d; e++) acc[e] += fl * ln[e];
    for (int i = 0; i < sinks; i++) {
      const float x = w.slog[t * sinks + i];
      if (x == -INFINITY) continue;
      const float p = r.gamma * expf(x - w.cm[t]);
      const float* sv = r.sink_v + (long)i * d;
      for (int e = 0; e < d; e++) acc[e] += p * sv[e];
      den += p;
    }
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;  // no real key: 0
    for (int e = 0; e < d; e++) o[e] = acc[e] * inv;
    if (lse) lse[t0 + t] = den > 0.0f ? logf(den) + w.cm[t] : -INFINITY;  // the log normalizer at c_t = 0
  }
}

}  // namespace

extern "C" {

// q, k, v, out: (b, heads, n, d) at the element strides qs, ks, vs, os (batch, head, position; the last dimension
// packed); pq, pk: (bh, n, m); ell: (bh, n) or null; gamma: (heads); valid, linear: (bh / heads, n) as 0 / 1;
// sink_k, sink_v: (bh, sinks, d); sink_pos (int64), sink_valid: (bh / heads, sinks); null when sinks is 0.
// map_code 0: pq, pk are the features; 1: Hedgehog's map made here, from wq, bq, wk, bk ((heads, d, m / 2) and
// (heads, m / 2)); pq, pk then null. The learned log scales may
// be made here too: with qa, qb ((heads, d), (heads)) l_t = q_t . qa_h + qb_h in place of ell; with ka, kb, phi_k
// times exp(R tanh((k_s . ka_h + kb_h) / R)), R = bound (map 1 only).
// chosen: (bh, nb, picks) int64 or null (picks 0): the key blocks of BLK each query block scores exactly (far
// from its frame; -1 for none), whose sums leave its linear state (ops/far_blocks.py).
// lse: (bh, n) or null: each query's log normalizer log(sum of its window, sink and linear scores) at c_t = 0, -inf
// where it has no real key.
// Rows b0 .. b1 - 1 of the bh. Returns 0, 1 for arguments it cannot take, 2 when out of memory.
int lf_hybrid_bidirectional_forward(const float* q, const float* k, const float* v, const float* pq, const float* pk,
                                    const float* ell, const float* gamma, const float* valid, const float* linear,
                                    const float* sink_k, const float* sink_v, const int64_t* sink_pos,
                                    const float* sink_valid, float* out, const int64_t* qs, const int64_t* ks,
                                    const int64_t* vs, const float* wq, const float* bq, const float* wk,
                                    const float* bk, const float* qa, const float* qb,
                                    const float* ka, const float* kb, const int64_t* os, float* lse,
                                    const int64_t* chosen, int b0, int b1, int heads,
                                    int n, int d, int m, int window, int sinks, int map_code, int picks,
                                    float scale, float headroom, float bound) {
  if (d % NR || m % NR || n <= 0 || heads <= 0 || window < 1 || sinks < 0 ||
      (sinks && (!sink_k || !sink_v || !sink_pos || !sink_valid)) || map_code < 0 || map_code > 1 ||
      (map_code == 0 && (!pq || !pk)) || (map_code == 1 && (!wq || !bq || !wk || !bk)) || (!qa != !qb) ||
      (!ka != !kb) || (ka && map_code != 1) || (ka && !(bound > 0.0f)) || !(scale > 0.0f) || picks < 0 ||
      (picks && !chosen))
    return 1;
  const int nb = (n + BLK - 1) / BLK, side = (window - 1 + BLK - 1) / BLK;
  const int frame = (2 * side + 1) * BLK, hp = round_up(m / 2);
  const long md = (long)m * d, mb = (long)m * BLK;
  long big = (long)frame * d;
  big = big > md ? big : md;
  big += mb;  // phi_q^T packed for the edges' scores beside a B for their products
  const long sizes[] = {nb * md, (long)nb * m, nb * md, (long)nb * m, nb * mb, md, m, md, m, big, (long)d * BLK,
                        mb, (long)frame * BLK, (long)BLK * BLK, (long)BLK * d, BLK, (long)BLK * d, BLK,
                        (long)BLK * (sinks > 0 ? sinks : 1), BLK, (long)hp * BLK, 2 * BLK, 3 * BLK,
                        (long)(picks > 0 ? picks : 1) * BLK * BLK};
  constexpr int PARTS = sizeof(sizes) / sizeof(sizes[0]);
  long total = 0;
  for (long size : sizes) total += (size + 15) & ~15L;
  float* scratch = alloc_floats(total);
  if (!scratch) return 2;
  float* cur = scratch;
  float* parts[PARTS];
  for (int i = 0; i < PARTS; i++) parts[i] = take(cur, sizes[i]);
  const Scratch w{parts[0],  parts[1],  parts[2],  parts[3],  parts[4],  parts[5],  parts[6],  parts[7],
                  parts[8],  parts[9],  parts[10], parts[11], parts[12], parts[13], parts[14], parts[15],
                  parts[16], parts[17], parts[18], parts[19], parts[20], parts[21], parts[22], parts[23]};
  for (int b = b0; b < b1; b++) {
    const long batch = b / heads, head = b % heads;
    const Row r{q + batch * qs[0] + head * qs[1],
                k + batch * ks[0] + head * ks[1],
                v + batch * vs[0] + head * vs[1],
                ell ? ell + (long)b * n : nullptr,
                valid + batch * n,
                linear + batch * n,
                sinks ? sink_k + (long)b * sinks * d : nullptr,
                sinks ? sink_v + (long)b * sinks * d : nullptr,
                sinks ? sink_valid + batch * sinks : nullptr,
                sinks ? sink_pos + batch * sinks : nullptr,
                picks ? chosen + (long)b * nb * picks : nullptr,
                qs[2],
                ks[2],
                vs[2],
                gamma[head]};
    const long wo = head * d * (m / 2), bo = head * (m / 2);
    const Maps f{map_code == 1 ? wq + wo : nullptr,
                 map_code == 1 ? bq + bo : nullptr,
                 map_code == 1 ? wk + wo : nullptr,
                 map_code == 1 ? bk + bo : nullptr,
                 qa ? qa + head * d : nullptr,
                 ka ? ka + head * d : nullptr,
                 qa ? qb[head] : 0.0f,
                 ka ? kb[head] : 0.0f,
                 bound};
    key_blocks(r, f, map_code == 0 ? pk + (long)b * n * m : nullptr, linear + batch * n, w, n, d, m, nb);
    suffix_states(w, d, m, nb, side);
    memset(w.pre_v, 0, sizeof(float) * md);
    memset(w.pre_z, 0, sizeof(float) * m);
    for (int c = 0; c < nb; c++) {
      const int src = c - side - 1;
      if (src >= 0) {
        for (long i = 0; i < md; i++) w.pre_v[i] += w.sv[src * md + i];
        for (int i = 0; i < m; i++) w.pre_z[i] += w.sz[(long)src * m + i];
      }
      query_block(r, f, map_code == 0 ? pq + (long)b * n * m : nullptr, w, out + batch * os[0] + head * os[1], os[2],
                  lse ? lse + (long)b * n : nullptr, c, n, d, m, nb, side, window, sinks, picks, scale, headroom);
    }
  }
  free(scratch);
  return 0;
}

}  // extern "C"
