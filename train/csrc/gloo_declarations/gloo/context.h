// Declarations only, for compiling against libtorch's ProcessGroupGloo.hpp: PyPI's torch ships
// that header but not the gloo headers it includes. Headway never creates or calls a gloo object;
// libtorch's own compiled code does. The header holds gloo objects only behind std::shared_ptr,
// so these declarations decide no layout. See train/csrc/distributed.cpp.
#pragma once

#include <chrono>

namespace gloo {
class Context {
 public:
  // Named by an inline member of ProcessGroupGloo that Headway never calls.
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
