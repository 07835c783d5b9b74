// multi_tensor_l2norm.cu: L2 norms over a tensor table (the engine: cukit/multi_tensor.cuh), a
// non-finite flag, and the in-place scaling of clip_grad_norm_. No host sync anywhere:
//   mt_sumsq:           per chunk c: sumsq[c] = sum x^2 (float32), nonfinite[c] = any(!isfinite(x))
//   mt_norm_finalize:   one block: norm = sqrt(sum_c sumsq[c]) / grad_div (in double, chunk order),
//                       coef = min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_),
//                       flag = any nonfinite[c]; each output optional
//   mt_norm_per_tensor: one warp per tensor: norm[t] = sqrt(sum of t's chunks' sumsq) / grad_div
//   mt_scale:           x *= *coef over every tensor
// Several tables (one per dtype) write disjoint ranges of one sumsq array, then one finalize.
// Host side and reference: optim/utils.py.
#include <cukit/multi_tensor.cuh>

using namespace cukit;
using namespace cukit::mt;

// Squares are summed in float32 for every T, float64 included (as torch's fused clipping does for
// its per-tensor norms of 16-bit tensors): a gradient norm needs neither float64's range nor its
// precision.
//
// Its own chunk loop rather than for_each_chunk: a read-only pass has one stream, so one vector per
// thread per trip leaves too few bytes in flight (8 for 16-bit types: the pass ran at ~2.4 TB/s on
// an H200 where the update kernels reach ~4). kUnroll independent vector loads go out before their
// squares are summed.
constexpr int kUnroll = 4;

template <typename T, int N> __device__ __forceinline__ void sumsq_add(const T* base, long long off, float& acc, bool& bad) {
  float x[N];
  load<T, N>(base, off, x);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    acc += x[k] * x[k];
    bad |= !isfinite(x[k]);
  }
}

template <typename T>
__global__ void __launch_bounds__(512) mt_sumsq(const long long* __restrict__ table, long long Tn, long long C,
                                                long long chunk, float* __restrict__ sumsq,
                                                float* __restrict__ nonfinite) {
  __shared__ float scratch[32];
  const Table<1> tab{table, Tn, C, chunk};
  const long long B = blockDim.x;
  for (long long c = blockIdx.x; c < tab.C; c += gridDim.x) {
    const Chunk k = chunk_at(tab, c);
    const long long n = k.n;
    const T* x = reinterpret_cast<const T*>(tab.addr(0, k.tensor)) + k.start;
    float acc = 0.f;
    bool bad = false;
    long long e0 = 0;  // first element left to the scalar loop
    if (k.info & kAlignedBit) {
      const long long nv = n / kVec;
      long long v = threadIdx.x;
      for (; v + (kUnroll - 1) * B < nv; v += kUnroll * B) {
        float part[kUnroll];
        bool pbad[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          part[u] = 0.f;
          pbad[u] = false;
          sumsq_add<T, kVec>(x, (v + u * B) * kVec, part[u], pbad[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          acc += part[u];
          bad |= pbad[u];
        }
      }
      for (; v < nv; v += B) sumsq_add<T, kVec>(x, v * kVec, acc, bad);
      e0 = nv * kVec;
    }
    for (long long e = e0 + threadIdx.x; e < n; e += B) sumsq_add<T, 1>(x, e, acc, bad);
    const float s = block_sum(acc, scratch);
    const float b = block_sum(bad ? 1.f : 0.f, scratch);
    if (threadIdx.x == 0) {
      sumsq[c] = s;
      nonfinite[c] = b > 0.f ? 1.f : 0.f;
    }
  }
}

template <int Unused>
__global__ void __launch_bounds__(1024) mt_norm_finalize(const float* __restrict__ sumsq, const float* __restrict__ nonfinite,
                                                         long long n, const float* __restrict__ grad_div, float max_norm,
                                                         float* __restrict__ norm_out, float* __restrict__ coef_out,
                                                         float* __restrict__ flag_out) {
  __shared__ double ssum[32];
  __shared__ float sbad[32];
  double s = 0.0;
  float bad = 0.f;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) {
    s += sumsq[i];
    bad = fmaxf(bad, nonfinite[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    bad = fmaxf(bad, __shfl_xor_sync(0xffffffffu, bad, o));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    ssum[warp] = s;
    sbad[warp] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    float any = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      total += ssum[w];
      any = fmaxf(any, sbad[w]);
    }
    double norm = sqrt(total);
    if (grad_div != nullptr) norm /= static_cast<double>(*grad_div);
    const float nf = static_cast<float>(norm);
    if (norm_out != nullptr) *norm_out = nf;
    if (coef_out != nullptr) *coef_out = fminf(1.f, max_norm / (nf + 1e-6f));
    if (flag_out != nullptr) *flag_out = any;
  }
}

template <int Unused>
__global__ void mt_norm_per_tensor(const long long* __restrict__ table, long long Tn, long long C,
                                   const float* __restrict__ sumsq, const float* __restrict__ grad_div,
                                   float* __restrict__ norm) {
  const Table<1> tab{table, Tn, C, 0};
  const int lane = threadIdx.x & 31;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
  for (long long i = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); i < Tn; i += warps) {
    double s = 0.0;
    for (long long c = tab.chunk_begin(i) + lane; c < tab.chunk_begin(i + 1); c += 32) s += sumsq[c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
      double r = sqrt(s);
      if (grad_div != nullptr) r /= static_cast<double>(*grad_div);
      norm[i] = static_cast<float>(r);
    }
  }
}

template <typename T> struct ScaleFunctor {
  static constexpr int L = 1;
  const float* coef;
  struct Ctx {
    float c;
  };
  __device__ Ctx context(long long, int, const Shared&) const { return Ctx{*coef}; }
  template <int N> __device__ __forceinline__ void apply(const Ptrs<L>& p, long long off, const Ctx& c) const {
    acc_t<T> x[N];
    load<T, N>(p.template at<T>(0), off, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] *= static_cast<acc_t<T>>(c.c);
    store<T, N>(p.template at<T>(0), off, x);
  }
  __device__ __forceinline__ void end_chunk(long long, long long, const Ctx&) const {}
};

template <typename T>
__global__ void __launch_bounds__(512) mt_scale(const long long* __restrict__ table, long long Tn, long long C,
                                                long long chunk, const float* __restrict__ coef) {
  __shared__ Shared sh;
  const Table<1> tab{table, Tn, C, chunk};
  for_each_chunk<1>(tab, ScaleFunctor<T>{coef}, sh);
}
