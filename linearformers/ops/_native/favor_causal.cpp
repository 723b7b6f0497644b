// Causal FAVOR+ forward and backward on the CPU, one (batch, head) at a time per thread: the chunk walk of linear
// attention (one running state S = sum phi(k) [v, 1]^T carried chunk by chunk, a triangular product inside each chunk)
// with every product in tile.h's AVX2/FMA GEMM, whose operands stay in L1/L2 from one product to the next.
// Built at first use by _native/__init__.py (g++ -O3 -mavx2 -mfma) and called through ctypes with raw float32
// pointers, each call on a range of (batch, head) rows, so that Python threads (ctypes releases the GIL) split the
// heads without a second threading runtime next to torch's. The portable chunked backend (_favor_chunked.py) computes
// the same outputs on every other device and is what the tests hold this walk to, with the quadratic reference.
// Maps 0 and 1 (MAP_CODES in __init__.py: softmax, ReLU) are fused into the GEMM tiles; map 2 ("features") takes
// precomputed nonnegative features phi(q), phi(k) (bh, n, m) in place of q and k (no projection, no exp, no eps; w
// unused and may be null) and returns d phi(q), d phi(k) (bh, n, m) in place of dq, dk: any feature map runs here.
#include "tile.h"

namespace {

struct Shape {
  int d, m, c, map_code;  // map_code: 0 softmax, 1 relu, 2 features given; d, m, c multiples of 16
  float scale, eps;
};

struct Features {
  const float* bws;  // ws^T packed (K = d, N = m): x ws^T
  const float* bw;   // ws packed (K = m, N = d): du ws
  const float* hw;   // |w_j|^2 / 2
};

// W scaled by sqrt(scale) and packed both ways (x ws^T, du ws), and |w_j|^2 / 2, into shared (2 m d + m floats)
Features prepare_features(const float* w, int m, int d, float scale, float* shared) {
  const float root = sqrtf(scale);
  float *bws = shared, *bw = shared + (long)m * d, *hw = shared + (long)2 * m * d;
  float* ws = (float*)malloc(sizeof(float) * (long)m * d);
  for (int j = 0; j < m; j++) {
    float sq = 0.0f;
    for (int e = 0; e < d; e++) {
      ws[(long)j * d + e] = w[(long)j * d + e] * root;
      sq += w[(long)j * d + e] * w[(long)j * d + e];
    }
    hw[j] = 0.5f * sq;
  }
  pack_b(ws, 1, d, d, m, bws);
  pack_b(ws, d, 1, m, d, bw);
  free(ws);
  return Features{bws, bw, hw};
}

// phi(k) of one chunk into pk (c x m), [v * keep] into va (c x d); padded keys give zero rows. Map 2: k holds
// phi(k) itself (c x m), copied
void key_features(const Shape& s, const Features& f, const float* k, const float* v, const float* keep, float* pk,
                  float* va) {
  const int c = s.c, m = s.m, d = s.d;
  if (s.map_code == 2) {
    for (int r = 0; r < c; r++) {
      const float kp = keep ? keep[r] : 1.0f;
      if (kp == 0.0f) {
        memset(pk + (long)r * m, 0, m * sizeof(float));
        memset(va + (long)r * d, 0, d * sizeof(float));
        continue;
      }
      memcpy(pk + (long)r * m, k + (long)r * m, m * sizeof(float));
      for (int j = 0; j < d; j++) va[(long)r * d + j] = v[(long)r * d + j] * kp;
    }
    return;
  }
  gemm_pb(c, m, d, k, d, 1, f.bws, pk, m, false);
  for (int r = 0; r < c; r++) {
    float* row = pk + (long)r * m;
    const float kp = keep ? keep[r] : 1.0f;
    if (kp == 0.0f) {
      memset(row, 0, m * sizeof(float));
      memset(va + (long)r * d, 0, d * sizeof(float));
      continue;
    }
    for (int j = 0; j < d; j++) va[(long)r * d + j] = v[(long)r * d + j] * kp;
    if (s.map_code == 1) {
      for (int j = 0; j < m; j++) row[j] = (row[j] > 0.0f ? row[j] : 0.0f) + s.eps;
      continue;
    }
    const float sq = dot(k + (long)r * d, k + (long)r * d, d);
    const __m256 kk = _mm256_set1_ps(0.5f * s.scale * sq), l2e = _mm256_set1_ps(LOG2E);
    for (int j = 0; j < m; j += 8) {
      __m256 u = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), kk), _mm256_loadu_ps(f.hw + j));
      _mm256_storeu_ps(row + j, exp2_ps(_mm256_mul_ps(u, l2e)));
    }
  }
}

