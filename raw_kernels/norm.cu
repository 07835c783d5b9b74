// norm.cu: RMSNorm and LayerNorm over the last dimension, forward and backward.
// Host side, the maths and the references: cukit/ops/norm.py. x is contiguous (rows, H) (the host
// makes it so); each row is normalised on its own, its statistics in acc_t<T> (fp32; fp64 for fp64).
//
// Modes (ids match MODES in cukit/ops/norm.py); x^ = (x - mean) * rstd, mean = 0 for RMS:
//   RMS_ROUND 0  y = (offset + w) * round_T(x^)     Llama, Mistral, Qwen2: output dtype = torch's
//                                                  promotion of T and W, product in that precision
//   RMS       1  y = round_T(x^ * (offset + w))     Gemma (offset 1), torch.nn.RMSNorm (offset 0)
//   LAYER     2  y = round_T(x^ * w + b)            torch.nn.LayerNorm (biased variance, two passes)
// with rstd = 1 / sqrt(mean(x^2) + eps) (RMS) or 1 / sqrt(mean((x - mean)^2) + eps) (LAYER).
//
// Threads: blockDim.x = TPR threads share a row (a power of two, at most kMaxThreads), blockDim.y
// rows share a block. A row is cut into chunks of NV * TPR * VEC elements; thread t holds the
// VEC-wide vectors j * TPR + t (j < NV) of a chunk, so each load instruction of a row's threads is
// contiguous. A row of one chunk stays in registers between the passes (statistics, output); a
// longer row is read again for each pass (from L2 mostly). VEC > 1 only when H % VEC == 0 and every
// pointer is aligned to its vectors (see Pack), so a vector never straddles two rows.
#include <cukit/dtypes.cuh>
#include <cukit/ptx.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

enum NormMode : int { RMS_ROUND = 0, RMS = 1, LAYER = 2 };

constexpr int kMaxThreads = 512;  // threads per block; the host keeps TPR * rows per block within it

// NVRTC has no <type_traits>.
template <bool C, typename A, typename B> struct If { using type = A; };
template <typename A, typename B> struct If<false, A, B> { using type = B; };
template <typename A, typename B> constexpr bool kSame = false;
template <typename A> constexpr bool kSame<A, A> = true;
template <typename A> using NoDeduce = typename If<true, A, A>::type;  // a parameter typed by another

// M: the precision of the weight maths and of the weight gradient's partial sums: acc_t<T>, or
// double for a float64 weight. O: the output type (see the modes).
template <typename T, typename W> using math_t = typename If<kSame<W, double>, double, acc_t<T>>::type;
template <typename T, typename W, int MODE>
using out_t = typename If<MODE != RMS_ROUND || kSame<T, W>, T,
                          typename If<kSame<T, double> || kSame<W, double>, double, float>::type>::type;

// Any storage type to any maths type, through the storage type's own accumulation type (the
// 16-bit types convert only to float).
template <typename A, typename S> __device__ __forceinline__ A cvt(S v) {
  return static_cast<A>(to_acc<acc_t<S>>(v));
}
// Any maths type to a storage type, rounded once (double to the 16-bit types through float).
template <typename D, typename A> __device__ __forceinline__ D narrow(A v) {
  return from_acc<D>(static_cast<acc_t<D>>(v));
}

__device__ __forceinline__ float rsqrt_(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_(double v) { return rsqrt(v); }

// N elements of S as 16-byte (or, for N * sizeof(S) < 16, N * sizeof(S)-byte) vectors: the weight
// and the output may be wider than x (a float32 weight beside bfloat16 x), and a vector wider than
// 16 bytes would need more than 16-byte alignment. The host checks each pointer against
// min(16, VEC * sizeof(S)).
template <typename S, int N> struct Pack {
  static constexpr int C = N * static_cast<int>(sizeof(S)) > 16 ? 16 / static_cast<int>(sizeof(S)) : N;
  Vec<S, C> p[N / C];
  __device__ __forceinline__ S get(int k) const { return p[k / C].v[k % C]; }
  __device__ __forceinline__ void set(int k, S v) { p[k / C].v[k % C] = v; }
  // All bits zero (+0 in every float type), written as 32-bit words where the vectors allow: set()
  // per 16-bit element would make the compiler keep the elements in separate registers.
  __device__ __forceinline__ void zero() {
    if constexpr (sizeof(Vec<S, C>) % 4 == 0) {
      unsigned* w = reinterpret_cast<unsigned*>(p);
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(p) / 4); ++i) w[i] = 0u;
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) set(k, narrow<S>(acc_t<S>(0)));
    }
  }
};

