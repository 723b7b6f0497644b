// Bidirectional sliding-window softmax + linear attention inside one head (ops/hybrid.py's module docstring), forward
// only, on the CPU: the inference of an encoder over a long document. One (batch, head) row at a time per thread, in
// blocks of BLK queries, every product in tile.h's GEMM on operands that stay in L1/L2:
//   1. the block sums phi_k^T [v, 1] of every key block (linear keys only: padding and sinks weigh 0);
//   2. walking the blocks backward, the suffix states: for block c, the sums of the blocks from c + side + 1 on;
//   3. walking forward with the prefix of the blocks up to c - side - 1: per query block, its linear scores on every
//      key outside its frame through prefix + suffix (one product), its linear scores on the frame blocks that hold
//      keys outside some of its queries' windows (masked to those keys), and its exact window scores against the
//      frame (masked to each query's window and the real keys) with the sinks it sees outside its window; then the
//      stabilized sum of the parts, normalized.
// The frame of block c is the key blocks c - side .. c + side, side = ceil((w - 1) / BLK): every key of its queries'
// windows. Scores are made transposed (keys x queries), so that the masks, maxima and exponentials run along rows
// eight queries at a time, and the products read both operands without copying them out.
// The stabilizer is the definition's c'_t = max(c_t, l_t - R) (c_t the largest window or sink logit, 0 where there
// is none); without l the linear scores are taken as they are. The PyTorch core (_hybrid_core) computes the same
// outputs on every device and is what the tests hold this walk to, with the quadratic reference.
#include "tile.h"

namespace {

constexpr int BLK = 32;  // queries per block; key blocks have the same size

inline int round_up(int x) { return (x + NR - 1) / NR * NR; }

// B (K x N, element (k, j) at src[k * rs + j * cs]) times factor into panels of K x NR, N padded with zero columns
// up to Np (a multiple of NR)
void pack_b_pad(const float* src, long rs, long cs, int K, int N, int Np, float factor, float* dst) {
  for (int p = 0; p < Np / NR; p++) {
    float* d = dst + (long)p * K * NR;
    for (int k = 0; k < K; k++)
      for (int j = 0; j < NR; j++) {
        const int col = p * NR + j;
        d[k * NR + j] = col < N ? factor * src[k * rs + col * cs] : 0.0f;
      }
  }
}

// lanes of the queries t0 + tg .. t0 + tg + 7 within distance < window of key s: all ones where so
inline __m256 near_mask(int t0, int tg, int s, int window) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i dist = _mm256_abs_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(t0 + tg - s)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(window), dist));
}

struct Row {  // one (batch, head) row's inputs
  const float *q, *k, *v, *pq, *pk, *ell, *valid, *linear, *sink_k, *sink_v, *sink_valid;
  const int64_t* sink_pos;
  long qr, kr, vr;  // the row strides of q, k, v
  float gamma;
};

struct Scratch {
  float *sv, *sz, *fv, *fz;  // per key block: its sums; the suffix states of the query block
  float *pre_v, *pre_z, *wv, *wz, *bpack, *qt, *pqt, *lt, *et, *lin, *lden, *num, *va, *cm, *slog, *dw;
};

