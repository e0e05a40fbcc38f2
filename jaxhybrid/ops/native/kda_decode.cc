// One KDA step (one token per row) on the CPU, as an XLA FFI custom call: `kda_recurrent` for T = 1.
//
// Per row b and head h, with the float32 state S [dk, dv]:
//   S <- diag(exp(g)) S;   S <- S + (beta k) (v - k^T S)^T;   o = S^T q
// q, k, g float32 [B, H, dk]; v float32 [B, H, dv]; beta float32 [B, H]; state float32 [S, H, dk, dv] and
// rows int32 [B]: row b starts from state[rows[b]], read where it lies (a slot of the engine's pool, which
// XLA would otherwise copy out first) -> o float32 [B, H, dv], the rows' new states float32 [B, H, dk, dv].
//
// XLA:CPU runs this step as a dozen loops over the state, each reading and writing it; here each (b, h)
// reads its state once and writes it once (two passes over a row block that stays in L1/L2: the decay and
// k^T S, then the update and S^T q). The (b, h) pairs are split over XLA's intra-op thread pool. Plain
// loops over dv that the compiler vectorizes (-O3 -march=native).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One (row, head): state s [dk, dv] -> out [dk, dv]; o [dv]. `work` holds 2 * dv floats.
void Head(const float* q, const float* k, const float* g, const float* v, float beta, const float* s, float* out,
          float* o, int64_t dk, int64_t dv, float* work) {
  float* __restrict pred = work;
  float* __restrict diff = work + dv;
  for (int64_t j = 0; j < dv; ++j) pred[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float decay = std::exp(g[i]), ki = k[i];
    const float* __restrict si = s + i * dv;
    float* __restrict oi = out + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      const float x = si[j] * decay;
      oi[j] = x;
      pred[j] += ki * x;
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    diff[j] = v[j] - pred[j];
    o[j] = 0.0f;
  }
  float* __restrict oo = o;
  for (int64_t i = 0; i < dk; ++i) {
    const float bk = beta * k[i], qi = q[i];
    float* __restrict oi = out + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      const float x = oi[j] + bk * diff[j];
      oi[j] = x;
      oo[j] += qi * x;
    }
  }
}

ffi::Error KdaDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> beta,
                     ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> o,
                     ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = state.dimensions();
  if (sd.size() != 4 || q.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("kda_decode: q [B, H, dk], state [S, H, dk, dv] expected");
  }
  const int64_t S = sd[0], B = q.dimensions()[0], H = sd[1], dk = sd[2], dv = sd[3];
  if (rows.element_count() != B) return ffi::Error::InvalidArgument("kda_decode: rows [B] expected");
  const int32_t* rs = rows.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    if (rs[b] < 0 || rs[b] >= S) return ffi::Error::InvalidArgument("kda_decode: a row past the states");
  }
  if (q.element_count() != B * H * dk || k.element_count() != B * H * dk || g.element_count() != B * H * dk ||
      v.element_count() != B * H * dv || beta.element_count() != B * H) {
    return ffi::Error::InvalidArgument("kda_decode: q, k, g [B, H, dk], v [B, H, dv], beta [B, H] expected");
  }
  const float *qs = q.typed_data(), *ks = k.typed_data(), *gs = g.typed_data(), *vs = v.typed_data();
  const float *bs = beta.typed_data(), *ss = state.typed_data();
  float *os = o->typed_data(), *outs = out->typed_data();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(B * H, 2 * pool.num_threads()));
  jaxhybrid::ForParts(pool, parts, [=](int64_t p) {
    std::vector<float> scratch(2 * dv);
    for (int64_t bh = p; bh < B * H; bh += parts) {
      const float* from = ss + (rs[bh / H] * H + bh % H) * dk * dv;
      Head(qs + bh * dk, ks + bh * dk, gs + bh * dk, vs + bh * dv, bs[bh], from, outs + bh * dk * dv, os + bh * dv,
           dk, dv, scratch.data());
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_kda_decode, KdaDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
