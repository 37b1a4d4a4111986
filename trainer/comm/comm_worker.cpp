// The per-communicator worker thread and the Work handles (see comm_worker.h).
#include "trainer/comm/comm_worker.h"

#include <pthread.h>

#include "kernels/common/check.h"
#include "trainer/core/trace.h"

namespace tetra {

void Completion::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

void Completion::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!held_.empty()) throw Error(held_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool Completion::test() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void Completion::hold(std::string why) {
  std::lock_guard<std::mutex> lock(mutex_);
  held_ = std::move(why);
}

void Completion::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  held_.clear();
}

namespace {

class CompletionWork final : public Work {
 public:
  explicit CompletionWork(std::shared_ptr<Completion> c) : completion_(std::move(c)) {}
  void wait() override { completion_->wait(); }
  bool test() override { return completion_->test(); }

 private:
  std::shared_ptr<Completion> completion_;
};

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

}  // namespace

WorkHandle make_work(std::shared_ptr<Completion> completion) {
  return std::make_unique<CompletionWork>(std::move(completion));
}

WorkHandle make_done_work() { return std::make_unique<DoneWork>(); }

CommWorker::CommWorker(const std::string& name) : state_(std::make_shared<State>()) {
  thread_ = std::thread(&CommWorker::loop, state_, "comm " + name);
  const std::string thread_name = ("comm-" + name).substr(0, 15);  // the kernel keeps 15 characters
  pthread_setname_np(thread_.native_handle(), thread_name.c_str());
}

CommWorker::~CommWorker() { shutdown(); }

bool CommWorker::shutdown() {
  if (!thread_.joinable()) return joined_;
  bool idle = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
    idle = state_->queue.empty() && !state_->running;
  }
  state_->cv.notify_all();
  if (idle) {
    thread_.join();
  } else {
    thread_.detach();
  }
  joined_ = idle;
  return joined_;
}

void CommWorker::submit(std::shared_ptr<Completion> done, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TETRA_CHECK(!state_->stop, "operation queued on a communicator being destroyed");
    state_->queue.push_back(Task{std::move(done), std::move(task)});
  }
  state_->cv.notify_one();
}

void CommWorker::loop(std::shared_ptr<State> state, std::string track) {
  trace::name_thread(track);
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->running = false;
      state->cv.wait(lock, [&] { return state->stop || !state->queue.empty(); });
      if (state->queue.empty()) return;  // stopping, and everything queued has run
      task = std::move(state->queue.front());
      state->queue.pop_front();
      state->running = true;
    }
    std::exception_ptr error;
    try {
      task.run();
    } catch (...) {
      error = std::current_exception();
    }
    // Idle before the waiter wakes: a shutdown() right after the last wait() then joins instead of
    // taking the finished operation for one in flight.
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->running = false;
    }
    task.done->finish(std::move(error));
  }
}

}  // namespace tetra
