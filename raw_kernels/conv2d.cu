// conv2d.cu: 2-D convolution (NCHW, groups = 1) as implicit GEMMs, forward and backward, with the
// bias and activation fused into the forward's epilogue. Host side, plans and references:
// cukit/ops/conv2d.py.
//
//   conv2d_fprop   y = act(z), z = conv(x, w) + bias. GEMM rows m = (n, p, q) (the N*P*Q output
//                  pixels), columns the K filters, reduction kk = (c, r, s) (C*R*S): x is gathered
//                  on the fly (im2col without the copy), w read as it is stored. z is also stored
//                  when the backward needs it (a smooth activation).
//   conv2d_dgrad   dx = the transposed convolution of g = dy * act'(z): rows (n, h, w), columns the
//                  C input channels, reduction (k, r, s); g[n, k, p, q] is gathered where
//                  p = (h + ph - r * dh) / sh is an integer in [0, P) (likewise q).
//   conv2d_wgrad   dw[k, c, r, s] = sum over (n, p, q) of g * x and db[k] = sum of g: rows
//                  (c, r, s), columns k, reduction over the N*P*Q pixels, which the grid splits
//                  into fp32 partial sums (blockIdx.z); g = dy * act'(z) is formed as dy is loaded
//                  and, when dx is wanted, stored once (by the blocks of the first row tile) for
//                  conv2d_dgrad to read.
//   conv2d_wgrad_reduce   dw and db: the partial sums added in split order. Deterministic, no
//                  atomics: the same inputs give the same bits on a given GPU.
//
// Every tensor is contiguous NCHW (the host makes it so). Offsets are 64-bit; each dimension, each
// plane (H*W, P*Q) and the weight's C*R*S are below 2^31 (checked on the host). Padding is given
// as the top and left pads: the bottom and right ones are implicit in P and Q (a read past the
// input is a zero), so padding="same" with an even kernel needs nothing special.
//
// The three GEMMs share one SIMT tile (fp32 FMAs, fp64 for double): 128 threads, a 64 x BN block
// tile (BN = 16, 32 or 64, chosen by the host from the column count), BK = 8 deep stages double
// buffered through shared memory (one barrier per stage: the next stage travels global ->
// registers while this one is multiplied). A thread owns 4 consecutive rows x BN/8 columns, so
// the output pixels it stores are consecutive: 16-byte stores along a plane when P*Q % 4 == 0.
#include <cukit/activations.cuh>
#include <cukit/conv_tile.cuh>
#include <cukit/dtypes.cuh>
#include <cukit/vec.cuh>

using namespace cukit;
using namespace cukit::conv;

// The 16-bit types use the activations' fast forms (activations.cuh): their error is far below
// one rounding to 16 bits, as in bias_act.cu and the GEMM epilogue.
template <typename T> constexpr bool kFast = sizeof(T) == 2;

