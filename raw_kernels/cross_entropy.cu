// cross_entropy.cu: the row kernels of cukit.linear_cross_entropy. Host side, chunking and the
// references (the maths of every kernel, in torch): cukit/ops/linear_cross_entropy.py.
//
// The host loops over chunks of tokens: a GEMM writes a chunk's raw logits x_c @ W^T into a
// workspace of W elements with row stride `ld`: W = acc_t<T> (fp32, fp64 for fp64: the GEMM's
// sums unrounded), or W = T for 16-bit inputs (logits="input": the product rounded once to the
// input dtype, as F.linear rounds it). ce_rows turns each row into its log-sum-exp, its loss and
// (optionally) its gradient d loss / d logits, written over the same row as T; two GEMMs then read
// that gradient for dx and dW. Everything after the load is computed in A = acc_t<T>. One row is
//   z_c = cap(raw_c + b_c),  cap(u) = s tanh(u / s) (softcap s > 0) or u,
//   lse = log sum_c exp z_c,
//   loss = (1 - eps) w_y (lse - z_y) + (eps / V) (W lse - sum_c w_c z_c) + zl lse^2  (0 if ignored)
// with class weights w (all 1 without), W = sum_c w_c, label smoothing eps and z-loss zl, and
//   d loss / d z_c = u [((1 - eps) w_y + (eps / V) W + 2 zl lse) p_c - (1 - eps) w_y [c = y]
//                     - (eps / V) w_c] + v p_c,      p_c = exp(z_c - lse),
// times cap'(u_c) = 1 - (z_c / s)^2, where u is the upstream gradient of the row's loss and v that
// of its lse. An ignored row has u = 0; a target outside [0, V) that is not ignore_index makes the
// row's loss and gradient NaN (the kernels cannot raise, and a host check would be a sync).
//
// Workspace layout: row r starts at ws + r * ld (ld a multiple of the 16-byte vector, rows 16-byte
// aligned). The gradient of row r is written as T at gout + r * ldg: over the row itself (gout ==
// ws, ldg = ld * sizeof(W) / sizeof(T): the gradient needs no memory of its own), or into a
// separate buffer (the forward that stores every token's gradient for one dW GEMM later).
#include <cukit/dtypes.cuh>
#include <cukit/sm90.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// The 16-bit types use the hardware's approximate exp (and a tanh built on it): their relative
// error (~1e-6) is far below one rounding to 16 bits. float and double use the libm functions.
template <typename T> constexpr bool kFast = sizeof(T) == 2;

template <bool FAST> __device__ __forceinline__ float exp_(float x) { return FAST ? __expf(x) : expf(x); }
template <bool FAST> __device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }
template <bool FAST> __device__ __forceinline__ float tanh_(float x) {
  // 1 - 2 / (1 + e^{2x}): absolute error ~1e-7 (its relative error near 0 does not matter: the
  // result is multiplied by the cap and added to nothing)
  return FAST ? 1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * x)) : tanhf(x);
}
template <bool FAST> __device__ __forceinline__ double tanh_(double x) { return tanh(x); }

template <typename A> __device__ __forceinline__ A quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fffffff); }
template <> __device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7fffffffffffffffLL); }
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}

constexpr int kMaxWarps = 32;

template <bool B> struct Bool {
  static constexpr bool value = B;
};

// -------------------------------------------------------------------------------------------------
// Block reductions (fixed order: the results are bitwise reproducible for a launch configuration)
// -------------------------------------------------------------------------------------------------

// A running log-sum-exp: max m and sum s of exp(z - m), plus a plain sum t (label smoothing's
// sum_c w_c z_c).
template <typename A> struct Lse {
  A m, s, t;
};

// exp(a - b) for b >= a, exactly 1 when they are equal (so -inf - -inf is never formed).
template <bool FAST, typename A> __device__ __forceinline__ A rescale(A a, A b) {
  return a == b ? A(1) : exp_<FAST>(a - b);
}

template <bool FAST, typename A> __device__ __forceinline__ Lse<A> combine(Lse<A> a, Lse<A> b) {
  const A m = fmax(a.m, b.m);  // NaN logits reach s through exp below, not through m
  Lse<A> r;
  r.m = m;
  r.s = a.s * rescale<FAST>(a.m, m) + b.s * rescale<FAST>(b.m, m);
  r.t = a.t + b.t;
  return r;
}

