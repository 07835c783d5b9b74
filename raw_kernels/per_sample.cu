// per_sample.cu: the memory-bound pieces of per-sample gradients and one-pass DP clipping.
// Host side and references: cukit/ops/per_sample.py. The GEMMs (per-sample Linear grads, Gram
// matrices, the clipped second contraction) run on cukit's matmul kernels; these kernels do what
// surrounds them:
//   row_sumsq_partial / row_sum_reduce   s[i] = sum_j x[i, j]^2 (or x[i, j] y[i, j]): ghost norms
//   sum_t                                out[i, c] = sum_t g[i, t, c] (* x[i, t, c]): per-sample
//                                        bias and norm-weight grads
//   clip_factors                         norm = sqrt(s), f = min(1, C / (norm + 1e-6))
//   scale_rows                           y[i, :] = x[i, :] * f[i]: output grads scaled before the
//                                        clipped contraction (Book-Keeping)
//   weighted_sum_partial / _reduce       out[j] (+)= sum_i f[i] p[i, j]: clipped sum of
//                                        materialised per-sample grads
// Inputs are contiguous row-major (the host makes them so); rows are samples. Maths in acc_t<T>
// (fp32 for the 16-bit types). Every reduction has a fixed order for a given launch
// configuration (warp shuffle trees, cukit/reduce.cuh, then splits in order): no atomics, the
// results are bitwise reproducible.
#include <cukit/dtypes.cuh>
#include <cukit/reduce.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// Pass 1 of the per-row sums: block (s, i) sums elements [s * chunk, min(n, (s + 1) * chunk)) of
// row i of x^2 (TWO: x * y) and writes partial[i * splits + s]. With one split, partial is the
// output itself and pass 2 is skipped. VEC > 1 only when n % VEC == 0, chunk % VEC == 0 and the
// pointers are 16-byte aligned, so every row start is aligned. Four vectors per thread are loaded
// before any is used: enough bytes in flight per SM to cover DRAM latency.
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
  const T* xr = x + row * n;
  const T* yr = TWO ? y + row * n : nullptr;
  constexpr int U = 4;
  const long long step = static_cast<long long>(blockDim.x) * VEC;
  A acc = A(0);
  for (long long j0 = begin + static_cast<long long>(threadIdx.x) * VEC; j0 < end; j0 += step * U) {
    Vec<T, VEC> xv[U], yv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = j0 + u * step;
      if (j < end) {
        xv[u] = load_vec<T, VEC>(xr + j);
        if constexpr (TWO) yv[u] = load_vec<T, VEC>(yr + j);
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
