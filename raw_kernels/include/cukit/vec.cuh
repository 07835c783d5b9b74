// cukit/vec.cuh: aligned vector loads and stores. A Vec<T, N> of 16 bytes loads with one LDG.128;
// its stores are one STG.128 through stg_vec (store_vec's plain C++ store may be split by NVVM).
// Callers check 16-byte alignment on the host and pick N = 1 otherwise.
#pragma once
#include <cukit/ptx.cuh>

namespace cukit {

template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N> __device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N> __device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// store_vec to global memory in one instruction per 16 bytes (8 or 4 for smaller vectors): NVVM splits
// some vector stores of a Vec assembled element by element into 2- or 4-byte stores (the norms'
// outputs, conv2d's); ptx::stg128 / stg64 cannot be split. Kept apart from store_vec, which also
// writes shared memory and elsewhere compiles to one wide store with better unrolling.
template <typename T, int N> __device__ __forceinline__ void stg_vec(T* __restrict__ p, const Vec<T, N>& v) {
  constexpr int B = static_cast<int>(sizeof(Vec<T, N>));
  if constexpr (B % 16 == 0) {
    const uint4* w = reinterpret_cast<const uint4*>(&v);
#pragma unroll
    for (int i = 0; i < B / 16; ++i) ptx::stg128(reinterpret_cast<char*>(p) + 16 * i, w[i]);
  } else if constexpr (B == 8) {
    ptx::stg64(p, *reinterpret_cast<const uint2*>(&v));
  } else if constexpr (B == 4) {
    ptx::stg32(p, *reinterpret_cast<const unsigned int*>(&v));
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  }
}

// Bytes [s, s + 16) of the 32 bytes lo:hi (s < 16, even): an unaligned 16-byte window from two
// aligned 16-byte loads.
__device__ __forceinline__ uint4 funnel16(uint4 lo, uint4 hi, unsigned int s) {
  const unsigned int x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  unsigned int t[7], u[5];
#pragma unroll
  for (int i = 0; i < 7; ++i) t[i] = (s & 4) ? x[i + 1] : x[i];
#pragma unroll
  for (int i = 0; i < 5; ++i) u[i] = (s & 8) ? t[i + 2] : t[i];
  const unsigned int sh = (s & 2) << 3;  // 0 or 16 bits
  return make_uint4(__funnelshift_r(u[0], u[1], sh), __funnelshift_r(u[1], u[2], sh),
                    __funnelshift_r(u[2], u[3], sh), __funnelshift_r(u[3], u[4], sh));
}

}  // namespace cukit