// One element z into a running log-sum-exp, one exp per element: the sum is rescaled only when
// the running max grows (rarely, after the first elements). -inf adds 0 (also when the max is
// still -inf); NaN poisons the sum.
template <bool FAST, typename A> __device__ __forceinline__ void lse_take(Lse<A>& acc, A z) {
  if (z > acc.m) {
    acc.s = acc.s * exp_<FAST>(acc.m - z) + A(1);
    acc.m = z;
  } else if (z == z) {
    acc.s += acc.m == neg_inf<A>() ? A(0) : exp_<FAST>(z - acc.m);
  } else {
    acc.s = z;
  }
}

template <typename A> __device__ __forceinline__ A shfl_down(A v, int d) { return __shfl_down_sync(0xffffffffu, v, d); }

// The block's combined Lse, valid in every thread. Uses (and ends with a barrier on) `red`.
template <bool FAST, typename A> __device__ Lse<A> block_lse(Lse<A> v, Lse<A>* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    Lse<A> o;
    o.m = shfl_down(v.m, d);
    o.s = shfl_down(v.s, d);
    o.t = shfl_down(v.t, d);
    v = combine<FAST>(v, o);
  }
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    Lse<A> w = lane < warps ? red[lane] : Lse<A>{neg_inf<A>(), A(0), A(0)};
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      Lse<A> o;
      o.m = shfl_down(w.m, d);
      o.s = shfl_down(w.s, d);
      o.t = shfl_down(w.t, d);
      w = combine<FAST>(w, o);
    }
    if (lane == 0) red[kMaxWarps] = w;
  }
  __syncthreads();
  return red[kMaxWarps];
}

// The block's sum of v (and of c), valid in thread 0. Uses `red` (2 * (kMaxWarps + 1) entries).
template <typename A> __device__ void block_sum2(A& v, A& c, A* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    v += shfl_down(v, d);
    c += shfl_down(c, d);
  }
  if (lane == 0) {
    red[warp] = v;
    red[kMaxWarps + 1 + warp] = c;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? red[lane] : A(0);
    c = lane < warps ? red[kMaxWarps + 1 + lane] : A(0);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      v += shfl_down(v, d);
      c += shfl_down(c, d);
    }
  }
  __syncthreads();
}

// -------------------------------------------------------------------------------------------------
// ce_rows: one block per row (a grid-stride loop over the chunk's rows)
// -------------------------------------------------------------------------------------------------

enum Mode : int {
  MODE_LOSS = 0,    // lse and loss per row; the workspace is only read
  MODE_GRAD = 1,    // lse, loss and the gradient with u = 1 (the forward of 'mean'/'sum': the
                    // reduction's scale and the upstream gradient are applied to dx, dW, db later)
  MODE_REGRAD = 2,  // the gradient from a saved lse with per-row u and v (the recomputing backward)
};

template <typename T, typename A, bool FAST> struct Logit {
  const T* bias;
  A cap, inv_cap;  // cap == 0: no soft-capping
  __device__ __forceinline__ A operator()(A raw, long long c) const {
    A u = bias != nullptr ? raw + to_acc<A>(bias[c]) : raw;
    return cap > A(0) ? cap * tanh_<FAST>(u * inv_cap) : u;
  }
  // d z / d u from z: 1 - tanh^2
  __device__ __forceinline__ A slope(A z) const {
    if (cap > A(0)) {
      const A t = z * inv_cap;
      return A(1) - t * t;
    }
    return A(1);
  }
};

// One row's loss (see the file header; 0 when ignored, NaN for a bad target), from its lse, its
// target's logit z_y and wz = sum_c w_c z_c (label smoothing's term).
template <typename A>
__device__ __forceinline__ A row_loss_of(bool valid, bool bad, A w_y, A eps, A zl, A V, A w_total, A lse, A z_y, A wz) {
  if (!valid) return A(0);
  if (bad) return quiet_nan<A>();
  A loss = (A(1) - eps) * w_y * (lse - z_y);
  if (eps != A(0)) loss += eps / V * (w_total * lse - wz);
  if (zl != A(0)) loss += zl * lse * lse;
  return loss;
}