// Element k of a pack in the maths type A. A bfloat16 pair comes straight from its 32-bit word (a
// shift or a mask): through get() each element is first moved into a 16-bit register of its own.
template <typename A, typename S, int N> __device__ __forceinline__ A elem(const Pack<S, N>& v, int k) {
  if constexpr (kSame<S, __nv_bfloat16> && Pack<S, N>::C % 2 == 0) {
    const unsigned w = reinterpret_cast<const unsigned*>(v.p)[k / 2];
    return static_cast<A>(__uint_as_float(k % 2 == 0 ? w << 16 : w & 0xffff0000u));
  } else {
    return cvt<A>(v.get(k));
  }
}

template <typename S, int N> __device__ __forceinline__ Pack<S, N> load_pack(const S* __restrict__ ptr) {
  Pack<S, N> r;
#pragma unroll
  for (int i = 0; i < N / Pack<S, N>::C; ++i) r.p[i] = load_vec<S, Pack<S, N>::C>(ptr + i * Pack<S, N>::C);
  return r;
}

template <typename S, int N> __device__ __forceinline__ void store_pack(S* __restrict__ ptr, const Pack<S, N>& v) {
#pragma unroll
  for (int i = 0; i < N / Pack<S, N>::C; ++i) stg_vec<S, Pack<S, N>::C>(ptr + i * Pack<S, N>::C, v.p[i]);
}

// The NV vectors of one chunk of a row that this thread holds; zeros past the row's end and for
// rows past the last (they add nothing to the sums). C: the column type (int where the host knows
// the row is one chunk).
template <typename S, int VEC, int NV, typename C>
__device__ __forceinline__ void load_chunk(Pack<S, VEC> (&v)[NV], const S* __restrict__ row, NoDeduce<C> first,
                                           NoDeduce<C> stride, C H, bool active) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const C c = first + j * stride;
    v[j].zero();
    if (active && c < H) v[j] = load_pack<S, VEC>(row + c);
  }
}

// Sums each of N values over the TPR = blockDim.x threads of a row; every thread of the row gets the
// sums. A butterfly of shuffles within each warp (IEEE addition commutes, so both partners of each
// step compute the same bits); for TPR > 32 each warp then posts its sums, and every warp finishes
// alone: lane l reads warp (l % warps)'s sums and a butterfly over the warps adds them (one shared
// load and log2(warps) shuffles, not `warps` loads; every warp adds the same values in the same
// pattern, so every thread gets the same bits, independent of timing). Every thread of the block
// calls it (it holds __syncthreads). `scratch` holds N * kMaxThreads / 32 values. REUSE: the slots
// are written again by a later call, so the block waits until every warp has read them; a caller
// that gives each call its own slots passes false.
template <typename A, int N, bool REUSE = true> __device__ __forceinline__ void row_sum(A (&v)[N], A* scratch) {
  const int tpr = blockDim.x;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < tpr) {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
    }
  }
  if (tpr > 32) {
    const int warps = tpr >> 5, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    A* s = scratch + threadIdx.y * warps * N;
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) s[wid * N + i] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = s[(lane & (warps - 1)) * N + i];
#pragma unroll
    for (int o = kMaxThreads / 64; o > 0; o >>= 1) {
      if (o < warps) {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
      }
    }
    if (REUSE) __syncthreads();
  }
}

