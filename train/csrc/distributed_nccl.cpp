// c10d's NCCL process group, compiled only when the build finds CUDA's headers (build.rs): PyPI's
// torch ships libtorch_cuda, which holds ProcessGroupNCCL, but its headers also need CUDA's
// `crt/` and CCCL headers (PyPI nvidia-cuda-crt and nvidia-cuda-cccl, or a CUDA toolkit).
#define USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "distributed.hpp"

extern "C" {

// As headway_dist_new, with an NCCL group whose collectives run on CUDA device `device` (this
// rank's GPU); `timeout_ms` bounds collectives through NCCL's watchdog.
void *headway_dist_new_nccl(const char *host, uint16_t port, int rank, int world,
                            int64_t timeout_ms, int device, char **error) {
  headway::Group *group = nullptr;
  headway::guarded(error, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto store = headway::rendezvous(host, port, rank, world, timeout);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
    backend->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
    group = new headway::Group{store, backend};
  });
  return group;
}
}