// One row's gradient, g_c = (cp p_c - cy [c = y] - cwc w_c) cap'(z_c) with p_c = exp(z_c - lse), for
// the upstream gradients u (of the row's loss) and v (of its lse).
template <typename A, bool FAST> struct RowGrad {
  A cp, cy, cwc, lse;
  __device__ __forceinline__ RowGrad(bool valid, bool bad, A w_y, A u, A v, A eps, A zl, A V, A w_total, A lse_)
      : cp(v), cy(A(0)), cwc(A(0)), lse(lse_) {
    if (valid) {
      const A a = (A(1) - eps) * w_y;
      cp += u * (a + eps / V * w_total + A(2) * zl * lse);
      cy = u * a;
      cwc = u * eps / V;
      if (bad) cp = cy = cwc = quiet_nan<A>();
    }
  }
  // element c (target column y_col, class weights cw from the row's first column) of logit z
  template <typename T, typename L>
  __device__ __forceinline__ T operator()(A z, long long c, long long y_col, const A* cw, const L& logit) const {
    A g = cp * exp_<FAST>(z - lse);
    if (cwc != A(0)) g -= cwc * (cw != nullptr ? cw[c] : A(1));
    if (c == y_col) g -= cy;
    return from_acc<T>(g * logit.slope(z));
  }
};

