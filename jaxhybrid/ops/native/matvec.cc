// Weight-only products on the CPU, as XLA FFI custom calls: int8 weights with per-output-channel scales
// (`jaxhybrid_matvec_int8`) and float32 weights (`jaxhybrid_matvec_f32`).
//
// y[m, n] = scale[e, n] * sum_k x[m, k] * q[e, n, k]   for m < M, n < N, e = index[0] or index[m]
//
// x is float32 [M, K]; q int8 [E, N, K] with scale float32 [E, N], or float32 [E, N, K] without a scale (E = 1
// for a plain layer); index int32 [1] (one matrix of the stack for every row: an expert, read in place, never
// copied) or [M] (row m against matrix index[m], e.g. the (token, expert) pairs of a step, in any order;
// negative: a row of zeros). A call takes one or more weights (all [E, *, K]) and gives a result for each,
// e.g. the projections of one input, split over the threads as one product. The rows of x are grouped by
// their matrix. A small group (decode) reads each weight of its matrix once (an int8 code widened to float32
// in registers) for every row of the group while it is there (`Block`); a call of many rows (a prompt, its
// experts' pairs) goes through a blocked matrix product over the weights in place (`Gemm`, AVX-512). The
// rows n are split over XLA's intra-op thread pool. AVX-512 or AVX2 (+FMA) intrinsics, whichever the build
// machine has (-march=native); `jaxhybrid_matvec_isa` says which.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// kRows: rows of x per pass over a weight row, two accumulators each (`Body` has a case for each count):
// 8 fill half of AVX-512's 32 registers; AVX2 has 16, so 4.
#if defined(__AVX512F__)
constexpr int kIsa = 512;
constexpr int64_t kLanes = 32;  // two 16-float registers per step
constexpr int64_t kRows = 8;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kIsa = 256;
constexpr int64_t kLanes = 16;  // two 8-float registers per step
constexpr int64_t kRows = 4;
#else
constexpr int kIsa = 0;
constexpr int64_t kLanes = 1;
constexpr int64_t kRows = 4;
#endif

// Bytes ahead of the weight being read that the body asks the cache to fetch: with the hardware
// prefetchers alone a core streams weights from memory well below the rate it multiplies them at
// (BENCHMARKS.md, "int8 weights from memory").
#ifndef JAXHYBRID_PREFETCH_F32
#define JAXHYBRID_PREFETCH_F32 4096
#endif
template <typename W>
constexpr int64_t kPrefetch = sizeof(W) == 1 ? 2048 : JAXHYBRID_PREFETCH_F32;

// Weights kLanes at a time as two float32 registers: int8 codes widened, float32 as they are.
#if defined(__AVX512F__)
using Vec = __m512;
inline void Load(const int8_t* w, Vec& a, Vec& b) {
  const __m128i* p = reinterpret_cast<const __m128i*>(w);
  a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
  b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
}
inline void Load(const float* w, Vec& a, Vec& b) {
  a = _mm512_loadu_ps(w);
  b = _mm512_loadu_ps(w + 16);
}
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec LoadX(const float* x) { return _mm512_loadu_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec a, Vec b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
inline void Load(const int8_t* w, Vec& a, Vec& b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}
inline void Load(const float* w, Vec& a, Vec& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec LoadX(const float* x) { return _mm256_loadu_ps(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec a, Vec b) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a, b));
  float s = 0.0f;
  for (float v : lanes) s += v;
  return s;
}
#endif

