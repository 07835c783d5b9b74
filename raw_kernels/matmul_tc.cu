// matmul_tc.cu: tensor-core GEMM, the "tc" matmul family. Three kernels:
//   matmul_tc        mma.sync + ldmatrix (sm_80+): every dtype and operand layout;
//   matmul_tc_wgmma  Hopper's wgmma fed by cp.async (sm_90a only): 16-bit, A and B both K-major,
//                    any alignment (it runs misaligned x @ W.T);
//   matmul_tc_tma    Hopper's wgmma fed by the TMA engine, warp-specialised, persistent (sm_90a
//                    only): 16-bit, any layout, 16-byte aligned rows, block tiles of 128 x 256
//                    or 128 x 128 (see its section below).
// Host side, variant choice and the Gemm contract: cukit/ops/matmul_tc.py and cukit/ops/_gemm.py.
// PTX wrappers: cukit/ptx.cuh (sm_80) and cukit/sm90.cuh (wgmma, mbarrier, TMA).
//
//   C[z, m, n] = act(sum_k A[z, m, k] B[z, k, n] + bias[n])                       (EPI_STORE)
//   C[z, m, n] = alpha (sum_k A[z, m, k] B[z, k, n] + bias[n]) (+ beta C[z, m, n])  (cukit/gemm.cuh)
//
// T = __nv_bfloat16 / __half (mma m16n8k16, fp32 accumulation) or float (mma m16n8k8 tf32, each
// operand rounded with cvt.rna.tf32.f32); C (type TC: T, or float for 16-bit T with the scaled
// epilogues; matmul_tc and matmul_tc_tma) is written after the epilogue in fp32, rows ldc apart.
//
// Block tile 128 x 256 x (128 bytes of K: 64 elements of 16 bits, 32 of fp32), 8 warps (2 x 4),
// warp tile 64 x 64 (4 m16 x 8 n8 MMA tiles, 128 fp32 accumulators per thread).
//
// Shared memory holds each operand tile the way it lies in global memory (no transposes):
// "K-major" (A row-major: sa_k == 1; B column-major: sb_k == 1, nn.Linear's weight) tiles are
// rows of the M/N extent with 128 bytes of K each and feed ldmatrix; "MN-major" tiles are rows of
// K holding the 128/256-element M/N extent and feed ldmatrix.trans (16-bit) or plain 32-bit loads
// (fp32: ldmatrix.trans moves 16-bit elements only). 16-byte chunks are XOR-swizzled within each
// row (chunk ^ swz(row % 8)) so that every ldmatrix phase and every fp32 fragment load reads 32
// distinct banks.
//
// Load paths (template VEC), chosen on the host:
//   VEC = 1: every row start is 16-byte aligned (pointer, leading dimension and batch strides):
//            cp.async 16 B straight into a 3-4 stage ring (stage count = dynamic smem / stage
//            size); chunks that cross the end of a row load only their valid bytes (plain
//            loads, see copy_chunk) and zero-fill the rest. 16-bit: the copies are issued in 3
//            parts between the k-steps and the barrier sits before the last k-step, so the next
//            tile's first fragments load under its MMAs; fp32 keeps the simpler loop (fewer live
//            registers).
//   VEC = 2: (fp32) rows 4-byte aligned: the same ring with 4-byte cp.async.
//   VEC = 0: any alignment (e.g. K = 4093 in bf16). Each row's bytes are fetched as aligned
//            16-byte chunks (one extra chunk per row) by cp.async into a staging buffer, two
//            tiles ahead; the tile is then shifted into place in shared memory (two 16-byte
//            loads, a funnel shift, one 16-byte store per chunk) into a double-buffered compute
//            tile. Bytes past a row's end are never read (copy_chunk), so they arrive as zeros.
// All handle any M, N, K (0 included: C = act(bias)), batches through blockIdx.z and 64-bit
// batch offsets, and a fused bias + activation epilogue.
//
// Template defaults TC = T, EPI = EPI_STORE keep the matmul path's instantiations (and names)
// as they were; the scaled ones add <..., TC, EPI> (cukit/ops/matmul_tc.py declares both).
#include <cukit/gemm.cuh>
#include <cukit/ptx.cuh>
#include <cukit/sm90.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