// 1. per key block j: sv_j = phi_k^T (linear * v) (m x d), sz_j = the column sums of linear * phi_k (m)
void block_sums(const Row& r, const Scratch& w, int n, int d, int m, int nb) {
  const long md = (long)m * d;
  for (int j = 0; j < nb; j++) {
    const int s0 = j * BLK, nk = n - s0 < BLK ? n - s0 : BLK;
    float* z = w.sz + (long)j * m;
    memset(z, 0, sizeof(float) * m);
    for (int s = 0; s < nk; s++) {
      const float keep = r.linear[s0 + s];
      const float* vrow = r.v + (s0 + s) * r.vr;
      const float* prow = r.pk + (long)(s0 + s) * m;
      for (int e = 0; e < d; e++) w.va[(long)s * d + e] = keep * vrow[e];
      if (keep != 0.0f)
        for (int i = 0; i < m; i++) z[i] += keep * prow[i];
    }
    gemm(m, d, nk, r.pk + (long)s0 * m, 1, m, w.va, d, 1, w.sv + j * md, d, false, w.bpack);
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
void query_block(const Row& r, const Scratch& w, float* out, long out_row, int c, int n, int d, int m, int nb, int side, int window,
                 int sinks, float scale, float headroom) {
  const long md = (long)m * d;
  const int t0 = c * BLK, nq = n - t0 < BLK ? n - t0 : BLK, nqp = round_up(nq);
  const float* pq_c = r.pq + (long)t0 * m;
  // the keys outside the frame: phi_q (prefix + suffix)
  for (long i = 0; i < md; i++) w.wv[i] = w.pre_v[i] + w.fv[c * md + i];
  for (int i = 0; i < m; i++) w.wz[i] = w.pre_z[i] + w.fz[(long)c * m + i];
  gemm(nq, d, m, pq_c, m, 1, w.wv, d, 1, w.lin, d, false, w.bpack);
  for (int t = 0; t < nq; t++) w.lden[t] = dot(pq_c + (long)t * m, w.wz, m);
  // the frame blocks holding keys outside some query's window: their linear scores on those keys alone
  bool packed = false;
  const int j0 = c - side > 0 ? c - side : 0, j1 = c + side < nb - 1 ? c + side : nb - 1;
  for (int j = j0; j <= j1; j++) {
    const int off = j > c ? j - c : c - j;
    if (off * BLK + BLK - 1 < window) continue;  // every key of block j is in every query's window
    if (!packed) {
      pack_b_pad(pq_c, 1, m, m, nq, nqp, 1.0f, w.pqt);  // phi_q^T, K = m, N = nqp
      packed = true;
    }
    const int s0 = j * BLK, nk = n - s0 < BLK ? n - s0 : BLK;
    gemm_pb(nk, nqp, m, r.pk + (long)s0 * m, m, 1, w.pqt, w.et, nqp, false);  // (keys x queries)
    for (int s = 0; s < nk; s++) {
      float* row = w.et + (long)s * nqp;
      if (r.linear[s0 + s] == 0.0f) {
        memset(row, 0, sizeof(float) * nqp);
        continue;
      }
      for (int tg = 0; tg < nqp; tg += 8) {
        const __m256 x = _mm256_andnot_ps(near_mask(t0, tg, s0 + s, window), _mm256_loadu_ps(row + tg));
        _mm256_storeu_ps(row + tg, x);
        _mm256_storeu_ps(w.lden + tg, _mm256_add_ps(_mm256_loadu_ps(w.lden + tg), x));
      }
    }
    gemm(nq, d, nk, w.et, 1, nqp, r.v + s0 * r.vr, r.vr, 1, w.lin, d, true, w.bpack);
  }
  // the window: exact logits against the frame, (keys x queries)
  const int f0 = j0 * BLK, f1 = (j1 + 1) * BLK < n ? (j1 + 1) * BLK : n, nf = f1 - f0;
  pack_b_pad(r.q + t0 * r.qr, 1, r.qr, d, nq, nqp, scale, w.qt);  // (scale q)^T, K = d, N = nqp
  gemm_pb(nf, nqp, d, r.k + f0 * r.kr, r.kr, 1, w.qt, w.lt, nqp, false);
  for (int t = 0; t < nqp; t++) w.cm[t] = -INFINITY;
  for (int t = 0; t < nq; t++) {  // the sinks each query sees outside its window
    const int pos = t0 + t;
    for (int i = 0; i < sinks; i++) {
      const long dist = pos - r.sink_pos[i];
      const bool sees = r.sink_valid[i] != 0.0f && (dist >= window || -dist >= window);
      const float x = sees ? scale * dot(r.q + pos * r.qr, r.sink_k + (long)i * d, d) : -INFINITY;
      w.slog[t * sinks + i] = x;
      w.cm[t] = x > w.cm[t] ? x : w.cm[t];
    }
  }
  for (int s = 0; s < nf; s++) {
    if (r.valid[f0 + s] == 0.0f) continue;
    const float* row = w.lt + (long)s * nqp;
    for (int tg = 0; tg < nqp; tg += 8) {
      const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(row + tg),
                                        near_mask(t0, tg, f0 + s, window));
      _mm256_storeu_ps(w.cm + tg, _mm256_max_ps(_mm256_loadu_ps(w.cm + tg), x));
    }
  }
  for (int t = 0; t < nqp; t++) {  // c'_t, into cm
    float cc = isfinite(w.cm[t]) ? w.cm[t] : 0.0f;
    if (r.ell && t < nq) cc = fmaxf(cc, r.ell[t0 + t] - headroom);
    w.cm[t] = cc;
    w.dw[t] = 0.0f;
  }
  const __m256 l2e = _mm256_set1_ps(LOG2E), g = _mm256_set1_ps(r.gamma);
  for (int s = 0; s < nf; s++) {
    float* row = w.lt + (long)s * nqp;
    if (r.valid[f0 + s] == 0.0f) {
      memset(row, 0, sizeof(float) * nqp);
      continue;
    }
    for (int tg = 0; tg < nqp; tg += 8) {
      const __m256 u = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + tg), _mm256_loadu_ps(w.cm + tg)), l2e);
      const __m256 p = _mm256_and_ps(_mm256_mul_ps(g, exp2_ps(u)), near_mask(t0, tg, f0 + s, window));
      _mm256_storeu_ps(row + tg, p);
      _mm256_storeu_ps(w.dw + tg, _mm256_add_ps(_mm256_loadu_ps(w.dw + tg), p));
    }
  }
  gemm(nq, d, nf, w.lt, 1, nqp, r.v + f0 * r.vr, r.vr, 1, w.num, d, false, w.bpack);
  for (int t = 0; t < nq; t++) {
    float* o = out + (t0 + t) * out_row;
    const float* nm = w.num + (long)t * d;
    const float* ln = w.lin + (long)t * d;
    const float cc = w.cm[t];
    const float f = r.ell ? expf(r.ell[t0 + t] - cc) : 1.0f;
    float den = w.dw[t] + f * w.lden[t];
    for (int e = 0; e < d; e++) o[e] = nm[e] + f * ln[e];
    for (int i = 0; i < sinks; i++) {
      const float x = w.slog[t * sinks + i];
      if (x == -INFINITY) continue;
      const float p = r.gamma * expf(x - cc);
      const float* sv = r.sink_v + (long)i * d;
      for (int e = 0; e < d; e++) o[e] += p * sv[e];
      den += p;
    }
    if (den > 0.0f) {
      const float inv = 1.0f / den;
      for (int e = 0; e < d; e++) o[e] *= inv;
    } else {
      memset(o, 0, sizeof(float) * d);
    }
  }
}

