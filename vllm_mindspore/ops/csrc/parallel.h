// The kernels' threads: one pool for the process, whichever thread calls a kernel.
//
// OpenMP (libgomp) keeps a pool per calling thread, and MindSpore calls the kernels from the
// Python thread and, now and then, from an actor thread. With two pools' threads on two CPUs
// libgomp "throttles" its waits to ~100 spins, so the other thread fell asleep between two
// kernels and every parallel loop paid a futex wake-up: 28% of a batch-1 decode call in `perf`
// was the kernel's scheduler. Here the workers spin for kSpinTime after each job (longer than the
// gaps between a step's kernels, shorter than the host's work between steps), then sleep.
// A spinning worker holds a CPU the engine's other threads and front-end process want between
// steps: on 2 vCPUs (AMD EPYC, batch-1 decode through `LLM.generate`) a spin of 250 us took
// 5.75 ms a token, 120 us 5.31, 60 us 4.85-5.05, 25 us 5.12 and 10 us 7.50 (shorter than some
// gaps between kernels: every kernel woke its worker); 64-request throughput was the same at
// 250 and 60 us.
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace vllm_ms {

// Threads each kernel call may use: the worker's share of the host's cores (SetNumThreads).
inline int num_threads = 1;

class Pool {
 public:
  // Runs job() on the calling thread and on each of the pool's num_threads - 1 workers that
  // gets to it before the caller's own call returns. The job hands out its work by claims, so any
  // one call may do all of it: when the caller's call returns the job is closed, and the caller
  // waits only for the workers that entered it. A worker the OS has put aside (the API server
  // runs on the same CPUs when serving) then costs a kernel nothing, where waiting for every
  // worker stalled each kernel until that worker ran again. A call made while the pool is busy
  // (another thread's kernel, or from inside a job) runs job() on the calling thread alone.
  template <typename Job>
  void run(const Job &job) {
    bool idle = false;
    if (num_threads <= 1 || !busy_.compare_exchange_strong(idle, true)) return job();
    grow(num_threads - 1);
    job_ = &job;
    call_ = [](const void *job) { (*static_cast<const Job *>(job))(); };
    left_.store(0, std::memory_order_relaxed);
    // seq_cst, as the worker's sleepers_ count before it reads state_: otherwise this thread could
    // read sleepers_ before its store is seen, and a worker going to sleep miss the job.
    state_.store(generation_of(state_.load()) + kGeneration);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    job();
    const uint64_t entered = state_.fetch_or(kClosed, std::memory_order_acq_rel) & kEntered;
    while (static_cast<uint64_t>(left_.load(std::memory_order_acquire)) != entered) _mm_pause();
    busy_.store(false);
  }

 private:
  static constexpr std::chrono::microseconds kSpinTime{60};
  // state_: the job's generation (high 32 bits), whether it is closed, how many workers entered.
  static constexpr uint64_t kGeneration = uint64_t{1} << 32, kClosed = uint64_t{1} << 31,
                            kEntered = kClosed - 1;
  static uint64_t generation_of(uint64_t state) { return state & ~(kGeneration - 1); }

  // Called before a job is published: a new worker takes part in it and in every later one.
  void grow(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      const uint64_t seen = generation_of(state_.load());
      workers_.emplace_back([this, seen] { work(seen); });
      workers_.back().detach();
    }
  }

  void work(uint64_t seen) {
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; generation_of(state_.load()) == seen; ++spins) {
        _mm_pause();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpinTime) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_of(state_.load()) != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      uint64_t state = state_.load(std::memory_order_acquire);
      seen = generation_of(state);
      // Enter the job unless the caller has closed it (or a newer one has started: the next
      // turn of the loop enters that).
      while (!(state & kClosed) && generation_of(state) == seen) {
        if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) {
          call_(job_);
          left_.fetch_add(1, std::memory_order_release);
          break;
        }
      }
    }
  }

  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> state_{kClosed};
  std::atomic<int> left_{0}, sleepers_{0};
  const void *job_ = nullptr;
  void (*call_)(const void *) = nullptr;
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

