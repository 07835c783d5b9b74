// linalg.cu: the kernels of cukit.linalg (host side and references: cukit/ops/linalg.py).
//
// Matrix inverse p-th roots by the coupled Newton iteration (Guo & Higham; Shampoo's form), batched
// over B contiguous n x n matrices, T = float or double:
//   r = eps * lambda_max(A),  z = (p + 1) / (2 ||A + r I||_F),  X_0 = z^(1/p) I,  M_0 = z (A + r I)
//   T_k = ((p + 1) I - M_k) / p,  X_{k+1} = X_k T_k,  M_{k+1} = T_k^p M_k
// M_k -> I and X_k -> (A + r I)^(-1/p). Each matrix carries a state (0 running, 1 converged,
// 2 failed), tested on M_k before each step; the last step's M update is skipped (nothing would
// test it). Two implementations of the steps:
// - newton_fused (matrices that fit in shared memory three times: n <= 128 in float, 96 in double):
//   one block per matrix keeps X, M and T on chip for the whole loop and leaves it once its matrix
//   converged or failed, so a batch pays only for the steps each of its matrices needs, and no step
//   costs a launch or a round trip of the matrices through L2.
// - newton_step and the host's batched GEMMs (larger n, TF32): a fixed number of steps without a
//   host sync; a matrix that is not running gets T = I, and the GEMMs then reproduce its X and M
//   exactly (x * 1 + 0 is exact), so converged matrices freeze without a branch on the host.
// newton_power and newton_start (the ridge, scale, X_0, M_0) and, on the GEMM path, newton_resid,
// newton_step and newton_finish are O(n^2) beside the products' O(n^3), but a batch of a few
// large matrices would leave most SMs idle with a block per matrix: they run on row chunks, a
// matrix's reductions finished by the next launch (see Chunk).
//
// Also: the eigendecomposition route's V diag(f(w)) (f(w) = (max(w, 0) + r)^e) and kron.
#include <cukit/dtypes.cuh>
#include <cukit/reduce.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

enum NewtonState { RUNNING = 0, CONVERGED = 1, FAILED = 2 };

constexpr int POWER_ITERS = 8;  // power iterations for lambda_max (the host launches them; mirrored there)

// block_sum / block_max: cukit/reduce.cuh (fixed order; every thread gets the result).
__device__ __forceinline__ int block_any(int v) { return __syncthreads_or(v); }

// The power iteration's start vector: fixed and uneven, so that it is orthogonal to no usual
// eigenvector (the all-ones vector is, for centred statistics). Mirrored in the references.
template <typename A> __device__ __forceinline__ A power_start(long long j) {
  return A(1) + A(0.5) * static_cast<A>((j * 37) % 11) / A(10);
}

// The O(n^2) kernels around the products run on row chunks: block b takes matrix z = b / chunks,
// rows [c rows, (c + 1) rows) with c = b % chunks and chunks = ceil(n / rows) (the host sizes
// `rows` so that a batch of a few large matrices still fills the GPU), a warp per row (coalesced),
// lanes along the columns. A chunk's partial results go to part[(q * batch + z) * chunks + c] for
// quantity q; a later launch reduces a matrix's chunks in a fixed order (deterministic, no atomics).
struct Chunk {
  long long z, batch, r0, r1;  // matrix, matrices, rows [r0, r1)
  int c, chunks, lane, warp, warps;
};
__device__ __forceinline__ Chunk chunk_of(long long n, long long rows) {
  Chunk c;
  c.chunks = static_cast<int>((n + rows - 1) / rows);
  c.z = blockIdx.x / c.chunks;
  c.c = static_cast<int>(blockIdx.x - c.z * c.chunks);
  c.batch = gridDim.x / c.chunks;
  c.r0 = static_cast<long long>(c.c) * rows;
  c.r1 = min(n, c.r0 + rows);
  c.lane = threadIdx.x & 31;
  c.warp = threadIdx.x >> 5;
  c.warps = blockDim.x >> 5;
  return c;
}
template <typename A> __device__ __forceinline__ A* part_at(A* part, int q, const Chunk& c) {
  return part + (static_cast<long long>(q) * c.batch + c.z) * c.chunks + c.c;
}
// The sum (MAXQ: the maximum) of quantity q's partials of matrix z over its `chunks` chunks; every
// thread of the block gets it.
template <bool MAXQ, typename A>
__device__ __forceinline__ A reduce_parts(const A* part, int q, long long z, int chunks, long long batch, A* scratch) {
  A v = A(0);
  const A* pz = part + (static_cast<long long>(q) * batch + z) * chunks;
  for (int k = threadIdx.x; k < chunks; k += blockDim.x) v = MAXQ ? max(v, pz[k]) : v + pz[k];
  return MAXQ ? block_max(v, scratch) : block_sum(v, scratch);
}

