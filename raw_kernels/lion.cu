// lion.cu: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") over a tensor
// table (the engine: cukit/multi_tensor.cuh).
//   g = sign * grad * gmul;   p = p * (1 - lr * wd) - lr * sgn(b1 m + (1 - b1) g);   m = b2 m + (1 - b2) g
// Host side and the plain-torch reference with the same maths: optim/lion.py, optim/_reference.py.
// Lists: 0 param P, 1 grad P, 2 exp_avg S, [master float].
// lion_qstep (Lion8bit: optim/lowbit.py) keeps exp_avg blockwise-quantised (multi_tensor.cuh):
// lists 0 param, 1 grad, 2 codes, 3 block scales, [4 master: float32, or int8 residual].
// hp per group: beta1, beta2, weight_decay, sign (-1 to maximize).
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

template <typename P, typename S, bool MASTER> struct LionFunctor {
  static constexpr int L = 3 + MASTER;
  static constexpr int kMaster = 3;
  using A = acc_t<P>;

  struct Ctx {
    A lr, b1, b2, decay, sign, gmul;
  };

  __device__ Ctx context(long long, int info, const Shared& sh) const {
    const int g = info & kGroupMask;
    const double* h = sh.hp + g * kHP;
    Ctx c;
    c.lr = sh.lr[g];
    c.b1 = h[0];
    c.b2 = h[1];
    c.decay = static_cast<A>(1.0 - static_cast<double>(sh.lr[g]) * static_cast<double>(h[2]));
    c.sign = h[3];
    c.gmul = sh.gmul;
    return c;
  }

  // One element: the maths of every Lion launch, full-precision or quantised state.
  __device__ static __forceinline__ void update(A& w, A g, A& m, const Ctx& c) {
    const A gk = c.sign * g * c.gmul;
    const A u = c.b1 * m + (A(1) - c.b1) * gk;
    // sgn with sgn(0) = 0 and NaN kept (torch.sign)
    const A s = u > A(0) ? A(1) : (u < A(0) ? A(-1) : u);
    w = w * c.decay - c.lr * s;
    m = c.b2 * m + (A(1) - c.b2) * gk;
  }

  // The quantised launch's element (QStateFunctor): s[0] the decoded exp_avg.
  __device__ static __forceinline__ void qupdate(float& w, float g, float (&s)[1], const Ctx& c) { update(w, g, s[0], c); }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    A w[N], g[N], m[N];
    if constexpr (MASTER) load<float, N>(p.template at<float>(kMaster), off, w);
    else load<P, N>(p.template at<P>(0), off, w);
    load<P, N>(p.template at<P>(1), off, g);
    load<S, N>(p.template at<S>(2), off, m);
#pragma unroll
    for (int k = 0; k < N; ++k) update(w[k], g[k], m[k], c);
    if constexpr (MASTER) store<float, N>(p.template at<float>(kMaster), off, w);
    store<P, N>(p.template at<P>(0), off, w);
    store<S, N>(p.template at<S>(2), off, m);
  }

  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename P, typename S, bool MASTER>
__global__ void __launch_bounds__(512) lion_step(CUKIT_MT_PARAMS) {
  CUKIT_MT_PROLOGUE(sh, acc_t<P>);
  using F = LionFunctor<P, S, MASTER>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{}, sh);
}

template <typename P, int BITS, int MASTER>
__global__ void __launch_bounds__(512, 2) lion_qstep(CUKIT_MT_PARAMS, const float* __restrict__ qtables) {
  CUKIT_MT_PROLOGUE(sh, float);
  run_qstates<P, BITS, MASTER, 1>(table, T, C, chunk, LionFunctor<P, float, false>{}, qtables, sh);
}
