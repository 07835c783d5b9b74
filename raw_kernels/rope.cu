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

// Heads of one token each thread rotates (their x loads all issued before any compute; the tables
// loaded once for them).
#ifndef CUKIT_ROPE_ROW_UNROLL
#define CUKIT_ROPE_ROW_UNROLL 3
#endif
constexpr int ROW_UNROLL = CUKIT_ROPE_ROW_UNROLL;

// TI, TO: the rotated tensors' input and output types; TC: cos and sin. The maths is in float, or
// double when a tensor is double (the wider of TI and TO is at least as wide as TC: the host calls
// the forward with TO = promote(TI, TC) and the transpose with TI = promote(TO, TC)).
// (NVRTC has no <type_traits>.)
template <bool FIRST, typename X, typename Y> struct Pick { using type = X; };
template <typename X, typename Y> struct Pick<false, X, Y> { using type = Y; };
template <typename TI, typename TO>
using rope_acc_t = acc_t<typename Pick<(sizeof(TI) >= sizeof(TO)), TI, TO>::type>;

// A row is one head of one token; a group is ROW_UNROLL consecutive heads of one token (a token's q
// heads before its k heads, adjacent in memory in Hugging Face's layout), groups = tokens * ceil(H /
// ROW_UNROLL). blockDim.x threads span a row's h / VEC column pairs (then its pass-through columns),
// blockDim.y groups make a block's trip, and the grid strides over trips. A thread loads the x vectors
// of its group's rows, then the table vectors once for all of them, computes and stores: every load a
// thread makes is in flight at once, and the tables are read once per group rather than once per head.
// Bytes in flight per thread set the speed here more than resident warps do (benchmarks/NOTES.md:
// three heads per thread beat one head at half the registers, and the first version, which held a
// token's tables in registers as float across all its heads). VEC > 1 needs 16-byte vectors
// everywhere: h and D multiples of VEC, every pointer aligned, every stride a multiple of VEC. Index
// is int when every element offset of every tensor and every group index the loop forms fits (the
// host checks); long long otherwise.
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
  const int pairs = static_cast<int>(half / VEC);  // VEC-wide column pairs per row
  const int pass = static_cast<int>((D - R) / VEC);  // VEC-wide pass-through columns per row
  const Index H = Hq + Hk;
  const Index HG = (H + ROW_UNROLL - 1) / ROW_UNROLL;  // head groups per token
  const Index groups = tokens * HG;

  for (Index g = static_cast<Index>(blockIdx.x) * blockDim.y + threadIdx.y; g < groups;
       g += static_cast<Index>(gridDim.x) * blockDim.y) {
    const Index t = g / HG;
    const Index h0 = (g - t * HG) * ROW_UNROLL;
    const Index b = t / S, s = t - b * S;
    const Index co = b * c_sb + s * c_ss;
    // element offsets of each row in its input and its output; -1: past the token's last head
    Index xi[ROW_UNROLL], yo[ROW_UNROLL];
    bool isq[ROW_UNROLL];
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u) {
      const Index h = h0 + u;
      isq[u] = h < Hq;
      xi[u] = h >= H ? -1 : isq[u] ? b * q_sb + s * q_ss + h * q_sh : b * k_sb + s * k_ss + (h - Hq) * k_sh;
      yo[u] = h >= H ? 0 : isq[u] ? b * qo_sb + s * qo_ss + h * qo_sh : b * ko_sb + s * ko_ss + (h - Hq) * ko_sh;
    }

    for (int c = threadIdx.x; c < pairs; c += blockDim.x) {
      const Index d = static_cast<Index>(c) * VEC;
      Vec<TI, VEC> x_lo[ROW_UNROLL], x_hi[ROW_UNROLL];
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; ++u) {
        if (xi[u] >= 0) {
          const TI* __restrict__ x = (isq[u] ? q : k) + xi[u] + d;
          x_lo[u] = load_vec<TI, VEC>(x);
          x_hi[u] = load_vec<TI, VEC>(x + half);
        }
      }
      const Vec<TC, VEC> cl = load_vec<TC, VEC>(cos_ + co + d), ch = load_vec<TC, VEC>(cos_ + co + half + d);
      const Vec<TC, VEC> sl = load_vec<TC, VEC>(sin_ + co + d), sh = load_vec<TC, VEC>(sin_ + co + half + d);
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; ++u) {
        if (xi[u] >= 0) {
          TO* __restrict__ y = (isq[u] ? q_out : k_out) + yo[u] + d;
          Vec<TO, VEC> y_lo, y_hi;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const A lo = to_acc<A>(x_lo[u].v[j]), hi = to_acc<A>(x_hi[u].v[j]);
            const A s_lo = TRANSPOSE ? -to_acc<A>(sh.v[j]) : to_acc<A>(sl.v[j]);
            const A s_hi = TRANSPOSE ? -to_acc<A>(sl.v[j]) : to_acc<A>(sh.v[j]);
            y_lo.v[j] = from_acc<TO>(lo * to_acc<A>(cl.v[j]) - hi * s_lo);
            y_hi.v[j] = from_acc<TO>(hi * to_acc<A>(ch.v[j]) + lo * s_hi);
          }
          store_vec<TO, VEC>(y, y_lo);
          store_vec<TO, VEC>(y + half, y_hi);
        }
      }
    }

    // partial rotary: columns [R, D) are copied (converted to TO)
    for (int c = threadIdx.x; c < pass; c += blockDim.x) {
      // (R / VEC + c) * VEC, not R + ...: provably a multiple of VEC, so the store stays one vector
      const Index d = (R / VEC + static_cast<Index>(c)) * VEC;
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; ++u) {
        if (xi[u] >= 0) {
          const Vec<TI, VEC> xv = load_vec<TI, VEC>((isq[u] ? q : k) + xi[u] + d);
          Vec<TO, VEC> yv;
#pragma unroll
          for (int j = 0; j < VEC; ++j) yv.v[j] = from_acc<TO>(to_acc<A>(xv.v[j]));
          store_vec<TO, VEC>((isq[u] ? q_out : k_out) + yo[u] + d, yv);
        }
      }
    }
  }
}