namespace tc {

using namespace cukit::ptx;

constexpr int BM = 128;             // block tile rows (M)
constexpr int BN = 256;             // block tile columns (N)
constexpr int KB = 128;             // bytes of K per k-tile
constexpr int NT = 256;             // threads per block
constexpr int WM = 64;              // warp tile rows
constexpr int WN = 64;              // warp tile columns
constexpr int WARPS_N = BN / WN;    // 4 (and BM / WM = 2 warp rows)
constexpr int MI = WM / 16;         // m16 tiles per warp
constexpr int NI = WN / 8;          // n8 tiles per warp
constexpr int A_TILE = BM * KB;     // bytes of one A tile (16 KiB)
constexpr int B_TILE = BN * KB;     // bytes of one B tile (32 KiB)
constexpr int STAGE = A_TILE + B_TILE;
#ifndef CUKIT_TC_GROUP_M
#define CUKIT_TC_GROUP_M 8
#endif
constexpr int GROUP_M = CUKIT_TC_GROUP_M;  // rasterization: sweep 8 tile rows per column of tiles
constexpr int KSTEPS = 4;           // MMA k-steps per k-tile (32 bytes of K each)

// Geometry of one operand tile. MN: the tile's extent along M (A) or N (B).
template <typename T, bool KMAJ, int MN> struct Geo {
  static constexpr int SZ = sizeof(T);
  static constexpr int EPC = 16 / SZ;                    // elements per 16-byte chunk
  static constexpr int BK = KB / SZ;                     // K elements per k-tile
  static constexpr int ROWS = KMAJ ? MN : BK;            // smem rows
  static constexpr int R = KMAJ ? KB / 16 : MN * SZ / 16;  // 16-byte chunks per row (8..64)
  static constexpr int CHUNKS = ROWS * R;                // = MN * KB / 16
  static constexpr int PER_THREAD = CHUNKS / NT;
  static constexpr int SR = R + 1;                       // staging chunks per row (VEC = 0)
  static constexpr int STAGING = ROWS * SR * 16;         // staging bytes
  static constexpr int STAGED_ITERS = (ROWS * SR + NT - 1) / NT;  // staging copies per thread
  static_assert(CHUNKS % NT == 0 && NT % R == 0, "tile does not split evenly over the threads");
};

// Which of the 8 XOR patterns row r uses: a permutation of 0..7 whose values for rows 0-3 (and
// 4-7) differ in bits 1-2, so that the fp32 MN-major fragment loads (rows t and t + 4, two
// adjacent chunks) are conflict-free as well as the 8-row ldmatrix phases.
__device__ __forceinline__ int swz(int row) { return ((row & 3) << 1) | ((row >> 2) & 1); }

template <int R> __device__ __forceinline__ u32 chunk_off(int row, int c) {
  return static_cast<u32>(row * R + (c ^ swz(row))) * 16u;
}

template <bool B> struct Fast {
  static constexpr bool value = B;
};

// ------------------------------------------------------------------------------------ operands
// One operand of one batch, seen as a 2-D array: row o (outer) at base + o * ld, its elements
// i (inner, contiguous) for 0 <= i < I, rows 0 <= o < O. K-major: o = m (or n), i = k;
// MN-major: o = k, i = m (or n). mn0: the block's first row/column along M (or N).
struct Operand {
  const char* base;
  long long ld, O, I, mn0;
};

// The compiler would hoist each row's loop-invariant address arithmetic out of the k-loop and
// keep it in registers, which the accumulators need: hide the value so it is recomputed.
template <typename V> __device__ __forceinline__ V opaque(V v) {
  if constexpr (sizeof(V) == 8) {
    asm volatile("" : "+l"(v));
  } else {
    asm volatile("" : "+r"(v));
  }
  return v;
}

template <typename T, bool KMAJ, int MN>
__device__ __forceinline__ void tile_origin(const Operand& op, int kt, long long& o0, long long& i0) {
  using G = Geo<T, KMAJ, MN>;
  o0 = KMAJ ? op.mn0 : static_cast<long long>(kt) * G::BK;
  i0 = KMAJ ? static_cast<long long>(kt) * G::BK : op.mn0;
}

// VEC = 1: cp.async the 16-byte chunks [IT0, IT1) of this thread (of G::PER_THREAD) of k-tile
// kt into their swizzled places at dst. Thread tid copies chunk tid % R of rows
// tid / R + it * (NT / R).
template <typename T, bool KMAJ, int MN, int IT0, int IT1>
__device__ __forceinline__ void load_tile_vec(u32 dst, const Operand& op, int kt, int tid_) {
  using G = Geo<T, KMAJ, MN>;
  constexpr int STEP = NT / G::R;  // rows between a thread's chunks
  const int tid = opaque(tid_);
  long long o0, i0;
  tile_origin<T, KMAJ, MN>(op, kt, o0, i0);
  const int c = tid % G::R, row0 = tid / G::R;
  const long long i = i0 + c * G::EPC;
  const long long rem = op.I - i;  // valid elements from this chunk on (same for every row)
  const int vbytes = rem <= 0 ? 0 : (rem >= G::EPC ? 16 : static_cast<int>(rem) * G::SZ);
  const long long ld = opaque(op.ld);
  const char* src = op.base + ((o0 + row0) * ld + i) * G::SZ;
  const long long step = STEP * ld * G::SZ;
  const long long rows_left = op.O - o0 - row0;  // row row0 + STEP * it is valid while < rows_left
  const u32 d = dst + chunk_off<G::R>(row0, c);
  auto copy = [&](auto fast) {
#pragma unroll
    for (int it = IT0; it < IT1; ++it) {
      // STEP is a multiple of 8 (R <= 32 for 16-byte loads): every row has row0's swizzle
      const u32 dd = STEP % 8 == 0 ? d + it * STEP * G::R * 16 : dst + chunk_off<G::R>(row0 + STEP * it, c);
      if constexpr (decltype(fast)::value) {
        cp_async16_full(dd, src + it * step);
      } else {
        const bool ok = STEP * it < rows_left && vbytes > 0;
        copy_chunk<16>(dd, src + it * step, ok ? vbytes : 0);
      }
    }
  };
  // A tile inside the operand (the same for every thread: no divergence) copies every chunk
  // whole; edge tiles check each chunk.
  if (o0 + G::ROWS <= op.O && i0 + G::R * G::EPC <= op.I) {
    copy(Fast<true>{});
  } else {
    copy(Fast<false>{});
  }
}

// VEC = 2: as VEC = 1 with 4-byte copies, for rows that are only 4-byte aligned (any fp32
// operand; 16-bit ones with an even leading dimension). Lane l copies word l % 4 of chunk l / 4,
// so a warp copies 128 contiguous bytes per instruction.
template <typename T, bool KMAJ, int MN, int IT0, int IT1>
__device__ __forceinline__ void load_tile_w4(u32 dst, const Operand& op, int kt, int tid_) {
  using G = Geo<T, KMAJ, MN>;
  constexpr int CPT = NT / 4;  // chunks per pass
  constexpr int STEP = CPT / G::R;  // rows per pass
  static_assert(CPT % G::R == 0, "a pass must cover whole rows");
  const int tid = opaque(tid_);
  long long o0, i0;
  tile_origin<T, KMAJ, MN>(op, kt, o0, i0);
  const int c = (tid >> 2) % G::R, w = tid & 3, row0 = (tid >> 2) / G::R;
  const long long i = i0 + c * G::EPC + w * (4 / G::SZ);
  const long long rem = op.I - i;
  const int vbytes = rem <= 0 ? 0 : (rem * G::SZ >= 4 ? 4 : static_cast<int>(rem) * G::SZ);
  const long long ld = opaque(op.ld);
  const char* src = op.base + ((o0 + row0) * ld + i) * G::SZ;
  const long long step = STEP * ld * G::SZ;
  const u32 d = dst + chunk_off<G::R>(row0, c) + 4 * w;
  const long long rows_left = op.O - o0 - row0;  // rows o0 + row0 + STEP * it valid while < O
  auto copy = [&](auto fast) {
#pragma unroll
    for (int it = IT0; it < IT1; ++it) {
      // rows row0 + STEP * it share row0's swizzle when STEP is a multiple of 8
      const u32 dd = STEP % 8 == 0 ? d + it * STEP * G::R * 16
                                   : dst + chunk_off<G::R>(row0 + STEP * it, c) + 4 * w;
      if constexpr (decltype(fast)::value) {
        cp_async4_full(dd, src + it * step);
      } else {
        const bool ok = STEP * it < rows_left && vbytes > 0;
        copy_chunk<4>(dd, src + it * step, ok ? vbytes : 0);
      }
    }
  };
  if (o0 + G::ROWS <= op.O && i0 + G::R * G::EPC <= op.I) {
    copy(Fast<true>{});
  } else {
    copy(Fast<false>{});
  }
}

// VEC = 0, step 1: cp.async the aligned 16-byte chunks that hold each row's bytes of k-tile kt
// (R + 1 chunks per row) into the staging buffer at dst, unswizzled. Chunk j of row o starts at
// align16(row start) + 16 j; it copies only the bytes before the row's end (copy_chunk), so
// elements past I arrive as zeros and nothing past the operand is read. The bytes before the row
// start in its first chunk lie in the same 16-byte block as a valid element, hence in the same
// allocation; they are skipped by the shift.
template <typename T, bool KMAJ, int MN, int IT0, int IT1>
__device__ __forceinline__ void load_tile_staged(u32 dst, const Operand& op, int kt, int tid_) {
  const int tid = opaque(tid_);
  using G = Geo<T, KMAJ, MN>;
  long long o0, i0;
  tile_origin<T, KMAJ, MN>(op, kt, o0, i0);
  const u64 base = opaque(reinterpret_cast<u64>(op.base));
  const long long ld = opaque(op.ld);
  constexpr int TOTAL = G::ROWS * G::SR;
  auto copy = [&](auto fast) {
#pragma unroll
    for (int it = IT0; it < IT1; ++it) {
      const int q = tid + it * NT;
      if (TOTAL % NT == 0 || q < TOTAL) {
        const int row = q / G::SR;
        const int j = q - row * G::SR;
        const long long o = o0 + row;
        const u64 start = base + static_cast<u64>((o * ld + i0) * G::SZ);
        const u64 p = (start & ~static_cast<u64>(15)) + 16u * j;
        if constexpr (decltype(fast)::value) {
          cp_async16_full(dst + q * 16, reinterpret_cast<const char*>(p));
        } else {
          int bytes = 0;
          const u64 end = base + static_cast<u64>((o * ld + op.I) * G::SZ);
          if (o < op.O && p < end) bytes = end - p >= 16 ? 16 : static_cast<int>(end - p);
          copy_chunk<16>(dst + q * 16, bytes > 0 ? reinterpret_cast<const char*>(p) : op.base, bytes);
        }
      }
    }
  };
  // Inside the operand when every row's R + 1 chunks end before the row does (the last one
  // reaches at most one chunk of elements past the tile).
  if (o0 + G::ROWS <= op.O && i0 + (G::R + 1) * G::EPC <= op.I) {
    copy(Fast<true>{});
  } else {
    copy(Fast<false>{});
  }
}

// The copies of one k-tile come in 3 parts (A; the first half of B; the second half), issued
// before the MMAs of k-steps 0, 1 and 2 so that they interleave with them.
template <typename T, bool AK, bool BK, int VEC, int PART>
__device__ __forceinline__ void load_part(u32 dst, const Operand& opa, const Operand& opb, int kt, int tid) {
  using GA = Geo<T, AK, BM>;
  using GB = Geo<T, BK, BN>;
  if constexpr (VEC == 1) {
    constexpr int H = GB::PER_THREAD / 2;
    if constexpr (PART == 0) load_tile_vec<T, AK, BM, 0, GA::PER_THREAD>(dst, opa, kt, tid);
    if constexpr (PART == 1) load_tile_vec<T, BK, BN, 0, H>(dst + A_TILE, opb, kt, tid);
    if constexpr (PART == 2) load_tile_vec<T, BK, BN, H, GB::PER_THREAD>(dst + A_TILE, opb, kt, tid);
  } else {
    constexpr int H = GB::PER_THREAD * 2;
    if constexpr (PART == 0) load_tile_w4<T, AK, BM, 0, GA::PER_THREAD * 4>(dst, opa, kt, tid);
    if constexpr (PART == 1) load_tile_w4<T, BK, BN, 0, H>(dst + A_TILE, opb, kt, tid);
    if constexpr (PART == 2) load_tile_w4<T, BK, BN, H, GB::PER_THREAD * 4>(dst + A_TILE, opb, kt, tid);
  }
}

// VEC = 0, step 2: shift each row of the staged k-tile kt into its swizzled place at dst.
template <typename T, bool KMAJ, int MN, int IT0, int IT1, bool SW128 = false>
__device__ __forceinline__ void shift_tile(u32 dst, u32 stg, const Operand& op, int kt, int tid_) {
  const int tid = opaque(tid_);
  using G = Geo<T, KMAJ, MN>;
  long long o0, i0;
  tile_origin<T, KMAJ, MN>(op, kt, o0, i0);
  const int c = tid % G::R;
  const u32 base = static_cast<u32>(opaque(reinterpret_cast<u64>(op.base)));
  const u32 ld = static_cast<u32>(opaque(op.ld));
#pragma unroll
  for (int it = IT0; it < IT1; ++it) {
    const int row = tid / G::R + it * (NT / G::R);
    const u32 o = static_cast<u32>(o0) + row;  // only the low bits matter
    const u32 s = (base + (o * ld + static_cast<u32>(i0)) * G::SZ) & 15u;
    const u32 src = stg + (row * G::SR + c) * 16;
    const uint4 v = funnel16(lds128(src), lds128(src + 16), s);
    // SW128: wgmma's 128-byte swizzle (K-major rows of 128 bytes, chunk ^ row % 8)
    sts128(dst + (SW128 ? static_cast<u32>(row * 128 + ((c ^ (row & 7)) << 4)) : chunk_off<G::R>(row, c)), v);
  }
}

// VEC = 0: the staging copies (stg: the staging slot) and the shifts (stg -> dst, a compute
// slot) of one k-tile, in the same 3 parts.
template <typename T, bool AK, bool BK, int PART>
__device__ __forceinline__ void stage_part(u32 stg, const Operand& opa, const Operand& opb, int kt, int tid) {
  using GA = Geo<T, AK, BM>;
  constexpr int IB = Geo<T, BK, BN>::STAGED_ITERS, H = IB / 2;
  if constexpr (PART == 0) load_tile_staged<T, AK, BM, 0, GA::STAGED_ITERS>(stg, opa, kt, tid);
  if constexpr (PART == 1) load_tile_staged<T, BK, BN, 0, H>(stg + GA::STAGING, opb, kt, tid);
  if constexpr (PART == 2) load_tile_staged<T, BK, BN, H, IB>(stg + GA::STAGING, opb, kt, tid);
}
template <typename T, bool AK, bool BK, int PART>
__device__ __forceinline__ void shift_part(u32 dst, u32 stg, const Operand& opa, const Operand& opb, int kt,
                                           int tid) {
  using GA = Geo<T, AK, BM>;
  using GB = Geo<T, BK, BN>;
  constexpr int H = GB::PER_THREAD / 2;
  if constexpr (PART == 0) shift_tile<T, AK, BM, 0, GA::PER_THREAD>(dst, stg, opa, kt, tid);
  if constexpr (PART == 1) shift_tile<T, BK, BN, 0, H>(dst + A_TILE, stg + GA::STAGING, opb, kt, tid);
  if constexpr (PART == 2) shift_tile<T, BK, BN, H, GB::PER_THREAD>(dst + A_TILE, stg + GA::STAGING, opb, kt, tid);
}

// ------------------------------------------------------------------------------------ fragments
// Per-thread shared-memory offsets of the A and B fragments (see the file comment for the maps).
// A: 4 registers per m16 tile; B: 2 registers per n8 tile.
template <typename T, bool KMAJ> struct FragA {
  using G = Geo<T, KMAJ, BM>;
  u32 off[MI];  // per m16 tile (K-major: its row; MN-major: its column chunk), k-step 0
  int f;
  __device__ __forceinline__ void init(int wm, int lane) {
    if constexpr (KMAJ) {
      f = swz(lane);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) off[mi] = (wm * WM + mi * 16 + (lane & 15)) * G::R * 16;
    } else if constexpr (sizeof(T) == 2) {
      f = swz(lane);
      const int row = (lane & 7) + 8 * (lane >> 4);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int c = (wm * WM) / 8 + ((mi * 2 + ((lane >> 3) & 1)) ^ f);
        off[mi] = (row * G::R + c) * 16;
      }
    } else {  // fp32 MN-major: 32-bit loads at (k = t (+4), m = mi * 16 + g (+8))
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int e = wm * WM + mi * 16 + g;
        off[mi] = (t * G::R + ((e >> 2) ^ swz(t))) * 16 + (e & 3) * 4;
      }
      f = 0;
    }
  }
  // Load the fragments of k-step j (0..3) from the tile at smem address s.
  __device__ __forceinline__ void load(u32 (&a)[MI][4], u32 s, int j, int lane) const {
    if constexpr (KMAJ) {
      const u32 col = (((2 * j) | (lane >> 4)) ^ f) * 16;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldsm_x4(a[mi], s + off[mi] + col);
    } else if constexpr (sizeof(T) == 2) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldsm_x4_t(a[mi], s + off[mi] + j * 16 * G::R * 16);
    } else {
      // rows j*8 + t and j*8 + t + 4 (swz(t + 4) = swz(t) ^ 1); elements e and e + 8 (chunk + 2)
#pragma unroll
      // (offsets within the tile: bits 4-6 are the chunk within a 128-byte line; element e + 8
      // is chunk + 2 = chunk ^ 2, row t + 4 has swz ^ 1)
      for (int mi = 0; mi < MI; ++mi) {
        const u32 p = off[mi] + j * 8 * G::R * 16, q = p + 4 * G::R * 16;
        a[mi][0] = lds32(s + p);
        a[mi][1] = lds32(s + (p ^ 32));
        a[mi][2] = lds32(s + (q ^ 16));
        a[mi][3] = lds32(s + (q ^ 48));
      }
    }
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[mi][r] = to_tf32(a[mi][r]);
    }
  }
};