// ---------------------------------------------------------------------------------------------
// fprop and dgrad: out[n, col, oh, ow] = sum over kk of A[m, kk] B[kk, col], A gathered.
//
//   fprop: src = x (N, C, H, W), rows (n, p, q), kk = (c, r, s), B[kk, k] = w[k, kk],
//          ih = p * sh - ph + r * dh.
//   dgrad: src = g (N, K, P, Q), rows (n, h, w), kk = (k, r, s), B[kk, c] = w[k, c, r, s],
//          ih = (h + ph - r * dh) / sh where that divides exactly.
//
// Loads: thread t stages A[kk = t / 16][rows t % 16 + 16 i] (consecutive threads read consecutive
// output pixels: coalesced along a row of the input) and B[kk = t % 8][columns t / 8 + 16 j]
// (consecutive threads read consecutive kk: w's contiguous dimension for fprop). A's shared row
// stride is 80 == 16 (mod 32): the two kk rows a warp stores fall in opposite halves of the banks.
// ---------------------------------------------------------------------------------------------
template <typename T, bool DGRAD, int BN, int ACT>
__device__ __forceinline__ void igemm_nchw(const T* __restrict__ src, const T* __restrict__ wt,
                                           const T* __restrict__ bias, T* __restrict__ out, T* __restrict__ zout,
                                           int N, int C, int H, int W, int K, int P, int Q, int R, int S, int sh,
                                           int sw, int ph, int pw, int dh, int dw, int vec_out) {
  using A = acc_t<T>;
  constexpr int TN = BN / 8;
  constexpr int NB = BN / 16;  // column-operand values a thread stages per stage
  constexpr int LDA = BM + 16;
  constexpr int LDB = kLdCols<BN>;
  __shared__ __align__(32) A As[2][BK * LDA];
  __shared__ __align__(32) A Bs[2][BK * LDB];

  const int OH = DGRAD ? H : P, OW = DGRAD ? W : Q;   // rows m = (n, oh, ow)
  const int IC = DGRAD ? K : C;                       // the gathered tensor: (N, IC, IH, IW)
  const int IH = DGRAD ? P : H, IW = DGRAD ? Q : W;
  const int NG = DGRAD ? C : K;                       // columns
  const int RS = R * S;
  const long long OHW = static_cast<long long>(OH) * OW, IHW = static_cast<long long>(IH) * IW;
  const long long M = static_cast<long long>(N) * OHW;
  const long long KRED = static_cast<long long>(IC) * RS;
  const long long m0 = static_cast<long long>(blockIdx.x) * BM;
  const int n0 = blockIdx.y * BN;
  const int tid = threadIdx.x;

  // A's rows: fixed for the whole reduction, decoded once.
  const int a_k = tid >> 4;
  long long a_img[4];
  int a_h[4], a_w[4];
  bool a_ok[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long m = m0 + (tid & 15) + 16 * i;
    a_ok[i] = m < M;
    const long long mm = a_ok[i] ? m : 0;
    const long long img = mm / OHW;
    const int pix = static_cast<int>(mm - img * OHW);
    const int oh = pix / OW, ow = pix - (pix / OW) * OW;
    a_img[i] = img * IC * IHW;
    a_h[i] = DGRAD ? oh + ph : oh * sh - ph;
    a_w[i] = DGRAD ? ow + pw : ow * sw - pw;
  }
  Radix3 ka;  // A's kk = (channel, r, s)
  ka.init(a_k, R, S);
  const int ka_hi = BK / RS, ka_mid = (BK / S) % R, ka_lo = BK % S;

  // B's columns.
  const int b_k = tid & 7;
  long long b_col[NB];
  bool b_ok[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int col = n0 + (tid >> 3) + 16 * j;
    b_ok[j] = col < NG;
    b_col[j] = DGRAD ? static_cast<long long>(col) * RS : static_cast<long long>(col) * KRED;
  }
  long long kkb = b_k;  // fprop: B's kk
  Radix3 kb;            // dgrad: B's kk = (k, 0, rs)
  kb.init(b_k, 1, RS);
  const long long w_k = static_cast<long long>(C) * RS;  // dgrad: w's stride along k

  A ra[4], rb[NB];
  auto load = [&]() {
    const bool kv = ka.hi < IC;
    const long long coff = static_cast<long long>(ka.hi) * IHW;
    const int rh = ka.mid * dh, rw = ka.lo * dw;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int ih, iw;
      bool ok = kv && a_ok[i];
      if (!DGRAD) {
        ih = a_h[i] + rh;
        iw = a_w[i] + rw;
      } else {
        const int th = a_h[i] - rh, tw = a_w[i] - rw;
        if (sh == 1) {
          ih = th;
        } else {
          ok = ok && th >= 0 && th % sh == 0;
          ih = th / sh;
        }
        if (sw == 1) {
          iw = tw;
        } else {
          ok = ok && tw >= 0 && tw % sw == 0;
          iw = tw / sw;
        }
      }
      ok = ok && static_cast<unsigned>(ih) < static_cast<unsigned>(IH) &&
           static_cast<unsigned>(iw) < static_cast<unsigned>(IW);
      ra[i] = ok ? to_acc<A>(src[a_img[i] + coff + static_cast<long long>(ih) * IW + iw]) : A(0);
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      bool ok;
      long long off;
      if (!DGRAD) {
        ok = b_ok[j] && kkb < KRED;
        off = b_col[j] + kkb;
      } else {
        ok = b_ok[j] && kb.hi < K;
        off = static_cast<long long>(kb.hi) * w_k + b_col[j] + kb.lo;
      }
      rb[j] = ok ? to_acc<A>(wt[off]) : A(0);
    }
  };
  auto store = [&](int buf) {
#pragma unroll
    for (int i = 0; i < 4; ++i) As[buf][a_k * LDA + (tid & 15) + 16 * i] = ra[i];
#pragma unroll
    for (int j = 0; j < NB; ++j) Bs[buf][b_k * LDB + (tid >> 3) + 16 * j] = rb[j];
  };
  auto advance = [&]() {
    ka.advance(ka_hi, ka_mid, ka_lo, R, S);
    kkb += BK;
    kb.advance(BK / RS, 0, BK % RS, 1, RS);
  };

  const int tx = tile_tx(), ty = tile_ty();
  A acc[4][TN];
  const long long stages = (KRED + BK - 1) / BK;
  run_stages<A, BN, LDA, LDB>(stages, As, Bs, acc, tx, ty, advance, load, store);

  // Epilogue: z = acc + bias (fprop), y = act(z); rows m .. m + 3, columns col .. col + TN - 1.
  const long long m = m0 + 4 * tx;
  const int col = n0 + ty * TN;
  A bz[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) bz[j] = (bias != nullptr && col + j < NG) ? to_acc<A>(bias[col + j]) : A(0);
  auto value = [&](A z) -> A {
    if constexpr (ACT < 0) {
      return z;
    } else {
      return act_fwd<ACT, kFast<T>>(z);
    }
  };
  if (vec_out && m + 3 < M) {
    // OHW % 4 == 0 and m % 4 == 0: the 4 rows are consecutive pixels of one plane, 4-aligned.
    const long long img = m / OHW;
    const long long base = img * NG * OHW + (m - img * OHW);
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      if (col + j >= NG) continue;
      Vec<T, 4> yv, zv;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const A z = acc[i][j] + bz[j];
        zv.v[i] = from_acc<T>(z);
        yv.v[i] = from_acc<T>(value(z));
      }
      const long long off = base + (col + j) * OHW;
      stg_vec<T, 4>(out + off, yv);
      if (zout != nullptr) stg_vec<T, 4>(zout + off, zv);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (m + i >= M) continue;
      const long long img = (m + i) / OHW;
      const long long base = img * NG * OHW + (m + i - img * OHW);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        if (col + j >= NG) continue;
        const A z = acc[i][j] + bz[j];
        const long long off = base + (col + j) * OHW;
        out[off] = from_acc<T>(value(z));
        if (zout != nullptr) zout[off] = from_acc<T>(z);
      }
    }
  }
}

