// rope.cu: rotary position embedding in the "rotate_half" convention of Hugging Face's
// apply_rotary_pos_emb (y = x * cos + rotate_half(x) * sin), applied to q and k in one launch, and its
// transpose (the backward). With h = R / 2 (R = cos's last dim <= D, the head dim) and d < h:
//   forward    y[d] = x[d] c[d] - x[d+h] s[d],     y[d+h] = x[d+h] c[d+h] + x[d] s[d+h]
//   transpose  y[d] = x[d] c[d] + x[d+h] s[d+h],   y[d+h] = x[d+h] c[d+h] - x[d] s[d]
// and dims [R, D) pass through (partial rotary, as Phi-3 and GPT-NeoX). The transpose is the forward
// with (s[d], s[d+h]) replaced by (-s[d+h], -s[d]); when both halves of sin are equal (Hugging Face's
// tables: cat(freqs, freqs)) that is the forward with sin negated.
// Host side and references: cukit/ops/rope.py.
//
// Layout: every tensor is addressed through strides (in elements) over logical (batch b, position s,
// head, dim d): q and k in and out keep whatever layout they have (Hugging Face's q and k are
// transposed views of the projections' output); only d must have stride 1, which the host ensures.
// cos and sin have strides (c_sb, c_ss) over (b, s), 0 where they broadcast, and share them.
#include <cukit/dtypes.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// Heads each thread loads before it computes any (bytes in flight per thread: 2 * HEAD_UNROLL vectors).
#ifndef CUKIT_ROPE_HEAD_UNROLL
#define CUKIT_ROPE_HEAD_UNROLL 2
#endif
constexpr int HEAD_UNROLL = CUKIT_ROPE_HEAD_UNROLL;

// TI, TO: the rotated tensors' input and output types; TC: cos and sin. The maths is in float, or
// double when a tensor is double (the wider of TI and TO is at least as wide as TC: the host calls
// the forward with TO = promote(TI, TC) and the transpose with TI = promote(TO, TC)).
// (NVRTC has no <type_traits>.)
template <bool FIRST, typename X, typename Y> struct Pick { using type = X; };
template <typename X, typename Y> struct Pick<false, X, Y> { using type = Y; };
template <typename TI, typename TO>
using rope_acc_t = acc_t<typename Pick<(sizeof(TI) >= sizeof(TO)), TI, TO>::type>;

