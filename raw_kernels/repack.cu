// repack.cu: copy a batch of rows of 2-byte elements into a contiguous layout whose rows start
// 16-byte aligned (row length padded to a multiple of 8 elements, the padding zeroed):
//
//   dst[z, r, c] = src[z * sb + r * ld + c]   for c < C;   dst[z, r, c] = 0   for C <= c < Cp
//
// dst is (nb, R, Cp) contiguous, Cp = C rounded up to 8; src rows may start at any 2-byte
// address (an odd leading dimension, e.g. K = 4093). Host side: cukit/ops/repack.py. Used by the
// matmul front end to move misaligned 16-bit operands onto the TMA kernels ("pad-and-run").
//
// One thread per 16-byte output chunk (8 elements): rows on blockIdx.y, chunks on blockIdx.x. A chunk whose two covering
// aligned 16-byte source blocks lie inside its row is read with two vector loads and a funnel
// shift; the last chunks of a row (where those blocks could pass the row's, and the allocation's,
// end) load element by element, so nothing past the source is read.
#include <cukit/vec.cuh>

using namespace cukit;

template <typename T>
__global__ void pad_rows(const T* __restrict__ src, uint4* __restrict__ dst, long long nb, long long R,
                         long long C, long long ld, long long sb, long long Cp) {
  static_assert(sizeof(T) == 2, "2-byte elements");
  const long long per_row = Cp / 8;
  // Rows on blockIdx.y (grid-stride), chunks of a row on blockIdx.x: no 64-bit division per chunk.
  for (long long row = blockIdx.y; row < nb * R; row += gridDim.y) {
    const long long z = row / R;
    const T* s_row = src + z * sb + (row - z * R) * ld;
    uint4* d_row = dst + row * per_row;
    for (long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; j < per_row;
         j += static_cast<long long>(gridDim.x) * blockDim.x) {
      const T* s = s_row + j * 8;
      const long long rem = C - j * 8;  // valid elements from this chunk on
      uint4 v;
      if (rem >= 16) {  // [align16(s), align16(s) + 32) ends at or before element j * 8 + 16 <= C
        const unsigned long long a = reinterpret_cast<unsigned long long>(s);
        const uint4* p = reinterpret_cast<const uint4*>(a & ~15ull);
        const unsigned int off = static_cast<unsigned int>(a & 15ull);
        const uint4 lo = __ldg(p);
        v = off == 0 ? lo : funnel16(lo, __ldg(p + 1), off);
      } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(s);
        unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (e < rem) w[e >> 1] |= static_cast<unsigned int>(h[e]) << (16 * (e & 1));
        }
        v = make_uint4(w[0], w[1], w[2], w[3]);
      }
      d_row[j] = v;
    }
  }
}
