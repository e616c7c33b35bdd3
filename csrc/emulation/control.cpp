// The emulator's controls, as ops of the test library effilayers_emulated:
// seed, debug mode, the multiprocessor count launches are sized for, and
// the launch log. Debug mode makes the guard-page buffers of simt.cpp the
// CPU allocator, so every tensor allocated while it is on (a test's inputs,
// the bindings' outputs and workspaces) ends at an inaccessible page.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "emulation/simt.h"

namespace effilayers {
namespace emulation {
namespace {

void free_guarded(void* data) { simt::guarded_free(data); }

class GuardedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* data = simt::guarded_alloc(bytes);
    TORCH_CHECK(bytes == 0 || data != nullptr, "SIMT emulator debug mode: could not allocate ", bytes,
                " guarded bytes");
    return {data, data, &free_guarded, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_guarded; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

GuardedAllocator g_guarded;
c10::Allocator* g_previous = nullptr;
std::mutex g_mutex;

void configure(int64_t seed, bool debug, int64_t multiprocessors) {
  TORCH_CHECK_VALUE(seed >= 0, "simt_configure: seed must be non-negative, got ", seed);
  TORCH_CHECK_VALUE(multiprocessors >= 1, "simt_configure: multiprocessors must be at least 1, got ",
                    multiprocessors);
  const std::lock_guard<std::mutex> lock(g_mutex);
  simt::set_seed(static_cast<uint64_t>(seed));
  simt::set_multiprocessors(static_cast<int>(multiprocessors));
  if (debug && g_previous == nullptr) {
    g_previous = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&g_guarded, /*priority=*/0);
  } else if (!debug && g_previous != nullptr) {
    c10::SetCPUAllocator(g_previous, /*priority=*/0);
    g_previous = nullptr;
  }
  simt::set_debug(debug);
}

std::string launch_log() { return simt::launch_log(); }

void reset_launch_log() { simt::reset_launch_log(); }

}  // namespace

// Called from the library's one registration block (selftest.cpp).
void register_controls(torch::Library& m) {
  m.def("simt_configure(int seed, bool debug, int multiprocessors) -> ()", &configure);
  m.def("simt_launch_log() -> str", &launch_log);
  m.def("simt_reset_launch_log() -> ()", &reset_launch_log);
}

}  // namespace emulation
}  // namespace effilayers
