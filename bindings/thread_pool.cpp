#include "thread_pool.h"

#include <algorithm>

namespace kvmetal {

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::ThreadPool() {
  unsigned hw = std::thread::hardware_concurrency();
  start(hw == 0 ? 1 : static_cast<int>(hw));
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::start(int n) {
  stopping_ = false;
  for (int i = 1; i < n; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::set_num_threads(int n) {
  std::lock_guard<std::mutex> call(call_mutex_);
  n = std::max(1, n);
  if (n == num_threads()) return;
  stop();
  start(n);
}

// Claim items one at a time until none are left. Items are coarse (a whole
// (sequence, kv-head chunk, split) of attention), so a mutex-guarded counter costs
// nothing measurable.
void ThreadPool::run_items() {
  for (;;) {
    int64_t i;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_item_ >= job_size_) return;
      i = next_item_++;
    }
    (*job_)(i);
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      ++busy_workers_;
    }
    run_items();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --busy_workers_;
    }
    done_.notify_all();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call(call_mutex_);
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_size_ = n;
    next_item_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  run_items();
  // Wait until every item is claimed and every worker that joined is done.
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return next_item_ >= job_size_ && busy_workers_ == 0; });
  job_ = nullptr;
  job_size_ = 0;
}

}  // namespace kvmetal
