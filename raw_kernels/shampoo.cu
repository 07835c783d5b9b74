// shampoo.cu: Shampoo's elementwise passes over a tensor table (the engine: cukit/multi_tensor.cuh),
// the two ends of a step around its batched GEMMs (optim/shampoo.py):
//   shampoo_graft:  g = sign * grad * gmul + l2 * p
//                   v = decay v + (1 - decay) g^2  (decay == 1: v += g^2)
//                   a = g / (sqrt(v / bc2) + eps)  (bc2: Adam grafting's bias correction, 1 - decay^t, or t
//                                                   when decay == 1; 1 for Adagrad grafting)
//                   writes the float32 working buffers G = g and A = a (the factors and the
//                   preconditioner read G; A is the grafting direction), and the state v.
//   shampoo_update: m += (1 - b1) (d - m);  u = m / (1 - b1^t)  (b1 == 0: u = d)
//                   p = p (1 - lr wd) - lr u
//                   d: the step's direction (the grafted, preconditioned one, or A).
// Plain-torch maths of both (the CPU path and the tests' oracle): optim/shampoo.py.
// Lists graft: 0 param P, 1 grad P, 2 graft state float, 3 G float, 4 A float.
// Lists update: 0 param P, 1 direction float, [2 exp_avg float].
// steps[0] is the count after this step. Both return at once when *skip != 0 (GradScaler found an
// inf): nothing is written.
// hp per group: sign (-1 to maximize), l2 (L2 weight decay, 0 for decoupled groups), decay, eps,
// beta1, wd (decoupled weight decay, 0 for L2 groups), bc (1: Adam grafting's bias correction).
// Arithmetic in float32 for every parameter dtype (the factors and states are float32).
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

template <typename P> struct GraftFunctor {
  static constexpr int L = 5;
  const float* steps;

  struct Ctx {
    float sign, l2, decay, one_minus, eps, inv_bc2, gmul;
  };

  __device__ Ctx context(long long, int info, const Shared& sh) const {
    const int g = info & kGroupMask;
    const double* h = sh.hp + g * kHP;
    Ctx c;
    c.sign = h[0];
    c.l2 = h[1];
    c.decay = h[2];
    c.one_minus = h[2] == 1.0 ? 1.f : static_cast<float>(1.0 - h[2]);
    c.eps = h[3];
    const double t = steps[0];
    double bc2 = 1.0;
    if (h[6] != 0.0) bc2 = h[2] == 1.0 ? t : 1.0 - pow(h[2], t);
    c.inv_bc2 = static_cast<float>(1.0 / bc2);
    c.gmul = sh.gmul;
    return c;
  }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    float w[N], g[N], v[N], a[N];
    if (c.l2 != 0.f) load<P, N>(p.template at<P>(0), off, w);
    load<P, N>(p.template at<P>(1), off, g);
    load<float, N>(p.template at<float>(2), off, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float gk = c.sign * g[k] * c.gmul;
      if (c.l2 != 0.f) gk += c.l2 * w[k];
      v[k] = c.decay == 1.f ? v[k] + gk * gk : c.decay * v[k] + c.one_minus * (gk * gk);
      a[k] = gk / (sqrtf(v[k] * c.inv_bc2) + c.eps);
      g[k] = gk;
    }
    store<float, N>(p.template at<float>(2), off, v);
    store<float, N>(p.template at<float>(3), off, g);
    store<float, N>(p.template at<float>(4), off, a);
  }

  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename P, bool MOMENTUM> struct UpdateFunctor {
  static constexpr int L = 2 + MOMENTUM;
  const float* steps;

  struct Ctx {
    float lr, b1, decay, inv_bc1;
  };

  __device__ Ctx context(long long, int info, const Shared& sh) const {
    const int g = info & kGroupMask;
    const double* h = sh.hp + g * kHP;
    Ctx c;
    c.lr = sh.lr[g];
    c.b1 = h[4];
    c.decay = static_cast<float>(1.0 - static_cast<double>(c.lr) * h[5]);
    c.inv_bc1 = MOMENTUM ? static_cast<float>(1.0 / (1.0 - pow(h[4], static_cast<double>(steps[0])))) : 1.f;
    return c;
  }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    float w[N], d[N], m[N];
    load<P, N>(p.template at<P>(0), off, w);
    load<float, N>(p.template at<float>(1), off, d);
    if constexpr (MOMENTUM) load<float, N>(p.template at<float>(2), off, m);
    const float weight = 1.f - c.b1;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float u = d[k];
      if constexpr (MOMENTUM) {
        // torch.lerp's two forms (exact at both ends)
        m[k] = weight < 0.5f ? m[k] + weight * (d[k] - m[k]) : d[k] - (d[k] - m[k]) * (1.f - weight);
        u = m[k] * c.inv_bc1;
      }
      w[k] = w[k] * c.decay - c.lr * u;
    }
    store<P, N>(p.template at<P>(0), off, w);
    if constexpr (MOMENTUM) store<float, N>(p.template at<float>(2), off, m);
  }

  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename P>
__global__ void __launch_bounds__(512) shampoo_graft(CUKIT_MT_PARAMS, const float* __restrict__ steps) {
  CUKIT_MT_PROLOGUE(sh, float);
  using F = GraftFunctor<P>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{steps}, sh);
}

template <typename P, bool MOMENTUM>
__global__ void __launch_bounds__(512) shampoo_update(CUKIT_MT_PARAMS, const float* __restrict__ steps) {
  CUKIT_MT_PROLOGUE(sh, float);
  using F = UpdateFunctor<P, MOMENTUM>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{steps}, sh);
}
