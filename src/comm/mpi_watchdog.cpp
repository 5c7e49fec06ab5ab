// mpi_watchdog.cpp: polling waits, the arrival questions and the timeout report.
#include "mpi_watchdog.hpp"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "describe.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/error.hpp"
#include "shardopt/options.hpp"

namespace shardopt::mpi {
namespace {

constexpr int kQuestionTag = 7301;
constexpr int kAnswerTag = 7302;

struct Answer {
  std::uint64_t entered;  // collectives this rank has entered
  std::uint64_t waiting;  // the collective it waits in
  char name[48];          // and its name
  char call[64];          // the library call it is in (CallScope)
};

// "step", or "(no shardopt call named)" outside every CallScope.
std::string call_text(const char* call, std::size_t size) {
  const std::string c(call, strnlen(call, size));
  return c.empty() ? "(no shardopt call named)" : c;
}

// The spin-wait hint (PAUSE on x86): a spinning poll of shared memory leaves the core's
// other hardware thread its resources and does not flood the memory bus.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

double Watchdog::grace_seconds(double timeout) { return std::clamp(timeout / 4, 0.5, 5.0); }

void Watchdog::attach(MPI_Comm comm) {
  comm_ = comm;
  SHARDOPT_MPI(MPI_Comm_rank(comm_, &rank_));
  SHARDOPT_MPI(MPI_Comm_size(comm_, &size_));
}

void Watchdog::throw_if_failed() const {
  if (failed())
    throw Error(Status::Communication, "this communicator gave up on a collective earlier: " + failure_);
}

Watchdog::Ticket Watchdog::enter(const char* name) {
  throw_if_failed();
  current_ = Ticket{entered_++, name};
  return current_;
}

void Watchdog::wait(const Ticket& t, int n, MPI_Request* requests) {
  throw_if_failed();
  if (!active()) {
    SHARDOPT_MPI(MPI_Waitall(n, requests, MPI_STATUSES_IGNORE));
    return;
  }
  poll(
      t,
      [&] {
        int done = 0;
        SHARDOPT_MPI(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE));
        return done != 0;
      },
      false);
}

void Watchdog::wait_until(const Ticket& t, const std::function<bool()>& done) {
  throw_if_failed();
  if (!active()) {
    while (!done()) cpu_relax();  // MpiWait::Block: spins, as MPI's blocking calls do
    return;
  }
  poll(t, done, true);
}

void Watchdog::poll(const Ticket& t, const std::function<bool()>& done, bool progress) {
  const Clock::time_point start = Clock::now();
  double sleep = 20e-6;
  for (;;) {
    if (done()) return;
    if (interrupt_) interrupt_();
    const double waited = since(start);
    if (timeout_ > 0 && waited > timeout_) give_up(t, waited);
    if (waited < kSpinSeconds) {
      if (waited > kPureSpinSeconds) {
        if (progress && comm_ != MPI_COMM_NULL) {  // MPI progress, the question left queued
          int flag = 0;
          MPI_Iprobe(MPI_ANY_SOURCE, kQuestionTag, comm_, &flag, MPI_STATUS_IGNORE);
        }
        // After a short pure spin (most collectives of a step complete within it), let a
        // rank or program that shares this CPU run.
        if (yield_) sched_yield();
      } else if (progress) {
        cpu_relax();
      }
      continue;
    }
    // A peer that asks has given up on its collective: this one cannot complete either.
    if (answer_questions()) give_up(t, waited);
    std::this_thread::sleep_for(std::chrono::duration<double>(sleep));
    sleep = std::min(2 * sleep, kMaxSleepSeconds);
  }
}

bool Watchdog::answer_questions() {
  bool asked = false;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQuestionTag, comm_, &flag, &st) != MPI_SUCCESS || !flag)
      return asked;
    asked = true;
    asked_by_.resize(static_cast<std::size_t>(size_), 0);
    asked_by_[static_cast<std::size_t>(st.MPI_SOURCE)] = 1;
    std::uint64_t asked = 0;
    MPI_Recv(&asked, 1, MPI_UINT64_T, st.MPI_SOURCE, kQuestionTag, comm_, MPI_STATUS_IGNORE);
    Answer a{};
    a.entered = entered_;
    a.waiting = current_.seq;
    std::strncpy(a.name, current_.name, sizeof a.name - 1);
    std::strncpy(a.call, CallScope::current(), sizeof a.call - 1);
    // Small enough to be sent eagerly: returns without waiting for the asker.
    MPI_Send(&a, sizeof a, MPI_BYTE, st.MPI_SOURCE, kAnswerTag, comm_);
  }
}

namespace {

// The last resort after a give-up (mpi_watchdog.hpp): one per process.
void arm_exit(double seconds, const std::string& why) {
  static std::once_flag once;
  std::call_once(once, [seconds, why] {
    std::thread([seconds, why] {
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      const std::string msg = why + "\n";
      // write(2), not stdio: another thread may hold stderr's lock (and this one must not wait).
      [[maybe_unused]] const ssize_t w = ::write(2, msg.data(), msg.size());
      // MPI_Abort, not a plain exit: across nodes, MPICH's hydra left the job running when a
      // rank exited while another node's ranks were stopped (measured on pretend nodes), and
      // its abort takes every node down. From this thread while the program's may be inside
      // MPI: an MPI library may refuse that, so the exit follows if it returns.
      MPI_Abort(MPI_COMM_WORLD, kCollectiveTimeoutExitCode);
      ::_exit(kCollectiveTimeoutExitCode);
    }).detach();
  });
}

}  // namespace