// y = act(conv(x, w) + bias), and z = conv(x, w) + bias when z != nullptr. bias may be nullptr.
// ACT: -1 (none) or an activations.cuh id. vec_out: P*Q % 4 == 0 (y and z are fresh, aligned).
// Grid (ceil(N*P*Q / 64), ceil(K / BN)), 128 threads.
template <typename T, int BN, int ACT>
__global__ void __launch_bounds__(THREADS)
    conv2d_fprop(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ y,
                 T* __restrict__ z, int N, int C, int H, int W, int K, int P, int Q, int R, int S, int sh, int sw,
                 int ph, int pw, int dh, int dw, int vec_out) {
  igemm_nchw<T, false, BN, ACT>(x, w, bias, y, z, N, C, H, W, K, P, Q, R, S, sh, sw, ph, pw, dh, dw, vec_out);
}

// dx = conv_transpose(g, w): g (N, K, P, Q) is dy, or dy * act'(z) as conv2d_wgrad stored it.
// vec_out: H*W % 4 == 0. Grid (ceil(N*H*W / 64), ceil(C / BN)), 128 threads.
template <typename T, int BN>
__global__ void __launch_bounds__(THREADS)
    conv2d_dgrad(const T* __restrict__ g, const T* __restrict__ w, T* __restrict__ dx, int N, int C, int H, int W,
                 int K, int P, int Q, int R, int S, int sh, int sw, int ph, int pw, int dh, int dw, int vec_out) {
  igemm_nchw<T, true, BN, -1>(g, w, nullptr, dx, nullptr, N, C, H, W, K, P, Q, R, S, sh, sw, ph, pw, dh, dw,
                              vec_out);
}