// Pass 2 may write row r's gradient as T over the row's own W values. When T is as wide as W, each
// thread writes exactly the elements it has just read. When T is narrower (sizeof(W) ==
// 2 sizeof(T)) element c of the gradient lands on W element c / 2, which another thread may not
// have read yet: iteration k (vectors [k B, (k + 1) B) of a B-thread block) writes over the W
// elements read in iteration k / 2. So there is a barrier between the reads and the
// writes of iteration 0 and one at the start of every iteration k that is a power of two: all reads
// of iterations < k are then done before any write of iterations [k, 2k). About log2(V / (4 B))
// barriers per row, not one per iteration. Nothing read is ever written first (writes trail reads),
// so the loads need no coherence beyond program order.
//
// Arguments (ws and gout may alias: no __restrict__ on them):
//   ws (rows, ld) W        raw logits in (W: A, or T for 16-bit T)
//   gout (rows, ldg) T     MODE_GRAD/REGRAD: the gradient out, over ws or elsewhere (the layout above);
//                          (16-byte aligned rows, ldg a multiple of 16 / sizeof(W) elements)
//   bias (Vtot,) T or null; target (rows,) Y; cw (Vtot,) A class weights or null
//   stats: [scale of the loss, scale of the gradient, sum of the class weights] (ce_stats)
//   row_grad (rows,) A or null: u per row (MODE_REGRAD, reduction 'none'); else
//   grad0 (1,) A or null: u = grad0[0] * stats[1] (MODE_REGRAD, 'mean'/'sum'; MODE_GRAD: null
//     means u = 1)
//   col0, V, Vtot: the row holds columns [col0, col0 + V) of the Vtot classes (MODE_REGRAD: a
//     vocabulary block; the other modes need the whole row: col0 = 0, V = Vtot)
//   lse_grad (rows,) A or null: v per row (MODE_REGRAD)
//   lse (rows,) A: written (MODE_LOSS, MODE_GRAD) or read (MODE_REGRAD); row_loss (rows,) A: written
//   eps, z_loss, softcap: host constants (as double, converted to A)
template <typename T, typename W, typename Y, int MODE>
__global__ void ce_rows(W* ws, T* gout, const T* __restrict__ bias, const Y* __restrict__ target,
                        const acc_t<T>* __restrict__ cw, const acc_t<T>* __restrict__ stats,
                        const acc_t<T>* __restrict__ row_grad, const acc_t<T>* __restrict__ grad0,
                        const acc_t<T>* __restrict__ lse_grad, acc_t<T>* __restrict__ lse,
                        acc_t<T>* __restrict__ row_loss, long long col0, long long rows, long long V,
                        long long ld, long long ldg, long long Vtot, long long ignore_index, double eps_d,
                        double z_loss_d, double softcap_d) {
  using A = acc_t<T>;
  constexpr bool FAST = kFast<T>;
  constexpr int VEC = 16 / sizeof(W);
  constexpr bool kNarrow = sizeof(T) < sizeof(W);
  static_assert(sizeof(W) == sizeof(A) || sizeof(W) == sizeof(T), "the workspace holds A or T");
  static_assert(sizeof(W) == sizeof(T) || sizeof(W) == 2 * sizeof(T), "T must be W or half its width");
  __shared__ Lse<A> red[kMaxWarps + 1];
  // the barriers of pass 2 order a narrow gradient's writes after the reads of the row it overwrites
  const bool overwrite = kNarrow && static_cast<void*>(gout) == static_cast<void*>(ws);

  const A eps = A(eps_d), zl = A(z_loss_d);
  // column c of the row is class col0 + c: the bias and the per-column class weights from col0
  const Logit<T, A, FAST> logit{bias != nullptr ? bias + col0 : nullptr, A(softcap_d),
                                softcap_d > 0 ? A(1.0 / softcap_d) : A(0)};
  const A* __restrict__ cw_cols = cw != nullptr ? cw + col0 : nullptr;
  const long long nvec = V / VEC;
  const long long tail0 = nvec * VEC;  // the last V % VEC elements are handled one per thread
  const int tid = threadIdx.x, nt = blockDim.x;
  const long long iters = (nvec + nt - 1) / nt;
  const A w_total = stats[2];

  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    W* row = ws + r * ld;
    const long long y = static_cast<long long>(target[r]);
    const bool valid = y != ignore_index;
    const bool bad = valid && (y < 0 || y >= Vtot);
    const long long y_col = y - col0;  // the target's column (outside [0, V): another block's)
    const A w_y = !valid ? A(0) : bad ? quiet_nan<A>() : cw != nullptr ? cw[y] : A(1);

    A row_lse;
    if constexpr (MODE != MODE_REGRAD) {
      // Pass 1: online max / sum of exp over the row, two vectors in flight per thread.
      Lse<A> acc{neg_inf<A>(), A(0), A(0)};
      auto take = [&](A z, long long c) {
        lse_take<FAST>(acc, z);
        if (eps != A(0)) acc.t += cw_cols != nullptr ? cw_cols[c] * z : z;
      };
      for (long long v = tid; v < nvec; v += 2 * static_cast<long long>(nt)) {
        const long long v2 = v + nt;
        const Vec<W, VEC> a = load_vec<W, VEC>(row + v * VEC);
        Vec<W, VEC> b;
        if (v2 < nvec) b = load_vec<W, VEC>(row + v2 * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) take(logit(to_acc<A>(a.v[k]), v * VEC + k), v * VEC + k);
        if (v2 < nvec) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) take(logit(to_acc<A>(b.v[k]), v2 * VEC + k), v2 * VEC + k);
        }
      }
      if (tail0 + tid < V) take(logit(to_acc<A>(row[tail0 + tid]), tail0 + tid), tail0 + tid);
      // the target's logit, read before the barriers below (pass 2 may overwrite it after them)
      const A z_y = tid == 0 && valid && !bad ? logit(to_acc<A>(row[y]), y) : A(0);
      const Lse<A> all = block_lse<FAST>(acc, red);
      row_lse = all.m + log_(all.s);
      if (tid == 0) {
        lse[r] = row_lse;
        row_loss[r] = row_loss_of(valid, bad, w_y, eps, zl, A(Vtot), w_total, row_lse, z_y, all.t);
      }
    } else {
      row_lse = lse[r];
    }

    if constexpr (MODE != MODE_LOSS) {
      // Pass 2: the gradient. Per-row coefficients: g_c = cp p_c - cy [c = y] - cw_ w_c.
      A u, v = A(0);
      if constexpr (MODE == MODE_GRAD) {
        u = grad0 != nullptr ? grad0[0] * stats[1] : A(1);
      } else {
        u = row_grad != nullptr ? row_grad[r] : grad0[0] * stats[1];
        if (lse_grad != nullptr) v = lse_grad[r];
      }
      const RowGrad<A, FAST> rg(valid, bad, w_y, u, v, eps, zl, A(Vtot), w_total, row_lse);
      T* grow = gout + r * ldg;
      auto grad = [&](A z, long long c) { return rg.template operator()<T>(z, c, y_col, cw_cols, logit); };
      // The tail is never overwritten by the vector loop (it writes T elements < tail0, i.e. W
      // elements < tail0 (or < tail0 / 2 when narrow)): read it first, write it after the loop's
      // last reads.
      A tz = A(0);
      const bool has_tail = tail0 + tid < V;
      if (has_tail) tz = logit(to_acc<A>(row[tail0 + tid]), tail0 + tid);
      for (long long k = 0; k < iters; ++k) {
        if (overwrite && k > 0 && (k & (k - 1)) == 0) __syncthreads();
        const long long vi = k * nt + tid;
        Vec<W, VEC> a;
        if (vi < nvec) a = load_vec<W, VEC>(row + vi * VEC);
        if (overwrite && k == 0) __syncthreads();
        if (vi < nvec) {
          Vec<T, VEC> out;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const long long c = vi * VEC + e;
            out.v[e] = grad(logit(to_acc<A>(a.v[e]), c), c);
          }
          store_vec<T, VEC>(grow + vi * VEC, out);
        }
      }
      if (overwrite) __syncthreads();
      if (has_tail) grow[tail0 + tid] = grad(tz, tail0 + tid);
    }
    __syncthreads();  // `red` is reused by the next row
  }
}