template <typename T, bool KMAJ> struct FragB {
  using G = Geo<T, KMAJ, BN>;
  u32 off[NI / 2];  // per pair of n8 tiles (fp32 MN-major: per n8 tile, see off2)
  u32 off2[NI / 2];
  int f;
  __device__ __forceinline__ void init(int wn, int lane) {
    if constexpr (KMAJ) {
      f = swz(lane);
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) off[p] = (wn * WN + p * 16 + (lane & 7) + 8 * (lane >> 4)) * G::R * 16;
    } else if constexpr (sizeof(T) == 2) {
      f = swz(lane);
      const int row = (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        const int c = (wn * WN) / 8 + ((2 * p + (lane >> 4)) ^ f);
        off[p] = (row * G::R + c) * 16;
      }
    } else {  // fp32 MN-major: 32-bit loads at (k = t (+4), n = ni * 8 + g)
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        const int e0 = wn * WN + 2 * p * 8 + g, e1 = e0 + 8;
        off[p] = (t * G::R + ((e0 >> 2) ^ swz(t))) * 16 + (e0 & 3) * 4;
        off2[p] = (t * G::R + ((e1 >> 2) ^ swz(t))) * 16 + (e1 & 3) * 4;
      }
      f = 0;
    }
  }
  __device__ __forceinline__ void load(u32 (&b)[NI][2], u32 s, int j, int lane) const {
    if constexpr (KMAJ) {
      const u32 col = (((2 * j) | ((lane >> 3) & 1)) ^ f) * 16;
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        u32 r[4];
        ldsm_x4(r, s + off[p] + col);
        b[2 * p][0] = r[0];
        b[2 * p][1] = r[1];
        b[2 * p + 1][0] = r[2];
        b[2 * p + 1][1] = r[3];
      }
    } else if constexpr (sizeof(T) == 2) {
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        u32 r[4];
        ldsm_x4_t(r, s + off[p] + j * 16 * G::R * 16);
        b[2 * p][0] = r[0];
        b[2 * p][1] = r[1];
        b[2 * p + 1][0] = r[2];
        b[2 * p + 1][1] = r[3];
      }
    } else {
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        const u32 p0 = off[p] + j * 8 * G::R * 16, p1 = off2[p] + j * 8 * G::R * 16;
        b[2 * p][0] = lds32(s + p0);
        b[2 * p][1] = lds32(s + ((p0 + 4 * G::R * 16) ^ 16));
        b[2 * p + 1][0] = lds32(s + p1);
        b[2 * p + 1][1] = lds32(s + ((p1 + 4 * G::R * 16) ^ 16));
      }
    }
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int n = 0; n < NI; ++n) {
        b[n][0] = to_tf32(b[n][0]);
        b[n][1] = to_tf32(b[n][1]);
      }
    }
  }
};

// The 32 MMAs of one k-step; serpentine over n so consecutive MMAs share an operand.
template <typename T>
__device__ __forceinline__ void mma_step(float (&acc)[MI][NI][4], const u32 (&a)[MI][4], const u32 (&b)[NI][2]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int n = (mi & 1) ? NI - 1 - ni : ni;
      Mma<T>::run(acc[mi][n], a[mi], b[n]);
    }
}

// One whole k-tile of MMAs (the simple loops): fragments of k-step j + 1 loaded while j multiplies.
template <typename T, bool AK, bool BK>
__device__ __forceinline__ void compute_tile(float (&acc)[MI][NI][4], const FragA<T, AK>& fa, const FragB<T, BK>& fb,
                                             u32 sa, u32 sb, int lane) {
  u32 a[2][MI][4], b[2][NI][2];
  fa.load(a[0], sa, 0, lane);
  fb.load(b[0], sb, 0, lane);
#pragma unroll
  for (int j = 0; j < KSTEPS; ++j) {
    if (j + 1 < KSTEPS) {
      fa.load(a[(j + 1) & 1], sa, j + 1, lane);
      fb.load(b[(j + 1) & 1], sb, j + 1, lane);
    }
    mma_step<T>(acc, a[j & 1], b[j & 1]);
  }
}

// Wait until at most stages - 2 groups of copies are pending (stages: 2, 3 or 4).
__device__ __forceinline__ void cp_async_wait_ring(int stages) {
  if (stages >= 4) {
    cp_async_wait<2>();
  } else if (stages == 3) {
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
}

// Two adjacent elements of C at p (aligned to both): the scaled epilogues' fp32 pairs go out as one
// 8-byte store (NVVM splits some Vec stores into 4-byte ones); the matmul path keeps its Vec store.
template <int EPI, typename TC> __device__ __forceinline__ void store_pair(TC* p, TC v0, TC v1) {
  if constexpr (EPI != EPI_STORE && sizeof(TC) == 4) {
    stg64(p, make_uint2(__float_as_uint(v0), __float_as_uint(v1)));
  } else {
    Vec<TC, 2> v;
    v.v[0] = v0;
    v.v[1] = v1;
    *reinterpret_cast<Vec<TC, 2>*>(p) = v;
  }
}

}  // namespace tc

