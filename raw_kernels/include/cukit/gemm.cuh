// cukit/gemm.cuh: what every matmul kernel shares. The parameter list and its meaning are
// cukit/ops/_gemm.py's Gemm (host side):
//   EPI_STORE:      C[z, m, n] = act(sum_k A[z, m, k] B[z, k, n] + bias[n])
//   EPI_SCALE:      C[z, m, n] = alpha (sum_k A[z, m, k] B[z, k, n] + bias[n])
//   EPI_ACCUMULATE: C[z, m, n] = alpha (sum_k A[z, m, k] B[z, k, n] + bias[n]) + beta C[z, m, n]
//   EPI_SCALE_DEVICE: C[z, m, n] = alpha s sum_k A[z, m, k] B[z, k, n], s = *(const float*)bias: a
//                   scale read on the device when the kernel runs (a loss's 1 / count times its
//                   upstream gradient: no host sync); this epilogue has no bias. TMA kernel only.
// C (type TC: A's type, or float for 16-bit A) is addressed C + z * sc + m * ldc + n.
#pragma once
#include <cukit/activations.cuh>
#include <cukit/dtypes.cuh>

namespace cukit {

// A kernel's EPI template argument (cukit/ops/_gemm.py's Gemm.epilogue). EPI_STORE is the matmul
// path: alpha and beta are ignored, the activation applies. The scaled epilogues take no
// activation; EPI_SCALE never reads C (beta == 0: C may hold NaN), EPI_ACCUMULATE reads each
// element of C once, before writing it.
enum Epilogue : int { EPI_STORE = 0, EPI_SCALE = 1, EPI_ACCUMULATE = 2, EPI_SCALE_DEVICE = 3 };

// Every matmul kernel takes exactly these parameters, in this order. alpha and beta are doubles
// for every dtype (one kernel signature); kernels use them in the accumulation type.
#define CUKIT_GEMM_PARAMS(T, TC)                                                                     \
  const T *__restrict__ A, const T *__restrict__ B, TC *__restrict__ C, const T *__restrict__ bias,  \
      double alpha, double beta, long long M, long long N, long long K, long long ldc, long long sc, \
      long long sa_m, long long sa_k, long long sb_k, long long sb_n, long long nb0, long long nb1,  \
      long long nb2, long long sa0, long long sa1, long long sa2, long long sb0, long long sb1,      \
      long long sb2

struct BatchOffsets {
  long long a, b, c;
};

// Element offsets of batch z (0 <= z < nb0 * nb1 * nb2) into A, B and C (C's batch stride: sc).
__device__ __forceinline__ BatchOffsets batch_offset(long long z, long long sc, long long nb1, long long nb2,
                                                     long long sa0, long long sa1, long long sa2, long long sb0,
                                                     long long sb1, long long sb2) {
  const long long i2 = z % nb2;
  const long long r = z / nb2;
  const long long i1 = r % nb1;
  const long long i0 = r / nb1;
  return {i0 * sa0 + i1 * sa1 + i2 * sa2, i0 * sb0 + i1 * sb1 + i2 * sb2, z * sc};
}

// The fused epilogue: act(acc + bias[n]) in the accumulation type. ACT < 0: no activation.
// FAST (float accumulators of a 16-bit output, as bias_act's kernels): the activations' fast
// forms, whose error is far below one bfloat16/float16 rounding; the exact forms (erfc, IEEE
// division) cost the non-overlapped epilogue of a large GEMM several % of its time.
template <int ACT, typename A, bool FAST = false> __device__ __forceinline__ A epilogue(A acc, const A bias_n) {
  const A z = acc + bias_n;
  if constexpr (ACT < 0) {
    return z;
  } else {
    return act_fwd<ACT, FAST>(z);
  }
}

// One output element in the accumulation type for any EPI: c_old (C's value) is read only by
// EPI_ACCUMULATE (callers load it only then).
template <int EPI, int ACT, typename A, bool FAST = false>
__device__ __forceinline__ A epilogue_out(A acc, const A bias_n, const A alpha, const A beta, const A c_old) {
  static_assert(EPI == EPI_STORE || ACT < 0, "the scaled epilogues take no activation");
  static_assert(EPI != EPI_SCALE_DEVICE, "EPI_SCALE_DEVICE reaches the epilogue as EPI_SCALE with alpha s");
  if constexpr (EPI == EPI_STORE) {
    return epilogue<ACT, A, FAST>(acc, bias_n);
  } else if constexpr (EPI == EPI_SCALE) {
    return alpha * (acc + bias_n);
  } else {
    return fma(beta, c_old, alpha * (acc + bias_n));
  }
}

}  // namespace cukit
