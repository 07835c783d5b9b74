// linalg.cu: the small kernels around cukit.linalg's batched GEMMs (host side and references:
// cukit/ops/linalg.py).
//
// Matrix inverse p-th roots by the coupled Newton iteration (Guo & Higham; Shampoo's form), batched
// over B contiguous n x n matrices, T = float or double:
//   r = eps * lambda_max(A),  z = (p + 1) / (2 ||A + r I||_F),  X_0 = z^(1/p) I,  M_0 = z (A + r I)
//   T_k = ((p + 1) I - M_k) / p,  X_{k+1} = X_k T_k,  M_{k+1} = T_k^p M_k      (GEMMs on the host side)
// M_k -> I and X_k -> (A + r I)^(-1/p). Each matrix carries a state (0 running, 1 converged,
// 2 failed); a matrix that is not running gets T = I, and the GEMMs then reproduce its X and M
// exactly (x * 1 + 0 is exact), so converged matrices freeze without a branch on the host.
// One block per matrix for these kernels: their work is O(n^2) beside the GEMMs' O(n^3), and a
// matrix's reduction then finishes in the block that uses it (no second launch, no atomics).
//
// Also: the eigendecomposition route's V diag(f(w)) (f(w) = (max(w, 0) + r)^e) and kron.
#include <cukit/dtypes.cuh>
#include <cukit/reduce.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

enum NewtonState { RUNNING = 0, CONVERGED = 1, FAILED = 2 };

constexpr int POWER_ITERS = 8;     // power iterations for lambda_max (the ridge only needs its scale)
constexpr int MAX_THREADS = 1024;  // the host's largest block for the one-block-per-matrix kernels

// block_sum / block_max: cukit/reduce.cuh (fixed order; every thread gets the result).
__device__ __forceinline__ int block_any(int v) { return __syncthreads_or(v); }

// The power iteration's start vector: fixed and uneven, so that it is orthogonal to no usual
// eigenvector (the all-ones vector is, for centred statistics). Mirrored in the references.
template <typename A> __device__ __forceinline__ A power_start(long long j) {
  return A(1) + A(0.5) * static_cast<A>((j * 37) % 11) / A(10);
}

// Per matrix z: the ridge r = eps * lambda_max (Rayleigh quotient after POWER_ITERS power
// iterations, a lower bound that is close for the ridge's purpose), the scale from the exact
// ||A + r I||_F^2 = ||A||_F^2 + 2 r tr(A) + n r^2, then X_0 and M_0. A matrix whose norm is zero or
// not finite is marked FAILED (its X_0 is NaN). work: 2 * n + 1 accumulators per matrix: the
// power-iteration vectors (read through L1 by the warps), then r (for add_diag).
template <typename T>
__global__ void __launch_bounds__(MAX_THREADS)
    newton_init(const T* __restrict__ a, T* __restrict__ x, T* __restrict__ m, int* __restrict__ state,
                acc_t<T>* __restrict__ work, long long n, long long p, double eps) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const long long z = blockIdx.x;
  const long long nn = n * n;
  const T* az = a + z * nn;
  A* v = work + z * (2 * n + 1);
  A* y = v + n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

  A ss = A(0), tr = A(0), vv = A(0);
  for (long long e = threadIdx.x; e < nn; e += blockDim.x) {
    const A t = static_cast<A>(az[e]);
    ss += t * t;
  }
  for (long long j = threadIdx.x; j < n; j += blockDim.x) {
    tr += static_cast<A>(az[j * n + j]);
    const A s = power_start<A>(j);
    v[j] = s;
    vv += s * s;
  }
  ss = block_sum(ss, scratch);
  tr = block_sum(tr, scratch);
  vv = block_sum(vv, scratch);
  A lam = A(0);
  for (int it = 0; it < POWER_ITERS; ++it) {
    // y = A v / ||v|| (a warp per row: coalesced row reads), then lam = v.y / ||v||, ||y||
    __syncthreads();
    const A inv = A(1) / sqrt(vv);
    for (long long i = warp; i < n; i += warps) {
      A s = A(0);
      for (long long j = lane; j < n; j += 32) s += static_cast<A>(az[i * n + j]) * v[j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) y[i] = s * inv;
    }
    __syncthreads();
    A vy = A(0), yy = A(0);
    for (long long j = threadIdx.x; j < n; j += blockDim.x) {
      vy += v[j] * y[j];
      yy += y[j] * y[j];
    }
    lam = block_sum(vy, scratch) * inv;
    vv = block_sum(yy, scratch);
    if (!(vv > A(0))) break;  // A v == 0: lam is 0 (uniform across the block: vv is)
    for (long long j = threadIdx.x; j < n; j += blockDim.x) v[j] = y[j];
  }
  const A r = static_cast<A>(eps) * max(lam, A(0));
  const A fro2 = ss + A(2) * r * tr + static_cast<A>(n) * r * r;
  const A fro = sqrt(max(fro2, A(0)));
  const bool ok = fro > A(0) && isfinite(fro);
  const A pp = static_cast<A>(p);
  const A sc = ok ? (pp + A(1)) / (A(2) * fro) : A(0);
  const A xs = ok ? pow(sc, A(1) / pp) : A(0) / A(0);  // NaN
  if (threadIdx.x == 0) {
    state[z] = ok ? RUNNING : FAILED;
    v[2 * n] = r;
  }
  T* xz = x + z * nn;
  T* mz = m + z * nn;
  for (long long e = threadIdx.x; e < nn; e += blockDim.x) {
    const bool diag = e % (n + 1) == 0;
    xz[e] = static_cast<T>(diag ? xs : A(0));
    mz[e] = static_cast<T>(sc * (static_cast<A>(az[e]) + (diag ? r : A(0))));
  }
}