// The vector body for MM rows of x: acc[i] += w[k .. k + kLanes) * x[i][k .. k + kLanes) for k < body;
// returns the per-row sums of the accumulators in out[i]. MM is a constant so that the compiler keeps the
// accumulators in registers (with a row count known only at run time it kept them on the stack, a load and
// a store around every multiply-add).
template <int MM, typename W>
inline void BodyOf(const W* w, const float* const* x, int64_t body, float* out) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr int64_t kHalf = kLanes / 2;
  Vec acc[MM][2];
  for (int i = 0; i < MM; ++i) acc[i][0] = acc[i][1] = Zero();
  for (int64_t k = 0; k < body; k += kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetch<W>, _MM_HINT_T0);
    Vec a, b;
    Load(w + k, a, b);
    for (int i = 0; i < MM; ++i) {
      const float* xr = x[i] + k;
      acc[i][0] = Fma(a, LoadX(xr), acc[i][0]);
      acc[i][1] = Fma(b, LoadX(xr + kHalf), acc[i][1]);
    }
  }
  for (int i = 0; i < MM; ++i) out[i] = Sum(acc[i][0], acc[i][1]);
#else
  for (int i = 0; i < MM; ++i) out[i] = 0.0f;
#endif
}

// BodyOf for mm (1 .. kRows) rows.
template <typename W>
inline void Body(const W* w, const float* const* x, int64_t mm, int64_t body, float* out) {
  switch (mm) {
    case 1: return BodyOf<1>(w, x, body, out);
    case 2: return BodyOf<2>(w, x, body, out);
    case 3: return BodyOf<3>(w, x, body, out);
    case 4: return BodyOf<4>(w, x, body, out);
#if defined(__AVX512F__)
    case 5: return BodyOf<5>(w, x, body, out);
    case 6: return BodyOf<6>(w, x, body, out);
    case 7: return BodyOf<7>(w, x, body, out);
    default: return BodyOf<8>(w, x, body, out);
#else
    default: return BodyOf<4>(w, x, body, out);
#endif
  }
}

// Rows [n0, n1) of y for the rows `rows` [count] of x against one matrix (q [N, K], scale [N] or none): each
// weight row is read from memory once, then used by every one of those rows, kRows at a time, while it stays
// in the L1 cache.
template <typename W>
void Block(const float* x, const int64_t* rows, int64_t count, const W* q, const float* scale, float* y,
           int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t body = K - K % kLanes;
  for (int64_t n = n0; n < n1; ++n) {
    const W* w = q + n * K;
    for (int64_t r = 0; r < count; r += kRows) {
      const int64_t mm = count - r < kRows ? count - r : kRows;
      const float* xs[kRows];
      for (int64_t i = 0; i < mm; ++i) xs[i] = x + rows[r + i] * K;
      float sums[kRows];
      Body(w, xs, mm, body, sums);
      for (int64_t i = 0; i < mm; ++i) {
        float s = sums[i];
        for (int64_t k = body; k < K; ++k) s += static_cast<float>(w[k]) * xs[i][k];
        y[rows[r + i] * N + n] = scale == nullptr ? s : s * scale[n];
      }
    }
  }
}

// Rows packed for `Gemm`: transposed, kTileM at a time.
constexpr int64_t kTileM = 32;

int64_t Padded(int64_t count) { return (count + kTileM - 1) / kTileM * kTileM; }

// Columns [k0, k1) of the packed rows `rows` [count] of x [M, K] (zeros past count, up to Padded(count)).
void PackRows(const float* x, const int64_t* rows, int64_t count, int64_t K, int64_t k0, int64_t k1, float* xt) {
  for (int64_t m = 0; m < Padded(count); ++m) {
    float* dst = xt + (m / kTileM) * K * kTileM + m % kTileM;
    if (m < count) {
      const float* src = x + rows[m] * K;
      for (int64_t k = k0; k < k1; ++k) dst[k * kTileM] = src[k];
    } else {
      for (int64_t k = k0; k < k1; ++k) dst[k * kTileM] = 0.0f;
    }
  }
}

