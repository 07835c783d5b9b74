// adagrad.cu: Adagrad over a tensor table (the engine: cukit/multi_tensor.cuh).
//   g = sign * grad * gmul + wd * p;   sum += g^2;   p -= lr / (1 + (t - 1) lr_decay) * g / (sqrt(sum) + eps)
// Host side and the plain-torch reference with the same maths: optim/adagrad.py, optim/_reference.py.
// Lists: 0 param P, 1 grad P, 2 sum S, [master float]. steps[t] is the count after this step.
// hp per group: lr_decay, weight_decay, eps, sign (-1 to maximize).
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

template <typename P, typename S, bool MASTER> struct AdagradFunctor {
  static constexpr int L = 3 + MASTER;
  static constexpr int kMaster = 3;
  using A = acc_t<P>;
  const float* steps;

  struct Ctx {
    A clr, wd, eps, sign, gmul;
  };

  __device__ Ctx context(long long i, int info, const Shared& sh) const {
    const int g = info & kGroupMask;
    const double* h = sh.hp + g * kHP;
    Ctx c;
    // torch: clr = lr / (1 + (step - 1) * lr_decay), in double on the host
    c.clr = static_cast<A>(static_cast<double>(sh.lr[g]) /
                           (1.0 + (static_cast<double>(steps[i]) - 1.0) * static_cast<double>(h[0])));
    c.wd = h[1];
    c.eps = h[2];
    c.sign = h[3];
    c.gmul = sh.gmul;
    return c;
  }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    A w[N], g[N], s[N];
    if constexpr (MASTER) load<float, N>(p.template at<float>(kMaster), off, w);
    else load<P, N>(p.template at<P>(0), off, w);
    load<P, N>(p.template at<P>(1), off, g);
    load<S, N>(p.template at<S>(2), off, s);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A gk = c.sign * g[k] * c.gmul + c.wd * w[k];
      s[k] += gk * gk;
      w[k] -= c.clr * (gk / (sqrt(s[k]) + c.eps));
    }
    if constexpr (MASTER) store<float, N>(p.template at<float>(kMaster), off, w);
    store<P, N>(p.template at<P>(0), off, w);
    store<S, N>(p.template at<S>(2), off, s);
  }

  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename P, typename S, bool MASTER>
__global__ void __launch_bounds__(512) adagrad_step(CUKIT_MT_PARAMS, const float* __restrict__ steps) {
  CUKIT_MT_PROLOGUE(sh, acc_t<P>);
  using F = AdagradFunctor<P, S, MASTER>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{steps}, sh);
}