// -------------------------------------------------------------------------------------------------
// ce_rows_held (sm_90): MODE_GRAD of ce_rows with the row held in registers across a cluster.
//
// ce_rows reads each row twice (pass 1 for the log-sum-exp, pass 2 for the gradient). At large
// vocabularies its resident rows (blocks x V x 4 bytes) outgrow L2, so the second read goes to
// DRAM as well. Here a cluster of CL CTAs holds one row in registers, R vectors per thread: every
// element is read once, the CTAs combine their partial log-sum-exps through distributed shared
// memory, and the gradient is computed from the registers. Needs V <= CL * blockDim.x * R * VEC,
// VEC = 16 / sizeof(W) (W: the workspace's float or 16-bit T, as in ce_rows; a 16-bit row stays
// packed in the registers, R * VEC / 2 words per thread).
//
// Element layout: vector k of thread t in CTA q (q = blockIdx.x, the rank: gridDim.x == CL) is
// vector (k CL + q) blockDim.x + t of the row (coalesced for each k); rank 0 also holds the
// V % VEC tail, one element per thread. Rows go to clusters by blockIdx.y (a grid-stride loop;
// every CTA of a cluster walks the same rows).
//
// The gradient goes where ce_rows writes it (gout, ldg). Written over the row, it is safe: all
// reads of the row, in every CTA, precede the cluster barrier that publishes the partial sums, and
// every write follows it. The partial sums are double-buffered by row parity: a CTA writes a
// buffer again two rows later, after a barrier that every CTA passes only once it has read that
// buffer. Same arguments as ce_rows (row_grad and lse_grad unused, col0 == 0, V == Vtot); the
// results agree with ce_rows up to the order of the sums (not bitwise).
// -------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <typename T, typename W, typename Y, int CL, int R>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(512, R * 16 / sizeof(W) <= 32 ? 2 : 1)
ce_rows_held(W* ws, T* gout, const T* __restrict__ bias, const Y* __restrict__ target,
             const float* __restrict__ cw, const float* __restrict__ stats, const float* __restrict__ row_grad,
             const float* __restrict__ grad0, const float* __restrict__ lse_grad, float* __restrict__ lse,
             float* __restrict__ row_loss, long long col0, long long rows, long long V, long long ld, long long ldg,
             long long Vtot, long long ignore_index, double eps_d, double z_loss_d, double softcap_d) {
  using A = float;
  constexpr bool FAST = kFast<T>;
  constexpr int VEC = 16 / sizeof(W);
  static_assert(sizeof(acc_t<T>) == sizeof(float), "ce_rows_held runs the float accumulator only");
  static_assert(sizeof(W) == sizeof(A) || sizeof(W) == sizeof(T), "the workspace holds A or T");
  constexpr bool kInPlace = sizeof(W) == sizeof(A);
  __shared__ Lse<A> red[kMaxWarps + 1];
  __shared__ Lse<A> part[2];
  __shared__ Lse<A> total;
  (void)row_grad, (void)lse_grad, (void)col0, (void)Vtot;

  const A eps = A(eps_d), zl = A(z_loss_d);
  const Logit<T, A, FAST> logit{bias, A(softcap_d), softcap_d > 0 ? A(1.0 / softcap_d) : A(0)};
  // 32-bit column indices: a held row has at most 8 x 512 x 64 floats
  const int nvec = static_cast<int>(V / VEC), tail0 = nvec * VEC;
  const int tid = threadIdx.x, nt = blockDim.x, q = blockIdx.x;
  const bool has_tail = q == 0 && tail0 + tid < V;
  const A w_total = stats[2];
  const A u = grad0 != nullptr ? grad0[0] * stats[1] : A(1);
  // The rows' loop, compiled twice for a 16-bit workspace: PLAIN (no bias, no soft-cap, the
  // common case) re-applies the transform, an unpacking shift, in each pass; otherwise each logit
  // is formed once before the barrier (one online pass) and once after it, because between two
  // passes the compiler would keep the bias and tanh values, and spill.
  auto rows_loop = [&](auto plain) {
    int parity = 0;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y, parity ^= 1) {
      W* row = ws + r * ld;
      const long long y = static_cast<long long>(target[r]);
      const bool valid = y != ignore_index;
      const bool bad = valid && (y < 0 || y >= V);
      const A w_y = !valid ? A(0) : bad ? quiet_nan<A>() : cw != nullptr ? cw[y] : A(1);

      // Every load first (R vectors in flight per thread), then the logits. A float workspace's
      // values become logits in place; a 16-bit one stays packed (half the registers: unpacked, the
      // row and its logits would not fit the 64 registers of two CTAs per SM and would spill) and
      // each pass re-applies the transform, an unpacking shift where there is no bias or soft-cap.
      Vec<W, VEC> raw[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const int vi = (k * CL + q) * nt + tid;
        if (vi < nvec) raw[k] = load_vec<W, VEC>(row + vi * VEC);
      }
      A tz = has_tail ? to_acc<A>(row[tail0 + tid]) : A(0);
      const A z_y = q == 0 && tid == 0 && valid && !bad ? logit(to_acc<A>(row[y]), y) : A(0);
      if constexpr (kInPlace) {
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const int vi = (k * CL + q) * nt + tid;
          if (vi < nvec) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) raw[k].v[e] = logit(raw[k].v[e], vi * VEC + e);
          }
        }
      }
      auto z_at = [&](int k, int e, int c) -> A {
        if constexpr (kInPlace) {
          return raw[k].v[e];
        } else if constexpr (decltype(plain)::value) {
          return to_acc<A>(raw[k].v[e]);
        } else {
          return logit(to_acc<A>(raw[k].v[e]), c);
        }
      };
      // f(z, c) for each of this thread's logits z (column c) in the row's vectors (the tail apart)
      auto each = [&](auto&& f) {
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const int vi = (k * CL + q) * nt + tid;
          if (vi < nvec) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) f(z_at(k, e, vi * VEC + e), vi * VEC + e);
          }
        }
      };
      Lse<A> mine{neg_inf<A>(), A(0), A(0)};
      if constexpr (kInPlace || decltype(plain)::value) {
        // the max, then the sum of exponentials (values at hand: in place, or one unpacking shift)
        A m = neg_inf<A>();
        each([&](A z, int) { m = fmax(m, z); });  // NaN is skipped here and poisons the sum below
        if (has_tail) {
          tz = logit(tz, tail0 + tid);
          m = fmax(m, tz);
        }
        mine.m = m;
        auto add = [&](A z, int c) {
          mine.s += z != z ? z : m == neg_inf<A>() ? A(0) : exp_<FAST>(z - m);
          if (eps != A(0)) mine.t += cw != nullptr ? cw[c] * z : z;
        };
        each(add);
        if (has_tail) add(tz, tail0 + tid);
      } else {
        // With a bias or soft-cap, one online pass (the sum rescaled when the max grows): two
        // passes would let the compiler keep the row's logits between them, and spill.
        auto take = [&](A z, int c) {
          lse_take<FAST>(mine, z);
          if (eps != A(0)) mine.t += cw != nullptr ? cw[c] * z : z;
        };
        each(take);
        if (has_tail) {
          tz = logit(tz, tail0 + tid);
          take(tz, tail0 + tid);
        }
      }
      const Lse<A> blk = block_lse<FAST>(mine, red);
      if (tid == 0) part[parity] = blk;
      sm90::cluster_sync();  // every CTA's reads of the row are done; the partial sums are published
      if (tid < 32) {
        // lane j takes CTA j's partial sums; a fixed shuffle tree combines them (the same order in
        // every CTA of the cluster, so each computes the same lse)
        Lse<A> p{neg_inf<A>(), A(0), A(0)};
        if (tid < CL) {
          const ptx::u32 ra =
              sm90::dsmem_addr(static_cast<ptx::u32>(__cvta_generic_to_shared(&part[parity])),
                               static_cast<ptx::u32>(tid));
          p = Lse<A>{sm90::ld_dsmem_f32(ra), sm90::ld_dsmem_f32(ra + 4), sm90::ld_dsmem_f32(ra + 8)};
        }
#pragma unroll
        for (int d = CL / 2; d > 0; d >>= 1) {
          Lse<A> o;
          o.m = shfl_down(p.m, d);
          o.s = shfl_down(p.s, d);
          o.t = shfl_down(p.t, d);
          p = combine<FAST>(p, o);
        }
        if (tid == 0) {
          total = p;
          const A row_lse = p.m + log_(p.s);
          if (q == 0) {
            lse[r] = row_lse;
            row_loss[r] = row_loss_of(valid, bad, w_y, eps, zl, A(V), w_total, row_lse, z_y, p.t);
          }
        }
      }
      __syncthreads();
      const Lse<A> all = total;
      const A row_lse = all.m + log_(all.s);

      // The gradient, from the registers.
      const RowGrad<A, FAST> rg(valid, bad, w_y, u, A(0), eps, zl, A(V), w_total, row_lse);
      auto grad = [&](A z, int c) { return rg.template operator()<T>(z, c, y, cw, logit); };
      T* grow = gout + r * ldg;
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const int vi = (k * CL + q) * nt + tid;
        if (vi < nvec) {
          Vec<T, VEC> out;
#pragma unroll
          for (int e = 0; e < VEC; ++e) out.v[e] = grad(z_at(k, e, vi * VEC + e), vi * VEC + e);
          stg_vec<T, VEC>(grow + vi * VEC, out);
        }
      }
      if (has_tail) grow[tail0 + tid] = grad(tz, tail0 + tid);
    }
  };
  if (!kInPlace && bias == nullptr && !(softcap_d > 0)) {
    rows_loop(Bool<true>{});
  } else {
    rows_loop(Bool<false>{});
  }
  sm90::cluster_sync();  // no CTA leaves while another may still read its partial sums
}
#endif