// ---------------------------------------------------------------------------------------------
// wgrad: partial[split, k, crs] = sum over the split's pixels j of X[j, crs] G[j, k], with
// X[j, crs] = x[n, c, p * sh - ph + r * dh, q * sw - pw + s * dw] and G[j, k] = g[n, k, p, q],
// g = dy * act'(zs) (zs: z for a smooth activation, y for relu, whose derivative is y > 0 exactly
// where z > 0); and dbp[split, k] = sum over the split's pixels of G[j, k].
//
// Block (crs tile, k tile, split); split s covers pixels [s * j_per_split, (s + 1) * j_per_split),
// j_per_split a multiple of BK. Thread t stages pixel t % 8 of each stage (its (n, p, q) kept by a
// Radix3) for the rows crs = t / 8 + 16 i and the columns k = t / 8 + 16 j: consecutive threads read
// consecutive pixels of a plane. The shared row stride of both operands is == 4 (mod 32), which
// suits that store pattern (8 pixels x 4 rows per warp).
//
// dyp != nullptr: G is also stored there (storage dtype) for conv2d_dgrad, by the blocks of the
// first crs tile, which between them read every (pixel, k) exactly once. dbp != nullptr: the db
// partial sums, from the same blocks: each thread sums its pixels in order, then the 8 threads of
// a column add theirs by a fixed shuffle tree.
// ---------------------------------------------------------------------------------------------
template <typename T, int BN, int ACT>
__global__ void __launch_bounds__(THREADS)
    conv2d_wgrad(const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ zs, T* __restrict__ dyp,
                 acc_t<T>* __restrict__ partial, acc_t<T>* __restrict__ dbp, int N, int C, int H, int W, int K, int P,
                 int Q, int R, int S, int sh, int sw, int ph, int pw, int dh, int dw, long long j_per_split) {
  using A = acc_t<T>;
  constexpr int TN = BN / 8;
  constexpr int NB = BN / 16;
  constexpr int LDA = BM + 4;
  constexpr int LDB = kLdCols<BN>;
  __shared__ __align__(32) A Xs[2][BK * LDA];
  __shared__ __align__(32) A Gs[2][BK * LDB];

  const int RS = R * S;
  const int CRS = C * RS;
  const long long HW = static_cast<long long>(H) * W, PQ = static_cast<long long>(P) * Q;
  const long long CHW = C * HW, KPQ = K * PQ;
  const long long NPQ = N * PQ;
  const long long j_begin = static_cast<long long>(blockIdx.z) * j_per_split;
  const long long j_end = min(NPQ, j_begin + j_per_split);
  const int tid = threadIdx.x;
  const int jl = tid & 7;   // the stage's pixel this thread loads
  const int rl = tid >> 3;  // its rows (crs) and columns (k): rl + 16 i

  PatchRows xr;  // the rows (c, r, s) this thread stages
  xr.init(static_cast<int>(blockIdx.x) * BM + rl, CRS, RS, S, 0, HW, dh, dw);
  long long g_off[NB];
  bool g_ok[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int k = blockIdx.y * BN + rl + 16 * j;
    g_ok[j] = k < K;
    g_off[j] = k * PQ;
  }
  long long jj = j_begin + jl;
  Radix3 js;  // (n, p, q) of pixel jj
  js.init(jj, P, Q);
  const int js_hi = static_cast<int>(BK / PQ), js_mid = static_cast<int>((BK / Q) % P), js_lo = BK % Q;
  const bool write_g = dyp != nullptr && blockIdx.x == 0;

  A rx[4], rg[NB], db[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) db[j] = A(0);
  auto load = [&]() {
    const bool jv = jj < j_end;
    const long long xb = js.hi * CHW;
    xr.load(rx, x, xb, js.mid * sh - ph, js.lo * sw - pw, H, W, jv);
    const long long gb = js.hi * KPQ + static_cast<long long>(js.mid) * Q + js.lo;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      A g = A(0);
      if (jv && g_ok[j]) {
        const long long off = gb + g_off[j];
        g = to_acc<A>(dy[off]);
        if constexpr (ACT == ACT_RELU) {
          g = to_acc<A>(zs[off]) <= A(0) ? A(0) : g;  // a select, as torch's threshold_backward
        } else if constexpr (ACT >= 0) {
          g *= act_grad<ACT, kFast<T>>(to_acc<A>(zs[off]));
        }
        if (write_g) dyp[off] = from_acc<T>(g);
      }
      rg[j] = g;
      db[j] += g;
    }
  };
  auto store = [&](int buf) {
#pragma unroll
    for (int i = 0; i < 4; ++i) Xs[buf][jl * LDA + rl + 16 * i] = rx[i];
#pragma unroll
    for (int j = 0; j < NB; ++j) Gs[buf][jl * LDB + rl + 16 * j] = rg[j];
  };
  auto advance = [&]() {
    jj += BK;
    js.advance(js_hi, js_mid, js_lo, P, Q);
  };

  const int tx = tile_tx(), ty = tile_ty();
  A acc[4][TN];
  const long long stages = j_end > j_begin ? (j_end - j_begin + BK - 1) / BK : 0;
  run_stages<A, BN, LDA, LDB>(stages, Xs, Gs, acc, tx, ty, advance, load, store);

  A* __restrict__ part = partial + static_cast<long long>(blockIdx.z) * K * CRS;
  const int crs0 = blockIdx.x * BM + 4 * tx;
  const int k0 = blockIdx.y * BN + ty * TN;
  if ((CRS & 3) == 0 && crs0 + 3 < CRS) {
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      if (k0 + j >= K) continue;
      Vec<A, 4> v;
#pragma unroll
      for (int i = 0; i < 4; ++i) v.v[i] = acc[i][j];
      store_vec<A, 4>(part + static_cast<long long>(k0 + j) * CRS + crs0, v);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (crs0 + i >= CRS) continue;
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (k0 + j < K) part[static_cast<long long>(k0 + j) * CRS + crs0 + i] = acc[i][j];
    }
  }

  if (dbp != nullptr && blockIdx.x == 0) {  // uniform over the block: every lane shuffles
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      A s = db[j];
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      const int k = blockIdx.y * BN + rl + 16 * j;
      if (jl == 0 && k < K) dbp[static_cast<long long>(blockIdx.z) * K + k] = s;
    }
  }
}

// dw[i] = sum over splits of partial[s, i] (i < K*C*R*S) and db[k] = sum of dbp[s, k] (db may be
// nullptr), each in split order. splits == 0 (no pixels) writes zeros.
template <typename T>
__global__ void conv2d_wgrad_reduce(const acc_t<T>* __restrict__ partial, const acc_t<T>* __restrict__ dbp,
                                    T* __restrict__ dw, T* __restrict__ db, long long splits, long long kcrs,
                                    long long K) {
  using A = acc_t<T>;
  const long long total = kcrs + (db != nullptr ? K : 0);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    A s = A(0);
    if (i < kcrs) {
      for (long long sp = 0; sp < splits; ++sp) s += partial[sp * kcrs + i];
      dw[i] = from_acc<T>(s);
    } else {
      const long long k = i - kcrs;
      for (long long sp = 0; sp < splits; ++sp) s += dbp[sp * K + k];
      db[k] = from_acc<T>(s);
    }
  }
}
