// sgd.cu: SGD with momentum over a tensor table (the engine: cukit/multi_tensor.cuh).
//   g = sign * grad * gmul + wd * p
//   buf = g on the tensor's first step (counts[t] == 1), else momentum * buf + (1 - dampening) g
// counts[t] is the number of steps taken with the tensor's buffer, counted before this launch
// unless the step is skipped (so a step GradScaler skips does not consume the first step); null
// once every buffer is known to exist.
//   p -= lr * (nesterov ? g + momentum * buf : buf)           (without momentum: p -= lr * g)
// Host side and the plain-torch reference with the same maths: optim/sgd.py, optim/_reference.py.
// Lists: 0 param P, 1 grad P, [momentum_buffer S], [master float].
// sgd_qstep (SGD8bit: optim/lowbit.py) keeps the momentum buffer blockwise-quantised
// (multi_tensor.cuh): lists 0 param, 1 grad, 2 codes, 3 block scales, [4 master: float32, or int8
// residual].
// hp per group: momentum, dampening, weight_decay, sign (-1 to maximize), nesterov (0 or 1).
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

template <typename P, typename S, bool MOMENTUM, bool MASTER> struct SgdFunctor {
  static constexpr int L = 2 + MOMENTUM + MASTER;
  static constexpr int kMaster = 2 + MOMENTUM;
  using A = acc_t<P>;
  const float* counts;

  struct Ctx {
    A lr, momentum, damp1, wd, sign, gmul;
    bool nesterov, init;
  };

  __device__ Ctx context(long long i, int info, const Shared& sh) const {
    const int g = info & kGroupMask;
    const double* h = sh.hp + g * kHP;
    Ctx c;
    c.lr = sh.lr[g];
    c.momentum = h[0];
    c.damp1 = A(1) - A(h[1]);
    c.wd = h[2];
    c.sign = h[3];
    c.nesterov = h[4] != 0.0;
    c.gmul = sh.gmul;
    c.init = counts != nullptr && counts[i] == 1.f;
    return c;
  }

  // One element: the maths of every SGD launch, full-precision or quantised momentum.
  template <bool MOM> __device__ static __forceinline__ void update(A& w, A g, A& b, const Ctx& c) {
    A gk = c.sign * g * c.gmul + c.wd * w;
    if constexpr (MOM) {
      b = c.init ? gk : c.momentum * b + c.damp1 * gk;
      gk = c.nesterov ? gk + c.momentum * b : b;
    }
    w -= c.lr * gk;
  }

  // The quantised launch's element (QStateFunctor): s[0] the decoded momentum buffer.
  __device__ static __forceinline__ void qupdate(float& w, float g, float (&s)[1], const Ctx& c) {
    update<true>(w, g, s[0], c);
  }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    A w[N], g[N], b[N];
    if constexpr (MASTER) load<float, N>(p.template at<float>(kMaster), off, w);
    else load<P, N>(p.template at<P>(0), off, w);
    load<P, N>(p.template at<P>(1), off, g);
    if constexpr (MOMENTUM) {
      if (!c.init) load<S, N>(p.template at<S>(2), off, b);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) update<MOMENTUM>(w[k], g[k], b[k], c);
    if constexpr (MASTER) store<float, N>(p.template at<float>(kMaster), off, w);
    store<P, N>(p.template at<P>(0), off, w);
    if constexpr (MOMENTUM) store<S, N>(p.template at<S>(2), off, b);
  }

  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename P, typename S, bool MOMENTUM, bool MASTER>
__global__ void __launch_bounds__(512) sgd_step(CUKIT_MT_PARAMS, const float* __restrict__ counts) {
  CUKIT_MT_PROLOGUE(sh, acc_t<P>);
  using F = SgdFunctor<P, S, MOMENTUM, MASTER>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{counts}, sh);
}

template <typename P, int BITS, int MASTER>
__global__ void __launch_bounds__(512, 2)
    sgd_qstep(CUKIT_MT_PARAMS, const float* __restrict__ counts, const float* __restrict__ qtables) {
  CUKIT_MT_PROLOGUE(sh, float);
  run_qstates<P, BITS, MASTER, 1>(table, T, C, chunk, SgdFunctor<P, float, true, false>{counts}, qtables, sh);
}