// A_K: A is K-major (row-major, sa_k == 1) else M-major (sa_m == 1). B_K: B is K-major
// (column-major, sb_k == 1) else N-major (sb_n == 1). VEC: see the file comment; the host picks
// VEC = 1 only when all of A's and B's row starts are 16-byte aligned. TC, EPI: C's type and
// the epilogue (cukit/gemm.cuh; the defaults are the matmul path). Launch: 256 threads, grid
// (tiles_m * tiles_n, 1, min(batch, 65535)), dynamic shared memory 3 or 4 * 48 KiB (VEC = 1) or
// 2 * 48 KiB + 2 * staging (VEC = 0; see cukit/ops/matmul_tc.py).
template <typename T, int ACT, int A_K, int B_K, int VEC, typename TC = T, int EPI = EPI_STORE>
__global__ void __launch_bounds__(tc::NT, 1) matmul_tc(CUKIT_GEMM_PARAMS(T, TC)) {
  using namespace tc;
  constexpr bool AK = A_K != 0, BKM = B_K != 0;
  using GA = Geo<T, AK, BM>;
  using GB = Geo<T, BKM, BN>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const u32 smem = static_cast<u32>(__cvta_generic_to_shared(smem_raw));

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;

  // Grouped rasterization: consecutive blocks walk GROUP_M tile rows down one tile column, so
  // the blocks resident at once share A rows and B columns in L2.
  const int tiles_m = static_cast<int>((M + BM - 1) / BM);
  const int tiles_n = static_cast<int>((N + BN - 1) / BN);
  const int bid = blockIdx.x;
  const int group = GROUP_M * tiles_n;
  const int first_m = (bid / group) * GROUP_M;
  const int gsz = min(tiles_m - first_m, GROUP_M);
  const int tm = first_m + (bid % group) % gsz;
  const int tn = (bid % group) / gsz;
  const long long m0 = static_cast<long long>(tm) * BM, n0 = static_cast<long long>(tn) * BN;

  const int KT = static_cast<int>((K + GA::BK - 1) / GA::BK);
  const int stages = VEC != 0 ? static_cast<int>(dynamic_smem_size() / STAGE) : 2;

  FragA<T, AK> fa;
  FragB<T, BKM> fb;
  fa.init(wm, lane);
  fb.init(wn, lane);

  const long long nbatch = nb0 * nb1 * nb2;
  for (long long z = blockIdx.z; z < nbatch; z += gridDim.z) {
    const BatchOffsets off = batch_offset(z, sc, nb1, nb2, sa0, sa1, sa2, sb0, sb1, sb2);
    const Operand opa{reinterpret_cast<const char*>(A + off.a), AK ? sa_m : sa_k, AK ? M : K, AK ? K : M, m0};
    const Operand opb{reinterpret_cast<const char*>(B + off.b), BKM ? sb_n : sb_k, BKM ? N : K, BKM ? K : N, n0};

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;

    // Fragments of the current k-step (a[j & 1], b[j & 1]) and of the next one, loaded while the
    // current one multiplies; across k-tiles too (the barrier comes before the last k-step).
    if constexpr (VEC == 1 && sizeof(T) == 2) {
      u32 a[2][MI][4], b[2][NI][2];
      // Ring of `stages` slots; tile kt in slot kt % stages. Iteration kt: k-steps 0-2 issue the
      // copies of tile kt + stages - 1 (into the slot tile kt - 1 left, free since the last
      // barrier); before k-step 3, wait for tile kt + 1 and barrier, then prefetch its k-step 0.
      for (int s = 0; s < stages - 1; ++s) {
        if (s < KT) {
          load_part<T, AK, BKM, VEC, 0>(smem + s * STAGE, opa, opb, s, tid);
          load_part<T, AK, BKM, VEC, 1>(smem + s * STAGE, opa, opb, s, tid);
          load_part<T, AK, BKM, VEC, 2>(smem + s * STAGE, opa, opb, s, tid);
        }
        cp_async_commit();
      }
      cp_async_wait_ring(stages);
      __syncthreads();
      if (KT > 0) {
        fa.load(a[0], smem, 0, lane);
        fb.load(b[0], smem + A_TILE, 0, lane);
      }
      int rd = 0, wr = stages - 1;
      for (int kt = 0; kt < KT; ++kt) {
        const bool more = kt + stages - 1 < KT;
        const u32 sa = smem + rd * STAGE, sb = sa + A_TILE, dst = smem + wr * STAGE;
        const int lt = kt + stages - 1;
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
          if (j == 0 && more) load_part<T, AK, BKM, VEC, 0>(dst, opa, opb, lt, tid);
          if (j == 1 && more) load_part<T, AK, BKM, VEC, 1>(dst, opa, opb, lt, tid);
          if (j == 2 && more) load_part<T, AK, BKM, VEC, 2>(dst, opa, opb, lt, tid);
          if (j == 2) cp_async_commit();
          if (j + 1 < KSTEPS) {
            fa.load(a[(j + 1) & 1], sa, j + 1, lane);
            fb.load(b[(j + 1) & 1], sb, j + 1, lane);
          } else {
            cp_async_wait_ring(stages);
            __syncthreads();  // tile kt + 1 visible; no warp reads tile kt's slot after this but k-step 3
            rd = rd + 1 == stages ? 0 : rd + 1;
            wr = wr + 1 == stages ? 0 : wr + 1;
            if (kt + 1 < KT) {
              fa.load(a[0], smem + rd * STAGE, 0, lane);
              fb.load(b[0], smem + rd * STAGE + A_TILE, 0, lane);
            }
          }
          mma_step<T>(acc, a[j & 1], b[j & 1]);
        }
      }
      cp_async_wait<0>();
    } else if constexpr (VEC != 0) {
      // The simple ring (fp32 operands: the interleaved loop's extra live registers cost more
      // than it gains there): at the top of iteration kt wait for tile kt, barrier, issue all
      // copies of tile kt + stages - 1 into the slot tile kt - 1 left, then the whole k-tile.
      for (int s = 0; s < stages - 1; ++s) {
        if (s < KT) {
          load_part<T, AK, BKM, VEC, 0>(smem + s * STAGE, opa, opb, s, tid);
          load_part<T, AK, BKM, VEC, 1>(smem + s * STAGE, opa, opb, s, tid);
          load_part<T, AK, BKM, VEC, 2>(smem + s * STAGE, opa, opb, s, tid);
        }
        cp_async_commit();
      }
      int rd = 0, wr = stages - 1;
      for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait_ring(stages);
        __syncthreads();  // tile kt visible to all; slot wr no longer read (it held tile kt - 1)
        if (kt + stages - 1 < KT) {
          load_part<T, AK, BKM, VEC, 0>(smem + wr * STAGE, opa, opb, kt + stages - 1, tid);
          load_part<T, AK, BKM, VEC, 1>(smem + wr * STAGE, opa, opb, kt + stages - 1, tid);
          load_part<T, AK, BKM, VEC, 2>(smem + wr * STAGE, opa, opb, kt + stages - 1, tid);
        }
        cp_async_commit();
        compute_tile<T, AK, BKM>(acc, fa, fb, smem + rd * STAGE, smem + rd * STAGE + A_TILE, lane);
        rd = rd + 1 == stages ? 0 : rd + 1;
        wr = wr + 1 == stages ? 0 : wr + 1;
      }
      cp_async_wait<0>();
    } else {
      // Compute tiles in 2 slots at smem, staging in 2 slots after them. Tile kt: staged at the
      // top of iteration kt - 2 (prologue for 0 and 1), shifted into compute slot kt % 2 after
      // the MMAs of iteration kt - 1 (so that the shift's registers do not add to the
      // fragments'; the other warps' MMAs overlap it), multiplied in iteration kt.
      const u32 stg = smem + 2 * STAGE;
      constexpr int STG = GA::STAGING + GB::STAGING;
      if (KT > 0) {
        stage_part<T, AK, BKM, 0>(stg, opa, opb, 0, tid);
        stage_part<T, AK, BKM, 1>(stg, opa, opb, 0, tid);
        stage_part<T, AK, BKM, 2>(stg, opa, opb, 0, tid);
      }
      cp_async_commit();
      if (KT > 1) {
        stage_part<T, AK, BKM, 0>(stg + STG, opa, opb, 1, tid);
        stage_part<T, AK, BKM, 1>(stg + STG, opa, opb, 1, tid);
        stage_part<T, AK, BKM, 2>(stg + STG, opa, opb, 1, tid);
      }
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      if (KT > 0) {
        shift_part<T, AK, BKM, 0>(smem, stg, opa, opb, 0, tid);
        shift_part<T, AK, BKM, 1>(smem, stg, opa, opb, 0, tid);
        shift_part<T, AK, BKM, 2>(smem, stg, opa, opb, 0, tid);
      }
      for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt & 1, nxt = cur ^ 1;
        cp_async_wait<0>();
        __syncthreads();  // tile kt shifted and visible; staging slot cur and compute slot nxt free
        if (kt + 2 < KT) {
          stage_part<T, AK, BKM, 0>(stg + cur * STG, opa, opb, kt + 2, tid);
          stage_part<T, AK, BKM, 1>(stg + cur * STG, opa, opb, kt + 2, tid);
          stage_part<T, AK, BKM, 2>(stg + cur * STG, opa, opb, kt + 2, tid);
        }
        cp_async_commit();
        compute_tile<T, AK, BKM>(acc, fa, fb, smem + cur * STAGE, smem + cur * STAGE + A_TILE, lane);
        if (kt + 1 < KT) {
          shift_part<T, AK, BKM, 0>(smem + nxt * STAGE, stg + nxt * STG, opa, opb, kt + 1, tid);
          shift_part<T, AK, BKM, 1>(smem + nxt * STAGE, stg + nxt * STG, opa, opb, kt + 1, tid);
          shift_part<T, AK, BKM, 2>(smem + nxt * STAGE, stg + nxt * STG, opa, opb, kt + 1, tid);
        }
      }
      cp_async_wait<0>();
    }

    // Epilogue in fp32 (cukit/gemm.cuh's epilogue_out), rounded once to TC. Thread (g, t) of a
    // warp holds rows g and g + 8 of each m16 tile, columns 2t and 2t + 1 of each n8 tile; a
    // quad's pairs are one 16-byte (16-bit C) or 32-byte (fp32 C) piece of a row.
    TC* Cz = C + off.c;
    const int g = lane >> 2, t = lane & 3;
    const bool pair = (N % 2 == 0) && (ldc % 2 == 0) && (reinterpret_cast<u64>(Cz) % (2 * sizeof(TC)) == 0);
    const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    float bv[NI][2];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const long long col = n0 + wn * WN + ni * 8 + 2 * t;
      bv[ni][0] = (bias != nullptr && col < N) ? to_acc<float>(bias[col]) : 0.0f;
      bv[ni][1] = (bias != nullptr && col + 1 < N) ? to_acc<float>(bias[col + 1]) : 0.0f;
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const long long row = m0 + wm * WM + mi * 16 + g + 8 * h;
        if (row >= M) continue;
        TC* crow = Cz + row * ldc;
        // EPI_ACCUMULATE: the row's C values, all loaded before its first store (in flight together)
        float old[NI][2];
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          old[ni][0] = old[ni][1] = 0.0f;
          const long long col = n0 + wn * WN + ni * 8 + 2 * t;
          if (EPI == EPI_ACCUMULATE && col < N) {
            if (pair) {
              const Vec<TC, 2> v = *reinterpret_cast<const Vec<TC, 2>*>(crow + col);
              old[ni][0] = to_acc<float>(v.v[0]);
              old[ni][1] = to_acc<float>(v.v[1]);
            } else {
              old[ni][0] = to_acc<float>(crow[col]);
              if (col + 1 < N) old[ni][1] = to_acc<float>(crow[col + 1]);
            }
          }
        }
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const long long col = n0 + wn * WN + ni * 8 + 2 * t;
          if (col >= N) continue;
          const TC v0 = from_acc<TC>(epilogue_out<EPI, ACT, float, sizeof(TC) == 2>(acc[mi][ni][2 * h], bv[ni][0], al,
                                                                                  be, old[ni][0]));
          const TC v1 = from_acc<TC>(epilogue_out<EPI, ACT, float, sizeof(TC) == 2>(acc[mi][ni][2 * h + 1], bv[ni][1],
                                                                                  al, be, old[ni][1]));
          if (pair) {  // col is even and col + 1 < N (N even)
            store_pair<EPI>(crow + col, v0, v1);
          } else {
            crow[col] = v0;
            if (col + 1 < N) crow[col + 1] = v1;
          }
        }
      }
    }
    __syncthreads();  // the next batch's prologue overwrites shared memory
  }
}

