// adam.cu: Adam and AdamW over a tensor table (the engine: cukit/multi_tensor.cuh).
//   g = sign * grad * gmul  (+ wd * p for Adam's L2 penalty)       p *= 1 - lr * wd  (AdamW)
//   m += (1 - b1) (g - m);   v = b2 v + (1 - b2) g^2;   vmax = max(vmax, v)  (amsgrad)
//   p -= lr / (1 - b1^t) * m / (sqrt(v or vmax) / sqrt(1 - b2^t) + eps)
// Host side and the plain-torch reference with the same maths: optim/adam.py, optim/_reference.py.
// Lists: 0 param P, 1 grad P, 2 exp_avg S, 3 exp_avg_sq S, [max_exp_avg_sq S], [master float].
// adam_qstep (AdamW8bit, Adam8bit, AdamW4bit: optim/lowbit.py) keeps exp_avg and exp_avg_sq as
// blockwise-quantised states (multi_tensor.cuh): lists 0 param P, 1 grad P, 2 codes of exp_avg,
// 3 its block scales, 4 codes of exp_avg_sq, 5 its scales, [6 master: float32, or int8 residual],
// and the two code tables (signed map for exp_avg, unsigned for exp_avg_sq) in `qtables`.
// With a master, the maths reads and writes the float32 master and stores its rounding in param.
// hp per group: beta1, beta2, eps, weight_decay, sign (-1 to maximize).
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

template <typename P, typename S, bool AMSGRAD, bool MASTER, bool DECOUPLED> struct AdamFunctor {
  static constexpr int L = 4 + AMSGRAD + MASTER;
  static constexpr int kMax = 4, kMaster = 4 + AMSGRAD;
  using A = acc_t<P>;
  const float* steps;

  struct Ctx {
    A lr, b1, b2, eps, wd, sign, gmul, step_size, bc2_sqrt, decay;
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
    // torch computes the bias corrections in double on the host; here in double once per chunk.
    const double t = steps[i];
    const double bc1 = 1.0 - pow(static_cast<double>(h[0]), t);
    c.step_size = static_cast<A>(static_cast<double>(c.lr) / bc1);
    c.bc2_sqrt = static_cast<A>(sqrt(1.0 - pow(static_cast<double>(h[1]), t)));
    c.decay = static_cast<A>(1.0 - static_cast<double>(c.lr) * static_cast<double>(h[3]));
    return c;
  }

  // One element: the maths of every Adam launch, full-precision or quantised states. FAST (the
  // quantised launches, float only): the two divisions by the fast reciprocal (2 ulp), negligible
  // beside the states' quantisation and a tenth of the kernel's instructions.
  template <bool AMS, bool FAST = false>
  __device__ static __forceinline__ void update(A& w, A g, A& m, A& v, A& vmax, const Ctx& c) {
    A gk = c.sign * g * c.gmul;
    if constexpr (DECOUPLED) w *= c.decay;
    else gk += c.wd * w;
    m += (A(1) - c.b1) * (gk - m);
    v = c.b2 * v + (A(1) - c.b2) * gk * gk;
    A vk = v;
    if constexpr (AMS) {
      vmax = max(vmax, v);
      vk = vmax;
    }
    if constexpr (FAST) {
      const float denom = __fdividef(sqrtf(vk), c.bc2_sqrt) + c.eps;
      w -= c.step_size * __fdividef(m, denom);
    } else {
      const A denom = sqrt(vk) / c.bc2_sqrt + c.eps;
      w -= c.step_size * (m / denom);
    }
  }

  // The quantised launch's element (QStateFunctor): s the decoded exp_avg and exp_avg_sq.
  __device__ static __forceinline__ void qupdate(float& w, float g, float (&s)[2], const Ctx& c) {
    update<false, true>(w, g, s[0], s[1], s[1], c);
  }

  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    A w[N], g[N], m[N], v[N], vmax[N];
    if constexpr (MASTER) load<float, N>(p.template at<float>(kMaster), off, w);
    else load<P, N>(p.template at<P>(0), off, w);
    load<P, N>(p.template at<P>(1), off, g);
    load<S, N>(p.template at<S>(2), off, m);
    load<S, N>(p.template at<S>(3), off, v);
    if constexpr (AMSGRAD) load<S, N>(p.template at<S>(kMax), off, vmax);
#pragma unroll
    for (int k = 0; k < N; ++k) update<AMSGRAD>(w[k], g[k], m[k], v[k], vmax[k], c);
    if constexpr (MASTER) store<float, N>(p.template at<float>(kMaster), off, w);
    store<P, N>(p.template at<P>(0), off, w);
    store<S, N>(p.template at<S>(2), off, m);
    store<S, N>(p.template at<S>(3), off, v);
    if constexpr (AMSGRAD) store<S, N>(p.template at<S>(kMax), off, vmax);
  }

  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename P, typename S, bool AMSGRAD, bool MASTER, bool DECOUPLED>
__global__ void __launch_bounds__(512) adam_step(CUKIT_MT_PARAMS, const float* __restrict__ steps) {
  CUKIT_MT_PROLOGUE(sh, acc_t<P>);
  using F = AdamFunctor<P, S, AMSGRAD, MASTER, DECOUPLED>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_chunk<F::L>(tab, F{steps}, sh);
}

template <typename P, int BITS, int MASTER, bool DECOUPLED>
__global__ void __launch_bounds__(512, 2)
    adam_qstep(CUKIT_MT_PARAMS, const float* __restrict__ steps, const float* __restrict__ qtables) {
  CUKIT_MT_PROLOGUE(sh, float);
  run_qstates<P, BITS, MASTER, 2>(table, T, C, chunk, AdamFunctor<P, float, false, false, DECOUPLED>{steps}, qtables,
                                  sh);
}
