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
#include <cukit/vec.cuh>

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

// Split-K's second pass (host side: cukit/ops/_gemm.py's SplitK). A product whose output tiles
// leave most SMs idle while K is long runs as S products over K / S each (the family's kernel
// with the slices as a batch, into a workspace W of S contiguous M x N partial products in the
// accumulation type, no bias, no activation); this kernel sums each element's S partials in slice
// order (deterministic) and applies the epilogue the one-pass kernel would have:
// C[m, n] = epilogue_out(sum_s W[s, m, n], bias[n], alpha, beta, C[m, n]), rounded once to TC
// (the activations' fast forms for 16-bit C, as the tensor-core kernels' epilogues). A thread
// owns G consecutive columns of a row, G = one 16-byte vector of W (loaded as such where
// N % G == 0; C stored as one vector where its rows are aligned too), grid-stride over the
// M x ceil(N / G) groups. Each .cu that splits K instantiates it for its types.
template <typename T, typename TC, int ACT, int EPI = EPI_STORE>
__global__ void __launch_bounds__(256)
    splitk_reduce(const acc_t<T>* __restrict__ W, TC* __restrict__ C, const T* __restrict__ bias, double alpha,
                  double beta, long long S, long long M, long long N, long long ldc) {
  using A = acc_t<T>;
  constexpr bool FAST = sizeof(TC) == 2;
  constexpr int G = 16 / static_cast<int>(sizeof(A));
  const long long groups = (N + G - 1) / G;
  const long long total = M * groups;
  const long long mn = M * N;
  const bool wvec = N % G == 0;
  const bool cvec = wvec && ldc % G == 0 && (reinterpret_cast<unsigned long long>(C) & (sizeof(TC) * G - 1)) == 0;
  const A al = static_cast<A>(alpha), be = static_cast<A>(beta);
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long m = i / groups;
    const long long n0 = (i - m * groups) * G;
    const A* w = W + m * N + n0;
    A acc[G];
#pragma unroll
    for (int j = 0; j < G; ++j) acc[j] = A(0);
    if (wvec) {
      for (long long s = 0; s < S; ++s) {
        const Vec<A, G> v = load_vec<A, G>(w + s * mn);
#pragma unroll
        for (int j = 0; j < G; ++j) acc[j] += v.v[j];
      }
    } else {
      for (long long s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < G; ++j)
          if (n0 + j < N) acc[j] += w[s * mn + j];
    }
    TC* crow = C + m * ldc;
    Vec<TC, G> o;
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const long long n = n0 + j;
      const bool in = n < N;
      const A bn = (bias != nullptr && in) ? to_acc<A>(bias[n]) : A(0);
      A old = A(0);
      if constexpr (EPI == EPI_ACCUMULATE) {
        if (in) old = to_acc<A>(crow[n]);
      }
      o.v[j] = from_acc<TC>(epilogue_out<EPI, ACT, A, FAST>(acc[j], bn, al, be, old));
    }
    if (cvec) {
      stg_vec<TC, G>(crow + n0, o);
    } else {
#pragma unroll
      for (int j = 0; j < G; ++j)
        if (n0 + j < N) crow[n0 + j] = o.v[j];
    }
  }
}

}  // namespace cukit