// One Newton step's T from M: the residual max |M - I| (a max does not depend on order) decides
// whether the matrix converged (<= tol) or failed (a non-finite element); T = I unless running.
template <typename T>
__global__ void __launch_bounds__(MAX_THREADS)
    newton_step(const T* __restrict__ m, T* __restrict__ t, int* __restrict__ state, long long n, long long p,
                double tol) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const long long z = blockIdx.x;
  const long long nn = n * n;
  const T* mz = m + z * nn;
  T* tz = t + z * nn;
  const int s0 = state[z];  // read by every thread before thread 0 may write it below
  A res = A(0);
  int bad = 0;
  if (s0 == RUNNING) {
    for (long long e = threadIdx.x; e < nn; e += blockDim.x) {
      const A d = static_cast<A>(mz[e]) - (e % (n + 1) == 0 ? A(1) : A(0));
      bad |= !isfinite(d);
      res = max(res, fabs(d));
    }
  }
  bad = block_any(bad);
  res = block_max(res, scratch);
  int s = s0;
  if (s == RUNNING && bad) s = FAILED;
  else if (s == RUNNING && res <= static_cast<A>(tol)) s = CONVERGED;
  if (threadIdx.x == 0 && s != s0) state[z] = s;
  const A pp = static_cast<A>(p);
  const A a0 = (pp + A(1)) / pp, a1 = A(-1) / pp;
  for (long long e = threadIdx.x; e < nn; e += blockDim.x) {
    const bool diag = e % (n + 1) == 0;
    const A v = s == RUNNING ? a1 * static_cast<A>(mz[e]) + (diag ? a0 : A(0)) : (diag ? A(1) : A(0));
    tz[e] = static_cast<T>(v);
  }
}

// The per-matrix result flag after the last step: 0 converged (max |M - I| <= tol, X finite),
// 1 not converged, 2 failed (non-finite M or X, or a zero/non-finite scale at the start).
template <typename T>
__global__ void __launch_bounds__(MAX_THREADS)
    newton_finish(const T* __restrict__ m, const T* __restrict__ x, const int* __restrict__ state,
                  int* __restrict__ info, long long n, double tol) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const long long z = blockIdx.x;
  const long long nn = n * n;
  const T* mz = m + z * nn;
  const T* xz = x + z * nn;
  A res = A(0);
  int bad = 0;
  for (long long e = threadIdx.x; e < nn; e += blockDim.x) {
    const A d = static_cast<A>(mz[e]) - (e % (n + 1) == 0 ? A(1) : A(0));
    bad |= !isfinite(d) || !isfinite(static_cast<A>(xz[e]));
    res = max(res, fabs(d));
  }
  bad = block_any(bad);
  res = block_max(res, scratch);
  if (threadIdx.x == 0) {
    const int s = state[z];
    info[z] = (s == FAILED || bad) ? FAILED : (s == CONVERGED || res <= static_cast<A>(tol)) ? 0 : 1;
  }
}