// Forward: one row per blockDim.x threads, no grid-stride loop (a block's rows are independent).
// ONE: the row is one chunk (H <= NV * TPR * VEC; the host picks it so): the loops and reloads
// compile away and columns are 32-bit, which saves registers and lets more warps stay resident
// (benchmarks/NOTES.md, "Stop 33": norm kernels with a row held in one chunk). Otherwise longer rows are read
// again for each pass, with 64-bit columns.
// y == nullptr: statistics only (the array API's backward without saved statistics). mean_out,
// rstd_out == nullptr: not written (inference keeps no statistics).
template <typename T, typename W, int MODE, int VEC, int NV, bool ONE>
__global__ void __launch_bounds__(kMaxThreads)
    norm_fwd(const T* __restrict__ x, const W* __restrict__ w, const W* __restrict__ b,
             out_t<T, W, MODE>* __restrict__ y, acc_t<T>* __restrict__ mean_out, acc_t<T>* __restrict__ rstd_out,
             long long rows, long long H, double eps, double offset) {
  using A = acc_t<T>;
  using M = math_t<T, W>;
  using O = out_t<T, W, MODE>;
  using C = typename If<ONE, int, long long>::type;  // a column within the row
  __shared__ A scratch[2 * kMaxThreads / 32];  // a half per row_sum call: no barrier between them
  const int t = threadIdx.x, tpr = blockDim.x;
  const long long r = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = r < rows;
  const long long row0 = active ? r * H : 0;
  const T* __restrict__ xr = x + row0;
  const C h = static_cast<C>(H);
  const C stride = static_cast<C>(tpr) * VEC;
  const C chunk = NV * stride;
  const int nchunks = ONE ? 1 : static_cast<int>((h + chunk - 1) / chunk);
  Pack<T, VEC> xv[NV];

  A s[1] = {A(0)};
  for (int ch = 0; ch < nchunks; ++ch) {
    load_chunk(xv, xr, ch * chunk + t * VEC, stride, h, active);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A v = elem<A>(xv[j], k);
        s[0] += MODE == LAYER ? v : v * v;
      }
    }
  }
  row_sum<A, 1, false>(s, scratch);
  A mean = A(0);
  if (MODE == LAYER) {  // the variance from the centred values: no cancellation of E[x^2] - mean^2
    mean = s[0] / static_cast<A>(H);
    s[0] = A(0);
    for (int ch = 0; ch < nchunks; ++ch) {
      if (!ONE) load_chunk(xv, xr, ch * chunk + t * VEC, stride, h, active);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (ch * chunk + j * stride + t * VEC < h) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const A d = elem<A>(xv[j], k) - mean;
            s[0] += d * d;
          }
        }
      }
    }
    row_sum<A, 1, false>(s, scratch + kMaxThreads / 32);
  }
  const A rstd = rsqrt_(s[0] / static_cast<A>(H) + static_cast<A>(eps));
  if (active && t == 0) {
    if (rstd_out != nullptr) rstd_out[r] = rstd;
    if (MODE == LAYER && mean_out != nullptr) mean_out[r] = mean;
  }
  if (y == nullptr || !active) return;  // no barrier below

  O* __restrict__ yr = y + row0;
  const M off = static_cast<M>(offset);
  for (int ch = 0; ch < nchunks; ++ch) {
    if (!ONE) load_chunk(xv, xr, ch * chunk + t * VEC, stride, h, true);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const C c = ch * chunk + j * stride + t * VEC;
      if (c >= h) continue;
      Pack<W, VEC> wv{}, bv{};
      if (w != nullptr) wv = load_pack<W, VEC>(w + c);
      if (MODE == LAYER && b != nullptr) bv = load_pack<W, VEC>(b + c);
      Pack<O, VEC> yv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A xh = (elem<A>(xv[j], k) - mean) * rstd;
        M o;
        if (MODE == RMS_ROUND) {  // HF Llama: hidden_states.to(input_dtype), then weight * it
          o = cvt<M>(narrow<T>(xh));
          if (w != nullptr) o = (off + elem<M>(wv, k)) * o;
        } else if (MODE == RMS) {  // HF Gemma: (x^ * (1 + w.float())).type_as(x)
          o = static_cast<M>(xh);
          if (w != nullptr) o = o * (off + elem<M>(wv, k));
        } else {
          o = static_cast<M>(xh);
          if (w != nullptr) o = o * elem<M>(wv, k);
          if (b != nullptr) o = o + elem<M>(bv, k);
        }
        yv.set(k, narrow<O>(o));
      }
      store_pack<O, VEC>(yr + c, yv);
    }
  }
}