// Partials (6 quantities: the host's _NEWTON_PARTS): 0 and 1 are ||A||_F^2 and tr(A) (newton_power's
// first pass), the power iteration's v.y / ||v|| and y.y take 2 + 2 (it % 2) and 3 + 2 (it % 2);
// newton_resid's max |M - I| takes 0.

// Power iteration `it` for lambda_max (the ridge only needs its scale), per row chunk:
// y = A v / ||v|| with v the power_start vector (it = 0) or the previous y; work[z] holds the two
// vectors (it writes work[z, (it % 2) n + i]) and then r. Partials v.y and y.y of the chunk's rows;
// it = 0 also ||A||_F^2 and tr(A) over them. A previous y of zero (or not finite) norm stops the
// iteration: y = 0 from there on (lambda = 0: the ridge is 0, as for a zero A v).
template <typename T>
__global__ void __launch_bounds__(256)
    newton_power(const T* __restrict__ a, acc_t<T>* __restrict__ work, acc_t<T>* __restrict__ part, long long n,
                 long long rows, long long it) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const Chunk c = chunk_of(n, rows);
  const T* az = a + c.z * n * n;
  A* wz = work + c.z * (2 * n + 1);
  const A* v = wz + ((it + 1) % 2) * n;
  A* y = wz + (it % 2) * n;
  A vv;
  if (it == 0) {
    vv = A(0);
    for (long long j = threadIdx.x; j < n; j += blockDim.x) vv += power_start<A>(j) * power_start<A>(j);
    vv = block_sum(vv, scratch);
  } else {
    vv = reduce_parts<false>(part, 3 + 2 * ((it + 1) % 2), c.z, c.chunks, c.batch, scratch);
  }
  const bool live = vv > A(0);  // uniform over the block
  const A inv = live ? A(1) / sqrt(vv) : A(0);
  A vy = A(0), yy = A(0), ss = A(0), tr = A(0);
  for (long long i = c.r0 + c.warp; i < c.r1; i += c.warps) {
    A s = A(0);
    const T* row = az + i * n;
    for (long long j = c.lane; j < n; j += 32) {
      const A aij = static_cast<A>(row[j]);
      s += aij * (it == 0 ? power_start<A>(j) : v[j]);
      if (it == 0) ss += aij * aij;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (c.lane == 0) {
      const A yi = live ? s * inv : A(0);
      y[i] = yi;
      vy += (it == 0 ? power_start<A>(i) : v[i]) * yi;
      yy += yi * yi;
      if (it == 0) tr += static_cast<A>(row[i]);
    }
  }
  vy = block_sum(vy, scratch);
  yy = block_sum(yy, scratch);
  if (it == 0) {
    ss = block_sum(ss, scratch);
    tr = block_sum(tr, scratch);
  }
  if (threadIdx.x == 0) {
    *part_at(part, 2 + 2 * (it % 2), c) = vy * inv;  // lambda's share: v.(A v) / ||v||^2
    *part_at(part, 3 + 2 * (it % 2), c) = yy;
    if (it == 0) {
      *part_at(part, 0, c) = ss;
      *part_at(part, 1, c) = tr;
    }
  }
}

