// ATen's autocast state per device, which tch 0.24 does not reach: it exposes only the CUDA
// on/off switch, whose default dtype is f16. Errors come back as false instead of C++ exceptions,
// which must not cross into Rust.
#include <ATen/autocast_mode.h>

extern "C" {

// Reads whether autocast is on for `device_type` (c10::DeviceType) and its dtype
// (c10::ScalarType).
bool headway_autocast_state(int device_type, bool *enabled, int *scalar_type) {
  try {
    auto device = static_cast<at::DeviceType>(device_type);
    *enabled = at::autocast::is_autocast_enabled(device);
    *scalar_type = static_cast<int>(at::autocast::get_autocast_dtype(device));
    return true;
  } catch (...) {
    return false;
  }
}

// Sets the state; entering a region (`enter`) counts one nesting level, leaving it uncounts one
// and drops the cached casts of the weights when the outermost region ends, as torch.autocast
// does (the weights change at the next optimizer step).
bool headway_autocast_set(int device_type, bool enabled, int scalar_type, bool enter) {
  try {
    auto device = static_cast<at::DeviceType>(device_type);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(scalar_type));
    at::autocast::set_autocast_enabled(device, enabled);
    if (enter) {
      at::autocast::increment_nesting();
    } else if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    return true;
  } catch (...) {
    return false;
  }
}
}