#if defined(__AVX512F__)
// Many rows against one matrix (a prompt's rows, an expert's share of them): a blocked product that reads
// the weights where they lie (an expert in its stack). The rows are packed once per call, transposed,
// kTileM at a time (xt[(b * K + k) * kTileM + l] = row b * kTileM + l at column k); a tile of kTileN
// outputs x kTileM rows is held in registers while a panel of kTileN weight rows, widened to float32 one
// block of kBlockK columns at a time (int8 codes widened, float32 copied), is broadcast against them. Each
// weight is read once per chunk of kChunkM rows; outputs go kChunkN at a time, so a thread's buffers stay
// small; nothing of a whole matrix is written out (XLA's products copy an expert out of its stack, and an
// int8 matrix in float32).
constexpr int64_t kTileN = 12, kTileV = kTileM / 16, kBlockK = 256, kChunkM = 256, kChunkN = 24 * kTileN;
// The blocked product takes every group of a call of at least kGemmRows rows, and (rows per matrix) at least
// kGemmPerMatrix rows per matrix of the stack on average; smaller calls go through `Block`. The choice is
// the call's shape's, never the routing's: a row's sums (and their rounding) do not depend on which other
// rows share its matrix, so a later token's routing never moves an earlier token's result.
constexpr int64_t kGemmRows = 24, kGemmPerMatrix = 8;

// One tile over kl columns: acc (saved [kTileN][kTileM], or zeros when `first`) += wp [kTileN][kBlockK]
// times the packed rows xt [kl][kTileM]; V vectors of rows (1 for a last block of up to 16 rows).
template <int V>
inline void Tile(const float* wp, const float* xt, int64_t kl, float* saved, bool first) {
  __m512 acc[kTileN][V];
  for (int r = 0; r < kTileN; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(saved + r * kTileM + 16 * v);
  for (int64_t kk = 0; kk < kl; ++kk) {
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + kk * kTileM + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < kTileN; ++r) {
      const __m512 w = _mm512_set1_ps(wp[r * kBlockK + kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kTileN; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(saved + r * kTileM + 16 * v, acc[r][v]);
}

// Weights [k0, k0 + kl) of rows [n0, n1) of q [N, K] as float32 (int8 codes widened, float32 copied), row
// n0 + i at wp[i * kBlockK], `rows` rows (past n1: zeros); the segment 4 rows on is asked for ahead of its
// turn.
template <typename W>
void Widen(const W* q, int64_t K, int64_t n0, int64_t n1, int64_t k0, int64_t kl, int64_t rows, float* wp) {
  for (int64_t i = 0; i < rows; ++i) {
    float* dst = wp + i * kBlockK;
    if (n0 + i >= n1) {
      std::fill(dst, dst + kl, 0.0f);
      continue;
    }
    const W* src = q + (n0 + i) * K + k0;
    const W* ahead = n0 + i + 4 < n1 ? src + 4 * K
                     : k0 + kBlockK < K ? src + (4 - (n1 - n0)) * K + kBlockK
                                        : nullptr;
    if (ahead != nullptr)
      for (int64_t c = 0; c < kBlockK * int64_t{sizeof(W)}; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead) + c, _MM_HINT_T0);
    int64_t k = 0;
    for (; k + 16 <= kl; k += 16) {
      if constexpr (sizeof(W) == 1) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
        _mm512_storeu_ps(dst + k, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
      } else {
        _mm512_storeu_ps(dst + k, _mm512_loadu_ps(src + k));
      }
    }
    for (; k < kl; ++k) dst[k] = static_cast<float>(src[k]);
  }
}

// `Gemm` for outputs [n0, n1), at most kChunkN of them. Per chunk of rows and block of columns: the block's
// codes widened, then every tile; a tile's sums wait in `saved` between blocks. The buffers are the
// thread's, kept for its next call.
template <typename W>
void GemmRange(const float* xt, const int64_t* rows, int64_t count, const W* q, const float* scale, float* y,
               int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t blocks_max = kChunkM / kTileM, panels_max = kChunkN / kTileN;
  thread_local std::vector<float> saved_all(panels_max * blocks_max * kTileN * kTileM), wp_all(kChunkN * kBlockK);
  const int64_t panels = (n1 - n0 + kTileN - 1) / kTileN;
  for (int64_t m0 = 0; m0 < count; m0 += kChunkM) {
    const int64_t blocks = (std::min(kChunkM, count - m0) + kTileM - 1) / kTileM;
    for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
      const int64_t kl = std::min(kBlockK, K - k0);
      Widen(q, K, n0, n1, k0, kl, panels * kTileN, wp_all.data());
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t row0 = m0 + b * kTileM;
        const float* xb = xt + (row0 / kTileM * K + k0) * kTileM;
        for (int64_t p = 0; p < panels; ++p) {
          float* saved = saved_all.data() + (p * blocks_max + b) * kTileN * kTileM;
          const float* wp = wp_all.data() + p * kTileN * kBlockK;
          if (count - row0 <= 16) {
            Tile<1>(wp, xb, kl, saved, k0 == 0);
          } else {
            Tile<kTileV>(wp, xb, kl, saved, k0 == 0);
          }
          if (k0 + kl < K) continue;
          const int64_t first = n0 + p * kTileN, width = std::min(kTileN, n1 - first);
          for (int64_t l = 0; l < kTileM && row0 + l < count; ++l) {
            float* out = y + rows[row0 + l] * N + first;
            for (int64_t r = 0; r < width; ++r)
              out[r] = scale == nullptr ? saved[r * kTileM + l] : saved[r * kTileM + l] * scale[first + r];
          }
        }
      }
    }
  }
}

// Rows [n0, n1) of y for the `count` rows `rows` of one group, packed in xt, against q [N, K] with scale
// [N], kChunkN outputs at a time (so the thread's buffers stay a few hundred KB for any width).
template <typename W>
void Gemm(const float* xt, const int64_t* rows, int64_t count, const W* q, const float* scale, float* y,
          int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t c = n0; c < n1; c += kChunkN) GemmRange(xt, rows, count, q, scale, y, N, K, c, std::min(n1, c + kChunkN));
}
#else
constexpr int64_t kGemmRows = 0, kGemmPerMatrix = 0;  // no blocked product: every group goes through `Block`
#endif

