// per_sample.cu: the memory-bound pieces of per-sample gradients and one-pass DP clipping.
// Host side and references: cukit/ops/per_sample.py. The GEMMs (per-sample Linear grads, Gram
// matrices, the clipped second contraction) run on cukit's matmul kernels; these kernels do what
// surrounds them:
//   row_sumsq_partial / row_sum_reduce   s[i] = sum_j x[i, j]^2 (or x[i, j] y[i, j]): ghost norms
//   sum_t                                out[i, c] = sum_t g[i, t, c] (* x[i, t, c]): per-sample
//                                        bias and norm-weight grads
//   outer_rows                           out[b] = g[b]^T a[b]: per-sample Linear weight grads of
//                                        2-D inputs
//   dense_ghost_norms                    the ghost norms of several Linear layers with 2-D inputs
//                                        in one launch
//   clip_factors                         norm = sqrt(s), f = min(1, C / (norm + 1e-6))
//   scale_rows                           y[i, :] = x[i, :] * f[i]: output grads scaled before the
//                                        clipped contraction (Book-Keeping)
//   weighted_sum_partial / _reduce       out[j] (+)= sum_i f[i] p[i, j]: clipped sum of
//                                        materialised per-sample grads
//   conv_per_sample / conv_norms_reduce  per-sample Conv weight and bias grads, their squared
//                                        norms, or their clipped sum, as implicit GEMMs over the
//                                        output pixels of each sample (patches never stored)
// Inputs are contiguous row-major (the host makes them so); rows are samples. Maths in acc_t<T>
// (fp32 for the 16-bit types). Every reduction has a fixed order for a given launch
// configuration (warp shuffle trees, cukit/reduce.cuh, then splits in order): no atomics, the
// results are bitwise reproducible.
#include <cukit/conv_tile.cuh>
#include <cukit/dtypes.cuh>
#include <cukit/reduce.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// Pass 1 of the per-row sums: block (s, i) sums elements [s * chunk, min(n, (s + 1) * chunk)) of
// row i of x^2 (TWO: x * y) and writes partial[i * splits + s]. With one split, partial is the
// output itself and pass 2 is skipped. VEC > 1 only when n % VEC == 0, chunk % VEC == 0 and the
// pointers are 16-byte aligned, so every row start is aligned. Four vectors per thread are loaded
// before any is used: enough bytes in flight per SM to cover DRAM latency.
// This thread's share of sum_{begin <= j < end} x[j]^2 (TWO: x[j] y[j]) over a block's threads:
// VEC-wide vectors strided by the block, U of them loaded before any is used (bytes in flight).
template <typename T, bool TWO, int VEC, int U>
__device__ __forceinline__ acc_t<T> range_sumsq(const T* __restrict__ x, const T* __restrict__ y, long long begin,
                                                long long end) {
  using A = acc_t<T>;
  const long long step = static_cast<long long>(blockDim.x) * VEC;
  A acc = A(0);
  for (long long j0 = begin + static_cast<long long>(threadIdx.x) * VEC; j0 < end; j0 += step * U) {
    Vec<T, VEC> xv[U], yv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = j0 + u * step;
      if (j < end) {
        xv[u] = load_vec<T, VEC>(x + j);
        if constexpr (TWO) yv[u] = load_vec<T, VEC>(y + j);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (j0 + u * step < end) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A a = to_acc<A>(xv[u].v[k]);
          if constexpr (TWO) {
            acc += a * to_acc<A>(yv[u].v[k]);
          } else {
            acc += a * a;
          }
        }
      }
    }
  }
  return acc;
}

template <typename T, bool TWO, int VEC>
__global__ void row_sumsq_partial(const T* __restrict__ x, const T* __restrict__ y, acc_t<T>* __restrict__ partial,
                                  long long rows, long long n, long long chunk, long long splits) {
  using A = acc_t<T>;
  __shared__ A smem[32];
  // rows beyond gridDim.y (65535) loop; the bound is uniform over the block, so the barriers in
  // block_sum are reached by every thread
  for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
  const long long begin = static_cast<long long>(blockIdx.x) * chunk;
  const long long end = min(n, begin + chunk);
  const A acc = range_sumsq<T, TWO, VEC, 4>(x + row * n, TWO ? y + row * n : nullptr, begin, end);
  const A s = block_sum(acc, smem);
  if (threadIdx.x == 0) partial[row * splits + blockIdx.x] = s;
  __syncthreads();  // smem is rewritten by the next row
  }
}

