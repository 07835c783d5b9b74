// matmul_simt.cu: SIMT (CUDA-core) matrix products for float32 and float64.
// C[z, m, n] = act(sum_k A[z, m, k] B[z, k, n] + bias[n]) (EPI_STORE), or alpha (...) (+ beta
// C[z, m, n]) (EPI_SCALE, EPI_ACCUMULATE); the parameters and their meaning are cukit/gemm.cuh's
// CUKIT_GEMM_PARAMS (host side: cukit/ops/_gemm.py's Gemm, launcher: cukit/ops/matmul_simt.py).
// Each operand is addressed by element strides, one of which is 1; C (in T) by its row stride ldc
// and batch stride sc. Every kernel handles any M, N, K (K == 0 gives C = act(bias)) and any batch:
// v1 loops over blockIdx.z (batches) and blockIdx.y (M-tiles) grid-stride; matmul_simt folds the
// (batch, M-tile) pairs into blockIdx.y + gridDim.y * blockIdx.z. Neither grid dimension passes
// 65535. Reads of A and B never leave [0, M) x [0, K) and [0, K) x [0, N).
//
// Versions (numbered as in llm.c's dev/cuda; the one-line "what changed"):
//   matmul_v1    32x32 shared-memory tiles, one output per thread: the readable reference.
//   matmul_simt  register blocking (a TM x TN outer product per thread per k from shared memory,
//                16-byte shared loads), 16-byte global loads where alignment allows, the next
//                K-tile staged in registers while this one is computed (two shared buffers, one
//                barrier per tile), A/B transposed into shared memory as [BK][BM + pad].
//                H200, fp32 4096^3: v1 4.6-6.2 TFLOP/s, matmul_simt 128x256 tiles of 8x16 per
//                thread 44.0 (cuBLAS 51.1, TF32 off); benchmarks/NOTES.md has the history.
#include <cukit/gemm.cuh>
#include <cukit/vec.cuh>

using namespace cukit;

// ---------------------------------------------------------------------------------------------
// v1: the classic tiled kernel. Block (32, 32); thread (tx, ty) computes C[m0 + ty, n0 + tx].
// ---------------------------------------------------------------------------------------------
constexpr int V1_TILE = 32;

