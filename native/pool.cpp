#include "pool.h"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>

#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace offload {
namespace {

std::atomic<size_t> g_running{0};       // jobs running on the pools now
std::atomic<size_t> g_most_running{0};  // the most at once since pool_jobs_at_once last asked

class Pool {
 public:
  void run(size_t workers, const std::function<void(size_t)>& fn) {
    std::unique_lock<std::mutex> one_job_at_a_time(run_mu_);
    run_locked(workers, fn);
  }

  // Runs fn here if no other job holds this pool; returns whether it did.
  bool try_run(size_t workers, const std::function<void(size_t)>& fn) {
    std::unique_lock<std::mutex> one_job_at_a_time(run_mu_, std::try_to_lock);
    if (!one_job_at_a_time.owns_lock()) return false;
    run_locked(workers, fn);
    return true;
  }

 private:
  void run_locked(size_t workers, const std::function<void(size_t)>& fn) {
    const size_t now = g_running.fetch_add(1) + 1;
    for (size_t seen = g_most_running.load(); now > seen && !g_most_running.compare_exchange_weak(seen, now);) {
    }
    struct Done {
      ~Done() { g_running.fetch_sub(1); }
    } done;
    const size_t helpers = grow(workers - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      wanted_ = helpers;
      pending_ = helpers;
      ++generation_;
    }
    start_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

  // Start helpers up to `helpers`; returns how many exist (fewer if the OS refuses threads).
  size_t grow(size_t helpers) {
    while (threads_.size() < helpers) {
      try {
        // The helper starts from the current generation: a job posted before it first
        // takes the lock is still seen as new (run_mu_ is held, so nothing posts meanwhile).
        const size_t index = threads_.size(), seen = generation_;
        threads_.emplace_back([this, index, seen] { loop(index, seen); });
        threads_.back().detach();  // lives as long as the process; never joined at exit
      } catch (const std::system_error&) {
        break;
      }
    }
    return threads_.size() < helpers ? threads_.size() : helpers;
  }

  void loop(size_t index, size_t seen) {
    for (;;) {
      const std::function<void(size_t)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= wanted_) continue;
        job = job_;
      }
      (*job)(index + 1);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable start_;
  std::condition_variable done_;
  std::vector<std::thread> threads_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t wanted_ = 0;
  size_t pending_ = 0;
  size_t generation_ = 0;
};

// [Note: two pools] One pool runs one job at a time, so two host threads calling kernels at once took turns: a
// gradient's landing norm (a few hundred microseconds) waited behind a whole shard's Adam (several milliseconds on
// a 64 MiB unit) that the delayed update ran on its own thread, and backward's end waited for the last landing.
// Two pools let two jobs run at once (a third caller waits for the first pool); each has up to cores - 1 helpers,
// which sleep between jobs. Two jobs at once share the cores, and each thread's range is fixed by the job, so the
// results are the same whichever pool runs it.
constexpr size_t kPools = 2;
Pool* g_pools[kPools] = {};
std::once_flag g_once;

// A forked child has none of the parent's worker threads: give it fresh pools (the old
// ones, whose locks may be held by threads that do not exist there, are abandoned).
void reset_in_child() {
  for (Pool*& p : g_pools) p = new Pool();
}

Pool** pools() {
  std::call_once(g_once, [] {
    for (Pool*& p : g_pools) p = new Pool();
    pthread_atfork(nullptr, nullptr, &reset_in_child);
  });
  return g_pools;
}

void run_on_a_pool(size_t workers, const std::function<void(size_t)>& fn) {
  Pool** all = pools();
  for (size_t i = 0; i < kPools; ++i) {
    if (all[i]->try_run(workers, fn)) return;
  }
  all[0]->run(workers, fn);
}

// The OpenMP entry points GCC emits calls to (libgomp's ABI; Intel's libiomp5 exports them too).
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
using OmpInt = int (*)();

struct OpenMP {
  GompParallel parallel = nullptr;
  OmpInt thread_num = nullptr;
  OmpInt num_threads = nullptr;
  pthread_t owner{};
};
std::atomic<const OpenMP*> g_openmp{nullptr};

struct TeamJob {
  const std::function<void(size_t)>* fn;
  size_t workers;
  const OpenMP* omp;
};

// Each team thread runs the indices congruent to its number: correct whatever team size the
// runtime grants (it may give fewer threads than asked for).
void team_body(void* data) {
  const TeamJob* job = static_cast<const TeamJob*>(data);
  const size_t team = size_t(job->omp->num_threads());
  for (size_t i = size_t(job->omp->thread_num()); i < job->workers; i += team) (*job->fn)(i);
}

const OpenMP* openmp_here() {
  const OpenMP* omp = g_openmp.load(std::memory_order_acquire);
  return omp != nullptr && pthread_equal(omp->owner, pthread_self()) ? omp : nullptr;
}

}  // namespace

void run_on_workers(size_t workers, const std::function<void(size_t)>& fn) {
  if (workers <= 1) {
    fn(0);
    return;
  }
  if (const OpenMP* omp = openmp_here()) {
    TeamJob job{&fn, workers, omp};
    omp->parallel(&team_body, &job, unsigned(workers), 0);
    return;
  }
  run_on_a_pool(workers, fn);
}

size_t pool_jobs_at_once() { return g_most_running.exchange(g_running.load()); }

bool use_openmp(const char* path) {
  if (path == nullptr || *path == 0) {
    g_openmp.store(nullptr, std::memory_order_release);  // the old table is leaked: a caller may hold it
    return false;
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);  // only a runtime already in the process: torch's
  if (lib == nullptr) return false;
  auto* omp = new OpenMP();
  omp->parallel = reinterpret_cast<GompParallel>(dlsym(lib, "GOMP_parallel"));
  omp->thread_num = reinterpret_cast<OmpInt>(dlsym(lib, "omp_get_thread_num"));
  omp->num_threads = reinterpret_cast<OmpInt>(dlsym(lib, "omp_get_num_threads"));
  omp->owner = pthread_self();
  if (omp->parallel == nullptr || omp->thread_num == nullptr || omp->num_threads == nullptr) {
    delete omp;
    return false;
  }
  // A forked child cannot use the parent's OpenMP team (libgomp hangs there): it falls back to a pool.
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, [] { g_openmp.store(nullptr, std::memory_order_relaxed); });
  });
  g_openmp.store(omp, std::memory_order_release);
  return true;
}

const char* threads_backend() { return openmp_here() != nullptr ? "openmp" : "pool"; }

}  // namespace offload