// The rows of x grouped by the matrix they go through: `order` lists the rows, group g holding
// order[start[g] .. start[g + 1]) against matrix `matrix[g]` (-1: a row of zeros, nothing read).
struct Groups {
  std::vector<int64_t> order, start, matrix;
};

// One group of every row against index[0], or (per_row) one group per distinct index[m] in range, each
// matrix then read once for all its rows however they are ordered; the rest in a group of zeros.
Groups GroupRows(const int32_t* index, bool per_row, int64_t M, int64_t E) {
  Groups g;
  g.order.resize(M);
  for (int64_t m = 0; m < M; ++m) g.order[m] = m;
  auto key = [&](int64_t m) -> int64_t {
    const int64_t e = index[per_row ? m : 0];
    return e < 0 || e >= E ? -1 : e;
  };
  std::stable_sort(g.order.begin(), g.order.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  for (int64_t i = 0; i < M; ++i) {
    if (i == 0 || key(g.order[i]) != key(g.order[i - 1])) {
      g.start.push_back(i);
      g.matrix.push_back(key(g.order[i]));
    }
  }
  g.start.push_back(M);
  return g;
}

// A share of one group's rows: `count` rows `rows` against matrix e (-1: zeros); `packed`: those rows
// packed for `Gemm` (at `at` in the call's store, -1: through `Block`).
struct Job {
  const int64_t* rows;
  int64_t count, e, at;
};

// Rows [n0, n1) of y for every job.
template <typename W>
void Rows(const std::vector<Job>& jobs, const float* store, const float* x, const W* q, const float* scale,
          float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (const Job& j : jobs) {
    if (j.e < 0) {
      for (int64_t r = 0; r < j.count; ++r)
        for (int64_t n = n0; n < n1; ++n) y[j.rows[r] * N + n] = 0.0f;
      continue;
    }
    const W* w = q + j.e * N * K;
    const float* s = scale == nullptr ? nullptr : scale + j.e * N;
#if defined(__AVX512F__)
    if (j.at >= 0) {
      Gemm(store + j.at, j.rows, j.count, w, s, y, N, K, n0, n1);
      continue;
    }
#endif
    Block(x, j.rows, j.count, w, s, y, N, K, n0, n1);
  }
}

// The call's work as batches of jobs: with `gemm`, each group goes through `Gemm` in jobs of up to kJobRows
// rows, whose packed rows a batch holds at most kPackFloats of (so the store stays small however long the
// prompt); else (and for the zeros) each group is one job of `Block`'s.
constexpr int64_t kJobRows = 512, kPackFloats = int64_t{8} << 20;

std::vector<std::vector<Job>> Batches(const Groups& g, int64_t K, bool gemm) {
  std::vector<std::vector<Job>> batches(1);
  int64_t size = 0;
  for (size_t i = 0; i < g.matrix.size(); ++i) {
    const int64_t* rows = g.order.data() + g.start[i];
    const int64_t count = g.start[i + 1] - g.start[i], e = g.matrix[i];
    if (!gemm || e < 0) {
      batches.back().push_back({rows, count, e, -1});
      continue;
    }
    for (int64_t r = 0; r < count; r += kJobRows) {
      const int64_t n = std::min(kJobRows, count - r);
      if (size > 0 && size + Padded(n) * K > kPackFloats) {
        batches.emplace_back();
        size = 0;
      }
      batches.back().push_back({rows + r, n, e, size});
      size += Padded(n) * K;
    }
  }
  return batches;
}

// The packed rows of a batch's `Gemm` jobs, in the calling thread's store (kept for its next call), split
// over the pool by columns.
void Pack(ffi::ThreadPool& pool, const std::vector<Job>& jobs, const float* x, int64_t K, std::vector<float>& store) {
  int64_t size = 0;
  for (const Job& j : jobs)
    if (j.at >= 0) size = std::max(size, j.at + Padded(j.count) * K);
  if (size == 0) return;
  store.resize(std::max<size_t>(store.size(), size));
  const int64_t chunks = std::min<int64_t>(2 * pool.num_threads(), (K + 63) / 64);
  const int64_t width = (K + chunks - 1) / chunks;
  float* base = store.data();
  jaxhybrid::ForParts(pool, chunks, [&jobs, x, K, width, base](int64_t c) {
    const int64_t k0 = c * width, k1 = std::min(K, k0 + width);
    for (const Job& j : jobs)
      if (j.at >= 0) PackRows(x, j.rows, j.count, K, k0, k1, base + j.at);
  });
}

// One matrix stack of a call: weights [E, N, K], their scales [E, N] (int8) or none, the result [M, N].
template <typename W>
struct Matrix {
  const W* w;
  const float* scale;
  int64_t N;
  float* y;
};

// Every matrix of `mats` against x [M, K] (rows grouped by `index`): their rows n, taken as one list, are
// split over the pool, so a call of several small matrices (the projections of one input) is split as one.
template <typename W>
void Matvec(ffi::ThreadPool& pool, const float* x, const int32_t* index, int64_t index_count, int64_t M,
            int64_t E, int64_t K, std::vector<Matrix<W>> mats) {
  auto groups = std::make_shared<const Groups>(GroupRows(index, index_count != 1, M, E));
  auto all = std::make_shared<const std::vector<Matrix<W>>>(std::move(mats));
  int64_t N = 0;
  for (const auto& m : *all) N += m.N;
  int64_t parts = N * K >= (int64_t{1} << 16) ? 2 * pool.num_threads() : 1;
  parts = parts < 1 ? 1 : (parts > N ? N : parts);
  const int64_t step = (N + parts - 1) / parts;
  thread_local std::vector<float> store;
  const int64_t matrices = index_count == 1 ? 1 : E;
  const bool gemm = kGemmRows > 0 && M >= kGemmRows && M >= kGemmPerMatrix * matrices;
  for (const auto& batch : Batches(*groups, K, gemm)) {
    Pack(pool, batch, x, K, store);
    const float* packed = store.data();
    jaxhybrid::ForParts(pool, parts, [=, &batch](int64_t p) {
      const int64_t a = p * step, b = a + step < N ? a + step : N;
      int64_t offset = 0;
      for (const auto& m : *all) {
        const int64_t n0 = std::max<int64_t>(a - offset, 0), n1 = std::min<int64_t>(b - offset, m.N);
        if (n0 < n1) Rows(batch, packed, x, m.w, m.scale, m.y, m.N, K, n0, n1);
        offset += m.N;
      }
    });
  }
}

// The checks both handlers make: x [M, K], index [1] or [M], results [M, N] for weights [E, N, K].
ffi::Error CheckShapes(const ffi::AnyBuffer::Dimensions& xd, int64_t index_count,
                       const ffi::AnyBuffer::Dimensions& wd, int64_t E, const ffi::AnyBuffer::Dimensions& yd) {
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1] || wd[0] != E) {
    return ffi::Error::InvalidArgument("matvec: x [M, K] and weights [E, N, K] of one E expected");
  }
  if (index_count != 1 && index_count != xd[0]) {
    return ffi::Error::InvalidArgument("matvec: index holds one matrix, or one per row of x");
  }
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("matvec: a result [M, N] for each weight expected");
  }
  return ffi::Error::Success();
}