template <typename T, int ACT, int EPI = EPI_STORE>
__global__ void __launch_bounds__(V1_TILE * V1_TILE) matmul_v1(CUKIT_GEMM_PARAMS(T, T)) {
  using Acc = acc_t<T>;
  __shared__ Acc As[V1_TILE][V1_TILE + 1];  // As[m][k]; +1: the column reads of a transposed A
  __shared__ Acc Bs[V1_TILE][V1_TILE + 1];  // Bs[k][n]
  if (M <= 0 || N <= 0) return;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long batch = nb0 * nb1 * nb2;
  const long long m_tiles = (M + V1_TILE - 1) / V1_TILE;
  const long long n = static_cast<long long>(blockIdx.x) * V1_TILE + tx;
  for (long long z = blockIdx.z; z < batch; z += gridDim.z) {
    const BatchOffsets off = batch_offset(z, sc, nb1, nb2, sa0, sa1, sa2, sb0, sb1, sb2);
    const T* Az = A + off.a;
    const T* Bz = B + off.b;
    for (long long mt = blockIdx.y; mt < m_tiles; mt += gridDim.y) {
      const long long m = mt * V1_TILE + ty;
      Acc acc = Acc(0);
      for (long long k0 = 0; k0 < K; k0 += V1_TILE) {
        const long long ka = k0 + tx, kb = k0 + ty;
        As[ty][tx] = (m < M && ka < K) ? to_acc<Acc>(Az[m * sa_m + ka * sa_k]) : Acc(0);
        Bs[ty][tx] = (kb < K && n < N) ? to_acc<Acc>(Bz[kb * sb_k + n * sb_n]) : Acc(0);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < V1_TILE; ++kk) acc += As[ty][kk] * Bs[kk][tx];
        __syncthreads();
      }
      if (m < M && n < N) {
        const Acc b = bias ? to_acc<Acc>(bias[n]) : Acc(0);
        T* c = C + off.c + m * ldc + n;
        const Acc old = EPI == EPI_ACCUMULATE ? to_acc<Acc>(*c) : Acc(0);
        *c = from_acc<T>(epilogue_out<EPI, ACT>(acc, b, static_cast<Acc>(alpha), static_cast<Acc>(beta), old));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v2: register-blocked SIMT GEMM.
//
// Block tile BM x BN, K-tiles of BK; (BM/TM) x (BN/TN) threads, each computing TM x TN outputs.
// Shared memory holds both operands k-major, As[k][m] and Bs[k][n] (rows padded by one 16-byte
// vector so the transposing stores of a k-contiguous operand are free of bank conflicts), in two
// buffers: while tile t is computed from one, tile t+1 travels global -> registers, and lands in
// the other after the compute, so one barrier per tile suffices.
//
// A thread's TM rows are TM/G groups of G consecutive rows (G = one 16-byte vector: 4 floats,
// 2 doubles), the groups BM/(TM/G) apart; likewise its columns. A warp is 4 x 8 threads, so each
// 16-byte shared load of a warp touches 4 (A) or 8 (B) distinct vectors: one wavefront, no
// conflicts. Per k a thread issues TM/G + TN/G shared loads for TM * TN FMAs.
// ---------------------------------------------------------------------------------------------

// Loads one BMN x BK tile of an operand X (A with BMN = BM, or B^T with BMN = BN) into registers
// and stores it into shared memory as Xs[k][mn]. KC: X is contiguous along k (s_k == 1: a
// row-major A, a column-major B), so a thread loads a G-vector along k and stores it transposed;
// otherwise X is contiguous along mn and a vector along mn goes straight to a shared row.
// Out-of-range mn (rows of A past M, columns of B past N) only feed outputs that are never stored:
// a k-contiguous operand clamps them to the last valid row (so its loads need no predicate), an
// mn-contiguous one zero-fills the partial vector at the edge. Out-of-range k are zero-filled
// (they feed every output), which only the last, partial K-tile needs.
template <typename T, int BMN, int BK, int LD, bool KC, int THREADS>
struct TileLoader {
  static constexpr int G = 16 / static_cast<int>(sizeof(T));
  static constexpr int NV = BMN * BK / G;  // vectors per tile
  static constexpr int NL = NV / THREADS;  // vectors per thread
  static constexpr int KV = BK / G;        // KC: vectors along k per mn row
  static constexpr int MV = BMN / G;       // !KC: vectors along mn per k row
  static_assert(NV % THREADS == 0, "the tile must split evenly into one or more vectors per thread");
  static_assert(BK % G == 0 && BMN % G == 0, "tile sides must be multiples of the vector width");

  const T* p[NL];  // this thread's vector starts in the next K-tile to load
  long long step;  // !KC: elements between consecutive K-tiles (KC: BK)
  int lim[NL];     // !KC: last valid mn offset from the vector start (< G - 1: a partial vector)
  bool vec;        // 16-byte global loads allowed (alignment holds for this operand and batch)
  Vec<T, G> r[NL];

  // Vector i of thread tid: its k within the tile and its offset into the shared tile.
  static __device__ __forceinline__ int kloc(int tid, int i) {
    const int v = tid + i * THREADS;
    return KC ? (v % KV) * G : v / MV;
  }
  static __device__ __forceinline__ int soff(int tid, int i) {
    const int v = tid + i * THREADS;
    return KC ? (v % KV) * G * LD + v / KV : (v / MV) * LD + (v % MV) * G;
  }

  // X: this batch's operand; mn0: the tile's first mn; MN: extent; s_mn, s_k: strides.
  __device__ __forceinline__ TileLoader(const T* X, long long mn0, long long MN, long long s_mn, long long s_k,
                                        int tid) {
    const bool aligned = (reinterpret_cast<unsigned long long>(X) & 15ull) == 0;
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      const int v = tid + i * THREADS;
      if constexpr (KC) {
        const long long mg = min(mn0 + v / KV, MN - 1);
        p[i] = X + mg * s_mn + kloc(tid, i);
        lim[i] = G - 1;
      } else {
        const int mn = (v % MV) * G;
        p[i] = X + static_cast<long long>(kloc(tid, i)) * s_k + mn0 + mn;
        lim[i] = static_cast<int>(min(MN - 1 - (mn0 + mn), static_cast<long long>(G - 1)));
      }
    }
    if constexpr (KC) {
      vec = aligned && (s_mn % G == 0);
      step = BK;
    } else {
      vec = aligned && (s_k % G == 0);
      step = BK * s_k;
    }
  }

  // Global -> registers for the next K-tile, which starts at k0. FULL: the whole tile lies
  // inside [0, K); otherwise k >= K is zero-filled (and never read).
  template <bool FULL> __device__ __forceinline__ void load(int tid, long long k0, long long K) {
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      if constexpr (KC) {
        if (FULL && vec) {
          r[i] = load_vec<T, G>(p[i]);
        } else {
#pragma unroll
          for (int j = 0; j < G; ++j) r[i].v[j] = (FULL || k0 + kloc(tid, i) + j < K) ? p[i][j] : T(0);
        }
        p[i] += BK;
      } else {
        if (FULL || k0 + kloc(tid, i) < K) {
          if (vec && lim[i] == G - 1) {
            r[i] = load_vec<T, G>(p[i]);
          } else {
#pragma unroll
            for (int j = 0; j < G; ++j) r[i].v[j] = j <= lim[i] ? p[i][j] : T(0);
          }
        } else {
#pragma unroll
          for (int j = 0; j < G; ++j) r[i].v[j] = T(0);
        }
        p[i] += step;
      }
    }
  }

  // Registers -> shared buffer Xs (k-major, row length LD).
  __device__ __forceinline__ void store(T* Xs, int tid) const {
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      if constexpr (KC) {
#pragma unroll
        for (int j = 0; j < G; ++j) Xs[soff(tid, i) + j * LD] = r[i].v[j];
      } else {
        store_vec<T, G>(Xs + soff(tid, i), r[i]);
      }
    }
  }
};