// ============================================================================================
// sm_90a: wgmma (warpgroup MMA) for K-major A and B (A row-major, B column-major: x @ W.T),
// 16-byte aligned rows. Same block tile (128 x 256 x 128 bytes), 2 warpgroups of 64 x 256 each
// (wgmma m64n256k16, 128 fp32 accumulators per thread), operands straight from shared memory in
// the 128-byte-swizzle layout (chunk ^ (row % 8), 1024-byte aligned), a 4-slot cp.async ring
// loading 2 tiles ahead (a slot is refilled only after the wgmmas that read it have completed).
// Compiled only with -arch=sm_90a (cukit/ops/matmul_tc.py's KERNELS_SM90A).
// ============================================================================================
namespace tcw {
using namespace cukit::ptx;
using namespace cukit::sm90;

__device__ __forceinline__ u32 off128(int row, int c) { return static_cast<u32>(row * 128 + ((c ^ (row & 7)) << 4)); }

// One operand's k-tile (rows x 128 bytes, K-major) by cp.async, 16-byte chunks, swizzled.
template <typename T, int ROWS>
__device__ __forceinline__ void load_kmajor(u32 dst, const tc::Operand& op, int kt, int tid) {
  constexpr int EPC = 16 / sizeof(T), BK = 128 / sizeof(T), PER = ROWS * 8 / tc::NT;
  const int c = tid & 7, row0 = tid >> 3;
  const long long i = static_cast<long long>(kt) * BK + c * EPC;
  const long long rem = op.I - i;
  const int vbytes = rem <= 0 ? 0 : (rem >= EPC ? 16 : static_cast<int>(rem) * static_cast<int>(sizeof(T)));
  const long long ld = tc::opaque(op.ld);
  const char* src = op.base + ((op.mn0 + row0) * ld + i) * static_cast<long long>(sizeof(T));
  const long long step = 32 * ld * static_cast<long long>(sizeof(T));
  const long long rows_left = op.O - op.mn0 - row0;
  const u32 d = dst + off128(row0, c);
  if (op.mn0 + ROWS <= op.O && static_cast<long long>(kt + 1) * BK <= op.I) {  // interior tile
#pragma unroll
    for (int it = 0; it < PER; ++it) ptx::cp_async16_full(d + it * 32 * 128, src + it * step);
  } else {
#pragma unroll
    for (int it = 0; it < PER; ++it) {
      const bool ok = 32 * it < rows_left && vbytes > 0;
      ptx::copy_chunk<16>(d + it * 32 * 128, src + it * step, ok ? vbytes : 0);
    }
  }
}

// Epilogue of a warpgroup's 64 x 256 accumulators (rows r0.., columns n0..) into C (row-major,
// N columns, rows ldc apart) after bias + activation in fp32. Warp w of the warpgroup holds rows 16 (w % 4) + g
// and + 8; d[4 i + r]: columns 8 i + 2 t (+1), rows g (r < 2) and g + 8 (r >= 2).
template <typename T, int ACT>
__device__ __forceinline__ void store_tile(const float (&d)[128], T* Cz, const T* bias, long long M, long long N,
                                           long long ldc, long long r0, long long n0, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const bool pair = (N % 2 == 0) && (ldc % 2 == 0) && (reinterpret_cast<u64>(Cz) % (2 * sizeof(T)) == 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long row = r0 + (warp & 3) * 16 + g + 8 * h;
    if (row >= M) continue;
    T* crow = Cz + row * ldc;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const long long col = n0 + 8 * i + 2 * t;
      if (col >= N) continue;
      const float b0 = bias != nullptr ? to_acc<float>(bias[col]) : 0.0f;
      const float b1 = (bias != nullptr && col + 1 < N) ? to_acc<float>(bias[col + 1]) : 0.0f;
      const T v0 = from_acc<T>(epilogue<ACT, float, sizeof(T) == 2>(d[4 * i + 2 * h], b0));
      const T v1 = from_acc<T>(epilogue<ACT, float, sizeof(T) == 2>(d[4 * i + 2 * h + 1], b1));
      if (pair) {
        Vec<T, 2> v;
        v.v[0] = v0;
        v.v[1] = v1;
        *reinterpret_cast<Vec<T, 2>*>(crow + col) = v;
      } else {
        crow[col] = v0;
        if (col + 1 < N) crow[col + 1] = v1;
      }
    }
  }
}

}  // namespace tcw

// wgmma path: A K-major (sa_k == 1), B K-major (sb_k == 1). VEC = 1: every row start 16-byte
// aligned; VEC = 0: any alignment. The matmul epilogue only (EPI_STORE, C in T: alpha and beta
// are ignored). Launch: 256 threads, grid as matmul_tc, dynamic shared memory 4 * 48 KiB + 1 KiB
// (VEC = 1) or 2 * 48 KiB + 2 * 54 KiB + 1 KiB (VEC = 0).
template <typename T, int ACT, int VEC>
__global__ void __launch_bounds__(tc::NT, 1) matmul_tc_wgmma(CUKIT_GEMM_PARAMS(T, T)) {
  using namespace tc;
  constexpr int BKE = KB / static_cast<int>(sizeof(T));
  constexpr int S = 4;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 smem = (static_cast<u32>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int tiles_m = static_cast<int>((M + BM - 1) / BM);
  const int tiles_n = static_cast<int>((N + BN - 1) / BN);
  const int bid = blockIdx.x;
  const int group = GROUP_M * tiles_n;
  const int first_m = (bid / group) * GROUP_M;
  const int gsz = min(tiles_m - first_m, GROUP_M);
  const int tm = first_m + (bid % group) % gsz;
  const int tn = (bid % group) / gsz;
  const long long m0 = static_cast<long long>(tm) * BM, n0 = static_cast<long long>(tn) * BN;
  const int KT = static_cast<int>((K + BKE - 1) / BKE);

  const long long nbatch = nb0 * nb1 * nb2;
  for (long long z = blockIdx.z; z < nbatch; z += gridDim.z) {
    const BatchOffsets off = batch_offset(z, sc, nb1, nb2, sa0, sa1, sa2, sb0, sb1, sb2);
    const Operand opa{reinterpret_cast<const char*>(A + off.a), sa_m, M, K, m0};
    const Operand opb{reinterpret_cast<const char*>(B + off.b), sb_n, N, K, n0};

    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;

    if constexpr (VEC == 1) {
      for (int s = 0; s < S - 2; ++s) {
        if (s < KT) {
          tcw::load_kmajor<T, BM>(smem + s * STAGE, opa, s, tid);
          tcw::load_kmajor<T, BN>(smem + s * STAGE + A_TILE, opb, s, tid);
        }
        cp_async_commit();
      }
      for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 3>();
        sm90::fence_proxy_async();  // the copies (generic proxy) before the wgmmas (async proxy) read them
        __syncthreads();           // tile kt visible; every warpgroup's wgmmas of tile kt - 2 are complete
        if (kt + S - 2 < KT) {
          const u32 dst = smem + ((kt + S - 2) % S) * STAGE;
          tcw::load_kmajor<T, BM>(dst, opa, kt + S - 2, tid);
          tcw::load_kmajor<T, BN>(dst + A_TILE, opb, kt + S - 2, tid);
        }
        cp_async_commit();
        const u32 sa = smem + (kt % S) * STAGE + wg * 64 * 128, sb = smem + (kt % S) * STAGE + A_TILE;
        sm90::wg_fence();
  #pragma unroll
        for (int j = 0; j < 4; ++j) sm90::Wgmma<T>::template run<0, 0>(d, sm90::desc128(sa + 32 * j), sm90::desc128(sb + 32 * j));
        sm90::wg_commit();
        sm90::wg_wait<1>(d);
      }
    } else {
      // Any alignment: tiles staged by cp.async two ahead and shifted into the 128-byte-swizzle
      // layout (as matmul_tc's VEC = 0) in 2 compute slots; the shift of tile kt + 1 runs while
      // the wgmmas of tile kt execute.
      using GA = Geo<T, true, BM>;
      using GB = Geo<T, true, BN>;
      const u32 stg = smem + 2 * STAGE;
      constexpr int STG = GA::STAGING + GB::STAGING;
      constexpr int IA = GA::STAGED_ITERS, IB = GB::STAGED_ITERS;
      if (KT > 0) {
        load_tile_staged<T, true, BM, 0, IA>(stg, opa, 0, tid);
        load_tile_staged<T, true, BN, 0, IB>(stg + GA::STAGING, opb, 0, tid);
      }
      cp_async_commit();
      if (KT > 1) {
        load_tile_staged<T, true, BM, 0, IA>(stg + STG, opa, 1, tid);
        load_tile_staged<T, true, BN, 0, IB>(stg + STG + GA::STAGING, opb, 1, tid);
      }
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      if (KT > 0) {
        shift_tile<T, true, BM, 0, GA::PER_THREAD, true>(smem, stg, opa, 0, tid);
        shift_tile<T, true, BN, 0, GB::PER_THREAD, true>(smem + A_TILE, stg + GA::STAGING, opb, 0, tid);
      }
      for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt & 1, nxt = cur ^ 1;
        cp_async_wait<0>();
        sm90::fence_proxy_async();  // this thread's shifted stores before the wgmmas read them
        __syncthreads();  // tile kt shifted, tile kt + 1 staged; the wgmmas of tile kt - 1 complete
        if (kt + 2 < KT) {
          load_tile_staged<T, true, BM, 0, IA>(stg + cur * STG, opa, kt + 2, tid);
          load_tile_staged<T, true, BN, 0, IB>(stg + cur * STG + GA::STAGING, opb, kt + 2, tid);
        }
        cp_async_commit();
        const u32 sa = smem + cur * STAGE + wg * 64 * 128, sb = smem + cur * STAGE + A_TILE;
        sm90::wg_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) sm90::Wgmma<T>::template run<0, 0>(d, sm90::desc128(sa + 32 * j), sm90::desc128(sb + 32 * j));
        sm90::wg_commit();
        if (kt + 1 < KT) {
          const u32 dst = smem + nxt * STAGE, src = stg + nxt * STG;
          shift_tile<T, true, BM, 0, GA::PER_THREAD, true>(dst, src, opa, kt + 1, tid);
          shift_tile<T, true, BN, 0, GB::PER_THREAD, true>(dst + A_TILE, src + GA::STAGING, opb, kt + 1, tid);
        }
        sm90::wg_wait<0>(d);
      }
    }
    sm90::wg_wait<0>(d);
    cp_async_wait<0>();

    tcw::store_tile<T, ACT>(d, C + off.c, bias, M, N, ldc, m0 + wg * 64, n0, warp, lane);
    __syncthreads();
  }
}

