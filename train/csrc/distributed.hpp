// What the Gloo (distributed.cpp) and NCCL (distributed_nccl.cpp) shims share: the group handle
// Rust holds, the rendezvous, and the guard that keeps C++ exceptions from crossing into Rust.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>

namespace headway {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

// Runs `f`; on a C++ exception stores a malloc'ed copy of its message in `error` (freed by
// headway_dist_free_error) and returns false.
template <typename F>
bool guarded(char **error, F f) {
  try {
    f();
    return true;
  } catch (const c10::Error &e) {
    *error = strdup(e.what_without_backtrace());
  } catch (const std::exception &e) {
    *error = strdup(e.what());
  } catch (...) {
    *error = strdup("unknown C++ exception");
  }
  return false;
}

// The TCPStore at host:port as torchrun's env:// rendezvous makes it: rank 0 serves it and waits
// for all `world` ranks.
c10::intrusive_ptr<c10d::Store> rendezvous(const char *host, uint16_t port, int rank, int world,
                                           std::chrono::milliseconds timeout);

}  // namespace headway