// Pass 2: out[i] = sum over splits of partial[i, s], in split order; one thread per row.
template <typename A>
__global__ void row_sum_reduce(const A* __restrict__ partial, A* __restrict__ out, long long rows, long long splits) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  A s = A(0);
  for (long long k = 0; k < splits; ++k) s += partial[i * splits + k];
  out[i] = s;
}

// out[b, i, :] = g[b, i] * a[b, :] for a (B, n), g (B, m): the per-sample weight grads of a Linear
// with 2-D inputs (dW_b = g_b^T a_b), each product in acc_t<T> and rounded once. Bound by its
// writes (B m n elements against B (m + n) read): threads run along a row's VEC-wide column groups
// (grid.x covers n), and a thread loads its vector of a_b once per tile of kOuterRows rows i and
// writes one vector per row (grid.y strides over B x row tiles).
constexpr int kOuterRows = 16;

template <typename T, int VEC>
__global__ void outer_rows(const T* __restrict__ g, const T* __restrict__ a, T* __restrict__ out, long long B,
                           long long m, long long n) {
  using A = acc_t<T>;
  const long long j = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (j >= n) return;  // no barriers below
  const long long tiles = (m + kOuterRows - 1) / kOuterRows;
  for (long long t = blockIdx.y; t < B * tiles; t += gridDim.y) {
    const long long b = t / tiles, i0 = (t - b * tiles) * kOuterRows;
    const Vec<T, VEC> av = load_vec<T, VEC>(a + b * n + j);
    A af[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) af[k] = to_acc<A>(av.v[k]);
    const long long i1 = min(m, i0 + kOuterRows);
    const T* gb = g + b * m;
    T* ob = out + b * m * n + j;
    for (long long i = i0; i < i1; ++i) {
      const A gi = to_acc<A>(gb[i]);
      Vec<T, VEC> o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) o.v[k] = from_acc<T>(gi * af[k]);
      stg_vec<T, VEC>(ob + i * n, o);
    }
  }
}

// Ghost norms of up to kDenseLayers Linear layers y = a W^T (+ b) with 2-D inputs, in one launch:
//   s = sum over layers l of ||g_l[i, :]||^2 (||a_l[i, :]||^2 + bias_l)
// (||dW_i||_F^2 = ||a_i||^2 ||g_i||^2, ||db_i||^2 = ||g_i||^2), a_l (rows, na_l), g_l (rows, ng_l),
// bias_l = bit l of bias_mask; out[i] = s (accumulate: out[i] + s; finish: sqrt(scale2 * that),
// the norms themselves). One block per row (grid-stride), the layers in order, each sum by
// block_sum: a fixed order, no atomics, bitwise reproducible. Small models call this once per
// backward instead of several launches per layer: their step is host-bound.
constexpr int kDenseLayers = 4;

template <typename T, int VEC>
__global__ void dense_ghost_norms(acc_t<T>* __restrict__ out, const T* a0, const T* g0, const T* a1, const T* g1,
                                  const T* a2, const T* g2, const T* a3, const T* g3, long long rows,
                                  long long na0, long long ng0, long long na1, long long ng1, long long na2,
                                  long long ng2, long long na3, long long ng3, int layers, int bias_mask,
                                  int accumulate, int finish, double scale2) {
  using A = acc_t<T>;
  __shared__ A smem[32];
  const T* as[kDenseLayers] = {a0, a1, a2, a3};
  const T* gs[kDenseLayers] = {g0, g1, g2, g3};
  const long long nas[kDenseLayers] = {na0, na1, na2, na3};
  const long long ngs[kDenseLayers] = {ng0, ng1, ng2, ng3};
  // the row bound is uniform over the block, so every thread reaches block_sum's barriers
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    A s = A(0);
#pragma unroll
    for (int l = 0; l < kDenseLayers; ++l) {
      if (l < layers) {
        const A sa = block_sum(range_sumsq<T, false, VEC, 2>(as[l] + row * nas[l], nullptr, 0, nas[l]), smem);
        const A sg = block_sum(range_sumsq<T, false, VEC, 2>(gs[l] + row * ngs[l], nullptr, 0, ngs[l]), smem);
        s += sg * (sa + static_cast<A>((bias_mask >> l) & 1));
      }
    }
    if (threadIdx.x == 0) {
      if (accumulate) s = out[row] + s;
      out[row] = finish ? static_cast<A>(sqrt(scale2 * static_cast<double>(s))) : s;
    }
  }
}

