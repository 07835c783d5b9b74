// cukit/multi_tensor.cuh: the multi-tensor engine. One launch updates every chunk of every tensor
// of a tensor table, whatever the number of tensors: the tensors' addresses and sizes live in a
// device table (built once by optim/_engine.py, TensorTable), not in the kernel's arguments.
//
// The table is one int64 array; with T tensors, L lists (param, grad, states...) and C chunks:
//   [0, L*T)              addr[l * T + t]   the address of tensor t of list l
//   [L*T, (L+1)*T)        size[t]           elements of tensor t (all lists of t have it; 64-bit)
//   [(L+1)*T, (L+2)*T)    info[t]           bits 0-7: the tensor's group in the launch (its
//                                           hyperparameters), bit 8: every list's address of t is
//                                           aligned to kVec elements (the vector path)
//   [(L+2)*T, (L+3)*T+1)  chunk_begin[t]    the index of t's first chunk in the work list; chunks
//                                           of one tensor are consecutive, chunk_begin[T] = C
//   [(L+3)*T+1, ... + C)  work[c]           (t << 32) | (chunk index within t)
// Size-0 tensors have no chunk, so the kernels never see them.
//
// Per launch, besides the table: up to kMaxGroups param groups, each with kHP hyperparameters in a
// device array (written when they change, which is rarely) and its learning rate passed by value
// (the one a scheduler changes every step: by value there is no host-to-device copy to race with
// the previous step's kernel), or read from the device (capturable: lr tensors). All of them travel
// as double, the values the user gave, and are rounded once to the launch's accumulation type
// (load_shared<A>): float launches see float32 hyperparameters, float64 launches the exact ones.
#pragma once
#include <cukit/dtypes.cuh>
#include <cukit/reduce.cuh>
#include <cukit/vec.cuh>

