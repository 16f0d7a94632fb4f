#include "gemm.h"

#include <algorithm>

namespace mok {
namespace {

// Four rows of C at a time reuse each loaded row of B four times; the inner
// loop over N is contiguous and vectorises. Summation order is fixed, so the
// result is bitwise reproducible.
inline void rows_nn(int64_t rows, int64_t N, int64_t K, const float* A, int64_t lda,
                    const float* __restrict B, int64_t ldb, float* C, int64_t ldc) {
  float* __restrict c0 = C;
  float* __restrict c1 = rows > 1 ? C + ldc : nullptr;
  float* __restrict c2 = rows > 2 ? C + 2 * ldc : nullptr;
  float* __restrict c3 = rows > 3 ? C + 3 * ldc : nullptr;
  for (int64_t p = 0; p < K; ++p) {
    const float* __restrict b = B + p * ldb;
    const float a0 = A[p];
    if (rows == 4) {
      const float a1 = A[lda + p], a2 = A[2 * lda + p], a3 = A[3 * lda + p];
      for (int64_t j = 0; j < N; ++j) {
        const float bj = b[j];
        c0[j] += a0 * bj;
        c1[j] += a1 * bj;
        c2[j] += a2 * bj;
        c3[j] += a3 * bj;
      }
    } else {
      for (int64_t j = 0; j < N; ++j) c0[j] += a0 * b[j];
      if (rows > 1) { const float a1 = A[lda + p]; for (int64_t j = 0; j < N; ++j) c1[j] += a1 * b[j]; }
      if (rows > 2) { const float a2 = A[2 * lda + p]; for (int64_t j = 0; j < N; ++j) c2[j] += a2 * b[j]; }
    }
  }
}

void zero_rows(int64_t M, int64_t N, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
}

}  // namespace

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (!accumulate) zero_rows(M, N, C, ldc);
  for (int64_t i = 0; i < M; i += 4) {
    rows_nn(std::min<int64_t>(4, M - i), N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  }
}

void gemm_tn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (!accumulate) zero_rows(M, N, C, ldc);
  for (int64_t p = 0; p < K; ++p) {
    const float* __restrict a = A + p * lda;
    const float* __restrict b = B + p * ldb;
    for (int64_t i = 0; i < M; ++i) {
      const float ai = a[i];
      float* __restrict c = C + i * ldc;
      for (int64_t j = 0; j < N; ++j) c[j] += ai * b[j];
    }
  }
}

void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock)
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock)
      for (int64_t i = i0; i < std::min(rows, i0 + kBlock); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + kBlock); ++j) dst[j * rows + i] = src[i * cols + j];
}

}  // namespace mok