// out[i, c] = sum_t g[i, t, c] (PROD: g[i, t, c] * x[i, t, c]) for g, x of shape (B, T, d).
// Block (bx, by): bx threads across VEC-wide column groups, by threads down t; grid (column
// blocks, row blocks). Each thread sums its t in order, then the by partial sums of a column are added in
// order through shared memory. O: T (per-sample grads in the parameter's dtype) or acc_t<T>.
template <typename T, typename O, bool PROD, int VEC>
__global__ void sum_t(const T* __restrict__ g, const T* __restrict__ x, O* __restrict__ out, long long rows, long long T_,
                      long long d) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* smem = reinterpret_cast<A*>(smem_raw);  // [by][bx * VEC]
  const long long c0 = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const bool active = c0 < d;
  for (long long row = blockIdx.y; row < rows; row += gridDim.y) {  // block-uniform bound
  const long long base = row * T_ * d;
  A acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = A(0);
  if (active) {
    for (long long t = threadIdx.y; t < T_; t += blockDim.y) {
      const long long off = base + t * d + c0;
      const Vec<T, VEC> gv = load_vec<T, VEC>(g + off);
      if constexpr (PROD) {
        const Vec<T, VEC> xv = load_vec<T, VEC>(x + off);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += to_acc<A>(gv.v[k]) * to_acc<A>(xv.v[k]);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += to_acc<A>(gv.v[k]);
      }
    }
  }
  const int width = blockDim.x * VEC;
#pragma unroll
  for (int k = 0; k < VEC; ++k) smem[threadIdx.y * width + threadIdx.x * VEC + k] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && active) {
    const long long o = row * d + c0;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      A s = A(0);
      for (int j = 0; j < static_cast<int>(blockDim.y); ++j) s += smem[j * width + threadIdx.x * VEC + k];
      out[o + k] = from_acc<O>(s);
    }
  }
  __syncthreads();  // smem is rewritten by the next row
  }
}

// norms[i] = sqrt(sq[i]), factors[i] = min(1, max_norm / (norms[i] + 1e-6)): Abadi et al.'s
// clipping factor. A NaN norm gives factor NaN (min keeps it): a poisoned sample shows up in the
// result instead of being silently dropped.
template <typename A>
__global__ void clip_factors(const A* __restrict__ sq, A* __restrict__ norms, A* __restrict__ factors,
                             double max_norm, long long rows) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const A s = sq[i];
  const A nrm = sqrt(s < A(0) ? A(0) : s);  // not max(): fmax(NaN, 0) is 0 and would hide a NaN
  const A f = static_cast<A>(max_norm) / (nrm + A(1e-6));
  norms[i] = nrm;
  factors[i] = isnan(f) ? f : min(A(1), f);
}

// y[i, j] = x[i, j] * f[i] for x, y of shape (rows, n). Grid (column blocks, row blocks) with
// grid-stride loops in both directions, so each thread reads f[i] once per row.
template <typename T, int VEC>
__global__ void scale_rows(const T* __restrict__ x, const acc_t<T>* __restrict__ f, T* __restrict__ y, long long rows,
                           long long n) {
  using A = acc_t<T>;
  const long long col_step = static_cast<long long>(gridDim.x) * blockDim.x * VEC;
  for (long long i = blockIdx.y; i < rows; i += gridDim.y) {
    const A s = f[i];
    const long long base = i * n;
    for (long long j = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; j < n; j += col_step) {
      const Vec<T, VEC> xv = load_vec<T, VEC>(x + base + j);
      Vec<T, VEC> yv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) yv.v[k] = from_acc<T>(to_acc<A>(xv.v[k]) * s);
      store_vec<T, VEC>(y + base + j, yv);
    }
  }
}