// ============================================================================================
// sm_90a: TMA + warp-specialised wgmma, 16-bit (any operand layout) or float as tf32 (A and B both
// K-major: x @ W.T; PTX's tf32 wgmma has no transpose), 16-byte aligned rows.
//
// Four block-tile widths, template BN (cukit/ops/matmul_tc.py's tma_tile_n picks one per problem
// by a wave-quantisation model): 128 x 256 (the default: fewer bytes per FLOP), 128 x 192 (full
// waves where 256 leaves them ragged: 4096 x 768 is 128 such tiles, one wave on 132 SMs), 128 x
// 128 (more tiles: fuller last waves on medium shapes, e.g. 8192 x 768 = 192 tiles of 128 x 256
// on 132 SMs is 1.45 waves, 384 tiles of 128 x 128 are 2.9) and 128 x 64 (for problems with fewer
// 128 x 128 tiles than SMs: 1024^3 is 64 of them, 128 tiles of 128 x 64).
//
// 288 threads: warpgroups 0 and 1 consume (cooperative, BN = 256 or 192: each 64 x BN of every tile,
// wgmma m64nBNk16 straight from shared memory; ping-pong, BN = 128 or 64: each whole tiles in
// turn, see PP at the kernel), warp 8 produces: one thread issues the bulk tensor copies
// (cp.async.bulk.tensor, the TMA engine) of every k-tile into an S-stage ring (Cfg<BN>: 4 stages
// of 48 KiB for BN = 256, 4 of 40 KiB for 192, 6 of 32 KiB for 128, 8 of 24 KiB for 64: as many as fit beside
// the epilogue staging, at most 8).
// Stage s has a "full" mbarrier (the producer's arrive.expect_tx; the copy engine completes the
// bytes) and an "empty" one (each consumer warp arrives once the wgmmas that read the stage have
// completed), so loads never wait on a CTA-wide barrier and run up to S k-tiles ahead of the
// MMAs, across tile boundaries. Persistent: CTA b takes tiles b, b + gridDim.x, ... (grouped
// raster), so the producer fills the next tile's stages while the consumers run the epilogue.
//
// The tensor maps (cukit/ops/matmul_tc.py encodes them with cuTensorMapEncodeTiled) are 3-D:
// (contiguous dim, other dim, batch), 128-byte swizzle, out-of-bounds boxes zero-filled (any M,
// N, K: the edges need no predication). Box per operand and k-tile of 128 bytes of K (64
// elements of a 16-bit type, 32 of float; shown for 16-bit):
//   K-major A (row-major):     {64 k, 128 m}        -> 128 rows of 128 bytes
//   M-major A (A^T row-major): 2 x {64 m, 64 k}     -> 2 blocks of 64 k-rows x 128 bytes
//   K-major B (B^T row-major, nn.Linear's weight): {64 k, BN n}
//   N-major B (row-major):     BN / 64 x {64 n, 64 k}
// wgmma reads K-major tiles with the descriptor of desc128 (k16 step j, tf32's k8: +32 bytes) and MN-major
// ones with the transpose bit, leading byte offset 8 KiB (next 64 elements of M/N) and stride
// byte offset 1 KiB (next 8 k-rows); k16 step j: +2 KiB.
// ============================================================================================
namespace tma {
using namespace cukit::ptx;
using namespace cukit::sm90;

constexpr int THREADS = 288;            // 2 consumer warpgroups + 1 producer warp
constexpr int CONSUMER_WARPS = 8;       // each arrives on "empty" once per stage
constexpr int A_BYTES = tc::A_TILE;     // 16 KiB: 128 rows (M) x 128 bytes (K)
constexpr int SMEM_MAX = 227 * 1024;    // opt-in shared memory per block (sm_90)
constexpr int ALIGN = 1024;             // 128-byte-swizzled tiles start on 1024-byte boundaries

// Epilogue staging (store_tile_staged): per consumer warpgroup 64 rows x 128 columns of T.
constexpr int OUT_ROW = 128 * 2 + 8;   // staging row stride (bytes): fragment writes 2-way conflicted at most
constexpr int OUT_BYTES = 64 * OUT_ROW;  // one warpgroup's staging buffer

// Everything that depends on the block-tile width. Dynamic shared memory of a launch: SMEM
// (cukit/ops/matmul_tc.py's TMA_SMEM[BN] computes the same), laid out as the ring (S stages,
// A then B), the two staging buffers, S "full" and S "empty" mbarriers, and up to 1 KiB lost to
// aligning the ring.
template <int BN> struct Cfg {
  static_assert(BN == 256 || BN == 192 || BN == 128 || BN == 64,
                "TMA block tiles are 128 x 256, 128 x 192, 128 x 128 or 128 x 64");
  static constexpr int B_BYTES = BN * tc::KB;       // 32 / 24 / 16 / 8 KiB
  static constexpr int STAGE = A_BYTES + B_BYTES;   // 48 / 40 / 32 / 24 KiB
  static constexpr int FIT = (SMEM_MAX - 2 * OUT_BYTES - ALIGN) / (STAGE + 16);
  static constexpr int S = FIT < 8 ? FIT : 8;       // ring stages: 4 / 4 / 6 / 8
  static constexpr int SMEM = S * STAGE + 2 * OUT_BYTES + 16 * S + ALIGN;
  static constexpr int ACC = BN / 2;                // fp32 accumulators per consumer thread
  static constexpr int PASS = BN % 128 == 0 ? 128 : 64;  // columns per pass of store_tile_staged
  static constexpr int PASSES = BN / PASS;          // its passes per 64 x BN tile of a warpgroup
  static constexpr int GROUP_M = tc::GROUP_M;       // raster: tile rows swept per column of tiles
  static_assert(S >= 3 && SMEM <= SMEM_MAX, "the ring does not fit in shared memory");
  static_assert(STAGE % ALIGN == 0 && A_BYTES % ALIGN == 0, "tiles must stay 1024-byte aligned");
};

template <bool KMAJ> __device__ __forceinline__ u64 desc(u32 base, int j) {
  return KMAJ ? sm90::desc128(base + 32 * j) : desc_mn(base + 2048 * j);
}

// The descriptors of the mainloop as offsets from those of the ring's first stage: a descriptor's
// low 14 bits are its address / 16, and every tile address stays under 256 KiB, so moving the
// address by b bytes adds b / 16 to the low word with no carry out of the field. desc() computes
// that field with a mask and a shift per wgmma; desc_at is one 32-bit add.
template <bool KMAJ> __device__ constexpr u32 desc_step() {  // bytes of one k16 step (tf32: k8)
  return KMAJ ? 32 : 2048;
}
__device__ __forceinline__ u64 desc_at(u64 first, u32 bytes) {
  return (first & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(first) + (bytes >> 4));
}

// Tile t of the flattened (batch, tile) index, tiles of 128 x BN (tiles_n = ceil(N / BN)): grouped
// raster within a batch, Cfg<BN>::GROUP_M tile rows per column of tiles.
template <int BN>
__device__ __forceinline__ void tile_coords(long long t, int tiles_m, int tiles_n, int& z, int& tm, int& tn) {
  constexpr int GM = Cfg<BN>::GROUP_M;
  const long long tiles = static_cast<long long>(tiles_m) * tiles_n;
  z = static_cast<int>(t / tiles);
  const int r = static_cast<int>(t - static_cast<long long>(z) * tiles);
  const int group = GM * tiles_n;
  const int first_m = (r / group) * GM;
  const int gsz = min(tiles_m - first_m, GM);
  tm = first_m + (r % group) % gsz;
  tn = (r % group) / gsz;
}

// Epilogue through shared memory: the warpgroup's 64 x BN accumulators go out in passes of
// 64 x 128 (BN = 64 or 192: passes of 64 x 64; Cfg<BN>::PASS). Each pass: bias + activation, converted to T and written to the warpgroup's
// staging buffer (fragment layout), a warpgroup barrier, then written to C row by row: 16-byte
// vector stores when C's rows are 16-byte aligned, else 2-byte stores of 64 contiguous bytes per
// instruction. Storing the fragments directly touches 8 rows per instruction in 8- or 16-byte
// pieces (partial sectors; 2-byte pieces when N is odd).
template <typename T> __device__ __forceinline__ u32 bits16(T v) {
  return static_cast<u32>(*reinterpret_cast<const unsigned short*>(&v));
}
__device__ __forceinline__ void wg_bar(int wg) {
  bar_sync<128>(1 + wg);
}

// Ping-pong order: barrier 3 + wg is "warpgroup wg may start its next mainloop"; the other
// warpgroup arrives on it once it has issued its own mainloop's last wgmmas (256 = both groups).
__device__ __forceinline__ void order_wait(int wg) {
  bar_sync<256>(3 + wg);
}
__device__ __forceinline__ void order_signal(int other) {
  bar_arrive<256>(3 + other);
}

template <typename T, int ACT, int BN>
__device__ __forceinline__ void store_tile_staged(const float (&d)[BN / 2], u32 stg, T* Cz, const T* bias,
                                                  long long M, long long N, long long ldc, long long r0,
                                                  long long n0, int wg, int warp, int lane) {
  static_assert(sizeof(T) == 2, "the matmul epilogue stages 16-bit C");
  const int g = lane >> 2, t = lane & 3, w = warp & 3;
  constexpr int PASS = Cfg<BN>::PASS;  // columns per pass
  constexpr int CH = PASS / 8;         // 16-byte chunks per staged row
  constexpr int RPI = 32 / CH;         // rows per warp instruction of the vector path
  const bool vec = (N % 8 == 0) && (ldc % 8 == 0) && (reinterpret_cast<u64>(Cz) % 16 == 0);
#pragma unroll
  for (int half = 0; half < Cfg<BN>::PASSES; ++half) {
#pragma unroll
    for (int i = 0; i < PASS / 8; ++i) {
      const int ii = half * (PASS / 8) + i;  // n8 block of the BN columns
      const long long col = n0 + 8 * ii + 2 * t;
      const float b0 = (bias != nullptr && col < N) ? to_acc<float>(bias[col]) : 0.0f;
      const float b1 = (bias != nullptr && col + 1 < N) ? to_acc<float>(bias[col + 1]) : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const T v0 = from_acc<T>(epilogue<ACT, float, sizeof(T) == 2>(d[4 * ii + 2 * h], b0));
        const T v1 = from_acc<T>(epilogue<ACT, float, sizeof(T) == 2>(d[4 * ii + 2 * h + 1], b1));
        ptx::sts32(stg + (w * 16 + g + 8 * h) * OUT_ROW + (8 * i + 2 * t) * 2, bits16(v0) | (bits16(v1) << 16));
      }
    }
    wg_bar(wg);
    const long long c0 = n0 + PASS * half;
    if (vec) {  // RPI rows of CH chunks per instruction
#pragma unroll
      for (int it = 0; it < 16 / RPI; ++it) {
        const int lr = w * 16 + RPI * it + lane / CH, ch = lane % CH;
        const long long row = r0 + lr, col = c0 + 8 * ch;
        if (row < M && col < N) {
          const u32 a = stg + lr * OUT_ROW + ch * 16;
          const uint2 lo = lds64(a), hi = lds64(a + 8);
          stg128(Cz + row * ldc + col, make_uint4(lo.x, lo.y, hi.x, hi.y));  // NVVM splits a uint4 store
        }
      }
    } else {  // one row of 32 elements per instruction
      unsigned short* C16 = reinterpret_cast<unsigned short*>(Cz);
      for (int lr = w * 16; lr < w * 16 + 16; ++lr) {
        const long long row = r0 + lr;
        if (row >= M) break;
#pragma unroll
        for (int k = 0; k < PASS / 32; ++k) {
          const int lc = 32 * k + lane;
          const long long col = c0 + lc;
          if (col < N) {
            C16[row * ldc + col] = lds16(stg + lr * OUT_ROW + lc * 2);
          }
        }
      }
    }
    wg_bar(wg);  // the buffer is rewritten by the next pass (or tile)
  }
}

