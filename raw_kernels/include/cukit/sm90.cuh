// cukit/sm90.cuh: Hopper (sm_90a) PTX wrappers shared by tiled kernels: wgmma (warpgroup MMA)
// with its shared-memory descriptors, fences and waits; mbarriers; TMA (bulk tensor copies)
// driven by a CUtensorMap. Kernels that use them are compiled with -arch=sm_90a only (a
// KernelModule with arch="sm_90a"). The instructions that exist only on sm_90a are guarded by
// __CUDA_ARCH_FEAT_SM90_ALL, so that a file including this header still compiles for sm_80 and
// plain sm_90 (where those wrappers compile to nothing and must not be called); the mbarrier
// wrappers are plain inline functions, emitted only where a kernel uses them.
#pragma once
#include <cukit/ptx.cuh>

namespace cukit {
namespace sm90 {

using ptx::u32;
using ptx::u64;

// ------------------------------------------------------------------------------ descriptors
// Shared-memory matrix descriptor of a K-major operand tile in the 128-byte-swizzle layout: rows
// of 128 bytes (chunk c of row r at r * 128 + ((c ^ (r % 8)) << 4)), 1024-byte aligned.
__device__ __forceinline__ u64 desc128(u32 addr) {
  // start address, leading byte offset 16 (unused with this swizzle), stride byte offset 1024
  // (8 rows of 128 bytes), 128-byte swizzle
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(1) << 16) | (static_cast<u64>(1024 >> 4) << 32) |
         (static_cast<u64>(1) << 62);
}

// MN-major operand in 64-element blocks of 8 KiB: transpose bit set in the instruction.
__device__ __forceinline__ u64 desc_mn(u32 addr) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(8192 >> 4) << 16) |
         (static_cast<u64>(1024 >> 4) << 32) | (static_cast<u64>(1) << 62);
}

// ------------------------------------------------------------------------------ wgmma
// wgmma.mma_async m64nNk16 / m64nNk8 (N = 256, 192, 128 or 64; fp32 accumulators d[N / 2] per thread of the
// warpgroup: d[4 i + r] holds columns 8 i + 2 t (+1) of rows g (r < 2) and g + 8 (r >= 2) of its
// warp's 16 rows), A and B from shared memory by descriptor; TA, TB: the transpose bits
// (MN-major operand).
template <typename T, int N = 256> struct Wgmma;

// One asm statement per width; KT: the instruction's k, accumulator and operand types; TR: the
// transpose immediates' operands (16-bit types) or nothing (tf32).
#define CUKIT_WGMMA_N256(KT, TR)                                                                             \
  asm volatile("{\n"                                                                              \
               "wgmma.mma_async.sync.aligned.m64n256" KT " "                          \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1" TR ";\n"                                  \
               "}\n"                                                                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                              \
               : "l"(da), "l"(db), "n"(TA), "n"(TB))
#define CUKIT_WGMMA_N192(KT, TR)                                                                             \
  asm volatile("{\n"                                                                              \
               "wgmma.mma_async.sync.aligned.m64n192" KT " "                          \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, 1, 1, 1" TR ";\n"                                  \
               "}\n"                                                                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])                                                                              \
               : "l"(da), "l"(db), "n"(TA), "n"(TB))
#define CUKIT_WGMMA_N128(KT, TR)                                                                             \
  asm volatile("{\n"                                                                              \
               "wgmma.mma_async.sync.aligned.m64n128" KT " "                          \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1" TR ";\n"                                  \
               "}\n"                                                                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                              \
               : "l"(da), "l"(db), "n"(TA), "n"(TB))
#define CUKIT_WGMMA_N64(KT, TR)                                                                             \
  asm volatile("{\n"                                                                              \
               "wgmma.mma_async.sync.aligned.m64n64" KT " "                          \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1" TR ";\n"                                  \
               "}\n"                                                                               \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                              \
               : "l"(da), "l"(db), "n"(TA), "n"(TB))

