// Weight-only int8 products for decode-sized batches on the CPU, as an XLA FFI custom call.
//
// y[m, n] = scale[e, n] * sum_k x[m, k] * q[e, n, k]   for m < M, n < N, e = index[0] or index[m]
//
// x is float32 [M, K]; q int8 [E, N, K] (E = 1 for a plain layer); scale float32 [E, N]; index int32 [1]
// (one matrix of the stack for every row: an expert, read in place, never copied) or [M] (row m against
// matrix index[m], e.g. the (token, expert) pairs of a decode step, in any order; negative: a row of zeros).
// The rows of x are grouped by their matrix: each weight byte of a matrix in use is read once and widened
// to float32 in registers, and every row of its group uses it while it is there. The rows n are split over
// XLA's intra-op thread pool. AVX-512 or AVX2 (+FMA) intrinsics, whichever the build machine has
// (-march=native); `jaxhybrid_matvec_int8_isa` says which.
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
constexpr int64_t kPrefetch = 2048;

// The vector body for MM rows of x: acc[i] += widen(w[k .. k + kLanes)) * x[i][k .. k + kLanes) for
// k < body; returns the per-row sums of the accumulators in out[i]. MM is a constant so that the compiler
// keeps the accumulators in registers (with a row count known only at run time it kept them on the stack,
// a load and a store around every multiply-add).
template <int MM>
inline void BodyOf(const int8_t* w, const float* const* x, int64_t body, float* out) {
#if defined(__AVX512F__)
  __m512 acc[MM][2];
  for (int i = 0; i < MM; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < body; k += kLanes) {
    const __m128i* p = reinterpret_cast<const __m128i*>(w + k);
    _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetch), _MM_HINT_T0);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    for (int i = 0; i < MM; ++i) {
      const float* xr = x[i] + k;
      acc[i][0] = _mm512_fmadd_ps(a, _mm512_loadu_ps(xr), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(b, _mm512_loadu_ps(xr + 16), acc[i][1]);
    }
  }
  for (int i = 0; i < MM; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MM][2];
  for (int i = 0; i < MM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < body; k += kLanes) {
    const __m128i* p = reinterpret_cast<const __m128i*>(w + k);
    _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetch), _MM_HINT_T0);
    const __m128i bytes = _mm_loadu_si128(p);
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    for (int i = 0; i < MM; ++i) {
      const float* xr = x[i] + k;
      acc[i][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(xr), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xr + 8), acc[i][1]);
    }
  }
  for (int i = 0; i < MM; ++i) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(acc[i][0], acc[i][1]));
    float s = 0.0f;
    for (float v : lanes) s += v;
    out[i] = s;
  }
#else
  for (int i = 0; i < MM; ++i) out[i] = 0.0f;
#endif
}

// BodyOf for mm (1 .. kRows) rows.
inline void Body(const int8_t* w, const float* const* x, int64_t mm, int64_t body, float* out) {
  switch (mm) {
    case 1: return BodyOf<1>(w, x, body, out);
    case 2: return BodyOf<2>(w, x, body, out);
    case 3: return BodyOf<3>(w, x, body, out);
    case 4: return BodyOf<4>(w, x, body, out);
    case 5: return BodyOf<5>(w, x, body, out);
    case 6: return BodyOf<6>(w, x, body, out);
    case 7: return BodyOf<7>(w, x, body, out);
    default: return BodyOf<8>(w, x, body, out);
  }
}

// Rows [n0, n1) of y for the rows `rows` [count] of x against one matrix (q [N, K], scale [N]): each weight
// row is read from memory once, then used by every one of those rows, kRows at a time, while it stays in
// the L1 cache.
void Block(const float* x, const int64_t* rows, int64_t count, const int8_t* q, const float* scale, float* y,
           int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t body = K - K % kLanes;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = q + n * K;
    for (int64_t r = 0; r < count; r += kRows) {
      const int64_t mm = count - r < kRows ? count - r : kRows;
      const float* xs[kRows];
      for (int64_t i = 0; i < mm; ++i) xs[i] = x + rows[r + i] * K;
      float sums[kRows];
      Body(w, xs, mm, body, sums);
      for (int64_t i = 0; i < mm; ++i) {
        float s = sums[i];
        for (int64_t k = body; k < K; ++k) s += static_cast<float>(w[k]) * xs[i][k];
        y[rows[r + i] * N + n] = s * scale[n];
      }
    }
  }
}

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

// Rows [n0, n1) of y for every group.
void Rows(const Groups& g, const float* x, const int8_t* q, const float* scale, float* y, int64_t N, int64_t K,
          int64_t n0, int64_t n1) {
  for (size_t i = 0; i < g.matrix.size(); ++i) {
    const int64_t* rows = g.order.data() + g.start[i];
    const int64_t count = g.start[i + 1] - g.start[i];
    const int64_t e = g.matrix[i];
    if (e < 0) {
      for (int64_t r = 0; r < count; ++r)
        for (int64_t n = n0; n < n1; ++n) y[rows[r] * N + n] = 0.0f;
      continue;
    }
    Block(x, rows, count, q + e * N * K, scale + e * N, y, N, K, n0, n1);
  }
}

ffi::Error MatvecInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> index,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 || x.dimensions().size() != 2 || x.dimensions()[1] != qd[2]) {
    return ffi::Error::InvalidArgument("matvec_int8: x [M, K], q [E, N, K] expected");
  }
  const int64_t E = qd[0], N = qd[1], K = qd[2], M = x.dimensions()[0];
  const bool per_row = index.element_count() != 1;
  if (per_row && index.element_count() != M) {
    return ffi::Error::InvalidArgument("matvec_int8: index holds one matrix, or one per row of x");
  }
  const float* xs = x.typed_data();
  const int8_t* w = q.typed_data();
  const float* s = scale.typed_data();
  const int32_t* idx = index.typed_data();
  float* out = y->typed_data();
  auto groups = std::make_shared<const Groups>(GroupRows(idx, per_row, M, E));
  int64_t parts = N * K >= (int64_t{1} << 16) ? 2 * pool.num_threads() : 1;
  parts = parts < 1 ? 1 : (parts > N ? N : parts);
  const int64_t step = (N + parts - 1) / parts;
  jaxhybrid::ForParts(pool, parts, [=](int64_t p) {
    const int64_t n0 = p * step, n1 = n0 + step < N ? n0 + step : N;
    if (n0 < n1) Rows(*groups, xs, w, s, out, N, K, n0, n1);
  });
  return ffi::Error::Success();
}

}  // namespace

// The vector width the kernel was built with (512, 256; 0: scalar, slower than XLA's own product).
extern "C" int jaxhybrid_matvec_int8_isa() { return kIsa; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_matvec_int8, MatvecInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