// After newton_power's `iters` passes: lambda (the last pass's Rayleigh quotient, a lower bound that
// is close for the ridge's purpose), the ridge r = eps * lambda, the scale from the exact
// ||A + r I||_F^2 = ||A||_F^2 + 2 r tr(A) + n r^2, then X_0 and M_0 of the chunk's rows. A matrix
// whose norm is zero or not finite is marked FAILED (its X_0 is NaN). Chunk 0 writes the state and
// r (work[z, 2 n], for add_diag).
template <typename T>
__global__ void __launch_bounds__(256)
    newton_start(const T* __restrict__ a, T* __restrict__ x, T* __restrict__ m, int* __restrict__ state,
                 acc_t<T>* __restrict__ work, const acc_t<T>* __restrict__ part, long long n, long long p, double eps,
                 long long rows, long long iters) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const Chunk c = chunk_of(n, rows);
  const A ss = reduce_parts<false>(part, 0, c.z, c.chunks, c.batch, scratch);
  const A tr = reduce_parts<false>(part, 1, c.z, c.chunks, c.batch, scratch);
  const A lam = reduce_parts<false>(part, 2 + 2 * ((iters + 1) % 2), c.z, c.chunks, c.batch, scratch);
  const A r = static_cast<A>(eps) * max(lam, A(0));
  const A fro2 = ss + A(2) * r * tr + static_cast<A>(n) * r * r;
  const A fro = sqrt(max(fro2, A(0)));
  const bool ok = fro > A(0) && isfinite(fro);
  const A pp = static_cast<A>(p);
  const A sc = ok ? (pp + A(1)) / (A(2) * fro) : A(0);
  const A xs = ok ? pow(sc, A(1) / pp) : A(0) / A(0);  // NaN
  if (c.c == 0 && threadIdx.x == 0) {
    state[c.z] = ok ? RUNNING : FAILED;
    work[c.z * (2 * n + 1) + 2 * n] = r;
  }
  const long long off = c.z * n * n;
  for (long long i = c.r0 + c.warp; i < c.r1; i += c.warps)
    for (long long j = c.lane; j < n; j += 32) {
      const long long e = off + i * n + j;
      x[e] = static_cast<T>(i == j ? xs : A(0));
      m[e] = static_cast<T>(sc * (static_cast<A>(a[e]) + (i == j ? r : A(0))));
    }
}

// max |M - I| over the chunk's rows (quantity 0), +inf where an element of M, or of X when x is
// given, is not finite. A matrix that is not running (state given) is not read: its partial is 0
// (newton_step then keeps its state).
template <typename T>
__global__ void __launch_bounds__(256)
    newton_resid(const T* __restrict__ m, const T* __restrict__ x, const int* __restrict__ state,
                 acc_t<T>* __restrict__ part, long long n, long long rows) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const Chunk c = chunk_of(n, rows);
  A res = A(0);
  int bad = 0;
  if (state == nullptr || state[c.z] == RUNNING) {
    const long long off = c.z * n * n;
    for (long long i = c.r0 + c.warp; i < c.r1; i += c.warps)
      for (long long j = c.lane; j < n; j += 32) {
        const A d = static_cast<A>(m[off + i * n + j]) - (i == j ? A(1) : A(0));
        bad |= !isfinite(d) || (x != nullptr && !isfinite(static_cast<A>(x[off + i * n + j])));
        res = max(res, fabs(d));
      }
  }
  bad = block_any(bad);
  res = block_max(res, scratch);
  if (threadIdx.x == 0) *part_at(part, 0, c) = bad ? A(1) / A(0) : res;  // +inf
}

// One Newton step's T from M for the chunk's rows: the residual max |M - I| (newton_resid's
// partials; +inf: a non-finite element) decides whether the matrix converged (<= tol) or failed;
// T = I unless running. Chunk 0 writes the new state. The other chunks may read it already
// updated: the transition is idempotent (a converged or failed state stays), so every chunk
// computes the same state and the same T.
template <typename T>
__global__ void __launch_bounds__(256)
    newton_step(const T* __restrict__ m, T* __restrict__ t, int* __restrict__ state, const acc_t<T>* __restrict__ part,
                long long n, long long p, double tol, long long rows) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const Chunk c = chunk_of(n, rows);
  const int s0 = state[c.z];
  const A res = reduce_parts<true>(part, 0, c.z, c.chunks, c.batch, scratch);
  int s = s0;
  if (s == RUNNING && isinf(res)) s = FAILED;
  else if (s == RUNNING && res <= static_cast<A>(tol)) s = CONVERGED;
  if (c.c == 0 && threadIdx.x == 0 && s != s0) state[c.z] = s;
  const A pp = static_cast<A>(p);
  const A a0 = (pp + A(1)) / pp, a1 = A(-1) / pp;
  const long long off = c.z * n * n;
  for (long long i = c.r0 + c.warp; i < c.r1; i += c.warps)
    for (long long j = c.lane; j < n; j += 32) {
      const long long e = off + i * n + j;
      const A v = s == RUNNING ? a1 * static_cast<A>(m[e]) + (i == j ? a0 : A(0)) : (i == j ? A(1) : A(0));
      t[e] = static_cast<T>(v);
    }
}