// m[z, i, i] += r_z, r_z = work[z, 2 n] (newton_init's ridge): A + r I for matrix_root.
template <typename T>
__global__ void add_diag(T* __restrict__ m, const acc_t<T>* __restrict__ work, long long batch, long long n) {
  using A = acc_t<T>;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < batch * n; e += stride) {
    const long long z = e / n, i = e % n;
    T* d = m + z * n * n + i * (n + 1);
    *d = static_cast<T>(static_cast<A>(*d) + work[z * (2 * n + 1) + 2 * n]);
  }
}

// The eigendecomposition route: S[z, i, j] = V[z, i, j] * (max(w[z, j], 0) + r_z)^e with
// r_z = eps * max(w[z, n-1], 0) (w ascending, as eigh returns it); the host then forms S V^T.
// info[z] = 2 when lambda_max is not finite, or e < 0 and the smallest shifted eigenvalue is not
// positive (a singular matrix and eps == 0, or a zero matrix), else 0. A grid-stride loop over all
// B * n * n elements, 64-bit indices.
template <typename T>
__global__ void eig_scale(const T* __restrict__ vecs, const T* __restrict__ w, T* __restrict__ s,
                          int* __restrict__ info, long long batch, long long n, double expo, double eps) {
  using A = acc_t<T>;
  const long long nn = n * n;
  const long long total = batch * nn;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const long long z = e / nn;
    const long long j = e % n;
    const A lmax = static_cast<A>(w[z * n + n - 1]);
    const A r = static_cast<A>(eps) * max(lmax, A(0));
    const A d = max(static_cast<A>(w[z * n + j]), A(0)) + r;
    s[e] = static_cast<T>(static_cast<A>(vecs[e]) * pow(d, static_cast<A>(expo)));
    if (e % nn == 0) {
      const A dmin = max(static_cast<A>(w[z * n]), A(0)) + r;
      info[z] = (!isfinite(lmax) || (expo < 0 && !(dmin > A(0)))) ? FAILED : 0;
    }
  }
}

// kron: out[z, (i_0 q_0 + k_0), ..., (i_3 q_3 + k_3)] = a[z, i_0..i_3] * b[z, k_0..k_3] for z over
// the batch and four Kronecker dimensions (the host pads with 1s), all arrays contiguous. A row is
// the last output dimension (width W = p3 * q3); threads (bx, by): x across VEC-wide column groups
// of a row, y down the rows, each row decoded once per thread (not per element), so that narrow
// rows still fill the block. VEC > 1 when q3 % VEC == 0 and the pointers are 16-byte aligned: a
// vector then lies within one b row and uses one element of a. Product in acc_t, one rounding.
template <typename T, int VEC>
__global__ void kron_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, long long rows,
                            long long p0, long long p1, long long p2, long long p3, long long q0, long long q1,
                            long long q2, long long q3) {
  using A = acc_t<T>;
  const long long W = p3 * q3;
  const int wv = static_cast<int>(W / VEC);  // the host checks W < 2^31
  const int qv = static_cast<int>(q3 / VEC);
  const long long a_mat = p0 * p1 * p2 * p3, b_mat = q0 * q1 * q2 * q3;
  const long long rstep = static_cast<long long>(gridDim.y) * blockDim.y;
  for (long long r = static_cast<long long>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += rstep) {
    long long t = r;
    const long long o2 = t % (p2 * q2); t /= p2 * q2;
    const long long o1 = t % (p1 * q1); t /= p1 * q1;
    const long long o0 = t % (p0 * q0); t /= p0 * q0;
    const long long zb = t;
    const long long abase = zb * a_mat + (((o0 / q0) * p1 + o1 / q1) * p2 + o2 / q2) * p3;
    const long long bbase = zb * b_mat + (((o0 % q0) * q1 + o1 % q1) * q2 + o2 % q2) * q3;
    T* orow = out + r * W;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < wv; c += gridDim.x * blockDim.x) {
      const int i3 = c / qv, k3 = (c - i3 * qv) * VEC;
      const A av = static_cast<A>(a[abase + i3]);
      const Vec<T, VEC> bv = load_vec<T, VEC>(b + bbase + k3);
      Vec<T, VEC> ov;
#pragma unroll
      for (int k = 0; k < VEC; ++k) ov.v[k] = from_acc<T>(av * to_acc<A>(bv.v[k]));
      store_vec<T, VEC>(orow + static_cast<long long>(c) * VEC, ov);
    }
  }
}