// -------------------------------------------------------------------------------------------------
// ce_stats: the reduction's scales, on the device (no host sync). One block.
//   stats[0] = 1 / sum_i w_{y_i} over non-ignored rows for 'mean' (the loss's scale: inf, hence a
//              NaN loss, when that sum is 0, as torch), 1 otherwise;
//   stats[1] = the gradient's scale: as stats[0], but 0 when every row is ignored (torch's
//              gradients are then 0, not NaN);
//   stats[2] = sum_c w_c (V without class weights).
// A target outside [0, V) that is not ignore_index makes the sum NaN.
// -------------------------------------------------------------------------------------------------
template <typename A, typename Y>
__global__ void ce_stats(const Y* __restrict__ target, const A* __restrict__ cw, A* __restrict__ stats, long long n,
                         long long V, long long ignore_index, int mean) {
  __shared__ A red[2 * (kMaxWarps + 1)];
  A sw = A(0), cnt = A(0);
  for (long long i = threadIdx.x; i < n; i += blockDim.x) {
    const long long y = static_cast<long long>(target[i]);
    if (y == ignore_index) continue;
    cnt += A(1);
    sw += (y < 0 || y >= V) ? quiet_nan<A>() : cw != nullptr ? cw[y] : A(1);
  }
  block_sum2(sw, cnt, red);
  A total = A(V), unused = A(0);
  if (cw != nullptr) {
    total = A(0);
    for (long long c = threadIdx.x; c < V; c += blockDim.x) total += cw[c];
    block_sum2(total, unused, red);
  }
  if (threadIdx.x == 0) {
    stats[0] = mean ? A(1) / sw : A(1);
    stats[1] = mean ? (cnt > A(0) ? A(1) / sw : A(0)) : A(1);
    stats[2] = total;
  }
}