// Clipped sum of per-sample grads, pass 1: partial[s, j] = sum_{i in split s} f[i] p[i, j] for p of
// shape (rows, n). Block (bx, by): bx threads across VEC-wide column groups, by threads down the
// rows; grid (column blocks, splits), split s covering rows [s * rows_per_split, ...). Rows are
// summed in order per thread, then the by partial sums in order through shared memory: no
// atomics, bitwise reproducible. Splitting the rows keeps the GPU busy when n is small (a bias).
template <typename T, int VEC>
__global__ void weighted_sum_partial(const T* __restrict__ p, const acc_t<T>* __restrict__ f,
                                     acc_t<T>* __restrict__ partial, long long rows, long long n,
                                     long long rows_per_split) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* smem = reinterpret_cast<A*>(smem_raw);  // [by][bx * VEC]
  const long long c0 = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const bool active = c0 < n;
  const long long r_begin = static_cast<long long>(blockIdx.y) * rows_per_split;
  const long long r_end = min(rows, r_begin + rows_per_split);
  A acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = A(0);
  if (active) {
    for (long long r = r_begin + threadIdx.y; r < r_end; r += blockDim.y) {
      const A s = f[r];
      const Vec<T, VEC> pv = load_vec<T, VEC>(p + r * n + c0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += s * to_acc<A>(pv.v[k]);
    }
  }
  const int width = blockDim.x * VEC;
#pragma unroll
  for (int k = 0; k < VEC; ++k) smem[threadIdx.y * width + threadIdx.x * VEC + k] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      A s = A(0);
      for (int j = 0; j < static_cast<int>(blockDim.y); ++j) s += smem[j * width + threadIdx.x * VEC + k];
      partial[static_cast<long long>(blockIdx.y) * n + c0 + k] = s;
    }
  }
}

// Pass 2: out[j] = (accumulate ? out[j] : 0) + sum over splits of partial[s, j], in split order.
// O: the gradient's dtype (the parameter's, or a float32 accumulator for a 16-bit parameter).
template <typename A, typename O>
__global__ void weighted_sum_reduce(const A* __restrict__ partial, O* __restrict__ out, int accumulate, long long splits,
                                    long long n) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    A s = accumulate ? to_acc<A>(out[j]) : A(0);
    for (long long k = 0; k < splits; ++k) s += partial[k * n + j];
    out[j] = from_acc<O>(s);
  }
}

// ---------------------------------------------------------------------------------------------
// Conv2d (Conv1d as H = R = P = 1) per sample, NCHW, groups G: one block holds a 64 x BN tile of
// one sample's (or, clipped, one split's) weight gradient,
//   dW_b[k, crs] = sum over output pixels (p, q) of g[b, k, p, q] * x[b, c, p sh - ph + r dh, q sw - pw + s dw],
// crs = (c, r, s) within group grp (c in [0, C/G)), k in [0, K/G); db_b[k] = sum over (p, q) of g[b, k, p, q].
// Rows of the GEMM are crs (the patch coordinates, gathered from x as a stage is loaded: the
// patch matrix is never stored), columns k, reduction over the sample's P*Q pixels in stages of
// BK. A read outside x is a zero: the top/left pads are given, the bottom/right ones are implicit
// in P and Q (padding="same" with an even kernel costs nothing).
//
//   MODE 0 (grads)    dw (B, K, C/G, R, S) and db (B, K) in T: per-sample gradients.
//   MODE 1 (norms)    part[b, tile] = sum of squares of the tile of dW_b, partb[b, column tile] =
//                     sum of squares of db_b's columns; conv_norms_reduce adds them per sample in
//                     tile order (ghost norms without storing dW_b).
//   MODE 2 (clipped)  split z covers samples [z * per_split, ...) and g[b] is scaled by f[b] as it
//                     is loaded: part[z, K * C/G * R * S] and partb[z, K] are the split's sums of
//                     f_b dW_b and f_b db_b, which weighted_sum_reduce adds into p.grad in split order.
//
// Grid (ceil(C/G * R * S / 64) * splits, ceil(K/G / BN) * G): blockIdx.x = z * row tiles + row
// tile, so the z (sample or split) of a block is its x over the row tiles. 128 threads; thread t stages pixel t % 8 of each stage for the rows t / 8 + 16 i and the
// columns t / 8 + 16 j (consecutive threads read consecutive pixels of a plane), and multiplies 4
// consecutive rows by BN / 8 columns. Stages are double buffered through shared memory (one
// barrier per stage: the next stage travels global -> registers while this one is multiplied).
// Every sum has a fixed order (no atomics): results are bitwise reproducible.
// ---------------------------------------------------------------------------------------------
namespace conv_ps {
using namespace cukit::conv;  // the tile: THREADS, BM, BK, kLdCols, Radix3, mma_stage, PatchRows
// Shared row strides == 4 (mod 32): the stores of a warp (8 pixels x 4 rows) hit 32 distinct
// banks; multiples of 4 elements, so the multiply's vector reads stay aligned.
constexpr int LDA = BM + 4;
enum Mode { GRADS = 0, NORMS = 1, CLIPPED = 2 };
}  // namespace conv_ps