void Watchdog::give_up(const Ticket& t, double waited) {
  // Ask everyone; answer the others' questions while collecting (they give up too).
  // The sends may never complete (a stopped rank does not receive), so their buffer outlives
  // this call and the watchdog: 8 bytes, once per give-up.
  const std::uint64_t* asked = new std::uint64_t(t.seq);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request q = MPI_REQUEST_NULL;
    if (MPI_Isend(asked, 1, MPI_UINT64_T, r, kQuestionTag, comm_, &q) == MPI_SUCCESS)
      MPI_Request_free(&q);
  }
  asked_by_.resize(static_cast<std::size_t>(size_), 0);
  std::vector<int> answered(static_cast<std::size_t>(size_), 0);
  std::vector<Answer> answers(static_cast<std::size_t>(size_));
  const double grace = grace_seconds(timeout_);
  const Clock::time_point start = Clock::now();
  auto everyone_heard = [&] {
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && !(answered[static_cast<std::size_t>(r)] && asked_by_[static_cast<std::size_t>(r)]))
        return false;
    return true;
  };
  while (!everyone_heard() && since(start) < grace) {
    answer_questions();
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, comm_, &flag, &st) == MPI_SUCCESS && flag) {
      Answer a{};
      MPI_Recv(&a, sizeof a, MPI_BYTE, st.MPI_SOURCE, kAnswerTag, comm_, MPI_STATUS_IGNORE);
      const auto r = static_cast<std::size_t>(st.MPI_SOURCE);
      answered[r] = 1;
      answers[r] = a;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(kMaxSleepSeconds));
  }

  // The report: built only from what every rank that gave up together knows alike (the
  // collective's number and name, the answers, the calls), so their texts are equal.
  const std::string mine = call_text(CallScope::current(), sizeof Answer{}.call);
  std::vector<int> silent;
  std::string behind, arrived;
  for (int r = 0; r < size_; ++r) {
    const Answer& a = answers[static_cast<std::size_t>(r)];
    if (r == rank_) {
      arrived += (arrived.empty() ? "" : ", ") + std::to_string(r) + " (" + mine + ")";
    } else if (!answered[static_cast<std::size_t>(r)]) {
      silent.push_back(r);
    } else if (a.entered > t.seq) {
      arrived += (arrived.empty() ? "" : ", ") + std::to_string(r) + " (" +
                 call_text(a.call, sizeof a.call) + ")";
    } else {
      const std::string name(a.name, strnlen(a.name, sizeof a.name));
      behind += "; rank " + std::to_string(r) + " is in " + call_text(a.call, sizeof a.call) +
                ", waiting in collective #" + std::to_string(a.waiting) + " (" + name + ")";
    }
  }
  char timeout_text[64];
  std::snprintf(timeout_text, sizeof timeout_text, "%.3g s", timeout_);
  std::string msg = std::string("collective timeout (") + timeout_text + "): collective #" +
                    std::to_string(t.seq) + " (" + t.name + ") did not complete; ranks not arrived: ";
  if (silent.empty() && behind.empty()) msg += "none found";
  if (!silent.empty())
    msg += rank_list(silent) + " (no answer within " +
           std::to_string(static_cast<int>(grace * 1000)) +
           " ms: in no shardopt call (skipped this one, left the loop, or busy elsewhere), "
           "stopped, gone, or waiting without a timeout)";
  if (!silent.empty() && static_cast<int>(node_of_.size()) == size_)
    msg += "; by node: " + ranks_by_node(silent, node_of_, host_of_);
  if (!behind.empty()) msg += (silent.empty() ? behind.substr(2) : behind);
  msg += "; gave up together: " + arrived +
         ". This communicator cannot be used again, and MPI cannot cancel the abandoned "
         "collective (MPI_Finalize would wait for the missing ranks): end the job with "
         "MPI_Abort; a process still running " + std::string(timeout_text) +
         " after this error is ended by shardopt (code " +
         std::to_string(kCollectiveTimeoutExitCode) + ").";
  char head[200];
  std::snprintf(head, sizeof head, "shardopt: rank %d: collective timeout: waited %.1f s in ",
                rank_, waited);
  const std::string line = head + mine + ", collective #" + std::to_string(t.seq) + " (" +
                           t.name + "): Error(Communication): " + msg + "\n";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  // Gives the launcher time to forward the report: a program's MPI_Abort right after the
  // error tears the job down at once, and MPICH's hydra then drops pending output (seen in
  // test_collective_timeout without this pause).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  failure_ = msg;
  arm_exit(timeout_ > 0 ? timeout_ : kDefaultCollectiveTimeoutS,
           "shardopt: rank " + std::to_string(rank_) + ": still running " + timeout_text +
               " after the collective timeout's Error(Communication) (the process must end "
               "without MPI_Finalize): ending it (exit code " +
               std::to_string(kCollectiveTimeoutExitCode) + ")");
  throw Error(Status::Communication, msg);
}

}  // namespace shardopt::mpi
