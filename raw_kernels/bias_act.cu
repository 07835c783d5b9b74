// bias_act.cu: y = act(x + bias), bias broadcast over the last dimension, and its backward.
// Host side and reference: cukit/ops/bias_act.py. Inputs are contiguous (the host makes them so);
// x holds rows * C elements, bias C. Maths in acc_t<T> (fp32 for the 16-bit types).
#include <cukit/activations.cuh>
#include <cukit/dtypes.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// The 16-bit types use the fast activation forms (see activations.cuh): their error is far below
// one rounding to 16 bits. float and double use the libm functions.
template <typename T> constexpr bool kFast = sizeof(T) == 2;

// Forward: a grid-stride loop over VEC-wide vectors, UNROLL vectors per thread per trip, all
// loaded before any is computed so that enough bytes are in flight to cover DRAM latency while the
// activation maths (erf, exp, tanh) runs. The host launches a grid that covers the array in one
// trip (the loop serves grids past the launch limit), as for bias_act_fwd_rows below. VEC > 1 only
// when C % VEC == 0 and x, bias, y are 16-byte aligned, so a vector never straddles two rows. Index
// is int when n fits, which makes the per-vector column lookup (v % cv) a 32-bit remainder instead
// of a 64-bit one.
#ifndef CUKIT_FWD_UNROLL
#define CUKIT_FWD_UNROLL 1
#endif
constexpr int FWD_UNROLL = CUKIT_FWD_UNROLL;

template <typename T, int ACT, int VEC, typename Index>
__global__ void bias_act_fwd(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                             long long n, long long C) {
  using A = acc_t<T>;
  const Index nv = static_cast<Index>(n / VEC);
  const Index cv = static_cast<Index>(C / VEC);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index base = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; base < nv;
       base += stride * FWD_UNROLL) {
    Vec<T, VEC> xv[FWD_UNROLL], bv[FWD_UNROLL];
#pragma unroll
    for (int u = 0; u < FWD_UNROLL; ++u) {
      const Index v = base + u * stride;
      if (v < nv) {
        xv[u] = load_vec<T, VEC>(x + static_cast<long long>(v) * VEC);
        bv[u] = load_vec<T, VEC>(bias + static_cast<long long>(v % cv) * VEC);
      }
    }
#pragma unroll
    for (int u = 0; u < FWD_UNROLL; ++u) {
      const Index v = base + u * stride;
      if (v < nv) {
        Vec<T, VEC> yv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A z = to_acc<A>(xv[u].v[k]) + to_acc<A>(bv[u].v[k]);
          yv.v[k] = from_acc<T>(act_fwd<ACT, kFast<T>>(z));
        }
        store_vec<T, VEC>(y + static_cast<long long>(v) * VEC, yv);
      }
    }
  }
}

// Forward over rows: block (bx, by), bx threads across VEC-wide column groups, by down the rows;
// grid (column blocks, row blocks) covering the rows in one trip where the grid's y limit allows
// (a row-stride loop beyond it). Each thread keeps its bias vector in registers for all its rows,
// so there is no per-element column arithmetic and no bias reload: fewer instructions per element,
// which is what limits the 16-bit types. Used when rows are wide enough (cv >= 32 vectors) to fill
// a warp with one row.
template <typename T, int ACT, int VEC>
__global__ void bias_act_fwd_rows(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                  long long rows, long long C) {
  using A = acc_t<T>;
  const long long c0 = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c0 >= C) return;  // no barriers below
  const Vec<T, VEC> bv = load_vec<T, VEC>(bias + c0);
  A bz[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) bz[k] = to_acc<A>(bv.v[k]);
  const long long step = static_cast<long long>(gridDim.y) * blockDim.y;
  for (long long r = static_cast<long long>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += step) {
    const long long off = r * C + c0;
    const Vec<T, VEC> xv = load_vec<T, VEC>(x + off);
    Vec<T, VEC> yv;
#pragma unroll
    for (int k = 0; k < VEC; ++k) yv.v[k] = from_acc<T>(act_fwd<ACT, kFast<T>>(to_acc<A>(xv.v[k]) + bz[k]));
    store_vec<T, VEC>(y + off, yv);
  }
}

// Backward, pass 1: dx = dy * act'(x + bias) and per-split column sums of dx.
// Block (bx, by): bx threads across VEC-wide column groups, by threads down the rows. Grid
// (column blocks, splits): split s covers rows [s * rows_per_split, (s + 1) * rows_per_split).
// Each thread sums its rows in order, then the by partial sums of a column are added in a fixed
// order through shared memory, and the split's sum goes to partial[s, c]. No atomics: the result
// is bitwise reproducible for a given launch configuration. With one split (partial == nullptr)
// the column sums are dbias itself: the host picks that for small problems, where a second launch
// and a workspace would cost more host time than the narrower grid costs the device.
#ifndef CUKIT_BWD_UNROLL
#define CUKIT_BWD_UNROLL 4
#endif
constexpr int BWD_UNROLL = CUKIT_BWD_UNROLL;

template <typename T, int ACT, int VEC>
__global__ void bias_act_bwd(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ bias,
                             T* __restrict__ dx, acc_t<T>* __restrict__ partial, T* __restrict__ dbias,
                             long long rows, long long C, long long rows_per_split) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* smem = reinterpret_cast<A*>(smem_raw);  // [by][bx * VEC]

  const long long c0 = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const bool active = c0 < C;
  const long long r_begin = static_cast<long long>(blockIdx.y) * rows_per_split;
  const long long r_end = min(rows, r_begin + rows_per_split);

  A acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = A(0);

  if (active) {
    const Vec<T, VEC> bv = load_vec<T, VEC>(bias + c0);
    A bz[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) bz[k] = to_acc<A>(bv.v[k]);
    // BWD_UNROLL rows per trip, loads first: the same latency hiding as the forward.
    const long long step = blockDim.y;
    for (long long r0 = r_begin + threadIdx.y; r0 < r_end; r0 += step * BWD_UNROLL) {
      Vec<T, VEC> gv[BWD_UNROLL], xv[BWD_UNROLL];
#pragma unroll
      for (int u = 0; u < BWD_UNROLL; ++u) {
        const long long r = r0 + u * step;
        if (r < r_end) {
          gv[u] = load_vec<T, VEC>(dy + r * C + c0);
          xv[u] = load_vec<T, VEC>(x + r * C + c0);
        }
      }
#pragma unroll
      for (int u = 0; u < BWD_UNROLL; ++u) {
        const long long r = r0 + u * step;
        if (r < r_end) {
          Vec<T, VEC> dv;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const A g = to_acc<A>(gv[u].v[k]) * act_grad<ACT, kFast<T>>(to_acc<A>(xv[u].v[k]) + bz[k]);
            dv.v[k] = from_acc<T>(g);
            acc[k] += g;
          }
          store_vec<T, VEC>(dx + r * C + c0, dv);
        }
      }
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
      if (partial != nullptr) {
        partial[static_cast<long long>(blockIdx.y) * C + c0 + k] = s;
      } else {
        dbias[c0 + k] = from_acc<T>(s);
      }
    }
  }
}

// Backward, pass 2: dbias[c] = sum over splits of partial[s, c], in split order.
template <typename T>
__global__ void bias_act_bwd_reduce(const acc_t<T>* __restrict__ partial, T* __restrict__ dbias, long long splits,
                                    long long C) {
  using A = acc_t<T>;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; c < C; c += stride) {
    A s = A(0);
    for (long long j = 0; j < splits; ++j) s += partial[j * C + c];
    dbias[c] = from_acc<T>(s);
  }
}
