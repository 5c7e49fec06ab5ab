// mpi_watchdog.cpp: polling waits, the arrival questions and the timeout report.
#include "mpi_watchdog.hpp"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "describe.hpp"
#include "shardopt/comm.hpp"

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

Watchdog::Ticket Watchdog::enter(const char* name) {
  current_ = Ticket{entered_++, name};
  return current_;
}

void Watchdog::wait(const Ticket& t, int n, MPI_Request* requests) {
  if (!active()) {
    SHARDOPT_MPI(MPI_Waitall(n, requests, MPI_STATUSES_IGNORE));
    return;
  }
  const Clock::time_point start = Clock::now();
  double sleep = 20e-6;
  for (;;) {
    int done = 0;
    SHARDOPT_MPI(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE));
    if (done) return;
    if (interrupt_) interrupt_();
    const double waited = since(start);
    if (timeout_ > 0 && waited > timeout_) report_and_abort(t, waited);
    if (waited < kSpinSeconds) {
      // After a short pure spin (most collectives of a step complete within it), let a
      // rank or program that shares this CPU run.
      if (yield_ && waited > kPureSpinSeconds) sched_yield();
      continue;
    }
    answer_questions();
    std::this_thread::sleep_for(std::chrono::duration<double>(sleep));
    sleep = std::min(2 * sleep, kMaxSleepSeconds);
  }
}

void Watchdog::answer_questions() {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQuestionTag, comm_, &flag, &st) != MPI_SUCCESS || !flag) return;
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

void Watchdog::report_and_abort(const Ticket& t, double waited) {
  // Ask everyone; answer the others' questions while collecting (they time out too).
  const std::uint64_t asked = t.seq;
  std::vector<MPI_Request> sent;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    sent.emplace_back();
    MPI_Isend(&asked, 1, MPI_UINT64_T, r, kQuestionTag, comm_, &sent.back());
  }
  std::vector<int> answered(static_cast<std::size_t>(size_), 0);
  std::vector<Answer> answers(static_cast<std::size_t>(size_));
  int missing = size_ - 1;
  const Clock::time_point start = Clock::now();
  while (missing > 0 && since(start) < grace_seconds(timeout_)) {
    answer_questions();
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, comm_, &flag, &st) == MPI_SUCCESS && flag) {
      Answer a{};
      MPI_Recv(&a, sizeof a, MPI_BYTE, st.MPI_SOURCE, kAnswerTag, comm_, MPI_STATUS_IGNORE);
      const auto r = static_cast<std::size_t>(st.MPI_SOURCE);
      if (!answered[r]) --missing;
      answered[r] = 1;
      answers[r] = a;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(kMaxSleepSeconds));
  }

  const std::string mine = call_text(CallScope::current(), sizeof Answer{}.call);
  std::vector<int> silent;
  std::string behind, arrived = std::to_string(rank_) + " (" + mine + ")";
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const Answer& a = answers[static_cast<std::size_t>(r)];
    const std::string call = call_text(a.call, sizeof a.call);
    if (!answered[static_cast<std::size_t>(r)]) {
      silent.push_back(r);
    } else if (a.entered > t.seq) {
      arrived += ", " + std::to_string(r) + " (" + call + ")";
    } else {
      const std::string name(a.name, strnlen(a.name, sizeof a.name));
      behind += "; rank " + std::to_string(r) + " is in " + call + ", waiting in collective #" +
                std::to_string(a.waiting) + " (" + name + ")";
    }
  }
  char head[160];
  std::snprintf(head, sizeof head, "waited %.1f s (collective timeout %.3g s)", waited, timeout_);
  std::string msg = "shardopt: rank " + std::to_string(rank_) + ": collective timeout: " +
                    head + " in " + mine + ", collective #" + std::to_string(t.seq) + " (" +
                    t.name + "); ranks not arrived: ";
  if (silent.empty() && behind.empty()) msg += "none found";
  if (!silent.empty())
    msg += rank_list(silent) + " (no answer within " +
           std::to_string(static_cast<int>(grace_seconds(timeout_) * 1000)) +
           " ms: in no shardopt call (skipped this one, left the loop, or busy elsewhere), "
           "stopped, gone, or waiting without a timeout)";
  if (!silent.empty() && static_cast<int>(node_of_.size()) == size_)
    msg += "; by node: " + ranks_by_node(silent, node_of_, host_of_);
  if (!behind.empty()) msg += (silent.empty() ? behind.substr(2) : behind);
  msg += "; arrived: " + arrived + ". An MPI collective cannot be cancelled: "
         "aborting the job (MPI_Abort, error code " + std::to_string(kCollectiveTimeoutExitCode) +
         ").\n";
  std::fputs(msg.c_str(), stderr);
  std::fflush(stderr);
  // Gives the launcher time to forward the message: MPI_Abort tears the job down at once, and
  // MPICH's hydra once dropped every rank's pending output (a fresh-machine run of
  // test_collective_timeout, 1 of its 12 cases).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(MPI_COMM_WORLD, kCollectiveTimeoutExitCode);
  std::abort();  // MPI_Abort does not return; if it did, end this process anyway
}

}  // namespace shardopt::mpi
