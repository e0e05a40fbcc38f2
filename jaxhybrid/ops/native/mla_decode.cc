// MLA attention of a few new tokens per row (a decode or verify step) over a paged latent pool on the CPU, as
// an XLA FFI custom call: `mla_attention_paged` (the absorbed form, reading the pool through the block table
// in place).
//
// q float32 [B, T, H, nope + rope]; pool float32 [NB, bs, R + rope]; table int32 [B, W]; end int32 [B, T]
// (token j of row b sees its positions t < end[b, j]); w float32 [H * (nope + v), R] (kv_b_proj, checkpoint
// layout) -> o float32 [B, T, H, v]. Attributes: scale (float), nope (int64).
//
// Per row, token and head: q_lat = W_uk^T q_nope; s_t = scale (q_lat . c_t + q_rope . k_r,t); p = softmax(s);
// o = W_uv (sum_t p_t c_t). XLA:CPU gathers the row's pool into a copy, copies it again transposed for
// one of the two products and runs a dozen small products and fusions; here each latent is read once
// from the pool for every token and head of a part, where it lies. Parts: (row, half of the heads) over
// XLA's pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t B, T, H, nope, rope, v, R, NB, bs, W;
};

// a . b in 16 running sums (a loop the compiler vectorizes without reordering any one sum).
template <typename T>
inline float Dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  constexpr int64_t kLanes = 16;
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t u = 0; u < kLanes; ++u) part[u] += a[i + u] * static_cast<float>(b[i + u]);
  }
  float acc = 0.0f;
  for (; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  for (int64_t u = 0; u < kLanes; ++u) acc += part[u];
  return acc;
}

// Heads [h0, h1) of every token of row b (`end`: the row's T ends); W: the weight's element type (float or
// int8_t), ws its per-row scale. Query k = j * nh + i is token j, head h0 + i.
template <typename W>
void Heads(const Shapes& s, const float* q, const float* pool, const int32_t* table, const int32_t* end,
           const W* w, const float* ws, float scale, int64_t b, int64_t h0, int64_t h1, float* o) {
  const int64_t L = s.R + s.rope, nh = h1 - h0, nq = s.T * nh, D = s.nope + s.rope;
  std::vector<int64_t> n(s.T);
  int64_t most = 0;
  for (int64_t j = 0; j < s.T; ++j) most = std::max(most, n[j] = std::clamp<int64_t>(end[j], 0, s.W * s.bs));
  std::vector<float> qlat(nq * s.R, 0.0f), p(nq * std::max<int64_t>(most, 1)), olat(nq * s.R, 0.0f);
  auto query = [&](int64_t j, int64_t i) { return q + ((b * s.T + j) * s.H + h0 + i) * D; };
  for (int64_t j = 0; j < s.T; ++j) {
    for (int64_t i = 0; i < nh; ++i) {
      const float* qh = query(j, i);
      const int64_t first = (h0 + i) * (s.nope + s.v);
      float* __restrict ql = qlat.data() + (j * nh + i) * s.R;
      for (int64_t m = 0; m < s.nope; ++m) {
        const float a = qh[m] * ws[first + m];
        const W* __restrict row = w + (first + m) * s.R;
        for (int64_t r = 0; r < s.R; ++r) ql[r] += a * static_cast<float>(row[r]);
      }
    }
  }
  auto latent = [&](int64_t t) {
    const int64_t blk = std::min<int64_t>(std::max<int32_t>(table[b * s.W + t / s.bs], 0), s.NB - 1);
    return pool + (blk * s.bs + t % s.bs) * L;
  };
  for (int64_t t = 0; t < most; ++t) {
    const float* c = latent(t);
    for (int64_t j = 0; j < s.T; ++j) {
      if (t >= n[j]) continue;
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t k = j * nh + i;
        p[k * most + t] = (Dot(qlat.data() + k * s.R, c, s.R) + Dot(query(j, i) + s.nope, c + s.R, s.rope)) * scale;
      }
    }
  }
  std::vector<float> inv(nq, 0.0f);
  for (int64_t k = 0; k < nq; ++k) {
    const int64_t nk = n[k / nh];
    if (nk == 0) continue;
    float* pk = p.data() + k * most;
    const float mx = *std::max_element(pk, pk + nk);
    float sum = 0.0f;
    for (int64_t t = 0; t < nk; ++t) sum += (pk[t] = std::exp(pk[t] - mx));
    inv[k] = 1.0f / sum;
  }
  for (int64_t t = 0; t < most; ++t) {
    const float* __restrict c = latent(t);
    for (int64_t j = 0; j < s.T; ++j) {
      if (t >= n[j]) continue;
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t k = j * nh + i;
        const float a = p[k * most + t];
        float* __restrict ol = olat.data() + k * s.R;
        for (int64_t r = 0; r < s.R; ++r) ol[r] += a * c[r];
      }
    }
  }
  for (int64_t j = 0; j < s.T; ++j) {
    for (int64_t i = 0; i < nh; ++i) {
      const int64_t k = j * nh + i, first = (h0 + i) * (s.nope + s.v) + s.nope;
      const float* __restrict ol = olat.data() + k * s.R;
      float* oh = o + ((b * s.T + j) * s.H + h0 + i) * s.v;
      for (int64_t m = 0; m < s.v; ++m) oh[m] = Dot(ol, w + (first + m) * s.R, s.R) * ws[first + m] * inv[k];
    }
  }
}