// out[0] = stats[0] * sum_i row_loss[i] ('mean' / 'sum'). One block, fixed order.
template <typename A>
__global__ void ce_total(const A* __restrict__ row_loss, const A* __restrict__ stats, A* __restrict__ out,
                         long long n) {
  __shared__ A red[2 * (kMaxWarps + 1)];
  A s = A(0), unused = A(0);
  for (long long i = threadIdx.x; i < n; i += blockDim.x) s += row_loss[i];
  block_sum2(s, unused, red);
  if (threadIdx.x == 0) out[0] = s * stats[0];
}

// -------------------------------------------------------------------------------------------------
// Column sums of a chunk's gradient (the bias gradient), deterministic: per-split partial sums,
// then a fixed-order pass that adds them into the A accumulator.
// -------------------------------------------------------------------------------------------------

// partial[s, c] = sum over rows [s * rows_per_split, ...) of g[r, c]; g (rows, V) with row stride ldg.
// Grid (column blocks, splits), one column per thread: a warp reads 32 adjacent columns of a row.
template <typename T>
__global__ void ce_colsum(const T* __restrict__ g, acc_t<T>* __restrict__ partial, long long rows, long long V,
                          long long ldg, long long rows_per_split) {
  using A = acc_t<T>;
  const long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= V) return;
  const long long r0 = static_cast<long long>(blockIdx.y) * rows_per_split;
  const long long r1 = min(rows, r0 + rows_per_split);
  A s = A(0);
  for (long long r = r0; r < r1; ++r) s += to_acc<A>(g[r * ldg + c]);
  partial[static_cast<long long>(blockIdx.y) * V + c] = s;
}

