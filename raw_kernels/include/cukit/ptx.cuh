// cukit/ptx.cuh: thin wrappers of the sm_80+ PTX that tiled kernels share (matmul, fused losses,
// attention): cp.async into shared memory, ldmatrix, 32/64/128-bit shared loads and stores,
// mma.sync (bf16/fp16 m16n8k16, tf32 m16n8k8, fp32 accumulators), named barriers. Shared-memory
// addresses are 32-bit (__cvta_generic_to_shared). Hopper's wgmma, TMA and mbarriers: sm90.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cukit {
namespace ptx {

using u32 = unsigned int;  // no <cstdint> under NVRTC
using u64 = unsigned long long;

// ------------------------------------------------------------------------------ cp.async
// 16 bytes global -> shared, L2 only (.cg: the tile is read once per block from shared memory).
__device__ __forceinline__ void cp_async16_full(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4_full(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N groups of this thread's copies are pending.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A hint: the cache line holding global address p into L2 (no registers held, no fault).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// 16, 8 or 4 bytes to global memory in one instruction (p aligned to them): NVVM may split a vector
// struct's store into 4-byte stores.
__device__ __forceinline__ void stg128(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void stg64(void* p, uint2 v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void stg32(void* p, u32 v) {
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// ------------------------------------------------------------------------------ shared memory
__device__ __forceinline__ void sts32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void sts64(u32 addr, u32 x, u32 y) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ void sts128(u32 addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ unsigned short lds16(u32 addr) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(u32 addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Copy `bytes` (0, or a multiple of 2 up to N) of global memory at src into N bytes of shared
// memory at dst, zero-filling the rest. Full chunks go by cp.async. A partial or empty chunk (a
// row's end, a row past the operand) is loaded with plain 2-byte loads and stored zero-padded:
// cp.async's src-size form would zero-fill as well, but it is issued as a full-width access
// (compute-sanitizer reports it as an N-byte read past a small allocation's end), so it is not
// used. Only edge tiles take this path.
template <int N> __device__ __forceinline__ void copy_chunk(u32 dst, const char* src, int bytes) {
  static_assert(N == 16 || N == 4, "chunks are 16 or 4 bytes");
  if (bytes == N) {
    if constexpr (N == 16) cp_async16_full(dst, src); else cp_async4_full(dst, src);
    return;
  }
  u32 w[N / 4];
#pragma unroll
  for (int i = 0; i < N / 4; ++i) w[i] = 0u;
  const unsigned short* h = reinterpret_cast<const unsigned short*>(src);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    if (2 * i < bytes) w[i >> 1] |= static_cast<u32>(h[i]) << (16 * (i & 1));
  }
  if constexpr (N == 16) sts128(dst, make_uint4(w[0], w[1], w[2], w[3])); else sts32(dst, w[0]);
}

// ------------------------------------------------------------------------------ ldmatrix
// Four 8 x 8 matrices of 16-bit elements; lanes 8 i .. 8 i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ------------------------------------------------------------------------------ mma.sync
// fp32 bits rounded to tf32 (round to nearest, ties away: cvt.rna).
__device__ __forceinline__ u32 to_tf32(u32 x) {
  u32 y;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(y) : "f"(__uint_as_float(x)));
  return y;
}

// d += a b for one warp: m16n8k16 (bf16, fp16) or m16n8k8 (tf32: the operands' fp32 bits after
// to_tf32), A row-major fragments a[4], B column-major fragments b[2], fp32 accumulators d[4].
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct Mma<float> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// ------------------------------------------------------------------------------ barriers
// Named barrier `id` (1..15; 0 is __syncthreads') over COUNT threads (a multiple of 32): sync
// waits for all of them, arrive counts this warp in without waiting.
template <int COUNT> __device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}
template <int COUNT> __device__ __forceinline__ void bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}

__device__ __forceinline__ u32 dynamic_smem_size() {
  u32 v;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(v));
  return v;
}

}  // namespace ptx
}  // namespace cukit