namespace cukit {
namespace mt {

constexpr int kVec = 4;         // elements per thread per trip: 16-byte loads for 4-byte types
constexpr int kMaxGroups = 8;   // param groups per launch (their lrs are kernel arguments)
constexpr int kHP = 8;          // hyperparameters per group in the hp array
constexpr int kGroupMask = 0xff;
constexpr int kAlignedBit = 1 << 8;

template <int L> struct Table {
  const long long* __restrict__ t;
  long long T;
  long long C;
  long long chunk;
  __device__ __forceinline__ long long addr(int list, long long i) const { return t[list * T + i]; }
  __device__ __forceinline__ long long size(long long i) const { return t[L * T + i]; }
  __device__ __forceinline__ int info(long long i) const { return static_cast<int>(t[(L + 1) * T + i]); }
  __device__ __forceinline__ long long chunk_begin(long long i) const { return t[(L + 2) * T + i]; }
  __device__ __forceinline__ long long work(long long c) const { return t[(L + 3) * T + 1 + c]; }
};

// Work item c decoded: its tensor, the tensor's info, and the element range [start, start + n).
struct Chunk {
  long long tensor, start, n;
  int info;
};

template <int L> __device__ __forceinline__ Chunk chunk_at(const Table<L>& tab, long long c) {
  const long long w = tab.work(c);
  Chunk k;
  k.tensor = w >> 32;
  k.start = (w & 0xffffffffLL) * tab.chunk;
  k.n = min(tab.size(k.tensor) - k.start, tab.chunk);
  k.info = tab.info(k.tensor);
  return k;
}

template <int L> struct Ptrs {
  void* p[L];
  template <typename T> __device__ __forceinline__ T* at(int list) const { return static_cast<T*>(p[list]); }
};

// What every update reads besides the table, staged once per block in shared memory. Each value is
// already rounded to the launch's accumulation type A (exact in double), so a functor reads it as A,
// or as double where it derives a constant in double (bias corrections, 1 - lr wd).
struct Shared {
  double lr[kMaxGroups];
  double hp[kMaxGroups * kHP];
  double gmul;  // multiplies every gradient: 1 / grad_scale (GradScaler) * clip coefficient
};

// The parameters every update kernel starts with (signature "ptr i64 i64 i64 ptr i64 f64 x 8 ptr
// ptr ptr ptr" in optim/_kernels.py: MT_PARAMS). hp and lr_dev are float64 device arrays.
#define CUKIT_MT_PARAMS                                                                               \
  const long long *__restrict__ table, long long T, long long C, long long chunk,                     \
      const double *__restrict__ hp, long long groups, double lr0, double lr1, double lr2, double lr3, \
      double lr4, double lr5, double lr6, double lr7, const double *__restrict__ lr_dev,               \
      const float *__restrict__ grad_div, const float *__restrict__ grad_mul, const float *__restrict__ skip

// A hyperparameter as a launch accumulating in A sees it: rounded to A (float32 for every launch but
// float64's, which keeps the value exact), held in a double.
template <typename A> __device__ __forceinline__ double hp_as(double x) {
  return static_cast<double>(static_cast<A>(x));
}

// Fills `sh` (every thread must call it; it ends with a barrier). grad_div, grad_mul, lr_dev and
// skip may be null. Returns false when *skip != 0: the step is skipped (a non-finite gradient
// under GradScaler or in the clipping norm); the value is the same for every block, so all of
// them return together and nothing is written.
template <typename A>
__device__ __forceinline__ bool load_shared(Shared& sh, const double* __restrict__ hp, long long groups,
                                            const double (&lrs)[kMaxGroups], const double* __restrict__ lr_dev,
                                            const float* __restrict__ grad_div,
                                            const float* __restrict__ grad_mul, const float* __restrict__ skip) {
  if (skip != nullptr && *skip != 0.f) return false;
  const int i = threadIdx.x;
  if (i < kMaxGroups * kHP) sh.hp[i] = i < groups * kHP ? hp_as<A>(hp[i]) : 0.0;
  if (i < kMaxGroups) sh.lr[i] = hp_as<A>(lr_dev != nullptr ? (i < groups ? lr_dev[i] : 0.0) : lrs[i]);
  if (i == 0) {
    A m = A(1);
    if (grad_div != nullptr) m = A(1) / static_cast<A>(*grad_div);  // GradScaler scales are powers of two: exact
    if (grad_mul != nullptr) m *= static_cast<A>(*grad_mul);
    sh.gmul = m;
  }
  __syncthreads();
  return true;
}

// A: the launch's accumulation type (acc_t<P>).
#define CUKIT_MT_PROLOGUE(sh, A)                                                                      \
  __shared__ ::cukit::mt::Shared sh;                                                                   \
  {                                                                                                    \
    const double lrs_[::cukit::mt::kMaxGroups] = {lr0, lr1, lr2, lr3, lr4, lr5, lr6, lr7};             \
    if (!::cukit::mt::load_shared<A>(sh, hp, groups, lrs_, lr_dev, grad_div, grad_mul, skip)) return;  \
  }

// The engine: every block walks the work list with a grid stride; for each (tensor, chunk) it
// reads the tensor's addresses once, asks the functor for the per-tensor context (bias
// corrections, group hyperparameters), then visits the chunk's elements: kVec at a time where the
// tensor is aligned (the tail of the tensor's last chunk one at a time), one at a time otherwise.
// F provides:
//   using Ctx = ...;
//   __device__ Ctx context(long long tensor, int info, const Shared& sh) const;
//   template <int N> __device__ void apply(const Ptrs<L>& p, long long offset, const Ctx& c) const;
//   __device__ void end_chunk(long long c, long long tensor, const Ctx& c) const;  (block-wide; may sync)
template <int L, typename F> __device__ __forceinline__ void for_each_chunk(const Table<L>& tab, const F& f,
                                                                          const Shared& sh) {
  for (long long c = blockIdx.x; c < tab.C; c += gridDim.x) {
    const Chunk k = chunk_at(tab, c);
    const long long i = k.tensor, start = k.start, n = k.n;
    const int info = k.info;
    Ptrs<L> p;
#pragma unroll
    for (int l = 0; l < L; ++l) p.p[l] = reinterpret_cast<void*>(tab.addr(l, i));
    const typename F::Ctx ctx = f.context(i, info, sh);
    if (info & kAlignedBit) {
      const long long nv = n / kVec;
      for (long long v = threadIdx.x; v < nv; v += blockDim.x) f.template apply<kVec>(p, start + v * kVec, ctx);
      for (long long e = nv * kVec + threadIdx.x; e < n; e += blockDim.x) f.template apply<1>(p, start + e, ctx);
    } else {
      for (long long e = threadIdx.x; e < n; e += blockDim.x) f.template apply<1>(p, start + e, ctx);
    }
    f.end_chunk(c, i, ctx);
  }
}

// Loads N elements of list `l` at element offset `off`, converted to the accumulation type A.
template <typename T, int N, typename A> __device__ __forceinline__ void load(const T* base, long long off, A (&x)[N]) {
  const Vec<T, N> v = load_vec<T, N>(base + off);
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] = to_acc<A>(v.v[k]);
}

template <typename T, int N, typename A> __device__ __forceinline__ void store(T* base, long long off, const A (&x)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int k = 0; k < N; ++k) v.v[k] = from_acc<T>(x[k]);
  store_vec<T, N>(base + off, v);
}