// 16-bit operands: k16 per instruction, either operand K- or MN-major (the transpose immediates).
#define CUKIT_WGMMA_16(TYPE, N, PT)                                                                  \
  template <> struct Wgmma<TYPE, N> {                                                                \
    template <int TA, int TB> static __device__ __forceinline__ void run(float (&d)[N / 2], u64 da, u64 db) { \
      CUKIT_WGMMA_BODY(CUKIT_WGMMA_N##N("k16.f32." PT "." PT, ", %" CUKIT_WGMMA_TA_##N ", %" CUKIT_WGMMA_TB_##N)); \
    }                                                                                                \
  };
// float (TF32): k8 per instruction (the same 32 bytes of K as k16 of a 16-bit type, so the tiles
// and descriptors are the 16-bit ones), K-major operands only (PTX has no transpose for tf32).
// The tensor cores read the top 19 bits of each fp32 operand (truncation to tf32).
#define CUKIT_WGMMA_TF32(N)                                                                          \
  template <> struct Wgmma<float, N> {                                                               \
    template <int TA, int TB> static __device__ __forceinline__ void run(float (&d)[N / 2], u64 da, u64 db) { \
      static_assert(TA == 0 && TB == 0, "tf32 wgmma takes K-major operands only");                  \
      CUKIT_WGMMA_BODY(CUKIT_WGMMA_N##N("k8.f32.tf32.tf32", ""));                                    \
    }                                                                                                \
  };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUKIT_WGMMA_BODY(X) X
#else
#define CUKIT_WGMMA_BODY(X)
#endif
#define CUKIT_WGMMA_TA_256 "130"
#define CUKIT_WGMMA_TB_256 "131"
#define CUKIT_WGMMA_TA_192 "98"
#define CUKIT_WGMMA_TB_192 "99"
#define CUKIT_WGMMA_TA_128 "66"
#define CUKIT_WGMMA_TB_128 "67"
#define CUKIT_WGMMA_TA_64 "34"
#define CUKIT_WGMMA_TB_64 "35"
CUKIT_WGMMA_16(__nv_bfloat16, 256, "bf16")
CUKIT_WGMMA_16(__half, 256, "f16")
CUKIT_WGMMA_16(__nv_bfloat16, 192, "bf16")
CUKIT_WGMMA_16(__half, 192, "f16")
CUKIT_WGMMA_16(__nv_bfloat16, 128, "bf16")
CUKIT_WGMMA_16(__half, 128, "f16")
CUKIT_WGMMA_16(__nv_bfloat16, 64, "bf16")
CUKIT_WGMMA_16(__half, 64, "f16")
CUKIT_WGMMA_TF32(256)
CUKIT_WGMMA_TF32(192)
CUKIT_WGMMA_TF32(128)
CUKIT_WGMMA_TF32(64)
#undef CUKIT_WGMMA_16
#undef CUKIT_WGMMA_TF32
#undef CUKIT_WGMMA_BODY
#undef CUKIT_WGMMA_TA_256
#undef CUKIT_WGMMA_TB_256
#undef CUKIT_WGMMA_TA_192
#undef CUKIT_WGMMA_TB_192
#undef CUKIT_WGMMA_TA_128
#undef CUKIT_WGMMA_TB_128
#undef CUKIT_WGMMA_TA_64
#undef CUKIT_WGMMA_TB_64
#undef CUKIT_WGMMA_N256
#undef CUKIT_WGMMA_N192
#undef CUKIT_WGMMA_N128
#undef CUKIT_WGMMA_N64

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N, int R> __device__ __forceinline__ void wg_wait(float (&d)[R]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");  // accumulators are live here
}
template <int N, int R> __device__ __forceinline__ void wg_wait(float (&d0)[R], float (&d1)[R]) {
  wg_wait<N>(d0);
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d1[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------ mbarrier
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed (a fresh barrier: parity 1 is done).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// ------------------------------------------------------------------------------ clusters
// Thread-block clusters (sm_90; a kernel declares its cluster with __cluster_dims__): a barrier
// over every thread of the cluster whose arrive releases, and whose wait acquires, the threads'
// earlier memory operations at cluster scope; and loads from another CTA's shared memory.
// Compiled to nothing below sm_90, where no cluster kernel is built.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The cluster-window address of `addr` (this CTA's shared memory) in CTA `rank` of the cluster.
__device__ __forceinline__ u32 dsmem_addr(u32 addr, u32 rank) {
  u32 r = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
#endif
  return r;
}
__device__ __forceinline__ float ld_dsmem_f32(u32 addr) {
  float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}

// ------------------------------------------------------------------------------ TMA
struct __align__(64) Map {  // a CUtensorMap, opaque, passed by value (__grid_constant__)
  u64 v[16];
};

// Start fetching a tensor map into the copy engine's descriptor cache, so that the first copy
// that names it does not wait for the fetch.
__device__ __forceinline__ void tma_prefetch_map(const Map& map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&map)) : "memory");
#endif
}

// Box (c0, c1, c2) of the 3-D tensor map `map` into shared memory at dst; the copy engine
// completes its bytes on the mbarrier `bar` (armed with mbar_expect_tx).
__device__ __forceinline__ void tma_load(u32 dst, const Map& map, int c0, int c1, int c2, u32 bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#endif
}
}  // namespace sm90
}  // namespace cukit