// Backward, pass 1 of 2: dx for every row and one partial row of the weight (and bias) gradient per
// block. With g = dy * (offset + w) (dy without a weight) and the saved mean and rstd:
//   RMS:   dx = rstd * (g - x^ * mean(g x^))
//   LAYER: dx = rstd * (g - mean(g) - x^ * mean(g x^))
//   dw += dy * x^ (RMS_ROUND: dy * round_T(x^), the value the forward multiplied), db += dy.
// A persistent grid: block i takes the row groups i, i + gridDim.x, ... (a loop whose trip count is
// the same for every thread of the block: row_sum may synchronise). A thread's columns are the same
// for every row, so it sums its share of dw and db in registers across all its rows; at the end the
// blockDim.y row groups' sums are added in order through shared memory (rpb * H values of M) and
// the block writes pw[blockIdx.x, :] (pb[blockIdx.x, :]). Chunked rows (one row group per block)
// add into those partial rows directly instead, each column always by the same thread. No atomics:
// bitwise reproducible for a given launch configuration. pw (pb) == nullptr: no weight (bias).
// ONE: as the forward's, the row is one chunk (held in registers; the host picks it so): the chunk
// loops and the chunked rows' sums compile away and columns are 32-bit.
template <typename T, typename W, int MODE, int VEC, int NV, bool ONE>
__global__ void __launch_bounds__(kMaxThreads)
    norm_bwd(const out_t<T, W, MODE>* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
             const acc_t<T>* __restrict__ mean_in, const acc_t<T>* __restrict__ rstd_in, T* __restrict__ dx,
             math_t<T, W>* __restrict__ pw, math_t<T, W>* __restrict__ pb, long long rows, long long H,
             double offset, long long smem_acc) {
  using A = acc_t<T>;
  using M = math_t<T, W>;
  using O = out_t<T, W, MODE>;
  constexpr int NS = MODE == LAYER ? 2 : 1;  // row sums: sum(g x^) (and sum(g))
  __shared__ A scratch[NS * kMaxThreads / 32];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using C = typename If<ONE, int, long long>::type;  // a column within the row
  const int t = threadIdx.x, tpr = blockDim.x, rpb = blockDim.y;
  const C h = static_cast<C>(H);
  const C stride = static_cast<C>(tpr) * VEC;
  const C chunk = NV * stride;
  const int nchunks = ONE ? 1 : static_cast<int>((h + chunk - 1) / chunk);
  const bool in_regs = ONE || nchunks == 1;
  M* gw = pw != nullptr ? pw + static_cast<long long>(blockIdx.x) * H : nullptr;
  M* gb = MODE == LAYER && pb != nullptr ? pb + static_cast<long long>(blockIdx.x) * H : nullptr;
  M* red = reinterpret_cast<M*>(smem_raw);
  // Chunked rows: the sums live in shared memory when the host gave room for them (smem_acc),
  // else in the block's partial rows in global memory (L2 mostly).
  M* sw = gw;
  M* sb = gb;
  if (!in_regs && smem_acc) {
    sw = gw != nullptr ? red : nullptr;
    sb = gb != nullptr ? red + (gw != nullptr ? H : 0) : nullptr;
  }
  const M off = static_cast<M>(offset);

  M aw[NV][VEC], ab[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) aw[j][k] = ab[j][k] = M(0);
  }
  if (!in_regs) {  // one row group per block (the host's choice for chunked rows); zeroed by the owner
    for (int ch = 0; ch < nchunks; ++ch) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const C c = ch * chunk + j * stride + t * VEC;
        if (c >= h) continue;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if (sw != nullptr) sw[c + k] = M(0);
          if (sb != nullptr) sb[c + k] = M(0);
        }
      }
    }
  }

  // Scalar rows in registers are loaded one iteration ahead (xn, gn): a thread's few bytes of a row
  // are then in flight while this row is reduced and written, which the barriers in row_sum would
  // otherwise serialise. The vector paths hold 16-64 bytes per thread, enough in flight without it;
  // the second copy's registers cost them occupancy (benchmarks/NOTES.md, "norm backward").
  constexpr bool PREFETCH = VEC == 1 && NV * sizeof(T) <= 32;
  Pack<T, VEC> xv[NV], xn[NV];
  Pack<O, VEC> gv[NV], gn[NV];
  const long long step = static_cast<long long>(gridDim.x) * rpb;
  const long long first = static_cast<long long>(blockIdx.x) * rpb + threadIdx.y;
  const bool ahead = PREFETCH && in_regs;
  // 16-bit LayerNorm rows held in registers ask L2 for the next row group's lines before this
  // row's two reductions: no registers held, and DRAM stays busy across the barriers. RMSNorm's
  // single reduction, and float32 rows (twice the bytes per element in flight already), lost with
  // the hints (benchmarks/NOTES.md, "norm backward: the next rows' lines asked of L2").
  const bool l2_ahead = VEC > 1 && MODE == LAYER && sizeof(T) == 2 && in_regs;
  // A row held in registers with at most 32 bytes of weight per thread keeps the weight for all its
  // rows (read once, as its columns never change) instead of reading it from L1 twice per row.
  constexpr bool HOLD_W = ONE && NV * VEC * sizeof(W) <= 32;
  Pack<W, VEC> wh[HOLD_W ? NV : 1];
  if (HOLD_W && w != nullptr) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const C c = j * stride + t * VEC;
      if (c < h) wh[j] = load_pack<W, VEC>(w + c);
    }
  }
  if (ahead) {
    load_chunk(xn, x + (first < rows ? first * H : 0), t * VEC, stride, h, first < rows);
    load_chunk(gn, dy + (first < rows ? first * H : 0), t * VEC, stride, h, first < rows);
  }
  // row0 = r * H advanced by an add per row group (a multiply per load otherwise: the compiler
  // rematerialises it at each use); past the last row it is never dereferenced (every access is
  // guarded by `active`).
  const long long step_h = step * H;
  long long row0 = first * H;
  for (long long r0 = static_cast<long long>(blockIdx.x) * rpb; r0 < rows; r0 += step, row0 += step_h) {
    const long long r = r0 + threadIdx.y;
    const bool active = r < rows;
    const A rstd = active ? rstd_in[r] : A(0);
    const A mean = MODE == LAYER && active ? mean_in[r] : A(0);
    if (l2_ahead && r + step < rows) {
      const long long next = row0 + step_h;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const C c = t * VEC + j * stride;
        if (c < h) {
          ptx::prefetch_l2(x + next + c);
          ptx::prefetch_l2(dy + next + c);
        }
      }
    }
    if (ahead) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        xv[j] = xn[j];
        gv[j] = gn[j];
      }
      const long long rn = r + step;
      load_chunk(xn, x + (rn < rows ? rn * H : 0), t * VEC, stride, h, rn < rows);
      load_chunk(gn, dy + (rn < rows ? rn * H : 0), t * VEC, stride, h, rn < rows);
    }

    A s[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = A(0);
    for (int ch = 0; ch < nchunks; ++ch) {
      if (!ahead) {
        load_chunk(xv, x + row0, ch * chunk + t * VEC, stride, h, active);
        load_chunk(gv, dy + row0, ch * chunk + t * VEC, stride, h, active);
      }
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const C c = ch * chunk + j * stride + t * VEC;
        if (c >= h) continue;
        Pack<W, VEC> wv{};
        if (w != nullptr) wv = HOLD_W ? wh[HOLD_W ? j : 0] : load_pack<W, VEC>(w + c);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A xh = (elem<A>(xv[j], k) - mean) * rstd;
          const M d = elem<M>(gv[j], k);
          const A g = static_cast<A>(w != nullptr ? d * (MODE == LAYER ? elem<M>(wv, k) : off + elem<M>(wv, k)) : d);
          s[0] += g * xh;
          if (MODE == LAYER) s[NS - 1] += g;
        }
      }
    }
    row_sum(s, scratch);
    const A c1 = s[0] / static_cast<A>(H);
    const A c2 = MODE == LAYER ? s[NS - 1] / static_cast<A>(H) : A(0);

    for (int ch = 0; ch < nchunks; ++ch) {
      if (!in_regs) {
        load_chunk(xv, x + row0, ch * chunk + t * VEC, stride, h, active);
        load_chunk(gv, dy + row0, ch * chunk + t * VEC, stride, h, active);
      }
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const C c = ch * chunk + j * stride + t * VEC;
        if (!active || c >= h) continue;
        Pack<W, VEC> wv{};
        if (w != nullptr) wv = HOLD_W ? wh[HOLD_W ? j : 0] : load_pack<W, VEC>(w + c);
        Pack<T, VEC> dv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A xh = (elem<A>(xv[j], k) - mean) * rstd;
          const M d = elem<M>(gv[j], k);
          const A g = static_cast<A>(w != nullptr ? d * (MODE == LAYER ? elem<M>(wv, k) : off + elem<M>(wv, k)) : d);
          dv.set(k, narrow<T>(rstd * (g - c2 - xh * c1)));
          const M xw = MODE == RMS_ROUND ? cvt<M>(narrow<T>(xh)) : static_cast<M>(xh);
          if (in_regs) {
            aw[j][k] += d * xw;
            if (MODE == LAYER) ab[j][k] += d;
          } else {
            if (sw != nullptr) sw[c + k] += d * xw;
            if (sb != nullptr) sb[c + k] += d;
          }
        }
        store_pack<T, VEC>(dx + row0 + c, dv);
      }
    }
  }
  if (!in_regs) {
    if (smem_acc) {  // each column goes out from the thread that summed it: no barrier
      for (int ch = 0; ch < nchunks; ++ch) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const C c = ch * chunk + j * stride + t * VEC;
          if (c >= h) continue;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            if (gw != nullptr) gw[c + k] = sw[c + k];
            if (gb != nullptr) gb[c + k] = sb[c + k];
          }
        }
      }
    }
    return;  // no barrier below
  }

  // red: [rpb][H], only when rpb > 1