// ---------------------------------------------------------------- blockwise-quantised states
// A state kept in BITS bits per element (8, or 4 packed two per byte, low nibble first) with one
// float scale per block of QB = 32 * E elements: value = code[c] * absmax[block], where code is a
// sorted table of 2^BITS values in [-1, 1] (bitsandbytes' dynamic map, or a linear one) and absmax
// the block's largest |value| after the update. In a tensor table such a state is two lists: the
// codes (numel / (8 / BITS) bytes) and the scales (ceil(numel / QB) floats); TensorTable's
// `divisors` give each list its element ratio. Encoding picks the nearest code, ties to the lower,
// by the count of the 2^BITS - 1 midpoints of neighbouring codes below the value (the host
// reference does the same with torch.searchsorted over the same float32 midpoints), so the
// kernels and the reference agree bit for bit on the same input. A NaN anywhere in a block makes
// its scale NaN (the block decodes to NaN, as a float32 state would carry it). Values are
// normalised by multiplying with the float32 reciprocal of the scale.
//
// The search starts from a bucket table: |xn|'s float bits >> 16 (its binade and 7 mantissa bits,
// so a bucket spans 0.8 % of its values) index, per sign, the first candidate code; one compare
// with the next midpoint finishes it (no bucket of these maps holds two midpoints). A binary
// search would take 2^BITS's log2 dependent shared-memory loads per element, each a bank conflict.
constexpr int kQTable = 2304;  // floats per state in a code table: code [0, 256), midpoints [256, 511)
                               // and +inf, the bucket table's 2 x kBuckets bytes from float 512 on
constexpr int kBucketShift = 16;
constexpr int kBucketLo = 0x33800000 >> kBucketShift;  // |xn| < 2^-24 (and zero) share bucket 0
constexpr int kBuckets = (0x3f800000 >> kBucketShift) - kBucketLo + 1;  // up to |xn| = 1

template <int BITS> struct QCodec {
  static constexpr int kCodes = 1 << BITS;
  // the most midpoints one bucket holds, for every map cukit builds (checked on the host:
  // optim/lowbit.py bucket_table)
  static constexpr int kSteps = 1;
  const float* code;  // shared memory: the state's table (kQTable floats)

  __device__ __forceinline__ unsigned int encode(float xn) const {
    if (xn != xn) return 0u;
    const unsigned int u = __float_as_uint(xn);
    const int b = min(max(static_cast<int>((u & 0x7fffffffu) >> kBucketShift) - kBucketLo, 0), kBuckets - 1);
    const unsigned char* bucket = reinterpret_cast<const unsigned char*>(code + 512);
    const float* mid = code + 256;
    unsigned int lo = bucket[(u >> 31) * kBuckets + b];
    // a fixed number of compares, no branch: the E encodes of a lane interleave (mid[kCodes - 1]
    // is +inf, so a finished search stays put)
#pragma unroll
    for (int s = 0; s < kSteps; ++s) lo += mid[lo] < xn ? 1u : 0u;
    return lo;
  }
};