template <typename T, int BN, int MODE>
__global__ void __launch_bounds__(conv_ps::THREADS)
    conv_per_sample(const T* __restrict__ x, const T* __restrict__ g, const acc_t<T>* __restrict__ f,
                    T* __restrict__ dw, T* __restrict__ db, acc_t<T>* __restrict__ part, acc_t<T>* __restrict__ partb,
                    int B, int C, int H, int W, int K, int P, int Q, int R, int S, int sh, int sw, int ph, int pw,
                    int dil_h, int dil_w, int groups, int per_split, int splits) {
  using namespace conv_ps;
  using A = acc_t<T>;
  constexpr int TN = BN / 8;   // columns a thread multiplies
  constexpr int NB = BN / 16;  // g values a thread stages per stage
  constexpr int LB = kLdCols<BN>;
  __shared__ __align__(32) A Xs[2][BK * LDA];
  __shared__ __align__(32) A Gs[2][BK * LB];
  __shared__ A red[32];

  const int Cg = C / groups, Kg = K / groups, RS = R * S, CRS = Cg * RS;
  const int row_tiles = (CRS + BM - 1) / BM;
  const long long z = blockIdx.x / row_tiles;  // the sample (grads, norms) or split (clipped)
  const int row_tile = static_cast<int>(blockIdx.x - z * row_tiles);
  const int col_tiles = (Kg + BN - 1) / BN;
  const int grp = blockIdx.y / col_tiles;
  const int k_base = (blockIdx.y - grp * col_tiles) * BN;  // the tile's first column within the group
  const long long HW = static_cast<long long>(H) * W, PQ = static_cast<long long>(P) * Q;
  const long long CHW = C * HW, KPQ = K * PQ;
  const long long wsz = static_cast<long long>(K) * CRS;  // one sample's dW
  const int tid = threadIdx.x;
  const int jl = tid & 7;   // the stage's pixel this thread loads
  const int rl = tid >> 3;  // its rows and columns: rl + 16 i

  PatchRows xr;  // the rows (c, r, s) of group grp this thread stages
  xr.init(row_tile * BM + rl, CRS, RS, S, grp * Cg, HW, dil_h, dil_w);
  long long g_off[NB];
  bool g_ok[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int k = k_base + rl + 16 * j;
    g_ok[j] = k < Kg;
    g_off[j] = static_cast<long long>(grp * Kg + k) * PQ;
  }
  const int st_n = static_cast<int>(BK / PQ), st_p = static_cast<int>((BK / Q) % P), st_q = BK % Q;
  const int tx = tile_tx(), ty = tile_ty();

  {
    const long long n_begin = z * per_split;
    const long long J = (min(static_cast<long long>(B), n_begin + per_split) - n_begin) * PQ;
    long long jj = jl;
    Radix3 px;  // (n, p, q) of the pixel this thread stages
    px.init(n_begin * PQ + jl, P, Q);
    A rx[4], rg[NB], dbs[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) dbs[j] = A(0);
    auto load = [&]() {
      const bool jv = jj < J;
      xr.load(rx, x, px.hi * CHW, px.mid * sh - ph, px.lo * sw - pw, H, W, jv);
      const long long gb = px.hi * KPQ + static_cast<long long>(px.mid) * Q + px.lo;
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        A v = (jv && g_ok[j]) ? to_acc<A>(g[gb + g_off[j]]) : A(0);
        if constexpr (MODE == CLIPPED) v *= f[jv ? px.hi : 0];
        rg[j] = v;
        dbs[j] += v;
      }
    };
    auto store = [&](int buf) {
#pragma unroll
      for (int i = 0; i < 4; ++i) Xs[buf][jl * LDA + rl + 16 * i] = rx[i];
#pragma unroll
      for (int j = 0; j < NB; ++j) Gs[buf][jl * LB + rl + 16 * j] = rg[j];
    };

    A acc[4][TN];
    const long long stages = (J + BK - 1) / BK;
    run_stages<A, BN, LDA, LB>(stages, Xs, Gs, acc, tx, ty, [&]() {
        jj += BK;
        px.advance(st_n, st_p, st_q, P, Q);
      }, load, store);

    // Epilogue: rows crs0 .. crs0 + 3, columns kk0 .. kk0 + TN - 1 of the tile (within the group).
    const int crs0 = row_tile * BM + 4 * tx;
    const int kk0 = k_base + ty * TN;
    if constexpr (MODE == NORMS) {
      A s = A(0);  // rows and columns past the edges hold exact zeros (their loads were zeros)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s += acc[i][j] * acc[i][j];
      s = block_sum(s, red);
      if (tid == 0) part[(z * gridDim.y + blockIdx.y) * row_tiles + row_tile] = s;
    } else {
      // grads: the sample's dW in T; clipped: the split's sum in A. Both laid out as the weight.
      const long long base = z * wsz + static_cast<long long>(grp * Kg) * CRS;
      if ((CRS & 3) == 0 && crs0 + 3 < CRS) {  // 4 consecutive, 4-aligned elements: one vector store
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          if (kk0 + j >= Kg) continue;
          const long long off = base + static_cast<long long>(kk0 + j) * CRS + crs0;
          if constexpr (MODE == GRADS) {
            Vec<T, 4> v;
#pragma unroll
            for (int i = 0; i < 4; ++i) v.v[i] = from_acc<T>(acc[i][j]);
            store_vec<T, 4>(dw + off, v);
          } else {
            Vec<A, 4> v;
#pragma unroll
            for (int i = 0; i < 4; ++i) v.v[i] = acc[i][j];
            store_vec<A, 4>(part + off, v);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (crs0 + i >= CRS) continue;
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            if (kk0 + j >= Kg) continue;
            const long long off = base + static_cast<long long>(kk0 + j) * CRS + crs0 + i;
            if constexpr (MODE == GRADS) {
              dw[off] = from_acc<T>(acc[i][j]);
            } else {
              part[off] = acc[i][j];
            }
          }
        }
      }
    }

    // Bias: the blocks of the first row tile saw every (pixel, k) of the sample once. Each column's
    // 8 staging threads are 8 consecutive lanes: a fixed shuffle tree adds their sums.
    const bool want_b = MODE == GRADS ? db != nullptr : partb != nullptr;
    if (want_b && row_tile == 0) {  // uniform over the block: every lane shuffles
      A sq = A(0);
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        A s = dbs[j];
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        const int k = k_base + rl + 16 * j;
        if (jl == 0 && k < Kg) {
          const long long off = z * K + grp * Kg + k;
          if constexpr (MODE == GRADS) {
            db[off] = from_acc<T>(s);
          } else if constexpr (MODE == CLIPPED) {
            partb[off] = s;
          } else {
            sq += s * s;
          }
        }
      }
      if constexpr (MODE == NORMS) {
        sq = block_sum(sq, red);
        if (tid == 0) partb[z * gridDim.y + blockIdx.y] = sq;
      }
    }
  }
}

// out[b] = sum over tiles of part[b, t] (b < B) and out[B + b] = sum of partb[b, t] (when partb
// is given), each in tile order: conv_per_sample's norms per sample, weight then bias.
template <typename A>
__global__ void conv_norms_reduce(const A* __restrict__ part, const A* __restrict__ partb, A* __restrict__ out,
                                  long long B, long long tiles, long long btiles) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool bias = i >= B;
  if (i >= (partb != nullptr ? 2 * B : B)) return;
  const A* src = bias ? partb + (i - B) * btiles : part + i * tiles;
  const long long n = bias ? btiles : tiles;
  A s = A(0);
  for (long long t = 0; t < n; ++t) s += src[t];
  out[i] = s;
}