constexpr int64_t kMaxRanges = 64;

// body(i, next) for i in [0, n), one index at a time to whichever thread claims it, from
// `ranges` ranges [begin(g), begin(g + 1)) (begin(0) = 0, begin(ranges) = n, ranges <= kMaxRanges):
// the k-th thread to start claims from range k % ranges first, in order, then from the ranges
// after it. A thread so keeps to its own range's data while there is any (a prefill matmul's
// weight panels: each core's L2 then holds only its share of them) and helps with the others'
// at the end. With many indices (at least 4 a thread) or one thread, a thread claims its next
// index before it runs the current one, so the body can prefetch for `next` (-1: none, or in
// another range); with fewer, claiming ahead could leave a thread idle (two decodes: one each),
// and `next` is -1. A thread holds a ThreadState from its first index to its last. `parallel`
// off: all on the calling thread.
template <typename ThreadState = NoThreadState, typename Begin, typename Body>
void parallel_for_claiming_next_in_ranges(int64_t ranges, const Begin &begin, const Body &body,
                                          bool parallel = true) {
  struct alignas(64) Counter {
    std::atomic<int64_t> next;
  } claimed[kMaxRanges];
  if (ranges < 1 || ranges > kMaxRanges) std::abort();  // a caller's bug
  for (int64_t g = 0; g < ranges; ++g) claimed[g].next.store(begin(g));
  const int64_t n = begin(ranges);
  const bool ahead = !parallel || n >= 4 * int64_t{num_threads};
  std::atomic<int64_t> arrivals{0};
  auto work = [&] {
    const int64_t first = arrivals.fetch_add(1) % ranges;
    std::optional<ThreadState> state;
    for (int64_t k = 0; k < ranges; ++k) {
      const int64_t g = (first + k) % ranges, end = begin(g + 1);
      std::atomic<int64_t> &counter = claimed[g].next;
      for (int64_t i = counter.fetch_add(1); i < end;) {
        if (!state) state.emplace();
        const int64_t next = ahead ? counter.fetch_add(1) : -1;
        body(i, next < end ? next : -1);
        i = ahead ? next : counter.fetch_add(1);
      }
    }
  };
  if (parallel && n > 1)
    pool().run(work);
  else
    work();
}

// The same over [0, n) as one range.
template <typename ThreadState = NoThreadState, typename Body>
void parallel_for_claiming_next(int64_t n, const Body &body, bool parallel = true) {
  parallel_for_claiming_next_in_ranges<ThreadState>(
      1, [n](int64_t g) { return g * n; }, body, parallel);
}

// body(i) for i in [0, n) in `ranges` contiguous ranges, claimed one at a time by whichever
// thread is free, when `parallel` and n > 1.
template <typename Body>
void parallel_for_ranges(int64_t n, int64_t ranges, const Body &body, bool parallel = true) {
  if (!parallel || n <= 1 || num_threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<int64_t> claimed{0};
  pool().run([&] {
    for (int64_t r = claimed.fetch_add(1); r < ranges; r = claimed.fetch_add(1))
      for (int64_t i = n * r / ranges; i < n * (r + 1) / ranges; ++i) body(i);
  });
}

// body(i) for i in [0, n), about 4 ranges a thread (a thread that comes late finds some left).
template <typename Body>
void parallel_for(int64_t n, const Body &body, bool parallel = true) {
  parallel_for_ranges(n, std::min<int64_t>(n, 4 * int64_t{num_threads}), body, parallel);
}

// body(i) for i in [0, n), one index at a time: for indices of very unequal cost (the MoE
// experts' token counts).
template <typename Body>
void parallel_for_each_claimed(int64_t n, const Body &body) {
  parallel_for_ranges(n, n, body);
}

}  // namespace vllm_ms
