// glu.cu: the gated activations of gated MLPs, y = act(gate) * up (SwiGLU: act = silu; GeGLU: act =
// gelu, erf or tanh form), and their backward. Host side and references: cukit/ops/glu.py.
// gate, up, dy hold n elements each, contiguous (the host makes them so). Maths in acc_t<T>.
#include <cukit/activations.cuh>
#include <cukit/dtypes.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// As bias_act.cu: the 16-bit types use the fast activation forms (their error is far below one
// rounding to 16 bits), float and double the libm ones.
template <typename T> constexpr bool kFast = sizeof(T) == 2;

// Both kernels: a grid-stride loop over VEC-wide vectors (16 bytes when VEC > 1: gate, up, dy and
// every output 16-byte aligned, checked on the host), UNROLL vectors per thread per trip, all loaded
// before any is computed. The host launches a grid that covers the arrays in one trip (the loop is
// for grids past the launch limit): short-lived blocks replace each other on an SM, which keeps more
// loads in flight than a fixed set of resident blocks looping (benchmarks/NOTES.md).
// The last n % VEC elements (VEC > 1) are done one per thread by the first block. Indices are
// 64-bit: n may exceed 2^31.
#ifndef CUKIT_GLU_FWD_UNROLL
#define CUKIT_GLU_FWD_UNROLL 1
#endif
#ifndef CUKIT_GLU_BWD_UNROLL
#define CUKIT_GLU_BWD_UNROLL 1
#endif
constexpr int GLU_FWD_UNROLL = CUKIT_GLU_FWD_UNROLL;
constexpr int GLU_BWD_UNROLL = CUKIT_GLU_BWD_UNROLL;

template <typename T, int ACT>
__device__ __forceinline__ T glu_one(T g, T u) {
  using A = acc_t<T>;
  return from_acc<T>(act_fwd<ACT, kFast<T>>(to_acc<A>(g)) * to_acc<A>(u));
}

// y = act(gate) * up
template <typename T, int ACT, int VEC>
__global__ void glu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long long n) {
  const long long nv = n / VEC;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long base = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; base < nv;
       base += stride * GLU_FWD_UNROLL) {
    Vec<T, VEC> gv[GLU_FWD_UNROLL], uv[GLU_FWD_UNROLL];
#pragma unroll
    for (int r = 0; r < GLU_FWD_UNROLL; ++r) {
      const long long v = base + r * stride;
      if (v < nv) {
        gv[r] = load_vec<T, VEC>(gate + v * VEC);
        uv[r] = load_vec<T, VEC>(up + v * VEC);
      }
    }
#pragma unroll
    for (int r = 0; r < GLU_FWD_UNROLL; ++r) {
      const long long v = base + r * stride;
      if (v < nv) {
        Vec<T, VEC> yv;
#pragma unroll
        for (int j = 0; j < VEC; ++j) yv.v[j] = glu_one<T, ACT>(gv[r].v[j], uv[r].v[j]);
        store_vec<T, VEC>(y + v * VEC, yv);
      }
    }
  }
  if (VEC > 1 && blockIdx.x == 0 && threadIdx.x < n - nv * VEC) {
    const long long i = nv * VEC + threadIdx.x;
    y[i] = glu_one<T, ACT>(gate[i], up[i]);
  }
}

// dgate = dy * up * act'(gate), dup = dy * act(gate): the activation is recomputed from gate, so
// the forward saves only its inputs.
template <typename T, int ACT>
__device__ __forceinline__ void glu_grad_one(T d, T g, T u, T& dg, T& du) {
  using A = acc_t<T>;
  const A dz = to_acc<A>(d);
  const A z = to_acc<A>(g);
  dg = from_acc<T>(dz * to_acc<A>(u) * act_grad<ACT, kFast<T>>(z));
  du = from_acc<T>(dz * act_fwd<ACT, kFast<T>>(z));
}

template <typename T, int ACT, int VEC>
__global__ void glu_bwd(const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
                        T* __restrict__ dgate, T* __restrict__ dup, long long n) {
  const long long nv = n / VEC;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long base = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; base < nv;
       base += stride * GLU_BWD_UNROLL) {
    Vec<T, VEC> dv[GLU_BWD_UNROLL], gv[GLU_BWD_UNROLL], uv[GLU_BWD_UNROLL];
#pragma unroll
    for (int r = 0; r < GLU_BWD_UNROLL; ++r) {
      const long long v = base + r * stride;
      if (v < nv) {
        dv[r] = load_vec<T, VEC>(dy + v * VEC);
        gv[r] = load_vec<T, VEC>(gate + v * VEC);
        uv[r] = load_vec<T, VEC>(up + v * VEC);
      }
    }
#pragma unroll
    for (int r = 0; r < GLU_BWD_UNROLL; ++r) {
      const long long v = base + r * stride;
      if (v < nv) {
        Vec<T, VEC> dgv, duv;
#pragma unroll
        for (int j = 0; j < VEC; ++j) glu_grad_one<T, ACT>(dv[r].v[j], gv[r].v[j], uv[r].v[j], dgv.v[j], duv.v[j]);
        store_vec<T, VEC>(dgate + v * VEC, dgv);
        store_vec<T, VEC>(dup + v * VEC, duv);
      }
    }
  }
  if (VEC > 1 && blockIdx.x == 0 && threadIdx.x < n - nv * VEC) {
    const long long i = nv * VEC + threadIdx.x;
    glu_grad_one<T, ACT>(dy[i], gate[i], up[i], dgate[i], dup[i]);
  }
}
