// Parts of one FFI call split over XLA's intra-op thread pool (included by the kernels beside it).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxhybrid {

// Runs part(p) for every p < parts. Parts are claimed from a counter by the caller and by helper tasks on
// the pool. The caller never waits for a task to start (the pool's threads may all be busy, e.g. in other
// calls of a kernel): it runs every part nobody has claimed, then waits only for parts claimed and running
// elsewhere. A task that starts after the call returned finds nothing to claim; what it touches is shared,
// not on the caller's stack.
template <typename Part>
void ForParts(xla::ffi::ThreadPool& pool, int64_t parts, Part part) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto body = std::make_shared<Part>(std::move(part));
  auto work = [state, body, parts] {
    for (int64_t p; (p = state->next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      (*body)(p);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t p = 1; p < parts && p <= pool.num_threads(); ++p) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

}  // namespace jaxhybrid