// acc[c] = (accumulate ? acc[c] : 0) + sum_s partial[s, c], in split order.
template <typename A>
__global__ void ce_colsum_finish(const A* __restrict__ partial, A* __restrict__ acc, long long splits, long long V,
                                 int accumulate) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; c < V; c += stride) {
    A s = accumulate ? acc[c] : A(0);
    for (long long j = 0; j < splits; ++j) s += partial[j * V + c];
    acc[c] = s;
  }
}

// -------------------------------------------------------------------------------------------------
// scale_cast: dst = D(src * s0[0] * s1[0] * factor) (s0, s1 may be null: 1). The gradients the
// forward computed, scaled by the reduction's scale and the upstream gradient and rounded once
// (src and dst may be the same buffer: each thread reads its elements before writing them).
// VEC elements per thread when n % VEC == 0 and both pointers are aligned to their vector.
// -------------------------------------------------------------------------------------------------
template <typename S, typename D, int VEC>
__global__ void scale_cast(const S* src, D* dst, const acc_t<D>* __restrict__ s0, const acc_t<D>* __restrict__ s1,
                           long long n, double factor) {
  using A = acc_t<D>;
  A scale = A(factor);
  if (s0 != nullptr) scale *= s0[0];
  if (s1 != nullptr) scale *= s1[0];
  const long long nv = n / VEC;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv; i += stride) {
    const Vec<S, VEC> a = load_vec<S, VEC>(src + i * VEC);
    Vec<D, VEC> b;
#pragma unroll
    for (int k = 0; k < VEC; ++k) b.v[k] = from_acc<D>(to_acc<A>(a.v[k]) * scale);
    store_vec<D, VEC>(dst + i * VEC, b);
  }
}