// The scaled epilogues (EPI_SCALE, EPI_ACCUMULATE; C in T or fp32), and the matmul epilogue of
// float (tf32) inputs, whose C is fp32 too, stage fp32 in the same buffer:
// BN / 64 passes of 64 x 64, rows of 256 bytes whose 16-byte chunk c sits at chunk c ^ 2 (r % 4)
// (wide_off), so that both the fragment writes (8 bytes; a half-warp covers rows g = 0..3, chunks
// 2 i + t / 2: 8 distinct chunks mod 8) and the row reads (16 bytes; a quarter-warp reads 8
// chunks of one row) hit 32 distinct banks. The staging buffer keeps its size (64 x 256 bytes
// fit in OUT_BYTES), so the ring keeps its stages. Each pass: alpha (acc + bias) staged, a
// warpgroup barrier, then each row written with 4 elements per lane (16-byte stores for fp32 C,
// 8-byte for 16-bit C; element-wise stores where C's rows are not 4-element aligned), beta C
// added in fp32 and rounded once. EPI_SCALE never reads C.
//
// EPI_ACCUMULATE loads a lane's 8 vectors of C for a pass right after the pass's barrier, all
// before the first store (8 loads in flight per lane), and the producer warp has prefetched the
// tile's C into L2 (prefetch_c, a few k-tiles before the epilogue), so the pass waits for one L2
// round trip. Loading them earlier (during the staging, or during the previous pass) keeps 32
// more registers live beside the accumulators of the passes not yet staged, past the 168 of a
// 288-thread CTA: ptxas spills (checked with --ptxas-options=-v: 0 bytes of spills as written).
constexpr int WIDE_ROW = 64 * 4;  // bytes of one staged fp32 row of a pass
static_assert(64 * WIDE_ROW <= OUT_BYTES, "a pass of 64 x 64 fp32 must fit in a warpgroup's staging buffer");

__device__ __forceinline__ u32 wide_off(int row, int chunk) {
  return static_cast<u32>(row * WIDE_ROW + ((chunk ^ ((row & 3) << 1)) << 4));
}

// EPI_ACCUMULATE: prefetch.global.L2 for `rows` rows (r0..) of a tile's BN columns (n0..) of C, one
// per 128-byte line, spread over `nthreads` threads (this one: tid).
template <typename TC, int BN>
__device__ __forceinline__ void prefetch_c(const TC* Cz, long long M, long long N, long long ldc, long long r0,
                                           long long n0, int rows, int tid, int nthreads) {
  constexpr int LINE = 128 / static_cast<int>(sizeof(TC));  // elements per line
  constexpr int LINES = BN / LINE;                           // lines per row of the tile
  for (int q = tid; q < rows * LINES; q += nthreads) {
    const long long row = r0 + q / LINES, col = n0 + (q % LINES) * LINE;
    if (row < M && col < N) prefetch_l2(Cz + row * ldc + col);
  }
}

template <typename T, typename TC, int ACT, int EPI, int BN>
__device__ __forceinline__ void store_tile_wide(const float (&d)[BN / 2], u32 stg, TC* Cz, const T* bias, float alpha,
                                                float beta, long long M, long long N, long long ldc, long long r0,
                                                long long n0, int wg, int warp, int lane) {
  static_assert(EPI != EPI_STORE || sizeof(TC) == 4, "store_tile_wide runs the scaled epilogues and fp32 C's matmul one");
  const int g = lane >> 2, t = lane & 3, w = warp & 3;
  // Vector path: every row start aligned to 4 elements. EPI_SCALE: N need not be a multiple of 4
  // (the padded rows of a logits buffer with an odd vocabulary still take vector stores; a row's
  // partial last chunk goes element by element). EPI_ACCUMULATE: N % 4 == 0 too (the partial
  // chunks' reads of C would take registers that its spill-free schedule does not have).
  const bool vec = (ldc % 4 == 0) && (reinterpret_cast<u64>(Cz) % (4 * sizeof(TC)) == 0) &&
                   (EPI != EPI_ACCUMULATE || N % 4 == 0);
  const int rr = w * 16 + (lane >> 4), ch = lane & 15;  // vector path: rows rr + 2 it, chunk ch
#pragma unroll
  for (int pass = 0; pass < BN / 64; ++pass) {
    const long long c0 = n0 + 64 * pass;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int ii = pass * 8 + i;  // n8 block of the BN columns
      const long long cb = n0 + 8 * ii + 2 * t;
      const float b0 = (bias != nullptr && cb < N) ? to_acc<float>(bias[cb]) : 0.0f;
      const float b1 = (bias != nullptr && cb + 1 < N) ? to_acc<float>(bias[cb + 1]) : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v0, v1;
        if constexpr (EPI == EPI_STORE) {  // fp32 C: the exact activations
          v0 = epilogue<ACT, float>(d[4 * ii + 2 * h], b0);
          v1 = epilogue<ACT, float>(d[4 * ii + 2 * h + 1], b1);
        } else {
          v0 = alpha * (d[4 * ii + 2 * h] + b0);
          v1 = alpha * (d[4 * ii + 2 * h + 1] + b1);
        }
        sts64(stg + wide_off(w * 16 + g + 8 * h, 2 * i + (t >> 1)) + (t & 1) * 8, __float_as_uint(v0),
              __float_as_uint(v1));
      }
    }
    wg_bar(wg);
    if (vec) {  // 2 rows of 16 chunks per instruction; a row's last, partial chunk element by element
      const long long col = c0 + 4 * ch;
      const bool full = EPI == EPI_ACCUMULATE ? col < N : col + 4 <= N;  // (EPI_ACCUMULATE: N % 4 == 0)
      Vec<TC, 4> old[8];  // EPI_ACCUMULATE: all loaded before the first store (in flight together)
      if constexpr (EPI == EPI_ACCUMULATE) {
#pragma unroll
        for (int it = 0; it < 8; ++it) {
          const long long row = r0 + rr + 2 * it;
          old[it] = (row < M && full) ? load_vec<TC, 4>(Cz + row * ldc + col) : Vec<TC, 4>{};
        }
      }
#pragma unroll
      for (int it = 0; it < 8; ++it) {
        const int lr = rr + 2 * it;
        const long long row = r0 + lr;
        if (row < M && full) {
          const uint4 sv = lds128(stg + wide_off(lr, ch));
          float x[4] = {__uint_as_float(sv.x), __uint_as_float(sv.y), __uint_as_float(sv.z), __uint_as_float(sv.w)};
          if constexpr (EPI == EPI_ACCUMULATE) {
#pragma unroll
            for (int j = 0; j < 4; ++j) x[j] = fmaf(beta, to_acc<float>(old[it].v[j]), x[j]);
          }
          TC* p = Cz + row * ldc + col;
          if constexpr (sizeof(TC) == 4) {
            stg128(p, make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]),
                                 __float_as_uint(x[3])));
          } else {
            stg64(p, make_uint2(bits16(from_acc<TC>(x[0])) | (bits16(from_acc<TC>(x[1])) << 16),
                                bits16(from_acc<TC>(x[2])) | (bits16(from_acc<TC>(x[3])) << 16)));
          }
        }
      }
      if constexpr (EPI != EPI_ACCUMULATE) {
        if (!full && col < N) {  // this lane's chunk is its rows' partial last one: element by element
          for (int it = 0; it < 8; ++it) {
            const int lr = rr + 2 * it;
            const long long row = r0 + lr;
            if (row >= M) break;
            for (int j = 0; col + j < N; ++j) {
              Cz[row * ldc + col + j] = from_acc<TC>(__uint_as_float(lds32(stg + wide_off(lr, ch) + 4 * j)));
            }
          }
        }
      }
    } else {  // rows not 4-element aligned: one row of 32 elements per instruction
      for (int lr = w * 16; lr < w * 16 + 16; ++lr) {
        const long long row = r0 + lr;
        if (row >= M) break;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int lc = 32 * k + lane;
          if (c0 + lc < N) {
            TC* p = Cz + row * ldc + c0 + lc;
            float x = __uint_as_float(lds32(stg + wide_off(lr, lc >> 2) + (lc & 3) * 4));
            if constexpr (EPI == EPI_ACCUMULATE) x = fmaf(beta, to_acc<float>(*p), x);
            *p = from_acc<TC>(x);
          }
        }
      }
    }
    wg_bar(wg);  // the buffer is rewritten by the next pass (or tile)
  }
}

// One warpgroup's 64 x BN tile of C at Cz (rows r0.., columns n0..) for any epilogue.
template <typename T, typename TC, int ACT, int EPI, int BN>
__device__ __forceinline__ void store_tile(const float (&d)[BN / 2], u32 stg, TC* Cz, const T* bias, float alpha,
                                           float beta, long long M, long long N, long long ldc, long long r0,
                                           long long n0, int wg, int warp, int lane) {
  if constexpr (EPI == EPI_STORE && sizeof(TC) == 2) {
    store_tile_staged<T, ACT, BN>(d, stg, Cz, bias, M, N, ldc, r0, n0, wg, warp, lane);
  } else {
    store_tile_wide<T, TC, ACT, EPI, BN>(d, stg, Cz, bias, alpha, beta, M, N, ldc, r0, n0, wg, warp, lane);
  }
}

}  // namespace tma

