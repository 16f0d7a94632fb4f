// Stage 3/5 on the CPU: dense fp32 GEMMs over one expert segment.
// (The CUDA backend's grouped wgmma GEMM is gemm_wgmma.cu.)
#pragma once

#include <cstdint>

namespace mok {

// C[M,N] (+)= A[M,K] @ B[K,N]; row-major, leading dimensions given.
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate);

// C[M,N] (+)= A[K,M]^T @ B[K,N]: weight gradients, K runs over token rows.
void gemm_tn(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
             int64_t ldb, float* C, int64_t ldc, bool accumulate);

// dst[cols, rows] = src[rows, cols]^T, so that A @ B^T becomes a gemm_nn.
void transpose(const float* src, int64_t rows, int64_t cols, float* dst);

}  // namespace mok
