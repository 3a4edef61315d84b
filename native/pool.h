// A persistent worker pool for the kernels' thread split.
//
// [Note: why a pool] Starting threads on every call costs tens of microseconds and gives
// the OS a fresh placement decision each time; CPUAdam calls the kernel once per
// parameter, so that cost would dominate small tensors. Workers start on first use,
// sleep between calls, and run one job at a time (concurrent callers take turns).
#pragma once

#include <cstddef>
#include <functional>

namespace offload {

// Run fn(0) .. fn(workers - 1) concurrently, fn(0) on the calling thread; return when all
// have finished. Never throws once started: fn must not throw.
void run_on_workers(size_t workers, const std::function<void(size_t)>& fn);

}  // namespace offload