// A K-major: A[z] is row-major (M x K); else A[z]^T is (K x M row-major). B K-major: B[z]^T is
// row-major (N x K); else B[z] is row-major (K x N). C[z] (at C + z * sc, rows ldc apart, type
// TC) = act(A[z] B[z] + bias) (EPI_STORE, the defaults: C in T), or the scaled epilogues of
// cukit/gemm.cuh (no activation).
// BN: block-tile width, 256, 192, 128 or 64 (the tensor map of B must have been encoded with BN's box).
// Launch: 288 threads, grid <= number of SMs, dynamic shared memory tma::Cfg<BN>::SMEM (a launch
// with less traps: the ring would overrun it).
// PP = 0 (cooperative): both consumer warpgroups work on each tile (64 x BN rows each) and run its
// epilogue together, so the tensor cores idle during every epilogue. PP = 1 (ping-pong, BN = 128
// or 64): warpgroup w takes the CTA's tiles w, w + 2, ... whole (128 x BN: two m64nBN wgmmas per
// k16 step), so one warpgroup's epilogue runs under the other's mainloop; the mainloops take turns
// (order_wait / order_signal), which also keeps a warpgroup from waiting on a ring stage more than
// one phase ahead of the copies (a parity wait cannot tell phase n from phase n - 2).
// EPI_SCALE_DEVICE runs as EPI_SCALE with alpha times the device scale its bias argument points
// to (read at each tile's epilogue: an L1 hit after the first) and no bias.
template <int EPI> constexpr int EPI_OF = EPI == EPI_SCALE_DEVICE ? EPI_SCALE : EPI;
template <int EPI, typename T> __device__ __forceinline__ const T* epi_bias(const T* bias) {
  return EPI == EPI_SCALE_DEVICE ? nullptr : bias;
}
template <int EPI, typename T> __device__ __forceinline__ float epi_alpha(double alpha, const T* bias) {
  if constexpr (EPI == EPI_SCALE_DEVICE) {
    return static_cast<float>(alpha) * *reinterpret_cast<const float*>(bias);
  } else {
    return static_cast<float>(alpha);
  }
}

template <typename T, int ACT, int A_K, int B_K, int BN, int PP, typename TC = T, int EPI = EPI_STORE>
__global__ void __launch_bounds__(tma::THREADS, 1)
    matmul_tc_tma(const __grid_constant__ sm90::Map map_a, const __grid_constant__ sm90::Map map_b,
                  TC* __restrict__ C, const T* __restrict__ bias, double alpha, double beta, long long M,
                  long long N, long long K, long long ldc, long long sc, long long batch) {
  using namespace tma;
  using Cf = Cfg<BN>;
  static_assert(!PP || BN <= 128, "ping-pong tiles are 128 x 128 or 128 x 64 per warpgroup");
  static_assert(sizeof(T) == 2 || (A_K && B_K), "tf32 (float) operands must both be K-major");
  constexpr int S = Cf::S, STAGE = Cf::STAGE;
  constexpr int BKE = tc::KB / static_cast<int>(sizeof(T));  // 64 elements of K per k-tile
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 smem = (static_cast<u32>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const u32 out = smem + S * STAGE, full = out + 2 * OUT_BYTES, empty = full + 8 * S;
  if (dynamic_smem_size() < static_cast<u32>(Cf::SMEM)) __trap();  // host and kernel disagree on the layout

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles_m = static_cast<int>((M + tc::BM - 1) / tc::BM);
  const int tiles_n = static_cast<int>((N + BN - 1) / BN);
  const long long total = static_cast<long long>(tiles_m) * tiles_n * batch;
  const int KT = static_cast<int>((K + BKE - 1) / BKE);

  if (warp == CONSUMER_WARPS && lane == 0) {  // the producer's first copies need both maps
    tma_prefetch_map(map_a);
    tma_prefetch_map(map_b);
  }
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, PP ? CONSUMER_WARPS / 2 : CONSUMER_WARPS);  // the warps that read a stage
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (warp == CONSUMER_WARPS) {  // producer warp: one thread issues every copy
    int s = 0;
    u32 phase = 0;
    auto copy_tile = [&](int z, int m0, int n0) {  // the tile's k-tiles into the ring
      for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(empty + 8 * s, phase ^ 1);
        const u32 bar = full + 8 * s, sa = smem + s * STAGE, sb = sa + A_BYTES;
        mbar_expect_tx(bar, STAGE);
        const int k0 = kt * BKE;
        if constexpr (A_K) {
          tma_load(sa, map_a, k0, m0, z, bar);
        } else {
          tma_load(sa, map_a, m0, k0, z, bar);
          tma_load(sa + 8192, map_a, m0 + 64, k0, z, bar);
        }
        if constexpr (B_K) {
          tma_load(sb, map_b, k0, n0, z, bar);
        } else {
#pragma unroll
          for (int j = 0; j < BN / 64; ++j) tma_load(sb + 8192 * j, map_b, n0 + 64 * j, k0, z, bar);
        }
        if (++s == S) {
          s = 0;
          phase ^= 1;
        }
      }
    };
    if constexpr (EPI != EPI_ACCUMULATE) {
      if (lane == 0) {
        for (long long t = blockIdx.x; t < total; t += gridDim.x) {
          int z, tm, tn;
          tile_coords<BN>(t, tiles_m, tiles_n, z, tm, tn);
          copy_tile(z, tm * tc::BM, tn * BN);
        }
      }
    } else {
      // Once lane 0 has issued a tile's last copies (the consumers are then S k-tiles behind on
      // it), the warp prefetches the tile's C into L2 for the epilogue's reads (prefetch_c).
      for (long long t = blockIdx.x; t < total; t += gridDim.x) {
        int z, tm, tn;
        tile_coords<BN>(t, tiles_m, tiles_n, z, tm, tn);
        if (lane == 0) copy_tile(z, tm * tc::BM, tn * BN);
        __syncwarp();
        prefetch_c<TC, BN>(C + static_cast<long long>(z) * sc, M, N, ldc, static_cast<long long>(tm) * tc::BM,
                           static_cast<long long>(tn) * BN, tc::BM, lane, 32);
      }
    }
    return;
  }

  const int wg = warp >> 2;
  const u64 da0 = desc<A_K != 0>(smem + (PP ? 0 : wg * 8192), 0), db0 = desc<B_K != 0>(smem + A_BYTES, 0);
  if constexpr (PP) {
    // Local tile i of this CTA fills ring positions i KT .. i KT + KT - 1 (position p: stage p % S,
    // phase (p / S) & 1); warpgroup wg takes the local tiles i = wg, wg + 2, ...
    long long pos = static_cast<long long>(wg) * KT;
    for (long long t = blockIdx.x + static_cast<long long>(wg) * gridDim.x; t < total; t += 2LL * gridDim.x) {
      int z, tm, tn;
      tile_coords<BN>(t, tiles_m, tiles_n, z, tm, tn);
      int s = static_cast<int>(pos % S);
      u32 phase = static_cast<u32>((pos / S) & 1);
      float d0[BN / 2], d1[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        d0[i] = 0.0f;
        d1[i] = 0.0f;
      }
      if (t >= static_cast<long long>(gridDim.x)) order_wait(wg);  // the previous tile's mainloop is issued
      int prev = -1;
      for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(full + 8 * s, phase);
        const u32 st = static_cast<u32>(s) * STAGE;
        sm90::wg_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 oa = st + j * desc_step<A_K != 0>(), ob = st + j * desc_step<B_K != 0>();
          sm90::Wgmma<T, BN>::template run<A_K ? 0 : 1, B_K ? 0 : 1>(d0, desc_at(da0, oa), desc_at(db0, ob));
          sm90::Wgmma<T, BN>::template run<A_K ? 0 : 1, B_K ? 0 : 1>(d1, desc_at(da0, oa + 8192), desc_at(db0, ob));
        }
        sm90::wg_commit();
        sm90::wg_wait<1>(d0, d1);
        if (prev >= 0 && lane == 0) mbar_arrive(empty + 8 * prev);
        prev = s;
        if (++s == S) {
          s = 0;
          phase ^= 1;
        }
      }
      if (t + gridDim.x < total) order_signal(wg ^ 1);  // the next tile (the other group's) may start
      sm90::wg_wait<0>(d0, d1);
      if (lane == 0) mbar_arrive(empty + 8 * prev);
      pos += 2LL * KT;
      TC* Cz = C + static_cast<long long>(z) * sc;
      const long long r0 = static_cast<long long>(tm) * tc::BM, c0 = static_cast<long long>(tn) * BN;
      // alpha and beta converted here, not kept in registers through the mainloop
      const float al = epi_alpha<EPI>(alpha, bias);
      store_tile<T, TC, ACT, EPI_OF<EPI>, BN>(d0, out + wg * OUT_BYTES, Cz, epi_bias<EPI>(bias), al,
                                              static_cast<float>(beta), M, N, ldc, r0, c0, wg, warp, lane);
      store_tile<T, TC, ACT, EPI_OF<EPI>, BN>(d1, out + wg * OUT_BYTES, Cz, epi_bias<EPI>(bias), al,
                                              static_cast<float>(beta), M, N, ldc, r0 + 64, c0, wg, warp, lane);
    }
    return;
  }

  // Cooperative consumers: warpgroup wg computes rows 64 wg .. 64 wg + 63 of each tile.
  int s = 0;
  u32 phase = 0;
  for (long long t = blockIdx.x; t < total; t += gridDim.x) {
    int z, tm, tn;
    tile_coords<BN>(t, tiles_m, tiles_n, z, tm, tn);
    float d[Cf::ACC];
#pragma unroll
    for (int i = 0; i < Cf::ACC; ++i) d[i] = 0.0f;
    int prev = -1;
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(full + 8 * s, phase);
      const u32 st = static_cast<u32>(s) * STAGE;
      sm90::wg_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j)
        sm90::Wgmma<T, BN>::template run<A_K ? 0 : 1, B_K ? 0 : 1>(d, desc_at(da0, st + j * desc_step<A_K != 0>()),
                                                                     desc_at(db0, st + j * desc_step<B_K != 0>()));
      sm90::wg_commit();
      sm90::wg_wait<1>(d);  // the previous k-tile's wgmmas are done: its stage may be refilled
      if (prev >= 0 && lane == 0) mbar_arrive(empty + 8 * prev);
      prev = s;
      if (++s == S) {
        s = 0;
        phase ^= 1;
      }
    }
    sm90::wg_wait<0>(d);
    if (prev >= 0 && lane == 0) mbar_arrive(empty + 8 * prev);
    store_tile<T, TC, ACT, EPI_OF<EPI>, BN>(d, out + wg * OUT_BYTES, C + static_cast<long long>(z) * sc,
                                            epi_bias<EPI>(bias), epi_alpha<EPI>(alpha, bias),
                                            static_cast<float>(beta), M, N, ldc,
                                            static_cast<long long>(tm) * tc::BM + wg * 64,
                                            static_cast<long long>(tn) * BN, wg, warp, lane);
  }
}