// Tuning knobs for benchmarks (the shipped kernels use the defaults): threads along n in a warp,
// and the blocks per SM asked of the register allocator (0: simt_min_blocks' rule).
#ifndef CUKIT_SIMT_WC
#define CUKIT_SIMT_WC 8
#endif
#ifndef CUKIT_SIMT_MINB
#define CUKIT_SIMT_MINB 0
#endif

// Blocks per SM to ask the register allocator for: two (a 128-register cap at 256 threads) while
// the accumulators plus two sets of fragments fit in about 100 registers, else one.
template <typename T, int TM, int TN> __host__ __device__ constexpr int simt_min_blocks() {
  return CUKIT_SIMT_MINB > 0 ? CUKIT_SIMT_MINB
                             : ((TM * TN + 2 * (TM + TN)) * static_cast<int>(sizeof(T)) / 4 > 100 ? 1 : 2);
}

// A_ROW: A[m, k] has unit stride along k (else along m). B_ROW: B[k, n] has unit stride along n
// (else along k). ACT: -1 (none) or an activations.cuh id. EPI: cukit/gemm.cuh's epilogue kind.
template <typename T, int BM, int BN, int BK, int TM, int TN, bool A_ROW, bool B_ROW, int ACT, int EPI = EPI_STORE>
__global__ void __launch_bounds__((BM / TM) * (BN / TN), simt_min_blocks<T, TM, TN>())
    matmul_simt(CUKIT_GEMM_PARAMS(T, T)) {
  static_assert(sizeof(acc_t<T>) == sizeof(T), "matmul_simt keeps operands in shared memory as acc_t");
  constexpr int G = 16 / static_cast<int>(sizeof(T));
  constexpr int TR = BM / TM, TC = BN / TN, THREADS = TR * TC;
  constexpr int WC = TC >= CUKIT_SIMT_WC ? CUKIT_SIMT_WC : TC, WR = 32 / WC, WARPS_C = TC / WC;
  static_assert(TM % G == 0 && TN % G == 0 && TR % WR == 0 && TC % WC == 0, "bad tile shape");
  constexpr int GM = TM / G, GN = TN / G;          // vector groups per thread
  constexpr int SM_ = BM / GM, SN_ = BN / GN;      // distance between a thread's groups
  constexpr int LDA = BM + G, LDB = BN + G;        // padded shared rows
  __shared__ alignas(16) T As[2][BK * LDA];
  __shared__ alignas(16) T Bs[2][BK * LDB];

  if (M <= 0 || N <= 0) return;
  // blockIdx.y + gridDim.y * blockIdx.z runs over (batch, M-tile) pairs, M-tiles fastest: the
  // host folds them so that neither grid dimension passes 65535.
  const long long m_tiles = (M + BM - 1) / BM;
  const long long yz = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
  if (yz >= nb0 * nb1 * nb2 * m_tiles) return;
  const long long z = yz / m_tiles;
  const long long m0 = (yz - z * m_tiles) * BM;
  const long long n0 = static_cast<long long>(blockIdx.x) * BN;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int tr = (warp / WARPS_C) * WR + lane / WC;
  const int tc = (warp % WARPS_C) * WC + lane % WC;
  // The host guarantees K / BK < 2^31.
  const int k_tiles = static_cast<int>((K + BK - 1) / BK);
  const int k_full = static_cast<int>(K / BK);  // tiles entirely inside [0, K)

  const BatchOffsets off = batch_offset(z, sc, nb1, nb2, sa0, sa1, sa2, sb0, sb1, sb2);
  // A as (mn = m, k): KC when row-major. B as (mn = n, k): KC when column-major.
  TileLoader<T, BM, BK, LDA, A_ROW, THREADS> la(A + off.a, m0, M, sa_m, sa_k, tid);
  TileLoader<T, BN, BK, LDB, !B_ROW, THREADS> lb(B + off.b, n0, N, sb_n, sb_k, tid);

  T acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = T(0);

  if (k_tiles > 0) {
    if (k_full > 0) {
      la.template load<true>(tid, 0, K);
      lb.template load<true>(tid, 0, K);
    } else {
      la.template load<false>(tid, 0, K);
      lb.template load<false>(tid, 0, K);
    }
    la.store(As[0], tid);
    lb.store(Bs[0], tid);
    __syncthreads();
  }
  for (int t = 0; t < k_tiles; ++t) {
    const int buf = t & 1;
    const bool more = t + 1 < k_tiles;
    if (more) {  // the next tile's global loads fly while this tile is computed
      if (t + 1 < k_full) {
        la.template load<true>(tid, 0, K);
        lb.template load<true>(tid, 0, K);
      } else {
        const long long k1 = static_cast<long long>(t + 1) * BK;
        la.template load<false>(tid, k1, K);
        lb.template load<false>(tid, k1, K);
      }
    }
    const T* as = As[buf] + tr * G;
    const T* bs = Bs[buf] + tc * G;
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      Vec<T, G> a[GM], b[GN];
#pragma unroll
      for (int g = 0; g < GM; ++g) a[g] = load_vec<T, G>(as + kk * LDA + g * SM_);
#pragma unroll
      for (int g = 0; g < GN; ++g) b[g] = load_vec<T, G>(bs + kk * LDB + g * SN_);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fma(a[i / G].v[i % G], b[j / G].v[j % G], acc[i][j]);
    }
    if (more) {
      la.store(As[buf ^ 1], tid);
      lb.store(Bs[buf ^ 1], tid);
    }
    __syncthreads();  // orders this tile's reads before the next stores into this buffer
  }

  // Epilogue: act(acc + bias[n]) or the scaled forms (cukit/gemm.cuh's epilogue_out), 16-byte
  // stores where C's rows are aligned; EPI_ACCUMULATE loads a row's C values before storing it.
  T* Cz = C + off.c;
  const bool cvec = ((reinterpret_cast<unsigned long long>(Cz) & 15ull) == 0) && (N % G == 0) && (ldc % G == 0);
  const T al = static_cast<T>(alpha), be = static_cast<T>(beta);
  T bv[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    const long long n = n0 + (j / G) * SN_ + tc * G + j % G;
    bv[j] = (bias != nullptr && n < N) ? bias[n] : T(0);
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const long long m = m0 + (i / G) * SM_ + tr * G + i % G;
    if (m >= M) continue;
    T* crow = Cz + m * ldc;
    Vec<T, G> old[GN];
#pragma unroll
    for (int h = 0; h < GN; ++h) {
      const long long n = n0 + h * SN_ + tc * G;
#pragma unroll
      for (int j = 0; j < G; ++j) old[h].v[j] = T(0);
      if constexpr (EPI == EPI_ACCUMULATE) {
        if (cvec && n + G <= N) {
          old[h] = load_vec<T, G>(crow + n);
        } else {
#pragma unroll
          for (int j = 0; j < G; ++j)
            if (n + j < N) old[h].v[j] = crow[n + j];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < GN; ++h) {
      const long long n = n0 + h * SN_ + tc * G;
      Vec<T, G> o;
#pragma unroll
      for (int j = 0; j < G; ++j) o.v[j] = epilogue_out<EPI, ACT>(acc[i][h * G + j], bv[h * G + j], al, be, old[h].v[j]);
      if (cvec && n + G <= N) {
        store_vec<T, G>(crow + n, o);
      } else {
#pragma unroll
        for (int j = 0; j < G; ++j)
          if (n + j < N) crow[n + j] = o.v[j];
      }
    }
  }
}
