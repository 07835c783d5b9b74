// cukit/gemm.cuh: what every matmul kernel shares. The parameter list and its meaning are
// cukit/ops/_gemm.py's Gemm (host side): C[z, m, n] = act(sum_k A[z, m, k] B[z, k, n] + bias[n]).
#pragma once
#include <cukit/activations.cuh>
#include <cukit/dtypes.cuh>

namespace cukit {

// Every matmul kernel takes exactly these parameters, in this order.
#define CUKIT_GEMM_PARAMS(T)                                                                        \
  const T *__restrict__ A, const T *__restrict__ B, T *__restrict__ C, const T *__restrict__ bias, \
      long long M, long long N, long long K, long long sa_m, long long sa_k, long long sb_k,       \
      long long sb_n, long long nb0, long long nb1, long long nb2, long long sa0, long long sa1,   \
      long long sa2, long long sb0, long long sb1, long long sb2

struct BatchOffsets {
  long long a, b, c;
};

// Element offsets of batch z (0 <= z < nb0 * nb1 * nb2) into A, B and C (C is contiguous).
__device__ __forceinline__ BatchOffsets batch_offset(long long z, long long M, long long N, long long nb1,
                                                     long long nb2, long long sa0, long long sa1, long long sa2,
                                                     long long sb0, long long sb1, long long sb2) {
  const long long i2 = z % nb2;
  const long long r = z / nb2;
  const long long i1 = r % nb1;
  const long long i0 = r / nb1;
  return {i0 * sa0 + i1 * sa1 + i2 * sa2, i0 * sb0 + i1 * sb1 + i2 * sb2, z * M * N};
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

}  // namespace cukit
