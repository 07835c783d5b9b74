// cukit/reduce.cuh: block-wide reductions with a fixed order (a warp shuffle tree, then the warps'
// values through shared memory and a second tree): the result does not depend on timing, so kernels
// that use them are bitwise reproducible.
#pragma once

namespace cukit {

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds 32 values; the leading barrier lets a previous call's reads finish.
template <typename V> __device__ __forceinline__ V block_sum(V v, V* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : V(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Maximum of v over the block, as block_sum (values >= 0 where fewer than 32 warps run: the
// missing warps contribute 0).
template <typename V> __device__ __forceinline__ V block_max(V v, V* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : V(0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace cukit