void query_features(const Shape& s, const Features& f, const float* q, float* pq) {
  const int c = s.c, m = s.m, d = s.d;
  if (s.map_code == 2) {  // q holds phi(q) itself (c x m)
    memcpy(pq, q, sizeof(float) * (long)c * m);
    return;
  }
  gemm_pb(c, m, d, q, d, 1, f.bws, pq, m, false);
  for (int r = 0; r < c; r++) {
    float* row = pq + (long)r * m;
    if (s.map_code == 1) {
      for (int j = 0; j < m; j++) row[j] = (row[j] > 0.0f ? row[j] : 0.0f) + s.eps;
      continue;
    }
    const __m256 l2e = _mm256_set1_ps(LOG2E);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < m; j += 8) {
      const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(f.hw + j)), l2e);
      _mm256_storeu_ps(row + j, u);
      mx = _mm256_max_ps(mx, u);
    }
    const __m256 t = _mm256_set1_ps(hmax(mx));
    for (int j = 0; j < m; j += 8) _mm256_storeu_ps(row + j, exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), t)));
  }
}

// S += pk^T va and z += the column sums of pk: one chunk's keys written into the state
void add_chunk(const Shape& s, const float* pk, const float* va, float* st, float* z, float* bbuf) {
  gemm(s.m, s.d, s.c, pk, 1, s.m, va, s.d, 1, st, s.d, true, bbuf);
  for (int t = 0; t < s.c; t++)
    for (int e = 0; e < s.m; e++) z[e] += pk[(long)t * s.m + e];
}

void tril(float* a, int c) {
  for (int t = 0; t < c; t++)
    for (int u = t + 1; u < c; u++) a[t * c + u] = 0.0f;
}

// floats of the B-packing buffer: the largest K x N of any product, K and N among c, d, m (the c x d of the products
// on v when m is the smallest)
long pack_floats(int d, int m, int c) {
  const long big = (long)m * (d > c ? (d > m ? d : m) : (c > m ? c : m));
  return big > (long)c * d ? big : (long)c * d;
}

// W prepared for maps 0 and 1; map 2 takes no W (null pointers)
Features features_for(const Shape& s, const float* w, float* shared) {
  if (s.map_code == 2) return Features{nullptr, nullptr, nullptr};
  return prepare_features(w, s.m, s.d, s.scale, shared);
}

}  // namespace

