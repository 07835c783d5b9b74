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
