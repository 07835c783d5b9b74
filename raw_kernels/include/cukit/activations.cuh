// cukit/activations.cuh: activation functions and their derivatives, shared by every kernel that
// fuses an activation (bias_act, the matmul epilogue). A is float or double.
// Ids match cukit/ops/bias_act.py ACTIVATIONS.
#pragma once

namespace cukit {

enum Activation : int { ACT_RELU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_SILU = 3 };

__device__ __forceinline__ float erfc_(float z) { return erfcf(z); }
__device__ __forceinline__ double erfc_(double z) { return erfc(z); }
__device__ __forceinline__ float exp_(float z) { return expf(z); }
__device__ __forceinline__ double exp_(double z) { return exp(z); }

// The exact forms (float32 with IEEE division, float64) avoid the cancellations of the textbook
// ones: Phi(z) = erfc(-z / sqrt2) / 2 instead of (1 + erf(z / sqrt2)) / 2, which loses all
// relative accuracy in the left tail (1 + erf(-3) is 2e-5 with an absolute error of one float
// ulp of 1); (1 + tanh u) / 2 = sigmoid(2u); and 1 - sigmoid(v) = e sigmoid(v) with e = exp(-v)
// for v >= 0 (1 - s rounds s ~ 1 away), 1 - s for v < 0 (s small: exact enough, and e could
// overflow).
template <typename A> __device__ __forceinline__ void sigmoid2(A v, A& s, A& one_minus_s) {
  const A e = exp_(-v);
  s = A(1) / (A(1) + e);
  one_minus_s = v >= A(0) ? e * s : A(1) - s;
}

template <typename A> struct GeluConst {
  static constexpr A inv_sqrt2 = A(0.70710678118654752440);
  static constexpr A inv_sqrt_2pi = A(0.39894228040143267794);
  static constexpr A sqrt_2_over_pi = A(0.79788456080286535588);
  static constexpr A k = A(0.044715);
};

// FAST (float only, used for 16-bit storage types): branch-free forms on the hardware's
// approximate exp and reciprocal. Their error (< 2e-7 absolute on Phi, ~1e-6 relative on the
// sigmoids) is far below one bfloat16/float16 rounding, and they halve the instruction count,
// which is what limits the 16-bit kernels (they move half the bytes per element of fp32).
template <bool FAST> __device__ __forceinline__ float fexp(float z) { return FAST ? __expf(z) : expf(z); }
template <bool FAST> __device__ __forceinline__ float frcp(float d) { return FAST ? __fdividef(1.0f, d) : 1.0f / d; }

// The standard normal CDF Phi(z) and exp(-z^2/2) (so the pdf comes for free), erf-free:
// erfc(x) ~ t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-x^2), t = 1 / (1 + p x), x = |z|/sqrt(2)
// (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7). For z < 0, Phi = erfc(x)/2 is computed
// directly, so the left tail does not suffer the cancellation of 1 + erf.
__device__ __forceinline__ void normal_cdf_fast(float z, float& cdf, float& e) {
  const float x = fabsf(z) * 0.70710678118654752f;
  const float t = __fdividef(1.0f, fmaf(0.3275911f, x, 1.0f));
  const float poly =
      t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
  e = __expf(-x * x);
  const float half_q = 0.5f * poly * e;
  cdf = z < 0.0f ? half_q : 1.0f - half_q;
}

// act(z)
template <int ACT, bool FAST, typename A> __device__ __forceinline__ A act_fwd(A z) {
  static_assert(!FAST || sizeof(A) == 4, "FAST forms are float-only");
  if constexpr (ACT == ACT_RELU) {
    return z < A(0) ? A(0) : z;  // NaN propagates, as in torch.relu
  } else if constexpr (ACT == ACT_GELU) {
    if constexpr (FAST) {
      float cdf, e;
      normal_cdf_fast(z, cdf, e);
      return z * cdf;
    } else {
      return A(0.5) * z * erfc_(-z * GeluConst<A>::inv_sqrt2);
    }
  } else if constexpr (ACT == ACT_GELU_TANH) {
    const A u = GeluConst<A>::sqrt_2_over_pi * (z + GeluConst<A>::k * z * z * z);
    if constexpr (FAST) {
      return z * frcp<true>(1.0f + fexp<true>(-2.0f * u));  // 0.5 (1 + tanh u) = sigmoid(2u)
    } else {
      return z / (A(1) + exp_(A(-2) * u));
    }
  } else {
    static_assert(ACT == ACT_SILU, "unknown activation");
    if constexpr (FAST) {
      return z * frcp<true>(1.0f + fexp<true>(-z));
    } else {
      return z / (A(1) + exp_(-z));
    }
  }
}

// d act(z) / dz
template <int ACT, bool FAST, typename A> __device__ __forceinline__ A act_grad(A z) {
  static_assert(!FAST || sizeof(A) == 4, "FAST forms are float-only");
  if constexpr (ACT == ACT_RELU) {
    return z <= A(0) ? A(0) : A(1);  // torch's convention: 0 at z = 0; NaN passes the gradient
  } else if constexpr (ACT == ACT_GELU) {
    if constexpr (FAST) {
      float cdf, e;
      normal_cdf_fast(z, cdf, e);
      return cdf + z * GeluConst<float>::inv_sqrt_2pi * e;
    } else {
      const A cdf = A(0.5) * erfc_(-z * GeluConst<A>::inv_sqrt2);
      const A pdf = GeluConst<A>::inv_sqrt_2pi * exp_(A(-0.5) * z * z);
      return cdf + z * pdf;
    }
  } else if constexpr (ACT == ACT_GELU_TANH) {
    const A z2 = z * z;
    const A u = GeluConst<A>::sqrt_2_over_pi * (z + GeluConst<A>::k * z2 * z);
    const A du = GeluConst<A>::sqrt_2_over_pi * (A(1) + A(3) * GeluConst<A>::k * z2);
    if constexpr (FAST) {
      const float s = frcp<true>(1.0f + fexp<true>(-2.0f * u));  // s = (1 + tanh u) / 2, 1 - tanh^2 = 4 s (1 - s)
      return s + 2.0f * z * s * (1.0f - s) * du;
    } else {
      A s, q;  // 1 - tanh^2 u = 4 s q
      sigmoid2(A(2) * u, s, q);
      return s + A(2) * z * s * q * du;
    }
  } else {
    static_assert(ACT == ACT_SILU, "unknown activation");
    if constexpr (FAST) {
      const float s = frcp<true>(1.0f + fexp<true>(-z));
      return s * (1.0f + z * (1.0f - s));
    } else {
      A s, q;
      sigmoid2(z, s, q);
      return s * (A(1) + z * q);
    }
  }
}

}  // namespace cukit
