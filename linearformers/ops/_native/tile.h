// The AVX2/FMA pieces the native CPU kernels share (favor_causal.cpp, hybrid_bidirectional.cpp): an MR x 16 GEMM
// tile that reads A in place through any two strides and B from packed 16-wide panels, horizontal sums and maxima,
// 2^x on eight lanes, and 64-byte aligned scratch. Everything here has internal linkage: each kernel file compiles
// its own copy.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {


constexpr int NR = 16;     // GEMM tile: MR x NR, NR = two AVX registers
constexpr int MRMAX = 6;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float TINY = 1e-30f;

// C[MR x NR] (row stride ldc) = or += A[MR x K] B[K x NR]; A's element (i, k) at a[i * ars + k * acs] (read in place:
// row-major A or its transpose, both regular), B one packed panel (K x NR)
template <int MR>
inline void kern(int K, const float* __restrict a, long ars, long acs, const float* __restrict b, float* __restrict c,
                 long ldc, bool acc) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define LF_LD(i)                                                              \
  if (MR > i) {                                                               \
    c##i##0 = acc ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();       \
    c##i##1 = acc ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();   \
  }
  LF_LD(0) LF_LD(1) LF_LD(2) LF_LD(3) LF_LD(4) LF_LD(5)
  for (int k = 0; k < K; k++) {
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
    const float* ak = a + k * acs;
#define LF_FM(i)                                                \
  if (MR > i) {                                                 \
    const __m256 av = _mm256_broadcast_ss(ak + i * ars);        \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);                 \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);                 \
  }
    LF_FM(0) LF_FM(1) LF_FM(2) LF_FM(3) LF_FM(4) LF_FM(5)
  }
#define LF_ST(i)                                  \
  if (MR > i) {                                   \
    _mm256_storeu_ps(c + i * ldc, c##i##0);       \
    _mm256_storeu_ps(c + i * ldc + 8, c##i##1);   \
  }
  LF_ST(0) LF_ST(1) LF_ST(2) LF_ST(3) LF_ST(4) LF_ST(5)
}

inline void kern_mr(int mr, int K, const float* a, long ars, long acs, const float* b, float* c, long ldc, bool acc) {
  switch (mr) {
    case 6: kern<6>(K, a, ars, acs, b, c, ldc, acc); break;
    case 5: kern<5>(K, a, ars, acs, b, c, ldc, acc); break;
    case 4: kern<4>(K, a, ars, acs, b, c, ldc, acc); break;
    case 3: kern<3>(K, a, ars, acs, b, c, ldc, acc); break;
    case 2: kern<2>(K, a, ars, acs, b, c, ldc, acc); break;
    default: kern<1>(K, a, ars, acs, b, c, ldc, acc); break;
  }
}

// B (K x N, element (k, j) at src[k * rs + j * cs]) into N / NR panels of K x NR
void pack_b(const float* src, long rs, long cs, int K, int N, float* dst) {
  for (int p = 0; p < N / NR; p++) {
    float* d = dst + (long)p * K * NR;
    const float* s0 = src + (long)p * NR * cs;
    if (cs == 1) {
      for (int k = 0; k < K; k++) memcpy(d + k * NR, s0 + k * rs, NR * sizeof(float));
    } else {
      for (int k = 0; k < K; k++)
        for (int j = 0; j < NR; j++) d[k * NR + j] = s0[k * rs + j * cs];
    }
  }
}

// C (M x N, row stride ldc) = or += A B, A's element (i, k) at a[i * ars + k * acs], B packed by pack_b
void gemm_pb(int M, int N, int K, const float* a, long ars, long acs, const float* bp, float* c, long ldc, bool acc) {
  if (K == 0) {
    if (!acc)
      for (int i = 0; i < M; i++) memset(c + i * ldc, 0, N * sizeof(float));
    return;
  }
  // row panels of 6, but a tail of 1 or 2 rows is merged with the last full panel and split in two (32 = 4 x 6 + 4
  // + 4): a 2-row tile runs at a third of the 6-row tile's rate
  int full = M / MRMAX, rem = M % MRMAX, sizes[3] = {0, 0, 0}, tails = 0;
  if (rem && rem < 3 && full) {
    full--;
    sizes[0] = (MRMAX + rem + 1) / 2, sizes[1] = (MRMAX + rem) / 2, tails = 2;
  } else if (rem) {
    sizes[0] = rem, tails = 1;
  }
  for (int p = 0; p < N / NR; p++) {  // panel by panel: B's panel stays in L1 while A's rows stream past
    const float* bpp = bp + (long)p * K * NR;
    int i0 = 0;
    for (int t = 0; t < full; t++, i0 += MRMAX)
      kern<MRMAX>(K, a + (long)i0 * ars, ars, acs, bpp, c + (long)i0 * ldc + p * NR, ldc, acc);
    for (int t = 0; t < tails; t++) {
      kern_mr(sizes[t], K, a + (long)i0 * ars, ars, acs, bpp, c + (long)i0 * ldc + p * NR, ldc, acc);
      i0 += sizes[t];
    }
  }
}

inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// n a multiple of 8
inline float dot(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
  }
  for (; j < n; j += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

inline float sum(const float* a, int n) {
  __m256 acc = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(a + j));
  return hsum(acc);
}

void gemm(int M, int N, int K, const float* a, long ars, long acs, const float* b, long brs, long bcs, float* c,
          long ldc, bool acc, float* bbuf) {
  pack_b(b, brs, bcs, K, N, bbuf);
  gemm_pb(M, N, K, a, ars, acs, bbuf, c, ldc, acc);
}

// 2^x for x <= 127 that is not NaN (-inf included), relative error ~1e-7: 0 below 2^-126 (the exponent field of
// 2^-127 is that of zero); the degree-6 polynomial on the fraction, times 2^floor
inline __m256 exp2_ps_bounded(__m256 x) {
  const __m256 y = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 fl = _mm256_floor_ps(y);
  const __m256 f = _mm256_sub_ps(y, fl);
  __m256 p = _mm256_set1_ps(0.00021690608991775662f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0012443081941455603f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.009678472764790058f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05548352375626564f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402298003435135f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931470036506653f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 2^x for any x: 0 below 2^-126, 2^127 above it, NaN kept
inline __m256 exp2_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 r = exp2_ps_bounded(_mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(127.0f)));
  return _mm256_blendv_ps(_mm256_andnot_ps(under, r), x, nan);
}

// 64-byte aligned floats (aligned_alloc wants a size that is a multiple of the alignment); null when out of memory
float* alloc_floats(long count) {
  return (float*)aligned_alloc(64, ((size_t)count * sizeof(float) + 63) & ~(size_t)63);
}

float* take(float*& cursor, long count) {
  float* p = cursor;
  cursor += (count + 15) & ~15L;
  return p;
}

}  // namespace
