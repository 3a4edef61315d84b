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

// [Note: torch's OpenMP team] torch runs its CPU ops on an OpenMP team whose threads spin
// for a few milliseconds after each parallel region. A pool thread of ours started in that
// window shares its core with a spinning thread and runs at half speed (measured: Adam on
// 10M parameters 9.2 ms right after a torch op, 6.1 ms once the spinning stopped, with 2
// threads). So on the thread that registered it (the one that imported offload, where
// torch's ops run), the work goes to that same team, found in the already loaded OpenMP
// runtime; other threads (the engine's host queues) use the pool, whose helpers sleep
// instead of spinning while backward computes.

// Run fn(0) .. fn(workers - 1) concurrently, fn(0) on the calling thread; return when all
// have finished. Never throws once started: fn must not throw.
void run_on_workers(size_t workers, const std::function<void(size_t)>& fn);

// Use the OpenMP runtime at `path` (already loaded by torch) for calls from this thread;
// returns whether it was found. An empty path turns it off.
bool use_openmp(const char* path);

// "openmp" or "pool": what run_on_workers uses when called from this thread.
const char* threads_backend();

// The most jobs the pools ran at once since the last call (see [Note: two pools] in pool.cpp).
size_t pool_jobs_at_once();

}  // namespace offload
