// torch.distributed's C++ side (c10d), which tch 0.24 does not reach: a TCPStore rendezvous as
// torchrun's env:// init makes, and a Gloo process group for gradient all-reduces. C++
// exceptions must not cross into Rust: every function catches them and hands back the message.
#define USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstring>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

// A malloc'ed copy of `message` for Rust to read and free with headway_dist_free_error.
char *copy_message(const char *message) { return strdup(message); }

template <typename F>
bool guarded(char **error, F f) {
  try {
    f();
    return true;
  } catch (const c10::Error &e) {
    *error = copy_message(e.what_without_backtrace());
  } catch (const std::exception &e) {
    *error = copy_message(e.what());
  } catch (...) {
    *error = copy_message("unknown C++ exception");
  }
  return false;
}

}  // namespace

extern "C" {

// Joins the group `rank` of `world` through the TCPStore at host:port (rank 0 serves it and waits
// for every rank), then builds a Gloo process group over it. Collectives that wait longer than
// `timeout_ms` (a peer died or hangs) fail instead of blocking forever. Null on failure.
void *headway_dist_new(const char *host, uint16_t port, int rank, int world, int64_t timeout_ms,
                       char **error) {
  Group *group = nullptr;
  guarded(error, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = rank == 0;
    options.numWorkers = static_cast<size_t>(world);
    options.waitWorkers = true;
    options.timeout = timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(host, options);
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo_options);
    group = new Group{store, backend};
  });
  return group;
}

void headway_dist_free(void *group) { delete static_cast<Group *>(group); }

void headway_dist_free_error(char *error) { free(error); }

// Sums `tensor` over every rank, in place.
bool headway_dist_all_reduce_sum(void *group, at::Tensor *tensor, char **error) {
  return guarded(error, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    static_cast<Group *>(group)->backend->allreduce(tensors, options)->wait();
  });
}

// Overwrites `tensor` on every rank with rank `root`'s.
bool headway_dist_broadcast(void *group, at::Tensor *tensor, int root, char **error) {
  return guarded(error, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    static_cast<Group *>(group)->backend->broadcast(tensors, options)->wait();
  });
}
}
