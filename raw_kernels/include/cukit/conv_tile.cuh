// cukit/conv_tile.cuh: the SIMT implicit-GEMM tile shared by the convolution kernels (conv2d.cu's
// fprop, dgrad and wgrad; per_sample.cu's per-sample weight gradients): 128 threads, a 64 x BN
// block tile, BK-deep stages double buffered through shared memory, a thread owning 4 consecutive
// rows x BN / 8 columns. Also the weight-gradient GEMMs' gather of patch rows (c, r, s) from x.
#pragma once
#include <cukit/dtypes.cuh>
#include <cukit/vec.cuh>

namespace cukit {
namespace conv {

constexpr int THREADS = 128;
constexpr int BM = 64;  // rows per block: 16 threads x 4 consecutive rows
constexpr int BK = 8;   // reduction depth of one stage

// Column-operand row stride BN + pad == 4 (mod 32): the stores of a warp (8 reduction rows x 4
// columns) hit 32 distinct banks; and a multiple of 4 elements, so every 16-byte read is aligned.
template <int BN> constexpr int kLdCols = BN + ((4 - BN) % 32 + 32) % 32;

// A 3-digit mixed-radix number (hi, mid, lo), radices (-, r1, r0), that advances by a fixed step:
// the (c, r, s), (k, r, s) or (n, p, q) coordinates of a GEMM index that moves by BK per stage,
// without a division per stage.
struct Radix3 {
  int hi, mid, lo;
  __device__ __forceinline__ void init(long long v, int r1, int r0) {
    lo = static_cast<int>(v % r0);
    v /= r0;
    mid = static_cast<int>(v % r1);
    hi = static_cast<int>(v / r1);
  }
  // step = (dhi * r1 + dmid) * r0 + dlo with dmid < r1, dlo < r0: one carry per digit at most.
  __device__ __forceinline__ void advance(int dhi, int dmid, int dlo, int r1, int r0) {
    lo += dlo;
    const int c0 = lo >= r0;
    lo -= c0 ? r0 : 0;
    mid += dmid + c0;
    const int c1 = mid >= r1;
    mid -= c1 ? r1 : 0;
    hi += dhi + c1;
  }
};

// The thread layout of the multiply: 4 warps of 8 (rows) x 4 (columns) threads, so one 16-byte
// shared read per operand and k serves a warp in one wavefront. tx in [0, 16): rows 4 tx .. 4 tx + 3;
// ty in [0, 8): columns ty * BN/8 ...
__device__ __forceinline__ int tile_tx() { return (threadIdx.x >> 5 & 1) * 8 + (threadIdx.x & 7); }
__device__ __forceinline__ int tile_ty() { return (threadIdx.x >> 6) * 4 + (threadIdx.x >> 3 & 3); }

// acc += As^T Bs over one stage: As[k][LDA] holds the 64 rows, Bs[k][LDB] the BN columns.
template <typename A, int BN, int LDA, int LDB>
__device__ __forceinline__ void mma_stage(const A* __restrict__ As, const A* __restrict__ Bs, A (&acc)[4][BN / 8],
                                          int tx, int ty) {
  constexpr int TN = BN / 8;
  constexpr int VB = TN < 4 ? TN : 4;  // columns per shared read (16 or 32 bytes, aligned)
#pragma unroll
  for (int k = 0; k < BK; ++k) {
    const Vec<A, 4> a = load_vec<A, 4>(As + k * LDA + 4 * tx);
    A b[TN];
#pragma unroll
    for (int j = 0; j < TN; j += VB) {
      const Vec<A, VB> v = load_vec<A, VB>(Bs + k * LDB + ty * TN + j);
#pragma unroll
      for (int u = 0; u < VB; ++u) b[j + u] = v.v[u];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] += a.v[i] * b[j];
  }
}

// The double-buffered mainloop over `stages` stages: acc = 0, then stage t is multiplied from
// buffer t % 2 while stage t + 1 travels global -> registers (advance, load) and then into the
// other buffer (store(buffer)); one barrier per stage.
template <typename A, int BN, int LDA, int LDB, int SA, int SB, typename Advance, typename Load, typename Store>
__device__ __forceinline__ void run_stages(long long stages, const A (&As)[2][SA], const A (&Bs)[2][SB],
                                           A (&acc)[4][BN / 8], int tx, int ty, Advance&& advance, Load&& load,
                                           Store&& store) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) acc[i][j] = A(0);
  if (stages > 0) {
    load();
    store(0);
  }
  __syncthreads();
  for (long long t = 0; t < stages; ++t) {
    const int buf = static_cast<int>(t & 1);
    const bool more = t + 1 < stages;
    if (more) {
      advance();
      load();
    }
    mma_stage<A, BN, LDA, LDB>(As[buf], Bs[buf], acc, tx, ty);
    if (more) store(buf ^ 1);
    __syncthreads();
  }
}

// The 4 patch rows crs = first + 16 i (crs = (c, r, s) over CRS = channels * R * S) a thread of a
// weight-gradient tile stages: the offset of channel c0 + c's plane in a sample of x, the kernel
// tap's row and column offsets (dilated), and whether the row exists.
struct PatchRows {
  long long off[4];
  int rh[4], sw[4];
  bool ok[4];
  __device__ __forceinline__ void init(int first, int CRS, int RS, int S, int c0, long long HW, int dil_h,
                                       int dil_w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int crs = first + 16 * i;
      ok[i] = crs < CRS;
      const int c = crs / RS, rs = crs - c * RS;
      off[i] = (c0 + c) * HW;
      rh[i] = (rs / S) * dil_h;
      sw[i] = (rs - (rs / S) * S) * dil_w;
    }
  }
  // x at the 4 rows for the output pixel whose window starts at (bh, bw) of the sample at xb;
  // zeros outside x (the padding) and for an invalid pixel (live false).
  template <typename A, typename T>
  __device__ __forceinline__ void load(A (&rx)[4], const T* __restrict__ x, long long xb, int bh, int bw, int H,
                                       int W, bool live) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int ih = bh + rh[i], iw = bw + sw[i];
      const bool in = live && ok[i] && static_cast<unsigned>(ih) < static_cast<unsigned>(H) &&
                      static_cast<unsigned>(iw) < static_cast<unsigned>(W);
      rx[i] = in ? to_acc<A>(x[xb + off[i] + static_cast<long long>(ih) * W + iw]) : A(0);
    }
  }
};

}  // namespace conv
}  // namespace cukit