// x = exp(R tanh(x / R)) in place, eight at a time (x holds n rounded up to 8 floats), tanh(y) = 1 - 2 / (e^2y + 1)
void bounded_exp(float* x, int n, float bound) {
  const __m256 two_l2e = _mm256_set1_ps(2.0f * LOG2E / bound), r_l2e = _mm256_set1_ps(bound * LOG2E);
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  for (int t = 0; t < n; t += 8) {
    const __m256 e = exp2_ps(_mm256_mul_ps(_mm256_loadu_ps(x + t), two_l2e));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    _mm256_storeu_ps(x + t, exp2_ps(_mm256_mul_ps(th, r_l2e)));
  }
}

// Hedgehog's features of n rows x (row stride xr, d wide): u = x W + b (W: d x m / 2 row-major, b: m / 2), then
// [softmax(u), softmax(-u)] (m), times key_scale per row when given, into out (n x m); a block of BLK rows at a time
// through ubuf (BLK x round_up(m / 2)); wpack holds W packed (d x round_up(m / 2))
void hedgehog_features(const float* x, long xr, const float* wt, const float* bias, const float* key_scale, int n,
                       int d, int m, float* out, float* ubuf, float* wpack) {
  const int half = m / 2, hp = round_up(half);
  const __m256 l2e = _mm256_set1_ps(LOG2E);
  pack_b_pad(wt, half, 1, d, half, hp, 1.0f, wpack);
  for (int t0 = 0; t0 < n; t0 += BLK) {
    const int rows = n - t0 < BLK ? n - t0 : BLK;
    gemm_pb(rows, hp, d, x + t0 * xr, xr, 1, wpack, ubuf, hp, false);
    for (int t = 0; t < rows; t++) {
      float* u = ubuf + (long)t * hp;
      float* o = out + (long)(t0 + t) * m;
      __m256 hi = _mm256_set1_ps(-INFINITY), lo = _mm256_set1_ps(INFINITY);
      for (int j = 0; j < half; j += 8) {
        const __m256 x8 = _mm256_add_ps(_mm256_loadu_ps(u + j), _mm256_loadu_ps(bias + j));
        _mm256_storeu_ps(u + j, x8);
        hi = _mm256_max_ps(hi, x8);
        lo = _mm256_min_ps(lo, x8);
      }
      const __m256 top = _mm256_set1_ps(hmax(hi)), bottom = _mm256_set1_ps(-hmax(_mm256_sub_ps(_mm256_setzero_ps(), lo)));
      __m256 s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps();
      for (int j = 0; j < half; j += 8) {
        const __m256 x8 = _mm256_loadu_ps(u + j);
        const __m256 e1 = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(x8, top), l2e));
        const __m256 e2 = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(bottom, x8), l2e));
        _mm256_storeu_ps(o + j, e1);
        _mm256_storeu_ps(o + half + j, e2);
        s1 = _mm256_add_ps(s1, e1);
        s2 = _mm256_add_ps(s2, e2);
      }
      const float factor = key_scale ? key_scale[t0 + t] : 1.0f;
      const __m256 f1 = _mm256_set1_ps(factor / hsum(s1)), f2 = _mm256_set1_ps(factor / hsum(s2));
      for (int j = 0; j < half; j += 8) {
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(o + j), f1));
        _mm256_storeu_ps(o + half + j, _mm256_mul_ps(_mm256_loadu_ps(o + half + j), f2));
      }
    }
  }
}

}  // namespace