// The per-matrix result flag after the last step, from newton_resid's partials of (M, X) (one block
// per matrix): 0 converged (max |M - I| <= tol, X finite), 1 not converged, 2 failed (non-finite
// M or X, or a zero/non-finite scale at the start).
template <typename T>
__global__ void __launch_bounds__(256)
    newton_finish(const acc_t<T>* __restrict__ part, const int* __restrict__ state, int* __restrict__ info,
                  long long chunks, double tol) {
  using A = acc_t<T>;
  __shared__ A scratch[32];
  const long long z = blockIdx.x;
  const A res = reduce_parts<true>(part, 0, z, static_cast<int>(chunks), gridDim.x, scratch);
  if (threadIdx.x == 0) {
    const int s = state[z];
    const bool bad = isinf(res);
    info[z] = (s == FAILED || bad) ? FAILED : (s == CONVERGED || res <= static_cast<A>(tol)) ? 0 : 1;
  }
}

// ---------------------------------------------------------------------------------------------
// newton_fused: the whole iteration for one matrix per block, X, M and T in shared memory
// (3 NMAX x LD buffers, zero beyond n: the products read the padding as zeros and never write it).
// Each product C = A B of the n x n matrices computes all of C in registers before it stores, so C
// may be one of its operands: X <- X T, T <- T T and M <- T M run in place, and three buffers hold
// the binary powering of any p.

constexpr int FUSED_THREADS = 256;  // a 16 x 16 grid: thread (ty, tx) owns a (NMAX/16)^2 tile of C

// Shapes of one tile size NMAX (the largest n it takes). A shared-memory access is 16 bytes (VEC
// elements): A's rows ty + 16 i give a warp two rows, 16 bytes apart in banks thanks to the row
// padding (LD = NMAX + VEC), and B's row k is read by 16 threads as 256 contiguous bytes.
template <typename T, int NMAX> struct FusedTile {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  static constexpr int LD = NMAX + VEC;
  static constexpr int RM = NMAX / 16;           // rows of C per thread: ty + 16 i
  static constexpr int CG = NMAX / (16 * VEC);  // column groups per thread: VEC columns at (16 h + tx) VEC
  static constexpr int CN = CG * VEC;
  static constexpr int SIZE = NMAX * LD;  // elements of one buffer
  static_assert(NMAX % (16 * VEC) == 0, "a row of C must split into whole 16-byte groups per thread");
};

