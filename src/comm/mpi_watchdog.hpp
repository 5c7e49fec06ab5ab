// mpi_watchdog.hpp: how the MPI communicators wait: the collective timeout
// (Communicator::set_collective_timeout) and yielding waits (MpiWait). Without a timeout and
// without yielding, waits are plain blocking MPI calls (or a spin on a shared-memory
// condition, wait_until). Otherwise every wait polls MPI_Test (or that condition):
// it spins for the first kSpinSeconds (calling sched_yield between polls after the first
// kPureSpinSeconds when yielding), then sleeps between polls (up to kMaxSleepSeconds); with a
// timeout, once it has waited longer it gives up: it asks every rank which call and collective
// it is in, prints its own, theirs and the ranks that have not arrived to stderr, and throws
// Error(Communication). Internal.
//
// Arrival. Every Communicator-level collective a rank enters gets the next number (enter());
// all ranks enter the same collectives in the same order, so a number names the same
// collective everywhere. A timed-out rank sends a question to every other rank (point to
// point, on the communicator's private duplicate, which carries no other point-to-point
// traffic); a rank that is itself waiting under the watchdog answers with how many
// collectives it has entered. A rank that does not answer within the grace period is stopped,
// busy outside the library, or waiting without a timeout: it is reported as not arrived.
//
// Giving up together. A waiting rank that is asked gives up too, at once (the collective can
// no longer complete: the asker has left it): it answers, asks every rank itself, and
// collects. Each rank that gives up keeps answering until the grace period ends (or until
// every other rank has both answered it and asked it), so every rank that was waiting within
// the grace hears from every other such rank, and all of them build the same report from the
// same answers (the Error's text names no rank-local detail; the stderr line adds the
// rank's own). Then it throws Error(Communication) with that text, and so does every later
// wait and collective of this watchdog: the abandoned MPI requests can never complete, so the
// communicator is unusable (failed()). Neither can MPI_Finalize complete while the missing
// ranks live (MPICH 4.0 waits for them), so a rank that gave up also arms a last resort: if
// its process still runs `timeout` seconds later (a program that called MPI_Finalize, or
// waits in its own collective), it prints why and ends the process (_exit with
// kCollectiveTimeoutExitCode), which makes the launcher end the job.
//
// Interrupt. A communicator built on this one (the NCCL communicator's host side) can ask
// every wait to call a function between polls (set_interrupt): it may throw to end the wait.
// A wait ended that way leaves its MPI requests unfinished, so the communicator must not be
// used for collectives again; the NCCL communicator throws on every call after an abort.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mpi_util.hpp"
#include "shardopt/mpi_comm.hpp"

namespace shardopt::mpi {

class Watchdog {
 public:
  static constexpr double kSpinSeconds = 0.05;
  static constexpr double kPureSpinSeconds = 50e-6;  ///< polls without yielding first
  static constexpr double kMaxSleepSeconds = 0.001;

  /// A collective as numbered on this rank: the same number on every rank.
  struct Ticket {
    std::uint64_t seq = 0;
    const char* name = "";  ///< a string literal
  };

  /// The communicator whose ranks the questions go to (the plain communicator's private
  /// duplicate); set once, before the first wait.
  void attach(MPI_Comm comm);
  void set_timeout(double seconds) { timeout_ = seconds; }
  /// Every rank's node and host (a job of several nodes): the timeout report then also names
  /// the nodes of the ranks that have not arrived.
  void set_nodes(std::vector<int> node_of, std::vector<std::string> host_of) {
    node_of_ = std::move(node_of);
    host_of_ = std::move(host_of);
  }
  /// Called between the polls of every wait, which polls even without a timeout once set.
  void set_interrupt(std::function<void()> interrupt) { interrupt_ = std::move(interrupt); }
  /// Whether waits yield for the resolved `wait` (Auto after the environment): Auto and
  /// Yield do, Block does not. A spinning rank holds its CPU against whatever else wants it:
  /// its own peers when ranks outnumber CPUs, any other program on a shared machine
  /// (docs/performance.md, "Waits on a shared machine").
  static bool should_yield(MpiWait wait) { return wait != MpiWait::Block; }
  /// Waits without a timeout poll and yield the CPU between polls (MpiWait::Yield).
  void set_yield(bool yield) { yield_ = yield; }
  /// Waits poll (a timeout or an interrupt is set, or they yield) instead of blocking in MPI.
  bool active() const { return timeout_ > 0 || interrupt_ != nullptr || yield_; }
  /// How long a rank that gave up waiting collects the other ranks' answers: timeout/4,
  /// clamped to 0.5-5 s (0.5 s without a timeout).
  static double grace_seconds(double timeout);

  /// Numbers the collective this rank enters now; `name` must be a string literal.
  Ticket enter(const char* name);
  /// The collective entered last (for waits inside it, e.g. the shared-memory barriers).
  const Ticket& current() const { return current_; }

  /// Waits for `n` requests of collective `t` (MPI_Waitall when waits do not poll). Throws
  /// Error(Communication) when it gives up (see above) or gave up before.
  void wait(const Ticket& t, int n, MPI_Request* requests);
  /// Waits until done() holds, polling it as wait() polls MPI_Testall (the same spin, yields,
  /// sleeps, timeout, questions and interrupt); when waits do not poll (MpiWait::Block, no
  /// timeout, no interrupt) it spins on done(). For a condition that MPI does not complete
  /// (the shared-memory node barrier, shm_window.hpp): once past the pure spin, every poll
  /// also runs MPI's progress engine, which this rank's other MPI requests in flight (a
  /// peer may be waiting for them) would otherwise get only from the sleep phase's questions.
  void wait_until(const Ticket& t, const std::function<bool()>& done);

  /// Whether this watchdog gave up on a collective: its communicator must not be used again
  /// (nor can it free its shared-memory windows: MPI_Win_free is collective).
  bool failed() const { return !failure_.empty(); }
  /// Throws the Error(Communication) of the collective it gave up on, if any.
  void throw_if_failed() const;
  /// The Error text of a give-up: the same on every rank that gave up together.
  const std::string& failure() const { return failure_; }

  /// Runs a blocking MPI collective: blocking() unless waits poll; then its non-blocking
  /// form start(&request), and wait(). Both throw through SHARDOPT_MPI.
  template <class Blocking, class Start>
  void run(const Ticket& t, Blocking&& blocking, Start&& start) {
    if (!active()) {
      blocking();
      return;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    start(&request);
    wait(t, 1, &request);
  }

 private:
  /// The polling wait of wait() and wait_until(); `progress`: done() is no MPI call.
  void poll(const Ticket& t, const std::function<bool()>& done, bool progress);
  /// Answers every question that has come in; returns whether one did (a peer gave up).
  bool answer_questions();
  [[noreturn]] void give_up(const Ticket& t, double waited);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_ = 0.0;
  bool yield_ = false;
  std::function<void()> interrupt_;
  std::vector<int> node_of_;
  std::vector<std::string> host_of_;
  std::uint64_t entered_ = 0;
  Ticket current_;
  std::vector<char> asked_by_;  ///< ranks whose question came in
  std::string failure_;
};

}  // namespace shardopt::mpi