// Copies `n` code tables (kQTable floats each) to shared memory; every thread calls it.
__device__ __forceinline__ void load_qtables(float* dst, const float* __restrict__ src, int n) {
  for (int i = threadIdx.x; i < n * kQTable; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
}

// The largest |x[k]| of the lane's first `cnt` values, reduced over the warp; NaN wins. The bits of
// non-negative floats order as unsigned integers (a NaN's above inf's), so one integer max per
// element and one warp reduction (REDUX on sm_80+) do it.
template <int E> __device__ __forceinline__ float warp_absmax(const float (&x)[E], int cnt) {
  unsigned int a = 0u;
#pragma unroll
  for (int k = 0; k < E; ++k)
    if (k < cnt) a = max(a, __float_as_uint(x[k]) & 0x7fffffffu);
#if __CUDA_ARCH__ >= 800
  a = __reduce_max_sync(0xffffffffu, a);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(0xffffffffu, a, o));
#endif
  return __uint_as_float(a);
}

// Element loads and stores of a lane's E consecutive elements, `cnt` of them valid (cnt < E only
// at a tensor's end); `vec` when the tensor's lists are aligned (kVec elements at a time).
template <typename T, int E, typename A>
__device__ __forceinline__ void load_part(const T* base, long long off, int cnt, bool vec, A (&x)[E]) {
  if (vec && cnt == E) {
#pragma unroll
    for (int j = 0; j < E; j += kVec) {
      A y[kVec];
      load<T, kVec>(base, off + j, y);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[j + k] = y[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = k < cnt ? to_acc<A>(base[off + k]) : A(0);
  }
}

template <typename T, int E, typename A>
__device__ __forceinline__ void store_part(T* base, long long off, int cnt, bool vec, const A (&x)[E]) {
  if (vec && cnt == E) {
#pragma unroll
    for (int j = 0; j < E; j += kVec) {
      A y[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) y[k] = x[j + k];
      store<T, kVec>(base, off + j, y);
    }
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k)
      if (k < cnt) base[off + k] = from_acc<T>(x[k]);
  }
}

// Decodes the lane's E values of a quantised state (codes at element offset `off`, scale `absmax`).
template <int BITS, int E>
__device__ __forceinline__ void q_load(const unsigned char* codes, long long off, int cnt, bool vec, float absmax,
                                       const QCodec<BITS>& q, float (&x)[E]) {
  static_assert(BITS == 8 || BITS == 4, "8- or 4-bit codes");
  unsigned int c[E];
  if constexpr (BITS == 8) {
    if (vec && cnt == E) {
#pragma unroll
      for (int j = 0; j < E; j += 4) {
        const unsigned int w = *reinterpret_cast<const unsigned int*>(codes + off + j);
#pragma unroll
        for (int k = 0; k < 4; ++k) c[j + k] = (w >> (8 * k)) & 0xffu;
      }
    } else {
#pragma unroll
      for (int k = 0; k < E; ++k) c[k] = k < cnt ? codes[off + k] : 0u;
    }
  } else {
    const unsigned char* b = codes + off / 2;  // off is a multiple of E (even)
#pragma unroll
    for (int k = 0; k < E; k += 2) {
      const unsigned int w = k < cnt ? b[k / 2] : 0u;
      c[k] = w & 0xfu;
      c[k + 1] = w >> 4;
    }
  }
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = k < cnt ? q.code[c[k]] * absmax : 0.f;
}

// Encodes the lane's E values with the warp's new scale (every lane of the warp calls it, cnt may
// be 0); lane 0 writes the scale of block `qb`.
template <int BITS, int E>
__device__ __forceinline__ void q_store(unsigned char* codes, float* scales, long long off, long long qb, int cnt,
                                        bool vec, const QCodec<BITS>& q, const float (&x)[E]) {
  const float absmax = warp_absmax<E>(x, cnt);
  if ((threadIdx.x & 31) == 0) scales[qb] = absmax;
  // one IEEE reciprocal per lane instead of E divisions (the reference multiplies by the same
  // float32 reciprocal); NaN and zero scales encode every value as x * 0
  const float inv = absmax > 0.f ? 1.f / absmax : 0.f;
  unsigned int c[E];
#pragma unroll
  for (int k = 0; k < E; ++k) c[k] = q.encode(x[k] * inv);
  if constexpr (BITS == 8) {
    if (vec && cnt == E) {
#pragma unroll
      for (int j = 0; j < E; j += 4)
        *reinterpret_cast<unsigned int*>(codes + off + j) = c[j] | (c[j + 1] << 8) | (c[j + 2] << 16) | (c[j + 3] << 24);
    } else {
#pragma unroll
      for (int k = 0; k < E; ++k)
        if (k < cnt) codes[off + k] = static_cast<unsigned char>(c[k]);
    }
  } else {
    unsigned char* b = codes + off / 2;
#pragma unroll
    for (int k = 0; k < E; k += 2)  // an odd count's last byte keeps 0 in its unused high nibble
      if (k < cnt) b[k / 2] = static_cast<unsigned char>(c[k] | ((k + 1 < cnt ? c[k + 1] : 0u) << 4));
  }
}

// The weights a quantised launch updates (MASTER): 0 the parameter itself; 1 a float32 master copy
// in list kMaster (the parameter receives its rounding); 2 a bfloat16 parameter plus an int8
// residual in list kMaster, w = p + r ulp(p) / 254: bf16's 8 significant bits and 8 more, so a
// weight costs 3 bytes instead of 2 + 4 (the host reference: optim/lowbit.py).
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

__device__ __forceinline__ float bf16_ulp(__nv_bfloat16 x) {
  const int e = (__bfloat16_as_ushort(x) >> 7) & 0xff;  // float's biased exponent; 0: zero or subnormal
  return ldexpf(1.f, max(e, 1) - 134);
}

template <typename P, int MASTER, int E, int L>
__device__ __forceinline__ void load_weights(const Ptrs<L>& p, int kMaster, long long off, int cnt, bool vec,
                                             float (&w)[E]) {
  if constexpr (MASTER == 1) {
    load_part<float, E>(p.template at<float>(kMaster), off, cnt, vec, w);
  } else {
    load_part<P, E>(p.template at<P>(0), off, cnt, vec, w);
    if constexpr (MASTER == 2) {
      static_assert(same_type<P, __nv_bfloat16>::value, "residual master weights are for bfloat16 parameters");
      const signed char* r = p.template at<signed char>(kMaster);
      const P* q = p.template at<P>(0);
#pragma unroll
      for (int k = 0; k < E; ++k)
        if (k < cnt) w[k] += static_cast<float>(r[off + k]) * (bf16_ulp(q[off + k]) * (1.f / 254.f));
    }
  }
}

template <typename P, int MASTER, int E, int L>
__device__ __forceinline__ void store_weights(const Ptrs<L>& p, int kMaster, long long off, int cnt, bool vec,
                                              const float (&w)[E]) {
  if constexpr (MASTER == 1) store_part<float, E>(p.template at<float>(kMaster), off, cnt, vec, w);
  store_part<P, E>(p.template at<P>(0), off, cnt, vec, w);
  if constexpr (MASTER == 2) {
    signed char* r = p.template at<signed char>(kMaster);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      if (k < cnt) {
        const __nv_bfloat16 b = __float2bfloat16_rn(w[k]);
        const float e = (w[k] - __bfloat162float(b)) / bf16_ulp(b) * 254.f;
        r[off + k] = static_cast<signed char>(isfinite(e) ? fminf(fmaxf(rintf(e), -127.f), 127.f) : 0.f);
      }
    }
  }
}

