// cukit/vec.cuh: aligned vector loads and stores. A Vec<T, N> of 16 bytes compiles to one
// LDG.128/STG.128; callers check 16-byte alignment on the host and pick N = 1 otherwise.
#pragma once

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

}  // namespace cukit
