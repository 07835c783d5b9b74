// lamb.cu: LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning") over a tensor table
// (the engine: cukit/multi_tensor.cuh), in three launches with no host sync:
//   stage 1:  g = sign * grad * gmul;  m += (1 - b1)(g - m);  v = b2 v + (1 - b2) g^2
//             u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * p        (bc = 1 - b^t, or 1 without
//             bias correction); per chunk: sum p^2 and sum u^2 (in the accumulation type) -> partial[c]
//   ratio:    per tensor: r = ||p|| / ||u|| when both are > 0, else 1 (sums its chunks' partials)
// partial and ratio are double for every launch: float launches store their float sums exactly and
// read the ratio rounded to float, float64 launches keep float64 norms end to end.
//   stage 2:  u recomputed from the stored m, v and the unchanged p;  p -= lr * r * u
// Recomputing u costs the same traffic as storing it (7 reads + 3 writes per element either way)
// and needs no scratch buffer. Host side and reference: optim/lamb.py, optim/_reference.py.
// Lists: 0 param P, 1 grad P, 2 exp_avg S, 3 exp_avg_sq S, [master float].
// hp per group: beta1, beta2, eps, weight_decay, sign (-1 to maximize), bias_correction (0 or 1).
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

template <typename P, typename S, bool MASTER, int STAGE> struct LambFunctor {
  static constexpr int L = 4 + MASTER;
  static constexpr int kMaster = 4;
  using A = acc_t<P>;
  const float* steps;
  double* partial;      // stage 1: [C][2]
  const double* ratio;  // stage 2: [T]
  A* scratch;           // shared, 32 values
  mutable A acc_w = A(0), acc_u = A(0);

  struct Ctx {
    A lr, b1, b2, eps, wd, sign, gmul, bc1, bc2, r;
  };

  __device__ Ctx context(long long i, int info, const Shared& sh) const {
    const int g = info & kGroupMask;
    const double* h = sh.hp + g * kHP;
    Ctx c;
    c.lr = sh.lr[g];
    c.b1 = h[0];
    c.b2 = h[1];
    c.eps = h[2];
    c.wd = h[3];
    c.sign = h[4];
    c.gmul = sh.gmul;
    const double t = steps[i];
    const bool bias_correction = h[5] != 0.0;
    c.bc1 = bias_correction ? static_cast<A>(1.0 - pow(static_cast<double>(h[0]), t)) : A(1);
    c.bc2 = bias_correction ? static_cast<A>(1.0 - pow(static_cast<double>(h[1]), t)) : A(1);
    c.r = STAGE == 2 ? static_cast<A>(ratio[i]) : A(1);
    acc_w = A(0);
    acc_u = A(0);
    return c;
  }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    A w[N], g[N], m[N], v[N];
    if constexpr (MASTER) load<float, N>(p.template at<float>(kMaster), off, w);
    else load<P, N>(p.template at<P>(0), off, w);
    if constexpr (STAGE == 1) load<P, N>(p.template at<P>(1), off, g);
    load<S, N>(p.template at<S>(2), off, m);
    load<S, N>(p.template at<S>(3), off, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if constexpr (STAGE == 1) {
        const A gk = c.sign * g[k] * c.gmul;
        m[k] += (A(1) - c.b1) * (gk - m[k]);
        v[k] = c.b2 * v[k] + (A(1) - c.b2) * gk * gk;
      }
      // Stage 2 reads m and v as stored (rounded to S), so stage 1 rounds them the same way first:
      // both stages see identical u.
      const A mk = to_acc<A>(from_acc<S>(m[k])), vk = to_acc<A>(from_acc<S>(v[k]));
      const A u = (mk / c.bc1) / (sqrt(vk / c.bc2) + c.eps) + c.wd * w[k];
      if constexpr (STAGE == 1) {
        acc_w += w[k] * w[k];
        acc_u += u * u;
      } else {
        w[k] -= c.lr * c.r * u;
      }
    }
    if constexpr (STAGE == 1) {
      store<S, N>(p.template at<S>(2), off, m);
      store<S, N>(p.template at<S>(3), off, v);
    } else {
      if constexpr (MASTER) store<float, N>(p.template at<float>(kMaster), off, w);
      store<P, N>(p.template at<P>(0), off, w);
    }
  }

  __device__ __forceinline__ void end_chunk(long long chunk, long long, const Ctx&) const {
    if constexpr (STAGE == 1) {
      const A sw = block_sum(acc_w, scratch);
      const A su = block_sum(acc_u, scratch);
      if (threadIdx.x == 0) {
        partial[2 * chunk] = sw;
        partial[2 * chunk + 1] = su;
      }
    }
  }
};

template <typename P, typename S, bool MASTER>
__global__ void __launch_bounds__(512) lamb_stage1(CUKIT_MT_PARAMS, const float* __restrict__ steps,
                                                   double* __restrict__ partial) {
  CUKIT_MT_PROLOGUE(sh, acc_t<P>);
  __shared__ acc_t<P> scratch[32];
  using F = LambFunctor<P, S, MASTER, 1>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{steps, partial, nullptr, scratch}, sh);
}

// One warp per tensor: sums the tensor's chunk partials in chunk order, writes its trust ratio.
template <int L>
__global__ void lamb_ratio(const long long* __restrict__ table, long long T, long long C,
                           const double* __restrict__ partial, double* __restrict__ ratio, const float* __restrict__ skip) {
  if (skip != nullptr && *skip != 0.f) return;
  const Table<L> tab{table, T, C, 0};
  const int lane = threadIdx.x & 31;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
  for (long long i = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); i < T; i += warps) {
    const long long c0 = tab.chunk_begin(i), c1 = tab.chunk_begin(i + 1);
    double sw = 0.0, su = 0.0;
    for (long long c = c0 + lane; c < c1; c += 32) {
      sw += partial[2 * c];
      su += partial[2 * c + 1];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sw += __shfl_xor_sync(0xffffffffu, sw, o);
      su += __shfl_xor_sync(0xffffffffu, su, o);
    }
    if (lane == 0) ratio[i] = (sw > 0.0 && su > 0.0) ? sqrt(sw) / sqrt(su) : 1.0;
  }
}

template <typename P, typename S, bool MASTER>
__global__ void __launch_bounds__(512) lamb_stage2(CUKIT_MT_PARAMS, const float* __restrict__ steps,
                                                   const double* __restrict__ ratio) {
  CUKIT_MT_PROLOGUE(sh, acc_t<P>);
  using F = LambFunctor<P, S, MASTER, 2>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{steps, nullptr, ratio, nullptr}, sh);
}