// x, index, then (codes, scales) for each int8 weight; a result for each.
ffi::Error MatvecInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> index,
                      ffi::RemainingArgs weights, ffi::RemainingRets results) {
  if (weights.size() == 0 || weights.size() != 2 * results.size()) {
    return ffi::Error::InvalidArgument("matvec_int8: codes and scales for each result expected");
  }
  std::vector<Matrix<int8_t>> mats;
  int64_t E = -1;
  for (size_t i = 0; i < results.size(); ++i) {
    auto q = weights.get<ffi::Buffer<ffi::S8>>(2 * i);
    auto scale = weights.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto y = results.get<ffi::Buffer<ffi::F32>>(i);
    if (!q.has_value() || !scale.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("matvec_int8: int8 codes, float32 scales, float32 results expected");
    }
    if (E < 0) E = q->dimensions()[0];
    auto error = CheckShapes(x.dimensions(), index.element_count(), q->dimensions(), E, (*y)->dimensions());
    if (error.failure()) return error;
    mats.push_back({q->typed_data(), scale->typed_data(), q->dimensions()[1], (*y)->typed_data()});
  }
  Matvec(pool, x.typed_data(), index.typed_data(), index.element_count(), x.dimensions()[0], E,
         x.dimensions()[1], std::move(mats));
  return ffi::Error::Success();
}

