// The thread that executes one communicator's operations, and the Work handles that wait on them.
//
// Why a thread per communicator: OpenMPI advances a transfer only while some thread is inside an
// MPI call. A non-blocking MPI_I* call issued by the caller and not polled again while OpenMP
// compute holds every core would not move the large (rendezvous-protocol) messages at all. So each
// communicator owns one worker thread that executes its operations in issue order with blocking
// MPI calls: the operations of one communicator stay ordered (the contract of communicator.h),
// the operations of different communicators proceed independently (no cross-group deadlock), and
// the caller computes meanwhile without calling MPI. An idle worker sleeps on a condition
// variable; a busy one waits inside MPI, yielding its core (bootstrap sets mpi_yield_when_idle).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "trainer/comm/communicator.h"

namespace tetra {

// The completion of one queued operation (or of one group_start/group_end batch).
class Completion {
 public:
  void finish(std::exception_ptr error);  // called once, by the worker
  void wait();                            // blocks until finished; rethrows the operation's error
  bool test();                            // finished? (never blocks)
  // Held: the operation is not queued yet (a send/recv before its group_end); wait() throws
  // `why` instead of blocking forever, until release().
  void hold(std::string why);
  void release();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string held_;
  std::exception_ptr error_;
};

// Work handles: one waiting on a Completion, one already complete (size-1 groups).
WorkHandle make_work(std::shared_ptr<Completion> completion);
WorkHandle make_done_work();

class CommWorker {
 public:
  explicit CommWorker(const std::string& name);  // starts the thread, named "comm-<name>"
  ~CommWorker();                                 // shutdown()
  CommWorker(const CommWorker&) = delete;
  CommWorker& operator=(const CommWorker&) = delete;

  // Queues `task` behind every earlier one; `done` is finished when it has run, with the
  // exception it threw, if any. A task must own (share) everything it uses: see shutdown().
  void submit(std::shared_ptr<Completion> done, std::function<void()> task);

  // Stops the thread. With nothing queued or running it joins and returns true. Otherwise it
  // detaches the thread, which keeps its queue, and returns false at once: an operation whose
  // peers never arrive (one rank unwinding an error) must not turn into a hang; the job then ends
  // through dist_abort. Idempotent.
  bool shutdown();

 private:
  struct Task {
    std::shared_ptr<Completion> done;
    std::function<void()> run;
  };
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Task> queue;
    bool running = false;  // a task is executing
    bool stop = false;
  };
  static void loop(std::shared_ptr<State> state, std::string track);  // track: its name in traces

  std::shared_ptr<State> state_;
  std::thread thread_;
  bool joined_ = false;
};

}  // namespace tetra