extern "C" {

// q, k, v, out: (b, heads, n, d) at the element strides qs, ks, vs, os (batch, head, position; the last dimension
// packed); pq, pk: (bh, n, m); ell: (bh, n) or null; gamma: (heads); valid, linear: (bh / heads, n)
// as 0 / 1; sink_k, sink_v: (bh, sinks, d); sink_pos (int64), sink_valid: (bh / heads, sinks); null when sinks is 0.
// map_code 0: pq, pk are the features; 1: Hedgehog's map made here, from wq, bq, wk, bk ((heads, d, m / 2) and
// (heads, m / 2)) and key_scale ((bh, n) factors of phi_k, or null); pq, pk then null. The learned log scales may
// be made here too: with qa, qb ((heads, d), (heads)) l_t = q_t . qa_h + qb_h in place of ell; with ka, kb, phi_k
// times exp(R tanh((k_s . ka_h + kb_h) / R)), R = bound, in place of key_scale.
// Rows b0 .. b1 - 1 of the bh. Returns 0, 1 for arguments it cannot take, 2 when out of memory.
int lf_hybrid_bidirectional_forward(const float* q, const float* k, const float* v, const float* pq, const float* pk,
                                    const float* ell, const float* gamma, const float* valid, const float* linear,
                                    const float* sink_k, const float* sink_v, const int64_t* sink_pos,
                                    const float* sink_valid, float* out, const int64_t* qs, const int64_t* ks,
                                    const int64_t* vs, const float* wq, const float* bq, const float* wk,
                                    const float* bk, const float* key_scale, const float* qa, const float* qb,
                                    const float* ka, const float* kb, const int64_t* os, int b0, int b1, int heads, int n, int d, int m,
                                    int window, int sinks, int map_code, float scale, float headroom, float bound) {
  if (d % NR || m % NR || n <= 0 || heads <= 0 || window < 1 || sinks < 0 ||
      (sinks && (!sink_k || !sink_v || !sink_pos || !sink_valid)) || map_code < 0 || map_code > 1 ||
      (map_code == 0 && (!pq || !pk)) || (map_code == 1 && (!wq || !bq || !wk || !bk)) || (!qa != !qb) ||
      (!ka != !kb) || (ka && map_code != 1) || (ka && !(bound > 0.0f)))
    return 1;
  const int hp = round_up(m / 2);
  const bool own_features = map_code == 1;
  const int nb = (n + BLK - 1) / BLK, side = (window - 1 + BLK - 1) / BLK;
  const int frame = (2 * side + 1) * BLK;
  const long md = (long)m * d;
  long big = (long)frame * d;
  big = big > md ? big : md;
  const long sizes[] = {nb * md, (long)nb * m, nb * md, (long)nb * m, md, m, md, m, big, (long)d * BLK,
                        (long)m * BLK, (long)frame * BLK, (long)BLK * BLK, (long)BLK * d, BLK, (long)BLK * d,
                        (long)BLK * d, BLK, (long)BLK * (sinks > 0 ? sinks : 1), BLK,
                        own_features ? (long)n * m : 0, own_features ? (long)n * m : 0,
                        own_features ? (long)BLK * hp : 0, own_features ? (long)d * hp : 0, qa ? n : 0, ka ? n : 0};
  long total = 0;
  for (long size : sizes) total += (size + 15) & ~15L;
  float* scratch = alloc_floats(total);
  if (!scratch) return 2;
  float* cur = scratch;
  float* parts[26];
  for (int i = 0; i < 26; i++) parts[i] = take(cur, sizes[i]);
  const Scratch w{parts[0],  parts[1],  parts[2],  parts[3],  parts[4],  parts[5],  parts[6],
                  parts[7],  parts[8],  parts[9],  parts[10], parts[11], parts[12], parts[13],
                  parts[14], parts[15], parts[16], parts[17], parts[18], parts[19]};
  for (int b = b0; b < b1; b++) {
    const long batch = b / heads;
    const long head = b % heads;
    const Row r{q + batch * qs[0] + head * qs[1],
                k + batch * ks[0] + head * ks[1],
                v + batch * vs[0] + head * vs[1],
                own_features ? parts[20] : pq + (long)b * n * m,
                own_features ? parts[21] : pk + (long)b * n * m,
                qa ? parts[24] : ell ? ell + (long)b * n : nullptr,
                valid + batch * n,
                linear + batch * n,
                sinks ? sink_k + (long)b * sinks * d : nullptr,
                sinks ? sink_v + (long)b * sinks * d : nullptr,
                sinks ? sink_valid + batch * sinks : nullptr,
                sinks ? sink_pos + batch * sinks : nullptr,
                qs[2],
                ks[2],
                vs[2],
                gamma[head]};
    if (qa)
      for (int t = 0; t < n; t++) parts[24][t] = dot(r.q + t * r.qr, qa + head * d, d) + qb[head];
    const float* factors = key_scale ? key_scale + (long)b * n : nullptr;
    if (ka) {
      for (int t = 0; t < n; t++) parts[25][t] = dot(r.k + t * r.kr, ka + head * d, d) + kb[head];
      bounded_exp(parts[25], n, bound);
      factors = parts[25];
    }
    if (own_features) {
      const long wo = head * d * (m / 2), bo = head * (m / 2);
      hedgehog_features(r.q, r.qr, wq + wo, bq + bo, nullptr, n, d, m, parts[20], parts[22], parts[23]);
      hedgehog_features(r.k, r.kr, wk + wo, bk + bo, factors, n, d, m, parts[21], parts[22], parts[23]);
    }
    block_sums(r, w, n, d, m, nb);
    suffix_states(w, d, m, nb, side);
    memset(w.pre_v, 0, sizeof(float) * md);
    memset(w.pre_z, 0, sizeof(float) * m);
    for (int c = 0; c < nb; c++) {
      const int src = c - side - 1;
      if (src >= 0) {
        for (long i = 0; i < md; i++) w.pre_v[i] += w.sv[src * md + i];
        for (int i = 0; i < m; i++) w.pre_z[i] += w.sz[(long)src * m + i];
      }
      query_block(r, w, out + batch * os[0] + head * os[1], os[2], c, n, d, m, nb, side, window, sinks, scale, headroom);
    }
  }
  free(scratch);
  return 0;
}

}  // extern "C"