// x, index, then each float32 weight; a result for each.
ffi::Error MatvecF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> index,
                     ffi::RemainingArgs weights, ffi::RemainingRets results) {
  if (weights.size() == 0 || weights.size() != results.size()) {
    return ffi::Error::InvalidArgument("matvec_f32: one weight for each result expected");
  }
  std::vector<Matrix<float>> mats;
  int64_t E = -1;
  for (size_t i = 0; i < results.size(); ++i) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    auto y = results.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("matvec_f32: float32 weights and results expected");
    }
    if (E < 0) E = w->dimensions()[0];
    auto error = CheckShapes(x.dimensions(), index.element_count(), w->dimensions(), E, (*y)->dimensions());
    if (error.failure()) return error;
    mats.push_back({w->typed_data(), nullptr, w->dimensions()[1], (*y)->typed_data()});
  }
  Matvec(pool, x.typed_data(), index.typed_data(), index.element_count(), x.dimensions()[0], E,
         x.dimensions()[1], std::move(mats));
  return ffi::Error::Success();
}

}  // namespace

// The vector width the kernels were built with (512, 256; 0: scalar, slower than XLA's own products).
extern "C" int jaxhybrid_matvec_isa() { return kIsa; }

// From how many rows in a call the blocked product runs (0: never, every call is `Block`'s); a call with a
// matrix per row also needs kGemmPerMatrix rows per matrix of its stack on average.
extern "C" int jaxhybrid_matvec_gemm_rows() { return static_cast<int>(kGemmRows); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_matvec_int8, MatvecInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_matvec_f32, MatvecF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
