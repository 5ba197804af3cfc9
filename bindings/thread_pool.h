// A small persistent thread pool for the CPU kernels.
//
// Why not OpenMP: Apple clang ships without it, and MLX's own CPU stream thread
// calls our kernels, so we want a pool we control: sized by
// hardware_concurrency(), created once, and joined by the calling thread (the
// caller runs work items too, so a pool of N threads keeps N cores busy with
// N - 1 workers).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvmetal {

class ThreadPool {
 public:
  // The process-wide pool.
  static ThreadPool& instance();

  // Run fn(i) for i in [0, n), spread over the pool; returns when all are done.
  // Work items are claimed dynamically (an atomic counter), so uneven items
  // balance themselves. Calls from several threads are serialized.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

  // Threads that run work items, the caller included (>= 1).
  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Resize the pool (tests use it to show results do not depend on it).
  void set_num_threads(int n);

  ~ThreadPool();

 private:
  ThreadPool();
  void start(int n);
  void stop();
  void worker_loop();
  void run_items();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t job_size_ = 0;
  uint64_t generation_ = 0;  // bumped for every job, so workers see each once
  int64_t next_item_ = 0;    // guarded by mutex_
  int busy_workers_ = 0;
  bool stopping_ = false;
};

}  // namespace kvmetal