ffi::Error MlaDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv,
                     ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> end, ffi::AnyBuffer w,
                     ffi::Buffer<ffi::F32> w_scale, float scale, int64_t nope, ffi::ResultBuffer<ffi::F32> o) {
  const auto qd = q.dimensions(), pd = kv.dimensions(), td = table.dimensions(), od = o->dimensions();
  if (qd.size() != 4 || pd.size() != 3 || td.size() != 2 || od.size() != 4 || w.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(
        "mla_decode: q [B, T, H, D], pool [NB, bs, L], table [B, W], w [H*(n+v), R], o [B, T, H, v]");
  }
  Shapes s{qd[0], qd[1], qd[2], nope, qd[3] - nope, od[3], w.dimensions()[1], pd[0], pd[1], td[1]};
  if (s.rope < 0 || pd[2] != s.R + s.rope || td[0] != s.B || end.element_count() != s.B * s.T ||
      w.dimensions()[0] != s.H * (s.nope + s.v) || w_scale.element_count() != w.dimensions()[0] || od[0] != s.B ||
      od[1] != s.T || od[2] != s.H) {
    return ffi::Error::InvalidArgument("mla_decode: shapes do not line up");
  }
  const bool codes = w.element_type() == ffi::DataType::S8;
  if (!codes && w.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("mla_decode: w must be float32 or int8");
  }
  const void* ws = w.untyped_data();
  const float *qs = q.typed_data(), *ps = kv.typed_data(), *scales = w_scale.typed_data();
  const int32_t *ts = table.typed_data(), *es = end.typed_data();
  float* os = o->typed_data();
  const int64_t halves = s.H > 1 && s.B < pool.num_threads() + 1 ? 2 : 1;
  jaxhybrid::ForParts(pool, s.B * halves, [=](int64_t part) {
    const int64_t b = part / halves, half = part % halves;
    const int64_t h0 = half * s.H / halves, h1 = (half + 1) * s.H / halves;
    if (codes) {
      Heads(s, qs, ps, ts, es + b * s.T, static_cast<const int8_t*>(ws), scales, scale, b, h0, h1, os);
    } else {
      Heads(s, qs, ps, ts, es + b * s.T, static_cast<const float*>(ws), scales, scale, b, h0, h1, os);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_mla_decode, MlaDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("nope")
                                  .Ret<ffi::Buffer<ffi::F32>>());