extern "C" {

// Forward. q, k, v, out: (bh, n, d); keep: (bh / heads, n) or null; den: (bh, n); starts: (bh, nblocks, m, d);
// zstarts: (bh, nblocks, m); s_final: (bh, m, d); z_final: (bh, m); lost: (bh) counts. w: (m, d). Map 2: q and k
// are phi(q), phi(k) (bh, n, m) and w is unused (may be null).
int lf_favor_causal_forward(const float* q, const float* k, const float* v, const float* keep, const float* w,
                            float* out, float* den, float* starts, float* zstarts, float* s_final, float* z_final,
                            int64_t* lost, int b0, int b1, int heads, int n, int n_valid, int d, int m, int c,
                            int cpb, int map_code, float scale, float eps) {
  const Shape s{d, m, c, map_code, scale, eps};
  if (d % NR || m % NR || c % NR || n % c || map_code < 0 || map_code > 2 || (map_code != 2 && !w)) return 1;
  const long qs = map_code == 2 ? m : d;  // row stride of q and k
  float* shared = alloc_floats((long)2 * m * d + m + 64);
  if (!shared) return 2;
  const Features f = features_for(s, w, shared);
  const int nblocks = (n / c + cpb - 1) / cpb;
  {
    const long big = pack_floats(d, m, c);
    float* scratch = alloc_floats(4 * (long)c * m + 3 * (long)c * d + (long)c * c + (long)m * d + m +
                                  big + 256);
    if (!scratch) {
      free(shared);
      return 2;
    }
    float* cur = scratch;
    float *pq = take(cur, (long)c * m), *pk = take(cur, (long)c * m), *sc = take(cur, (long)c * c);
    float *va = take(cur, (long)c * d), *num = take(cur, (long)c * d), *st = take(cur, (long)m * d);
    float *z = take(cur, m), *bbuf = take(cur, big);
    for (int b = b0; b < b1; b++) {
      const float *qb = q + (long)b * n * qs, *kb = k + (long)b * n * qs, *vb = v + (long)b * n * d;
      const float* kpb = keep ? keep + (long)(b / heads) * n : nullptr;
      float *ob = out + (long)b * n * d, *db = den + (long)b * n;
      memset(st, 0, sizeof(float) * m * d);
      memset(z, 0, sizeof(float) * m);
      bool seen = false;
      int64_t lost_b = 0;
      for (int j = 0; j < n / c; j++) {
        const long t0 = (long)j * c;
        if (j % cpb == 0) {
          memcpy(starts + ((long)b * nblocks + j / cpb) * m * d, st, sizeof(float) * m * d);
          memcpy(zstarts + ((long)b * nblocks + j / cpb) * m, z, sizeof(float) * m);
        }
        key_features(s, f, kb + t0 * qs, vb + t0 * d, kpb ? kpb + t0 : nullptr, pk, va);
        query_features(s, f, qb + t0 * qs, pq);
        gemm(c, c, m, pq, m, 1, pk, 1, m, sc, c, false, bbuf);  // pq pk^T
        tril(sc, c);
        gemm(c, d, c, sc, c, 1, va, d, 1, num, d, false, bbuf);
        gemm(c, d, m, pq, m, 1, st, d, 1, num, d, true, bbuf);
        for (int t = 0; t < c; t++) {
          float dn = sum(sc + t * c, c) + dot(pq + (long)t * m, z, m);  // sc is lower triangular
          seen = seen || (kpb ? kpb[t0 + t] != 0.0f : true);
          if (dn <= TINY && seen && t0 + t < n_valid) lost_b++;
          dn = dn > TINY ? dn : TINY;
          db[t0 + t] = dn;
          const float inv = 1.0f / dn;
          for (int e = 0; e < d; e++) ob[(t0 + t) * d + e] = num[(long)t * d + e] * inv;
        }
        add_chunk(s, pk, va, st, z, bbuf);
      }
      memcpy(s_final + (long)b * m * d, st, sizeof(float) * m * d);
      memcpy(z_final + (long)b * m, z, sizeof(float) * m);
      lost[b] = lost_b;
    }
    free(scratch);
  }
  free(shared);
  return 0;
}

// Backward. g, out: (bh, n, d); den: (bh, n) (clamped at TINY); starts / zstarts as forward wrote them.
// dq, dk, dv: (bh, n, d). Map 2: q, k, dq, dk are phi(q), phi(k), d phi(q), d phi(k) (bh, n, m).
int lf_favor_causal_backward(const float* q, const float* k, const float* v, const float* keep, const float* w,
                             const float* g, const float* out, const float* den, const float* starts,
                             const float* zstarts, float* dq, float* dk, float* dv, int b0, int b1, int heads, int n,
                             int d, int m, int c, int cpb, int map_code, float scale, float eps) {
  const Shape s{d, m, c, map_code, scale, eps};
  if (d % NR || m % NR || c % NR || n % c || map_code < 0 || map_code > 2 || (map_code != 2 && !w)) return 1;
  const long qs = map_code == 2 ? m : d;  // row stride of q and k
  float* shared = alloc_floats((long)2 * m * d + m + 64);
  if (!shared) return 2;
  const Features f = features_for(s, w, shared);
  const int nchunks = n / c, nblocks = (nchunks + cpb - 1) / cpb;
  {
    const long big = pack_floats(d, m, c);
    const long per = 2 * (long)cpb * c * m + (long)cpb * m * d + (long)cpb * m + 3 * (long)c * m + 6 * (long)c * d +
                     3 * (long)c * c + (long)m * d + 2 * m + 2 * c + big + 512;
    float* scratch = alloc_floats(per);
    if (!scratch) {
      free(shared);
      return 2;
    }
    float* cur = scratch;
    float *PK = take(cur, (long)cpb * c * m), *PQ = take(cur, (long)cpb * c * m);
    float *SS = take(cur, (long)cpb * m * d), *ZZ = take(cur, (long)cpb * m);
    float *dphi = take(cur, (long)c * m), *du = take(cur, (long)c * m), *sc = take(cur, (long)c * c);
    float *gv = take(cur, (long)c * c), *va = take(cur, (long)c * d), *ga = take(cur, (long)c * d);
    float *tmp = take(cur, (long)c * d), *dS = take(cur, (long)m * d), *dz = take(cur, m);
    float *gd = take(cur, c), *rs = take(cur, c), *bbuf = take(cur, big);
    for (int b = b0; b < b1; b++) {
      const float *qb = q + (long)b * n * qs, *kb = k + (long)b * n * qs, *vb = v + (long)b * n * d;
      const float *gb = g + (long)b * n * d, *ob = out + (long)b * n * d, *db = den + (long)b * n;
      const float* kpb = keep ? keep + (long)(b / heads) * n : nullptr;
      float *dqb = dq + (long)b * n * qs, *dkb = dk + (long)b * n * qs, *dvb = dv + (long)b * n * d;
      memset(dS, 0, sizeof(float) * m * d);
      memset(dz, 0, sizeof(float) * m);
      for (int blk = nblocks - 1; blk >= 0; blk--) {
        const int j0 = blk * cpb, nj = (nchunks - j0) < cpb ? (nchunks - j0) : cpb;
        memcpy(SS, starts + ((long)b * nblocks + blk) * m * d, sizeof(float) * m * d);
        memcpy(ZZ, zstarts + ((long)b * nblocks + blk) * m, sizeof(float) * m);
        for (int jj = 0; jj < nj; jj++) {  // features, and the state before each chunk of the block
          const long t0 = (long)(j0 + jj) * c;
          float *pk = PK + (long)jj * c * m, *pq = PQ + (long)jj * c * m;
          key_features(s, f, kb + t0 * qs, vb + t0 * d, kpb ? kpb + t0 : nullptr, pk, va);
          query_features(s, f, qb + t0 * qs, pq);
          if (jj + 1 < nj) {
            float *sn = SS + (long)(jj + 1) * m * d, *zn = ZZ + (long)(jj + 1) * m;
            memcpy(sn, SS + (long)jj * m * d, sizeof(float) * m * d);
            memcpy(zn, ZZ + (long)jj * m, sizeof(float) * m);
            add_chunk(s, pk, va, sn, zn, bbuf);
          }
        }
        for (int jj = nj - 1; jj >= 0; jj--) {
          const long t0 = (long)(j0 + jj) * c;
          const float *pk = PK + (long)jj * c * m, *pq = PQ + (long)jj * c * m;
          const float *st = SS + (long)jj * m * d, *z = ZZ + (long)jj * m;
          const float* kp = kpb ? kpb + t0 : nullptr;
          for (int t = 0; t < c; t++) {
            const float kt = kp ? kp[t] : 1.0f;
            for (int e = 0; e < d; e++) va[(long)t * d + e] = vb[(t0 + t) * d + e] * kt;
            const float dn = db[t0 + t], inv = dn > TINY ? 1.0f / dn : 0.0f;
            for (int e = 0; e < d; e++) ga[(long)t * d + e] = gb[(t0 + t) * d + e] * inv;
            gd[t] = -dot(ga + (long)t * d, ob + (t0 + t) * d, d);
          }
          gemm(c, c, m, pq, m, 1, pk, 1, m, sc, c, false, bbuf);  // scores, recomputed
          tril(sc, c);
          gemm(c, c, d, ga, d, 1, va, 1, d, gv, c, false, bbuf);  // ga va^T
          for (int t = 0; t < c; t++)
            for (int u = 0; u < c; u++) gv[t * c + u] = u <= t ? gv[t * c + u] + gd[t] * (kp ? kp[u] : 1.0f) : 0.0f;
          // dphi(Q) = gv pk + ga S^T + gd z^T
          gemm(c, m, c, gv, c, 1, pk, m, 1, dphi, m, false, bbuf);
          gemm(c, m, d, ga, d, 1, st, 1, d, dphi, m, true, bbuf);
          if (s.map_code == 2) {  // features given: d phi(Q) is the output
            for (int t = 0; t < c; t++) {
              const float* row = dphi + (long)t * m;
              float* dut = dqb + (t0 + t) * m;
              for (int e = 0; e < m; e++) dut[e] = row[e] + gd[t] * z[e];
            }
          } else {
            for (int t = 0; t < c; t++) {
              float* row = dphi + (long)t * m;
              const float* p = pq + (long)t * m;
              float* dut = du + (long)t * m;
              if (s.map_code == 1) {
                for (int e = 0; e < m; e++) dut[e] = p[e] > s.eps ? row[e] + gd[t] * z[e] : 0.0f;
              } else {
                for (int e = 0; e < m; e++) dut[e] = (row[e] + gd[t] * z[e]) * p[e];
              }
            }
            gemm_pb(c, d, m, du, m, 1, f.bw, dqb + t0 * d, d, false);
          }
          // dv = (sc^T ga + pk dS) * keep
          gemm(c, d, c, sc, 1, c, ga, d, 1, tmp, d, false, bbuf);
          gemm(c, d, m, pk, m, 1, dS, d, 1, tmp, d, true, bbuf);
          for (int t = 0; t < c; t++) {
            const float kt = kp ? kp[t] : 1.0f;
            for (int e = 0; e < d; e++) dvb[(t0 + t) * d + e] = tmp[(long)t * d + e] * kt;
          }
          // dphi(K) = gv^T pq + va dS^T + keep dz^T
          gemm(c, m, c, gv, 1, c, pq, m, 1, dphi, m, false, bbuf);
          gemm(c, m, d, va, d, 1, dS, 1, d, dphi, m, true, bbuf);
          if (s.map_code == 2) {  // features given: d phi(K) is the output, 0 for padded keys
            for (int t = 0; t < c; t++) {
              const float kt = kp ? kp[t] : 1.0f;
              const float* row = dphi + (long)t * m;
              float* dut = dkb + (t0 + t) * m;
              if (kt == 0.0f) {
                memset(dut, 0, m * sizeof(float));
                continue;
              }
              for (int e = 0; e < m; e++) dut[e] = row[e] + kt * dz[e];
            }
          } else {
            for (int t = 0; t < c; t++) {
              const float kt = kp ? kp[t] : 1.0f;
              float* row = dphi + (long)t * m;
              const float* p = pk + (long)t * m;
              float* dut = du + (long)t * m;
              if (s.map_code == 1) {
                for (int e = 0; e < m; e++) dut[e] = p[e] > s.eps ? row[e] + kt * dz[e] : 0.0f;
              } else {
                for (int e = 0; e < m; e++) dut[e] = (row[e] + kt * dz[e]) * p[e];
                rs[t] = sum(dut, m);
              }
            }
            gemm_pb(c, d, m, du, m, 1, f.bw, dkb + t0 * d, d, false);
            if (s.map_code == 0)
              for (int t = 0; t < c; t++)
                for (int e = 0; e < d; e++) dkb[(t0 + t) * d + e] -= s.scale * kb[(t0 + t) * d + e] * rs[t];
          }
          // the carry: dS += pq^T ga, dz += pq^T gd
          gemm(m, d, c, pq, 1, m, ga, d, 1, dS, d, true, bbuf);
          for (int t = 0; t < c; t++)
            for (int e = 0; e < m; e++) dz[e] += pq[(long)t * m + e] * gd[t];
        }
      }
    }
    free(scratch);
  }
  free(shared);
  return 0;
}

}  // extern "C"
