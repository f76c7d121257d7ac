// The kernels' threads: one pool for the process, whichever thread calls a kernel.
//
// OpenMP (libgomp) keeps a pool per calling thread, and MindSpore calls the kernels from the
// Python thread and, now and then, from an actor thread. With two pools' threads on two CPUs
// libgomp "throttles" its waits to ~100 spins, so the other thread fell asleep between two
// kernels and every parallel loop paid a futex wake-up: 28% of a batch-1 decode call in `perf`
// was the kernel's scheduler. Here the workers spin for kSpinTime after each job (longer than the
// gaps between a step's kernels, shorter than the host's work between steps), then sleep.
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace vllm_ms {

// Threads each kernel call may use: the worker's share of the host's cores (SetNumThreads).
inline int num_threads = 1;

class Pool {
 public:
  // Runs job(t, n) for t = 0 .. n - 1 on the n = num_threads threads of the pool (the caller is
  // t = 0; every worker takes part in every job) and returns when every one has returned. A call
  // made while the pool is busy (another thread's kernel, or from inside a job) runs job(0, 1) on
  // the calling thread alone.
  template <typename Job>
  void run(const Job &job) {
    bool idle = false;
    if (num_threads <= 1 || !busy_.compare_exchange_strong(idle, true)) return job(0, 1);
    grow(num_threads - 1);
    job_ = &job;
    call_ = [](const void *job, int t, int n) { (*static_cast<const Job *>(job))(t, n); };
    const int threads = threads_ = static_cast<int>(workers_.size()) + 1;
    pending_.store(threads - 1);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    job(0, threads);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
    busy_.store(false);
  }

 private:
  static constexpr std::chrono::microseconds kSpinTime{250};

  // Called before the job's generation is published: a new worker takes part in it whenever
  // its thread gets to run.
  void grow(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      const int t = static_cast<int>(workers_.size()) + 1;
      const uint64_t seen = generation_.load();
      workers_.emplace_back([this, t, seen] { work(t, seen); });
      workers_.back().detach();
    }
  }

  void work(int t, uint64_t seen) {
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; generation_.load() == seen; ++spins) {
        _mm_pause();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpinTime) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      seen = generation_.load();
      call_(job_, t, threads_);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  const void *job_ = nullptr;
  void (*call_)(const void *, int, int) = nullptr;
  int threads_ = 1;
  std::vector<std::thread> workers_;  // detached: they live as long as the process
  std::mutex mutex_;
  std::condition_variable wake_;
};

// One pool for the process, never destroyed (its detached workers may still be waiting on it
// while the process exits). A child process forked from this one (vLLM's engine and worker
// processes may be) has none of its threads: it starts a pool of its own.
inline std::atomic<Pool *> pool_instance{nullptr};

inline Pool &pool() {
  static const bool registered = [] {
    return pthread_atfork(nullptr, nullptr, [] { pool_instance.store(nullptr); }) == 0;
  }();
  (void)registered;
  Pool *current = pool_instance.load();
  if (current == nullptr) {
    Pool *made = new Pool;  // no threads yet: they start with its first job
    if (pool_instance.compare_exchange_strong(current, made))
      current = made;
    else
      delete made;
  }
  return *current;
}

// Nothing to set up on a thread before its first index (AMX sets up its tiles).
struct NoThreadState {};

// body(i, next) for i in [0, n), one index at a time to whichever thread is free, each thread
// claiming its next index before it runs the current one, so the body can prefetch for `next`
// (-1: this thread has no next index). Thread t starts at index t, so a few indices still
// spread over the threads (two decodes: one each). A thread holds a ThreadState from its first
// index to its last. `parallel` off: all on the calling thread.
template <typename ThreadState = NoThreadState, typename Body>
void parallel_for_claiming_next(int64_t n, const Body &body, bool parallel = true) {
  std::atomic<int64_t> claimed{0};  // indices claimed after each thread's first
  auto work = [&](int t, int used) {
    if (t >= n) return;
    ThreadState state;
    (void)state;
    for (int64_t i = t; i < n;) {
      const int64_t next = used + claimed.fetch_add(1);
      body(i, next < n ? next : -1);
      i = next;
    }
  };
  if (parallel && n > 1)
    pool().run(work);
  else
    work(0, 1);
}

// body(i) for i in [0, n): over the pool's threads in contiguous ranges when `parallel` and
// n > 1 (parallel_for_claiming_next hands out one index at a time).
template <typename Body>
void parallel_for(int64_t n, const Body &body, bool parallel = true) {
  if (!parallel || n <= 1 || num_threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  pool().run([&](int t, int used) {
    for (int64_t i = n * t / used; i < n * (t + 1) / used; ++i) body(i);
  });
}

}  // namespace vllm_ms