// The traversal of launches with quantised states: each chunk (a multiple of QB elements, so no
// block straddles two) is cut into its QB-element blocks, one warp per block, E consecutive
// elements per lane. F provides context() as for for_each_chunk and
//   __device__ void apply(const Ptrs<L>& p, long long off, int cnt, bool vec, long long qb, const Ctx& c) const;
// called by every lane of the warp (cnt in [0, E]; qb the block's index within the tensor).
template <int L, int E, typename F>
__device__ __forceinline__ void for_each_qblock(const Table<L>& tab, const F& f, const Shared& sh) {
  constexpr int QB = 32 * E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (long long c = blockIdx.x; c < tab.C; c += gridDim.x) {
    const Chunk k = chunk_at(tab, c);
    Ptrs<L> p;
#pragma unroll
    for (int l = 0; l < L; ++l) p.p[l] = reinterpret_cast<void*>(tab.addr(l, k.tensor));
    const typename F::Ctx ctx = f.context(k.tensor, k.info, sh);
    const bool vec = (k.info & kAlignedBit) != 0;
    const long long blocks = (k.n + QB - 1) / QB;
    for (long long b = warp; b < blocks; b += warps) {
      const long long first = k.start + b * QB, off = first + lane * E;
      const long long rem = k.start + k.n - off;
      const int cnt = rem <= 0 ? 0 : (rem >= E ? E : static_cast<int>(rem));
      f.apply(p, off, cnt, vec, first / QB, ctx);
    }
  }
}