__device__ __forceinline__ void lds16(const float* p, float* v) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
__device__ __forceinline__ void lds16(const double* p, double* v) {
  const double2 t = *reinterpret_cast<const double2*>(p);
  v[0] = t.x, v[1] = t.y;
}
__device__ __forceinline__ void sts16(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void sts16(double* p, const double* v) {
  *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
}

// c = a b (n x n in shared memory, row stride LD); c may alias a or b. Every thread of the block
// calls it; it ends with a barrier, so c is ready for the next product.
template <typename T, int NMAX>
__device__ __forceinline__ void fused_gemm(const T* a, const T* b, T* c, int n) {
  using S = FusedTile<T, NMAX>;
  using A = acc_t<T>;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  A acc[S::RM][S::CN];
#pragma unroll
  for (int i = 0; i < S::RM; ++i)
#pragma unroll
    for (int j = 0; j < S::CN; ++j) acc[i][j] = A(0);
  const int nk = (n + S::VEC - 1) / S::VEC * S::VEC;  // the zero padding covers the rounding up
#pragma unroll 2
  for (int k = 0; k < nk; k += S::VEC) {
    T af[S::RM][S::VEC], bf[S::VEC][S::CN];
#pragma unroll
    for (int i = 0; i < S::RM; ++i) lds16(a + (ty + 16 * i) * S::LD + k, af[i]);
#pragma unroll
    for (int kk = 0; kk < S::VEC; ++kk)
#pragma unroll
      for (int h = 0; h < S::CG; ++h) lds16(b + (k + kk) * S::LD + (16 * h + tx) * S::VEC, bf[kk] + h * S::VEC);
#pragma unroll
    for (int kk = 0; kk < S::VEC; ++kk)
#pragma unroll
      for (int i = 0; i < S::RM; ++i)
#pragma unroll
        for (int j = 0; j < S::CN; ++j)
          acc[i][j] = fma(static_cast<A>(af[i][kk]), static_cast<A>(bf[kk][j]), acc[i][j]);
  }
  __syncthreads();  // all reads of a and b are done: c may overwrite either
#pragma unroll
  for (int i = 0; i < S::RM; ++i) {
    const int r = ty + 16 * i;
    if (r >= n) continue;
#pragma unroll
    for (int h = 0; h < S::CG; ++h) {
      const int c0 = (16 * h + tx) * S::VEC;
      T v[S::VEC];
#pragma unroll
      for (int j = 0; j < S::VEC; ++j) v[j] = static_cast<T>(acc[i][h * S::VEC + j]);
      if (c0 + S::VEC <= n) {
        sts16(c + r * S::LD + c0, v);
      } else {
#pragma unroll
        for (int j = 0; j < S::VEC; ++j)
          if (c0 + j < n) c[r * S::LD + c0 + j] = v[j];  // the padding stays zero
      }
    }
  }
  __syncthreads();
}

// x: X_0 in, X out; m: M_0; state: newton_start's; info as newton_finish's, for the M of the step
// that stopped the matrix (or the last step's). The same tests, T and products as newton_step and
// the GEMM path (results equal up to the products' summation order); a matrix that is not running
// leaves the loop, where the GEMM path would multiply by T = I, which changes nothing.
template <typename T, int NMAX>
__global__ void __launch_bounds__(FUSED_THREADS, 1)
    newton_fused(T* __restrict__ x, const T* __restrict__ m, const int* __restrict__ state, int* __restrict__ info,
                 long long n_, long long p, long long iters, double tol) {
  using S = FusedTile<T, NMAX>;
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char fused_smem[];
  __shared__ A scratch[32];
  T* xs = reinterpret_cast<T*>(fused_smem);
  T* ms = xs + S::SIZE;
  T* ts = ms + S::SIZE;
  const int n = static_cast<int>(n_);  // <= NMAX (the host picks the tile)
  const long long z = blockIdx.x;
  T* xz = x + z * n_ * n_;
  const T* mz = m + z * n_ * n_;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int WARPS = FUSED_THREADS / 32;

  for (int e = threadIdx.x; e < 3 * S::SIZE; e += FUSED_THREADS) xs[e] = T(0);
  __syncthreads();
  // element (i, j) of the n x n matrices: warp-strided rows, lane-strided columns (coalesced)
  for (int i = warp; i < n; i += WARPS)
    for (int j = lane; j < n; j += 32) {
      xs[i * S::LD + j] = xz[i * n + j];
      ms[i * S::LD + j] = mz[i * n + j];
    }
  __syncthreads();

  const A pp = static_cast<A>(p);
  const A a0 = (pp + A(1)) / pp, a1 = A(-1) / pp;
  const A tl = static_cast<A>(tol);
  int s = state[z];
  for (long long k = 0; k < iters && s == RUNNING; ++k) {
    A res = A(0);
    int bad = 0;
    for (int i = warp; i < n; i += WARPS)
      for (int j = lane; j < n; j += 32) {
        const A d = static_cast<A>(ms[i * S::LD + j]) - (i == j ? A(1) : A(0));
        bad |= !isfinite(d);
        res = max(res, fabs(d));
      }
    bad = block_any(bad);
    res = block_max(res, scratch);
    if (bad) s = FAILED;
    else if (res <= tl) s = CONVERGED;
    if (s != RUNNING) break;  // uniform: bad and res are the block's
    for (int i = warp; i < n; i += WARPS)
      for (int j = lane; j < n; j += 32)
        ts[i * S::LD + j] = static_cast<T>(a1 * static_cast<A>(ms[i * S::LD + j]) + (i == j ? a0 : A(0)));
    __syncthreads();
    fused_gemm<T, NMAX>(xs, ts, xs, n);
    if (k + 1 < iters) {  // M <- T^p M as the host's _apply_power: T squared in place
      for (long long e = p;;) {
        if (e & 1) fused_gemm<T, NMAX>(ts, ms, ms, n);
        e >>= 1;
        if (!e) break;
        fused_gemm<T, NMAX>(ts, ts, ts, n);
      }
    }
  }

  A res = A(0);
  int bad = 0;
  for (int i = warp; i < n; i += WARPS)
    for (int j = lane; j < n; j += 32) {
      const A d = static_cast<A>(ms[i * S::LD + j]) - (i == j ? A(1) : A(0));
      const T xv = xs[i * S::LD + j];
      bad |= !isfinite(d) || !isfinite(static_cast<A>(xv));
      res = max(res, fabs(d));
      xz[i * n + j] = xv;
    }
  bad = block_any(bad);
  res = block_max(res, scratch);
  if (threadIdx.x == 0) info[z] = (s == FAILED || bad) ? FAILED : (s == CONVERGED || res <= tl) ? 0 : 1;
}

// m[z, i, i] += r_z, r_z = work[z, 2 n] (newton_start's ridge): A + r I for matrix_root.
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