// One block per (b, s) token (a grid-stride loop over tokens), covering every q and k head of it.
// blockDim.x threads span the h / VEC rotary column pairs of a head, blockDim.y threads the heads, so
// each thread loads its VEC columns of cos and sin (both halves) once per token and applies them to
// each head it visits (HEAD_UNROLL heads per trip, loads first). VEC > 1 needs 16-byte vectors
// everywhere: h and D multiples of VEC, every pointer aligned, every stride a multiple of VEC.
// Index is int when every element offset of every tensor fits (the host checks): 32-bit address
// arithmetic per head, and the bfloat16 instantiation down from 124 to 106 registers (ptxas,
// sm_90); long long otherwise.
template <typename TI, typename TC, typename TO, int VEC, bool TRANSPOSE, typename Index>
__global__ void rope(const TI* __restrict__ q, const TI* __restrict__ k, const TC* __restrict__ cos_,
                     const TC* __restrict__ sin_, TO* __restrict__ q_out, TO* __restrict__ k_out, long long tokens_,
                     long long S_, long long Hq_, long long Hk_, long long R_, long long D_, long long q_sb_,
                     long long q_ss_, long long q_sh_, long long qo_sb_, long long qo_ss_, long long qo_sh_,
                     long long k_sb_, long long k_ss_, long long k_sh_, long long ko_sb_, long long ko_ss_,
                     long long ko_sh_, long long c_sb_, long long c_ss_) {
  using A = rope_acc_t<TI, TO>;
  // sizes and strides (batch, position, head) in Index arithmetic from here on
  const Index tokens = static_cast<Index>(tokens_), S = static_cast<Index>(S_), Hq = static_cast<Index>(Hq_);
  const Index Hk = static_cast<Index>(Hk_), R = static_cast<Index>(R_), D = static_cast<Index>(D_);
  const Index q_sb = static_cast<Index>(q_sb_), q_ss = static_cast<Index>(q_ss_), q_sh = static_cast<Index>(q_sh_);
  const Index qo_sb = static_cast<Index>(qo_sb_), qo_ss = static_cast<Index>(qo_ss_);
  const Index qo_sh = static_cast<Index>(qo_sh_), k_sb = static_cast<Index>(k_sb_), k_ss = static_cast<Index>(k_ss_);
  const Index k_sh = static_cast<Index>(k_sh_), ko_sb = static_cast<Index>(ko_sb_), ko_ss = static_cast<Index>(ko_ss_);
  const Index ko_sh = static_cast<Index>(ko_sh_), c_sb = static_cast<Index>(c_sb_), c_ss = static_cast<Index>(c_ss_);
  const Index half = R / 2;
  const int pairs = static_cast<int>(half / VEC);  // VEC-wide column pairs per head
  const Index H = Hq + Hk;
  const Index pass = (D - R) / VEC;  // VEC-wide pass-through columns per head
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthreads = blockDim.x * blockDim.y;

  for (Index t = blockIdx.x; t < tokens; t += static_cast<Index>(gridDim.x)) {
    const Index b = t / S;
    const Index s = t - b * S;
    const Index qi = b * q_sb + s * q_ss, qo = b * qo_sb + s * qo_ss;
    const Index ki = b * k_sb + s * k_ss, ko = b * ko_sb + s * ko_ss;
    const TC* __restrict__ cp = cos_ + b * c_sb + s * c_ss;
    const TC* __restrict__ sp = sin_ + b * c_sb + s * c_ss;

    for (int c = threadIdx.x; c < pairs; c += blockDim.x) {
      const Index d = static_cast<Index>(c) * VEC;
      A c_lo[VEC], c_hi[VEC], s_lo[VEC], s_hi[VEC];
      {
        const Vec<TC, VEC> cl = load_vec<TC, VEC>(cp + d), ch = load_vec<TC, VEC>(cp + half + d);
        const Vec<TC, VEC> sl = load_vec<TC, VEC>(sp + d), sh = load_vec<TC, VEC>(sp + half + d);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          c_lo[j] = to_acc<A>(cl.v[j]);
          c_hi[j] = to_acc<A>(ch.v[j]);
          s_lo[j] = TRANSPOSE ? -to_acc<A>(sh.v[j]) : to_acc<A>(sl.v[j]);
          s_hi[j] = TRANSPOSE ? -to_acc<A>(sl.v[j]) : to_acc<A>(sh.v[j]);
        }
      }
      for (Index h0 = threadIdx.y; h0 < H; h0 += static_cast<Index>(blockDim.y) * HEAD_UNROLL) {
        Vec<TI, VEC> x_lo[HEAD_UNROLL], x_hi[HEAD_UNROLL];
#pragma unroll
        for (int r = 0; r < HEAD_UNROLL; ++r) {
          const Index h = h0 + static_cast<Index>(r) * blockDim.y;
          if (h < H) {
            const TI* __restrict__ x = h < Hq ? q + qi + h * q_sh : k + ki + (h - Hq) * k_sh;
            x_lo[r] = load_vec<TI, VEC>(x + d);
            x_hi[r] = load_vec<TI, VEC>(x + half + d);
          }
        }
#pragma unroll
        for (int r = 0; r < HEAD_UNROLL; ++r) {
          const Index h = h0 + static_cast<Index>(r) * blockDim.y;
          if (h < H) {
            TO* __restrict__ y = h < Hq ? q_out + qo + h * qo_sh : k_out + ko + (h - Hq) * ko_sh;
            Vec<TO, VEC> y_lo, y_hi;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              const A lo = to_acc<A>(x_lo[r].v[j]), hi = to_acc<A>(x_hi[r].v[j]);
              y_lo.v[j] = from_acc<TO>(lo * c_lo[j] - hi * s_lo[j]);
              y_hi.v[j] = from_acc<TO>(hi * c_hi[j] + lo * s_hi[j]);
            }
            store_vec<TO, VEC>(y + d, y_lo);
            store_vec<TO, VEC>(y + half + d, y_hi);
          }
        }
      }
    }

    // partial rotary: columns [R, D) are copied (converted to TO), spread over the whole block
    for (Index u = tid; u < H * pass; u += nthreads) {
      const Index h = u / pass;
      // (R / VEC + ...) * VEC, not R + ...: provably a multiple of VEC, so the store stays one vector
      const Index d = (R / VEC + u - h * pass) * VEC;
      const TI* __restrict__ x = h < Hq ? q + qi + h * q_sh : k + ki + (h - Hq) * k_sh;
      TO* __restrict__ y = h < Hq ? q_out + qo + h * qo_sh : k_out + ko + (h - Hq) * ko_sh;
      const Vec<TI, VEC> xv = load_vec<TI, VEC>(x + d);
      Vec<TO, VEC> yv;
#pragma unroll
      for (int j = 0; j < VEC; ++j) yv.v[j] = from_acc<TO>(to_acc<A>(xv.v[j]));
      store_vec<TO, VEC>(y + d, yv);
    }
  }
}