// The quantised-state launch of an optimizer (Lion8bit, SGD8bit, Adam8bit, ...): its float32
// functor Base keeps the maths, this keeps the layout. Lists: 0 param, 1 grad, then per state its
// codes (uint8) and block scales (float32), then the master list (MASTER 1: float32, 2: int8
// residual). Base provides Ctx, context() and
//   __device__ static void qupdate(float& w, float g, float (&s)[NS], const Ctx& c);
// the update of one element with its NS states decoded, in the launch's state order.
template <typename Base, typename P, int BITS, int MASTER, int NS> struct QStateFunctor {
  static constexpr int L = 2 + 2 * NS + (MASTER != 0);
  static constexpr int kMaster = 2 + 2 * NS;
  static constexpr int E = BITS == 8 ? 8 : 4;
  using Ctx = typename Base::Ctx;
  Base base;
  const float* tables;  // NS code tables of kQTable floats, in shared memory

  __device__ Ctx context(long long i, int info, const Shared& sh) const { return base.context(i, info, sh); }

  __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, int cnt, bool vec, long long qb,
                                        const Ctx& c) const {
    float w[E], g[E], s[NS][E];
    load_weights<P, MASTER, E>(p, kMaster, off, cnt, vec, w);
    load_part<P, E>(p.template at<P>(1), off, cnt, vec, g);
#pragma unroll
    for (int j = 0; j < NS; ++j)
      q_load<BITS, E>(p.template at<unsigned char>(2 + 2 * j), off, cnt, vec, p.template at<float>(3 + 2 * j)[qb],
                      QCodec<BITS>{tables + j * kQTable}, s[j]);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      float e[NS];
#pragma unroll
      for (int j = 0; j < NS; ++j) e[j] = s[j][k];
      Base::qupdate(w[k], g[k], e, c);
#pragma unroll
      for (int j = 0; j < NS; ++j) s[j][k] = e[j];
    }
#pragma unroll
    for (int j = 0; j < NS; ++j)
      q_store<BITS, E>(p.template at<unsigned char>(2 + 2 * j), p.template at<float>(3 + 2 * j), off, qb, cnt, vec,
                       QCodec<BITS>{tables + j * kQTable}, s[j]);
    store_weights<P, MASTER, E>(p, kMaster, off, cnt, vec, w);
  }
};

// The body of a quantised-state kernel, called by every thread after CUKIT_MT_PROLOGUE(sh, float):
// the NS code tables staged in shared memory once per block, then every block of every chunk.
template <typename P, int BITS, int MASTER, int NS, typename Base>
__device__ __forceinline__ void run_qstates(const long long* __restrict__ table, long long T, long long C,
                                            long long chunk, const Base& base, const float* __restrict__ qtables,
                                            const Shared& sh) {
  __shared__ float tables[NS * kQTable];
  load_qtables(tables, qtables, NS);
  using F = QStateFunctor<Base, P, BITS, MASTER, NS>;
  const Table<F::L> tab{table, T, C, chunk};
  for_each_qblock<F::L, F::E>(tab, F{base, tables}, sh);
}

// Counts a step: steps[i] += 1 for each of the n tensors, unless *skip != 0 (torch keeps a step
// count per parameter, as a float32 scalar; these are its storage, see TensorTable.steps).
template <int Unused> __global__ void mt_count_step(float* __restrict__ steps, long long n, const float* __restrict__ skip) {
  if (skip != nullptr && *skip != 0.f) return;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    steps[i] += 1.f;
}

}  // namespace mt
}  // namespace cukit
