// torch.distributed's C++ side (c10d), which tch 0.24 does not reach: a TCPStore rendezvous as
// torchrun's env:// init makes, a Gloo process group, and the collectives every backend shares
// (the NCCL group is built in distributed_nccl.cpp). C++ exceptions must not cross into Rust:
// every function catches them and hands back the message.
#define USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "distributed.hpp"

using headway::Group;
using headway::guarded;

c10::intrusive_ptr<c10d::Store> headway::rendezvous(const char *host, uint16_t port, int rank,
                                                    int world, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = port;
  options.isServer = rank == 0;
  options.numWorkers = static_cast<size_t>(world);
  options.waitWorkers = true;
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

extern "C" {

// Joins the group `rank` of `world` through the TCPStore at host:port, then builds a Gloo process
// group over it. Collectives that wait longer than `timeout_ms` (a peer died or hangs) fail
// instead of blocking forever. Null on failure.
void *headway_dist_new(const char *host, uint16_t port, int rank, int world, int64_t timeout_ms,
                       char **error) {
  Group *group = nullptr;
  guarded(error, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto store = headway::rendezvous(host, port, rank, world, timeout);
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
