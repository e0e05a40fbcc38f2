// One KDA step (one token per row) on the CPU, as an XLA FFI custom call: `kda_recurrent` for T = 1.
//
// Per row b and head h, with the float32 state S [dk, dv]:
//   S <- diag(exp(g)) S;   S <- S + (beta k) (v - k^T S)^T;   o = S^T q
// q, k, g float32 [B, H, dk]; v float32 [B, H, dv]; beta float32 [B, H]; state float32 [S, H, dk, dv] and
// rows int32 [B]: row b starts from state[rows[b]], read where it lies (a slot of the engine's pool, which
// XLA would otherwise copy out first) -> o float32 [B, H, dv], the rows' new states float32 [B, H, dk, dv].
//
// `jaxhybrid_kda_decode_pool` takes the same arguments and writes each row's new state over its old one in
// the pool, which its result aliases (the engine's decode program: the pool is updated in place, nothing
// else is written); `jaxhybrid_conv_decode_pool` does the same for the step's short convolution and its
// pool of windows.
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

// One (row, head): state s [dk, dv] -> out [dk, dv]; o [dv]. `work` holds 2 * dv floats. `out` may be `s`
// (each element is read before it is written, at the same index).
void Head(const float* q, const float* k, const float* g, const float* v, float beta, const float* s, float* out,
          float* o, int64_t dk, int64_t dv, float* work) {
  float* __restrict pred = work;
  float* __restrict diff = work + dv;
  for (int64_t j = 0; j < dv; ++j) pred[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float decay = std::exp(g[i]), ki = k[i];
    const float* si = s + i * dv;
    float* oi = out + i * dv;
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

// Whether every one of the B rows names one of S slots.
bool RowsInRange(const ffi::Buffer<ffi::S32>& rows, int64_t S) {
  const int32_t* rs = rows.typed_data();
  return std::all_of(rs, rs + rows.element_count(), [S](int32_t r) { return r >= 0 && r < S; });
}

// A pool variant's result starts as its pool: nothing to do where the caller aliased them, else a copy.
float* StartFrom(const ffi::Buffer<ffi::F32>& pool, ffi::ResultBuffer<ffi::F32>& out) {
  float* to = out->typed_data();
  const float* from = pool.typed_data();
  if (to != from) std::copy(from, from + pool.element_count(), to);
  return to;
}

// Checks the shapes; runs T tokens of every (row, head) in order, each from the state the last one wrote (the
// first from the row's slot of `state`), writing the state after token t at to(b, t, h). q, k, g hold
// [B, T, H, dk] floats, v [B, T, H, dv], beta [B, T, H] (T = 1: the one-token step's [B, H, ...]).
template <typename To>
ffi::Error Steps(ffi::ThreadPool& pool, int64_t T, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                 ffi::Buffer<ffi::F32>& g, ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::F32>& beta,
                 ffi::Buffer<ffi::F32>& state, ffi::Buffer<ffi::S32>& rows, float* os, To to) {
  const auto sd = state.dimensions();
  if (sd.size() != 4) return ffi::Error::InvalidArgument("kda_decode: state [S, H, dk, dv] expected");
  const int64_t S = sd[0], B = rows.element_count(), H = sd[1], dk = sd[2], dv = sd[3];
  if (!RowsInRange(rows, S)) return ffi::Error::InvalidArgument("kda_decode: a row past the states");
  const int32_t* rs = rows.typed_data();
  const int64_t n = B * T * H;
  if (q.element_count() != n * dk || k.element_count() != n * dk || g.element_count() != n * dk ||
      v.element_count() != n * dv || beta.element_count() != n) {
    return ffi::Error::InvalidArgument(
        "kda_decode: q, k, g [B, (T,) H, dk], v [B, (T,) H, dv], beta [B, (T,) H] and rows [B] expected");
  }
  const float *qs = q.typed_data(), *ks = k.typed_data(), *gs = g.typed_data(), *vs = v.typed_data();
  const float *bs = beta.typed_data(), *ss = state.typed_data();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(B * H, 2 * pool.num_threads()));
  jaxhybrid::ForParts(pool, parts, [=](int64_t p) {
    std::vector<float> scratch(2 * dv);
    for (int64_t bh = p; bh < B * H; bh += parts) {
      const int64_t b = bh / H, h = bh % H;
      const float* from = ss + (rs[b] * H + h) * dk * dv;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = (b * T + t) * H + h;  // (b, t, h) in the [B, T, H] layout
        float* into = to(b, t, h);
        Head(qs + at * dk, ks + at * dk, gs + at * dk, vs + at * dv, bs[at], from, into, os + at * dv, dk, dv,
             scratch.data());
        from = into;
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error KdaDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> beta,
                     ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> o,
                     ffi::ResultBuffer<ffi::F32> out) {
  if (state.dimensions().size() != 4) return ffi::Error::InvalidArgument("kda_decode: state [S, H, dk, dv]");
  const auto sd = state.dimensions();
  const int64_t H = sd[1], size = sd[2] * sd[3];
  if (out->element_count() != rows.element_count() * H * size) {
    return ffi::Error::InvalidArgument("kda_decode: the result must be [B, H, dk, dv]");
  }
  float* outs = out->typed_data();
  return Steps(pool, 1, q, k, g, v, beta, state, rows, o->typed_data(),
               [=](int64_t b, int64_t, int64_t h) { return outs + (b * H + h) * size; });
}

// The pool variant: `out` is the pool itself (aliased by the caller), row b written at its slot.
ffi::Error KdaDecodePool(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> beta,
                         ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> o,
                         ffi::ResultBuffer<ffi::F32> out) {
  if (out->element_count() != state.element_count() || state.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("kda_decode_pool: the result must be the pool [S, H, dk, dv]");
  }
  const auto sd = state.dimensions();
  const int64_t H = sd[1], size = sd[2] * sd[3];
  const int32_t* rs = rows.typed_data();
  float* outs = StartFrom(state, out);
  return Steps(pool, 1, q, k, g, v, beta, state, rows, o->typed_data(),
               [=](int64_t b, int64_t, int64_t h) { return outs + (rs[b] * H + h) * size; });
}

// The step's short convolution: x float32 [B, C] (the token's q/k/v inputs), weight float32 [C, K], pool
// float32 [S, C, K-1] of windows (the last K-1 inputs, oldest first), rows int32 [B], valid int32 [B] ->
// y float32 [B, C] (y[c] = sum_j weight[c, j] * (window[c], x[c])[j]) and the pool, aliased, with each row's
// window moved on by its token where valid[b] > 0 (a padding row's window stays).
ffi::Error ConvDecodePool(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> pool,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto pd = pool.dimensions(), wd = weight.dimensions();
  if (pd.size() != 3 || wd.size() != 2 || x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("conv_decode_pool: x [B, C], weight [C, K], pool [S, C, K-1] expected");
  }
  const int64_t S = pd[0], C = pd[1], W = pd[2], B = x.dimensions()[0];
  if (wd[0] != C || wd[1] != W + 1 || x.dimensions()[1] != C || rows.element_count() != B ||
      valid.element_count() != B || out->element_count() != pool.element_count()) {
    return ffi::Error::InvalidArgument("conv_decode_pool: x [B, C], weight [C, K], pool [S, C, K-1] expected");
  }
  if (!RowsInRange(rows, S)) return ffi::Error::InvalidArgument("conv_decode_pool: a row past the pool");
  const int32_t *rs = rows.typed_data(), *vs = valid.typed_data();
  float* to = StartFrom(pool, out);
  const float *xs = x.typed_data(), *ws = weight.typed_data();
  float* ys = y->typed_data();
  for (int64_t b = 0; b < B; ++b) {
    float* window = to + rs[b] * C * W;
    for (int64_t c = 0; c < C; ++c) {
      float* win = window + c * W;
      const float* w = ws + c * (W + 1);
      const float xc = xs[b * C + c];
      // The taps summed as XLA:CPU compiles `causal_conv1d` (w0 x0 + w1 x1 + ...: the second product, then
      // each other one fused into it in order), which gives its bits where its fusion keeps that order.
      auto tap = [&](int64_t j) { return j < W ? win[j] : xc; };
      float acc = W == 0 ? w[0] * xc : w[1] * tap(1);
      if (W > 0) acc = std::fma(w[0], tap(0), acc);
      for (int64_t j = 2; j <= W; ++j) acc = std::fma(w[j], tap(j), acc);
      ys[b * C + c] = acc;
      if (vs[b] > 0) {
        for (int64_t j = 0; j + 1 < W; ++j) win[j] = win[j + 1];
        if (W > 0) win[W - 1] = xc;
      }
    }
  }
  return ffi::Error::Success();
}

// A few tokens per row, keeping the state after each one (`kda_recurrent_states`: verifying drafted tokens
// needs the state at the last accepted position). q, k, g float32 [B, T, H, dk]; v float32 [B, T, H, dv];
// beta float32 [B, T, H]; state [S, H, dk, dv] and rows [B] as above -> o float32 [B, T, H, dv], states
// float32 [B, T, H, dk, dv]. Per (b, h) the T steps run in order, each reading the state the last one wrote
// (still in L1/L2); XLA:CPU runs them as a loop of a dozen ops a step.
ffi::Error KdaStates(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> g,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> state,
                     ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = state.dimensions(), qd = q.dimensions();
  if (sd.size() != 4 || qd.size() != 4 || qd[2] != sd[1] || qd[3] != sd[2]) {
    return ffi::Error::InvalidArgument("kda_states: q [B, T, H, dk], state [S, H, dk, dv] expected");
  }
  const int64_t T = qd[1], H = sd[1], size = sd[2] * sd[3];
  if (out->element_count() != qd[0] * T * H * size) {
    return ffi::Error::InvalidArgument("kda_states: the result must be [B, T, H, dk, dv]");
  }
  float* outs = out->typed_data();
  return Steps(pool, T, q, k, g, v, beta, state, rows, o->typed_data(),
               [=](int64_t b, int64_t t, int64_t h) { return outs + ((b * T + t) * H + h) * size; });
}

// Rows of a pool set in place: pool float32 [S, ...], rows int32 [B] (distinct), values float32 [B, ...] -> the
// pool, aliased, with values[b] in slot rows[b] (a verify step's accepted states, which XLA's scatter would
// write into a copy of a pool the same program reads).
ffi::Error SetRowsPool(ffi::Buffer<ffi::F32> pool, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> values,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto pd = pool.dimensions();
  const int64_t B = rows.element_count();
  if (pd.size() < 1 || out->element_count() != pool.element_count()) {
    return ffi::Error::InvalidArgument("set_rows_pool: pool [S, ...] expected, and the result must be the pool");
  }
  const int64_t S = pd[0], row = S == 0 ? 0 : pool.element_count() / S;
  if (values.element_count() != B * row) {
    return ffi::Error::InvalidArgument("set_rows_pool: values [B, ...] with the pool's row shape expected");
  }
  if (!RowsInRange(rows, S)) return ffi::Error::InvalidArgument("set_rows_pool: a row past the pool");
  const int32_t* rs = rows.typed_data();
  float* to = StartFrom(pool, out);
  const float* vs = values.typed_data();
  for (int64_t b = 0; b < B; ++b) std::copy(vs + b * row, vs + (b + 1) * row, to + rs[b] * row);
  return ffi::Error::Success();
}

// The arguments and results of both KDA steps: q, k, g, v, beta, state, rows -> o, states.
auto StepBinding() {
  using F32 = ffi::Buffer<ffi::F32>;
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
      .Arg<ffi::Buffer<ffi::S32>>().Ret<F32>().Ret<F32>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_kda_decode, KdaDecode, StepBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_kda_decode_pool, KdaDecodePool, StepBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_kda_states, KdaStates, StepBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_set_rows_pool, SetRowsPool,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxhybrid_conv_decode_pool, ConvDecodePool,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