#pragma unroll
  for (int q = 0; q < NS; ++q) {
    M* part = q == 0 ? gw : gb;
    if (part == nullptr) continue;  // the same for every thread
    if (rpb == 1) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const C c = j * stride + t * VEC;
        if (c >= h) continue;
#pragma unroll
        for (int k = 0; k < VEC; ++k) part[c + k] = q == 0 ? aw[j][k] : ab[j][k];
      }
      continue;
    }
    __syncthreads();  // red may still be read for the previous q
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const C c = j * stride + t * VEC;
      if (c >= h) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) red[threadIdx.y * H + c + k] = q == 0 ? aw[j][k] : ab[j][k];
    }
    __syncthreads();
    for (long long c = static_cast<long long>(threadIdx.y) * tpr + t; c < H; c += static_cast<long long>(tpr) * rpb) {
      M acc = M(0);
      for (int g = 0; g < rpb; ++g) acc += red[g * H + c];
      part[c] = acc;
    }
  }
}

// Backward, pass 2: out[c] = sum over the parts p of partial[p, c], in a fixed order, rounded once
// to D (the weight's or the bias's dtype). blockIdx.y picks the output: partial rows
// [y * parts, (y + 1) * parts) go to out0 (y = 0) or out1 (y = 1). Block (32, kReduceSplit): a
// warp's lanes read 32 adjacent columns (one 128-byte line per row), and threadIdx.y splits the
// parts (p = y, y + kReduceSplit, ...) so that kReduceSplit loads per column are in flight; the
// splits' sums are then added in split order.
constexpr int kReduceSplit = 16;

template <typename M, typename D>
__global__ void __launch_bounds__(32 * kReduceSplit)
    norm_reduce(const M* __restrict__ partial, D* __restrict__ out0, D* __restrict__ out1, long long parts,
                long long H) {
  __shared__ M red[kReduceSplit][32];
  const M* p = partial + static_cast<long long>(blockIdx.y) * parts * H;
  D* out = blockIdx.y == 0 ? out0 : out1;
  const long long c = static_cast<long long>(blockIdx.x) * 32 + threadIdx.x;
  M s = M(0);
  if (c < H) {
#pragma unroll 4
    for (long long q = threadIdx.y; q < parts; q += kReduceSplit) s += p[q * H + c];
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < H) {
    M acc = M(0);
#pragma unroll
    for (int g = 0; g < kReduceSplit; ++g) acc += red[g][threadIdx.x];
    out[c] = narrow<D>(acc);
  }
}
