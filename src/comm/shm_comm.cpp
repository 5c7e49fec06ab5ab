// shm_comm.cpp: reduce-scatter and all-gather over MPI-3 shared-memory windows inside a
// node, MPI collectives between node leaders.
//
// Inside a node every rank addresses every peer's segment of a window directly. A
// reduce-scatter sums each output block across the peers' buffers into the block's own place
// in its owner's buffer, the work of every block split between all node ranks (so uneven
// blocks, as in stage-2 buckets, still use every core); an all-gather copies the peers'
// blocks. ShmWindow::sync() (MPI_Win_sync + node
// barrier) separates the phases in which a buffer is read from those in which it is written.
// The node barrier is the window's own arrival counter in shared memory (shm_window.cpp), no
// MPI call: a rank goes on as soon as its peers have arrived, whichever of them are scheduled.
//
// Non-blocking on one node. start_reduce_scatter_sum, start_all_gather and
// start_all_reduce_sum return a request (ShmRequest) that is a list of local steps separated
// by node barriers: it starts the first barrier (or queues behind earlier requests, see
// below) and returns; test() runs
// whatever steps the barriers completed so far allow, without waiting; wait() runs the rest.
// So a trainer that calls test() (BucketSet::progress) while its accelerator computes does
// the copies then, as MPI does its own collectives' work inside MPI_Test. Requests advance in
// the order they were started (ShmQueue), the same on every rank, and only the oldest one has
// a barrier in flight: a window's barriers are matched by the order each rank starts them
// (the k-th of every rank is one barrier), so a later request's first barrier must not come
// between an earlier one's barriers on one rank and after them on another. Every blocking
// collective of this communicator first completes the pending ones (drain), so no rank can
// block in one collective while a peer waits for its part of an earlier one. Several nodes
// keep the blocking form. SHARDOPT_SHM_BLOCKING=1 makes every start wait for its request
// (the behaviour before 2026-11-26), to measure what the non-blocking form hides.
//
// Batches (start_batch, issue 29): on one node, collectives of disjoint buffers in the windows
// started together are one ShmRequest, whose step k runs step k of each of them: one round of
// node barriers for the batch instead of one per collective, the same sums and copies.
//
// Clearing while summing (issue 29): a reduce-scatter started with clear_inputs on one node zeroes
// each rank's input blocks other than the owner's as the parts are summed, so stage 2's staging
// slot needs only its owner's block cleared afterwards (clears_inputs()).
//
// Summation order: within a node, node ranks 0, 1, 2, ... left to right in fp32 (node ranks
// follow world ranks). Across nodes, the node sums are combined by MPI_Reduce_scatter on the
// leaders (MPI's own order).
#include "shm_comm.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "mpi_util.hpp"
#include "shm_kernels.hpp"
#include "shm_window.hpp"

namespace shardopt::shm {
namespace {

// A buffer of this rank inside a window, and the same offset in every peer's segment.
struct WindowView {
  const ShmWindow* win = nullptr;
  std::size_t offset = 0;
  std::shared_ptr<const ShmWindow> keep;  ///< holds the window while a request uses it
  char* at(int node_rank) const { return win->segment(node_rank) + offset; }
  float* f32(int node_rank) const { return reinterpret_cast<float*>(at(node_rank)); }
};

// Whether the shared-memory file system has `bytes` free (true when it cannot be inspected).
bool shm_has_room(std::size_t bytes) {
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) != 0) return true;
  return static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) >=
         static_cast<double>(bytes);
}

class ShmRequest;

// The node collectives started and not yet complete, in start order (the same on every rank).
class ShmQueue {
 public:
  /// Queues r; it starts (its first barrier) once every earlier request has completed.
  void push(ShmRequest* r);
  /// Advances the requests up to and including r, in order; without `block`, only as far as
  /// completed barriers allow. Returns whether r is complete.
  bool advance_to(ShmRequest* r, bool block);
  /// Completes every pending request (before a blocking collective).
  void drain();
  /// A request going away (completed, or its wait failed).
  void forget(ShmRequest* r) { std::erase(pending_, r); }

 private:
  void pop_front();  // the front completed: the next one starts
  std::deque<ShmRequest*> pending_;
};

// One node collective in flight (or a batch of them, start_batch): steps of local work, each
// after a node barrier, and a last barrier after them (barrier, step 0, barrier, step 1, ...,
// barrier). The barriers order the stores to every window the steps touch.
class ShmRequest final : public CommRequest {
 public:
  ShmRequest(ShmQueue& queue, std::shared_ptr<mpi::Watchdog> dog, mpi::Watchdog::Ticket ticket,
             std::vector<std::shared_ptr<const ShmWindow>> wins,
             std::vector<std::function<void()>> steps)
      : queue_(queue), dog_(std::move(dog)), ticket_(ticket), wins_(std::move(wins)),
        steps_(std::move(steps)) {
    queue_.push(this);
  }
  ~ShmRequest() override {
    if (!done_) {
      try {
        wait();
      } catch (...) {  // a destructor cannot report; the next collective will
      }
    }
    queue_.forget(this);
  }
  bool test() override { return done_ || queue_.advance_to(this, false); }
  void wait() override {
    if (!done_) queue_.advance_to(this, true);
  }

  /// Starts the first barrier (the queue's front only).
  void start() {
    if (started_) return;
    started_ = true;
    start_barrier();
  }
  /// Runs the steps whose barriers have completed (all of them with `block`, waiting under
  /// the watchdog: timeouts and yielding as for every other wait). Returns whether done.
  bool advance(bool block) {
    dog_->throw_if_failed();
    start();
    while (!done_) {
      if (block) wins_[0]->wait(barrier_, ticket_);
      else if (!wins_[0]->arrived(barrier_)) return false;
      for (const auto& w : wins_) w->finish_sync();
      if (next_ == steps_.size()) {
        done_ = true;
        break;
      }
      steps_[next_++]();
      start_barrier();
    }
    return true;
  }
  bool done() const { return done_; }

 private:
  // This rank's stores to every window made visible (finish_sync is MPI_Win_sync alone), then
  // one node barrier for all of them.
  void start_barrier() {
    for (std::size_t k = 1; k < wins_.size(); ++k) wins_[k]->finish_sync();
    barrier_ = wins_[0]->start_sync();
  }

  ShmQueue& queue_;
  std::shared_ptr<mpi::Watchdog> dog_;
  mpi::Watchdog::Ticket ticket_;
  std::vector<std::shared_ptr<const ShmWindow>> wins_;  ///< distinct, at least one
  std::vector<std::function<void()>> steps_;
  std::size_t next_ = 0;  ///< steps run
  ShmWindow::Barrier barrier_;  ///< the one in flight (on the first window)
  bool started_ = false;
  bool done_ = false;
};

// One collective's request inside a batch (start_batch): the batch completes as a whole.
class BatchPart final : public CommRequest {
 public:
  explicit BatchPart(std::shared_ptr<ShmRequest> batch) : batch_(std::move(batch)) {}
  bool test() override { return batch_->test(); }
  void wait() override { batch_->wait(); }

 private:
  std::shared_ptr<ShmRequest> batch_;  ///< the last part going away completes it
};

void ShmQueue::push(ShmRequest* r) {
  pending_.push_back(r);
  if (pending_.size() == 1) r->start();
}

void ShmQueue::pop_front() {
  pending_.pop_front();
  if (!pending_.empty()) pending_.front()->start();
}

bool ShmQueue::advance_to(ShmRequest* r, bool block) {
  while (!r->done()) {
    ShmRequest* front = pending_.front();  // r is pending, so there is a front
    if (!front->advance(block)) return false;
    pop_front();
  }
  return true;
}

void ShmQueue::drain() {
  while (!pending_.empty()) {
    pending_.front()->advance(true);
    pop_front();
  }
}

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(std::shared_ptr<Communicator> plain, std::shared_ptr<NodeTopology> topo,
                  std::shared_ptr<mpi::Watchdog> dog, bool clear_inputs)
      : plain_(std::move(plain)), topo_(std::move(topo)), dog_(std::move(dog)),
        clear_inputs_(clear_inputs) {
    const char* env = std::getenv("SHARDOPT_SHM_BLOCKING");
    blocking_ = env != nullptr && std::string(env) == "1";
  }
  ~ShmCommunicator() override {
    try {
      queue_.drain();
    } catch (...) {  // a destructor cannot report
    }
  }

  int rank() const override { return topo_->world_rank; }
  int size() const override { return topo_->world_size; }
  std::string name() const override {
    if (topo_->num_nodes == 1) return "mpi-shm";
    return "mpi-shm-hierarchical(" + std::to_string(topo_->num_nodes) + " nodes)";
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    queue_.drain();
    plain_->all_reduce_sum(buf, count, type);
  }
  // Reproducible mode: inside a window on one node, by loads and stores like the fp32
  // reduce-scatter (integer sums and maxima: any order gives the same result); otherwise
  // plain MPI.
  void reduce_scatter_int(void* buf, std::size_t count, IntOp op) override {
    const std::size_t elem = op == IntOp::SumI64 ? sizeof(std::int64_t) : 1;
    const std::size_t n = static_cast<std::size_t>(size());
    queue_.drain();
    const WindowView v = find(buf, count * n * elem);
    if (v.win == nullptr || topo_->num_nodes != 1) return plain_->reduce_scatter_int(buf, count, op);
    dog_->enter("reduce_scatter_int (shared memory)");
    v.win->sync();
    for (int k = 0; k < topo_->node_size; ++k)  // block k, into its owner's buffer
      reduce_int_part(v, op, static_cast<std::size_t>(k) * count, count, k);
    v.win->sync();
  }
  // Reproducible mode's direct exchange inside windows on one node: every block is split
  // between the node's ranks like the fp32 reduce-scatter, and each rank combines its part
  // from every peer's elements, writing into the block's owner's `out` (both buffers in
  // windows). Several nodes, or a buffer outside the windows, take plain MPI's all-to-all.
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out, std::size_t count,
                              BlockCombiner& op) override {
    const std::size_t n = static_cast<std::size_t>(size());
    queue_.drain();
    const Input one[1] = {{find(in, count * n * elem_bytes), elem_bytes}};
    const WindowView vout = find(out, count * n * sizeof(float));
    if (one[0].view.win == nullptr || vout.win == nullptr || topo_->num_nodes != 1)
      return plain_->reduce_scatter_combine(in, elem_bytes, out, count, op);
    combine_in_place(one, vout, out, count, op);
    return true;
  }
  // The same with two inputs; nothing to fall back on (plain MPI's exchange cannot read in
  // place): false unless all three buffers are in windows on one node.
  bool reduce_scatter_combine_pair(const void* in, std::size_t elem_bytes, const void* in2,
                                   std::size_t elem_bytes2, float* out, std::size_t count,
                                   BlockCombiner& op) override {
    const std::size_t n = static_cast<std::size_t>(size());
    queue_.drain();
    const Input two[2] = {{find(in, count * n * elem_bytes), elem_bytes},
                          {find(in2, count * n * elem_bytes2), elem_bytes2}};
    const WindowView vout = find(out, count * n * sizeof(float));
    if (two[0].view.win == nullptr || two[1].view.win == nullptr || vout.win == nullptr ||
        topo_->num_nodes != 1)
      return false;
    combine_in_place(two, vout, out, count, op);
    return true;
  }
  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    const std::size_t elem = op == IntOp::SumI64 ? sizeof(std::int64_t) : 1;
    queue_.drain();
    const WindowView v = find(buf, count * elem);
    if (v.win == nullptr || topo_->num_nodes != 1) return plain_->all_reduce_int(buf, count, op);
    dog_->enter("all_reduce_int (shared memory)");
    v.win->sync();
    reduce_int_part(v, op, 0, count, -1);
    v.win->sync();
  }
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    queue_.drain();
    plain_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    queue_.drain();
    plain_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    queue_.drain();
    plain_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override {
    queue_.drain();
    plain_->barrier();
  }
  void set_collective_timeout(double seconds) override { plain_->set_collective_timeout(seconds); }
  // The leader's count of what its node exchanged with the others (hierarchical paths).
  std::uint64_t internode_bytes() const override { return internode_; }

  Allocation allocate_collective_buffer(MemoryTracker* tracker, MemCategory category,
                                        std::size_t bytes) override {
    const BufferRequest one[1] = {{category, bytes}};
    return std::move(allocate_collective_buffers(tracker, one)[0]);
  }

  // All of them in one window (each at a whole cache line): a window's creation is several
  // node-wide rounds inside MPI, which spin (docs/performance.md, "CI time").
  std::vector<Allocation> allocate_collective_buffers(
      MemoryTracker* tracker, std::span<const BufferRequest> requests) override {
    constexpr std::size_t kLine = 64;
    std::vector<Allocation> out(requests.size());
    std::vector<std::size_t> offset(requests.size());
    std::size_t total = 0;
    for (std::size_t k = 0; k < requests.size(); ++k) {
      offset[k] = total;
      total += (requests[k].bytes + kLine - 1) / kLine * kLine;
    }
    if (total == 0) return out;
    queue_.drain();
    // Shared segments live in tmpfs, which overcommits: a full /dev/shm (containers default
    // to 64 MiB) would fault on first touch instead of failing here. Every rank falls back to
    // its backend's memory (and plain MPI) if any node lacks the room.
    const std::size_t node_bytes = total * static_cast<std::size_t>(topo_->node_size);
    double short_of_room = shm_has_room(node_bytes) ? 0 : 1;
    plain_->all_reduce_sum_host(&short_of_room, 1);
    if (short_of_room != 0) return out;
    dog_->enter("allocate_collective_buffer");
    auto win = std::make_shared<ShmWindow>(topo_, total, dog_);
    std::erase_if(windows_, [](const std::weak_ptr<ShmWindow>& w) { return w.expired(); });
    windows_.push_back(win);
    for (std::size_t k = 0; k < requests.size(); ++k)
      if (requests[k].bytes > 0)
        out[k] = Allocation(win->mine() + offset[k], requests[k].bytes, win, tracker,
                            requests[k].category);
    return out;
  }

  // On one node the shared-memory collectives return a pending ShmRequest; on several they
  // complete before they return (node barriers and leader collectives inside). Everything
  // else is the plain MPI communicator's.
  //
  // The uneven forms take the same paths with per-rank block offsets: on one node every
  // block is summed by all node ranks together (a single-owner bucket is split between them
  // like an equal one); on several, the leaders' reduce-scatter and all-gather are uneven
  // already. A bf16 wire or a buffer outside the windows takes plain MPI's form.
  //
  // Inside a window, an all-reduce is the reduce-scatter followed by the all-gather (each
  // rank sums 1/N of the buffer, then copies the other N-1 parts): 2 (N-1)/N of the buffer
  // read from peers, as a ring all-reduce moves, without MPI's out-of-place temporaries.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    return start_one({BatchedCollective::Op::ReduceScatterSum, buf, count, {}, wire});
  }
  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    return start_one({BatchedCollective::Op::AllGather, buf, count, {}, type});
  }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    return start_one({BatchedCollective::Op::ReduceScatterSumV, buf, 0, counts, wire});
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    return start_one({BatchedCollective::Op::AllGatherV, buf, 0, counts, type});
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    return start_one({BatchedCollective::Op::AllReduceSum, buf, count, {}, wire});
  }

  std::unique_ptr<CommRequest> start_collective(const BatchedCollective& c) override {
    return start_one(c);
  }
  // A reduce-scatter that runs on one node in the windows sums every block from every rank's
  // buffer, so its sums can zero what they read (node_reduce_scatter_step).
  bool clears_inputs(const BatchedCollective& c) const override {
    using Op = BatchedCollective::Op;
    if (!c.clear_inputs || !clear_inputs_ || topo_->num_nodes != 1) return false;
    if (c.op != Op::ReduceScatterSum && c.op != Op::ReduceScatterSumV) return false;
    return work(c).v.win != nullptr;
  }

  // A batch on one node, every buffer in the windows: one ShmRequest whose step k runs step k
  // of every collective of the batch (the same work, so the same bits), with one round of
  // node barriers per step for the whole batch. The collectives' buffers are disjoint, so
  // their steps do not race with each other. Otherwise one by one.
  std::vector<std::unique_ptr<CommRequest>> start_batch(
      std::span<const BatchedCollective> batch) override {
    if (topo_->num_nodes != 1 || batch.size() < 2) return Communicator::start_batch(batch);
    std::vector<Work> works;
    works.reserve(batch.size());
    std::size_t phases = 0;
    std::vector<std::shared_ptr<const ShmWindow>> wins;
    for (const BatchedCollective& c : batch) {
      works.push_back(work(c));
      const Work& w = works.back();
      if (w.v.win == nullptr) return Communicator::start_batch(batch);  // alike on every rank
      phases = std::max(phases, w.steps.size());
      if (std::find(wins.begin(), wins.end(), w.v.keep) == wins.end()) wins.push_back(w.v.keep);
    }
    const mpi::Watchdog::Ticket t = dog_->enter("batch of collectives (shared memory)");
    std::vector<std::function<void()>> steps;
    for (std::size_t k = 0; k < phases; ++k) {
      std::vector<std::function<void()>> parts;
      for (Work& w : works)
        if (k < w.steps.size()) parts.push_back(std::move(w.steps[k]));
      steps.push_back([parts = std::move(parts)] {
        for (const std::function<void()>& f : parts) f();
      });
    }
    auto r = std::make_shared<ShmRequest>(queue_, dog_, t, std::move(wins), std::move(steps));
    if (blocking_) r->wait();
    std::vector<std::unique_ptr<CommRequest>> requests;
    requests.reserve(batch.size());
    for (std::size_t k = 0; k < batch.size(); ++k) requests.push_back(std::make_unique<BatchPart>(r));
    return requests;
  }

 private:
  // What collective c does here: its window, its blocks' offsets (elements for the
  // reductions, bytes for the gathers) and counts, and on one node its steps between node
  // barriers. v.win == nullptr: plain MPI's (a buffer outside the windows, a bf16 wire, an
  // all-reduce not cut in equal blocks, nodes of non-consecutive ranks).
  struct Work {
    WindowView v;
    std::vector<std::size_t> start;
    std::vector<std::size_t> counts;  ///< the reduce-scatters' (several nodes)
    std::vector<std::function<void()>> steps;
    const char* name = "";
  };
  Work work(const BatchedCollective& c) const {
    using Op = BatchedCollective::Op;
    const std::size_t n = static_cast<std::size_t>(size());
    const bool reduction = c.op == Op::ReduceScatterSum || c.op == Op::ReduceScatterSumV ||
                           c.op == Op::AllReduceSum;
    Work w;
    std::size_t bytes = 0;
    switch (c.op) {
      case Op::ReduceScatterSum:
        w.name = "reduce_scatter_sum (shared memory)";
        w.start = offsets(c.count, 1);
        w.counts.assign(n, c.count);
        bytes = w.start.back() * sizeof(float);
        break;
      case Op::ReduceScatterSumV:
        w.name = "reduce_scatter_sum_v (shared memory)";
        w.start = uneven_offsets(c.counts, size(), "reduce_scatter_sum_v");
        w.counts.assign(c.counts.begin(), c.counts.end());
        bytes = w.start.back() * sizeof(float);
        break;
      case Op::AllGather:
        w.name = "all_gather (shared memory)";
        w.start = offsets(c.count, mpi::type_size(c.type));  // bytes
        bytes = w.start.back();
        break;
      case Op::AllGatherV:
        w.name = "all_gather_v (shared memory)";
        w.start = uneven_offsets(c.counts, size(), "all_gather_v");
        require(c.type == CommType::F32 || c.type == CommType::U16, Status::InvalidArgument,
                "all_gather_v: type F32 or U16");
        for (std::size_t& s : w.start) s *= mpi::type_size(c.type);  // bytes
        bytes = w.start.back();
        break;
      case Op::AllReduceSum:
        w.name = "all_reduce_sum (shared memory)";
        if (c.count % n != 0) return w;
        w.start = offsets(c.count / n, 1);
        w.counts.assign(n, c.count / n);
        bytes = c.count * sizeof(float);
        break;
    }
    if (reduction && c.type != CommType::F32) return w;
    w.v = find(c.buf, bytes);
    if (w.v.win == nullptr || !hierarchy_usable()) {
      w.v = {};
      return w;
    }
    if (topo_->num_nodes != 1) return w;
    switch (c.op) {
      case Op::ReduceScatterSum:
        w.steps = {node_reduce_scatter_step(w.v, c.count, w.start, c.clear_inputs && clear_inputs_)};
        break;
      case Op::ReduceScatterSumV:
        w.steps = {node_reduce_scatter_v_step(w.v, w.counts, w.start, c.clear_inputs && clear_inputs_)};
        break;
      case Op::AllGather: w.steps = {node_all_gather_step(w.v, w.start)}; break;
      case Op::AllGatherV: w.steps = {node_all_gather_v_step(w.v, w.start)}; break;
      case Op::AllReduceSum:
        w.steps = {node_reduce_scatter_step(w.v, c.count / n, w.start, false),
                   node_all_gather_step(w.v, offsets(c.count / n, sizeof(float)))};
        break;
    }
    return w;
  }

  // One collective: pending on one node, complete on return on several.
  std::unique_ptr<CommRequest> start_one(const BatchedCollective& c) {
    Work w = work(c);
    if (w.v.win == nullptr) return plain_->start_collective(c);
    const mpi::Watchdog::Ticket t = dog_->enter(w.name);
    if (topo_->num_nodes == 1) {
      auto r = std::make_unique<ShmRequest>(queue_, dog_, t,
                                            std::vector<std::shared_ptr<const ShmWindow>>{w.v.keep},
                                            std::move(w.steps));
      if (blocking_) r->wait();
      return r;
    }
    queue_.drain();
    using Op = BatchedCollective::Op;
    switch (c.op) {
      case Op::ReduceScatterSum:
      case Op::ReduceScatterSumV:
        hierarchical_reduce_scatter(w.v, w.counts, w.start);
        break;
      case Op::AllGather:
      case Op::AllGatherV:
        hierarchical_all_gather(w.v, w.start);
        break;
      case Op::AllReduceSum:
        hierarchical_reduce_scatter(w.v, w.counts, w.start);
        hierarchical_all_gather(w.v, offsets(c.count / static_cast<std::size_t>(size()), sizeof(float)));
        break;
    }
    return completed_request();
  }

  // Non-consecutive placements would need a permutation between the node and leader
  // levels; they take the plain path instead.
  bool hierarchy_usable() const { return topo_->num_nodes == 1 || topo_->contiguous; }

  // The window holding [p, p + bytes) of this rank's segment, if any. Every rank passes
  // buffers obtained the same way, so all of them take the same path.
  WindowView find(const void* p, std::size_t bytes) const {
    const char* c = static_cast<const char*>(p);
    for (const std::weak_ptr<ShmWindow>& w : windows_) {
      const std::shared_ptr<ShmWindow> win = w.lock();
      if (!win) continue;
      const char* mine = win->mine();
      if (c >= mine && c + bytes <= mine + win->bytes())
        return WindowView{win.get(), static_cast<std::size_t>(c - mine), win};
    }
    return {};
  }

  // dst[0, n) = sum over node ranks of their [begin, begin + n); this rank does its part.
  void sum_part(const WindowView& v, std::size_t begin, std::size_t n, float* dst,
                bool clear = false) const {
    const Range part = split_part(n, topo_->node_size, topo_->node_rank);
    if (part.empty()) return;
    std::vector<const float*> src(static_cast<std::size_t>(topo_->node_size));
    for (int p = 0; p < topo_->node_size; ++p)
      src[static_cast<std::size_t>(p)] = v.f32(p) + begin + part.begin;
    sum_rows(dst + part.begin, src.data(), topo_->node_size, part.size(), clear);
  }

  // One input of combine_in_place: a buffer in a window and its element size.
  struct Input {
    WindowView view;
    std::size_t elem_bytes;
  };
  // Reproducible mode's direct exchange inside windows on one node: every block is split
  // between the node's ranks like the fp32 reduce-scatter, and each rank combines its part
  // from every peer's elements of every input (op's sources: input by input, peers in rank
  // order), writing into the block's owner's `out`. A combiner that keeps the owner's state
  // (at_owner) gets the owner's whole block instead.
  void combine_in_place(std::span<const Input> ins, const WindowView& vout, float* out,
                        std::size_t count, BlockCombiner& op) {
    const std::size_t n = static_cast<std::size_t>(size());
    const int peers = topo_->node_size;
    dog_->enter("reduce_scatter_combine (shared memory)");
    std::vector<const ShmWindow*> wins;
    for (const Input& in : ins)
      if (std::find(wins.begin(), wins.end(), in.view.win) == wins.end()) wins.push_back(in.view.win);
    if (std::find(wins.begin(), wins.end(), vout.win) == wins.end()) wins.push_back(vout.win);
    for (const ShmWindow* w : wins) w->sync();
    std::vector<const void*> src(ins.size() * static_cast<std::size_t>(peers));
    const auto sources = [&](std::size_t first) {
      for (std::size_t k = 0; k < ins.size(); ++k)
        for (int p = 0; p < peers; ++p)
          src[k * static_cast<std::size_t>(peers) + static_cast<std::size_t>(p)] =
              ins[k].view.at(p) + first * ins[k].elem_bytes;
    };
    const int nsrc = static_cast<int>(src.size());
    if (op.at_owner()) {  // this rank combines its own block whole, into its own `out`
      const std::size_t first = static_cast<std::size_t>(topo_->node_rank) * count;
      sources(first);
      if (count != 0) op.combine(out + first, src.data(), nsrc, count);
    } else {
      const Range part = split_part(count, peers, topo_->node_rank);
      if (!part.empty()) {
        for (std::size_t k = 0; k < n; ++k) {
          const std::size_t first = k * count + part.begin;
          sources(first);
          op.combine(vout.f32(static_cast<int>(k)) + first, src.data(), nsrc, part.size());
        }
      }
    }
    for (const ShmWindow* w : wins) w->sync();
  }

  mutable std::vector<char> int_scratch_;  // all_reduce_int's part, reused
  std::uint64_t internode_ = 0;            // internode_bytes(): node leaders only

  // Elements [begin, begin + n) reduced over the node's ranks; this rank does its part of
  // them and writes the result into `owner`'s buffer, or every rank's (owner -1). Only this
  // rank reads or writes its part, in every buffer, between the two syncs around it.
  void reduce_int_part(const WindowView& v, IntOp op, std::size_t begin, std::size_t n,
                       int owner) const {
    const Range part = split_part(n, topo_->node_size, topo_->node_rank);
    if (part.empty()) return;
    const int peers = topo_->node_size;
    const std::size_t first = begin + part.begin;
    // The result is built in the first destination (or a reused scratch buffer when that
    // is not this rank's part alone to write), never in freshly allocated memory.
    const std::size_t elem = op == IntOp::SumI64 ? sizeof(std::int64_t) : 1;
    char* acc = owner >= 0 ? v.at(owner) + first * elem : nullptr;
    if (owner < 0) {
      if (int_scratch_.size() < part.size() * elem) int_scratch_.resize(part.size() * elem);
      acc = int_scratch_.data();
    }
    std::vector<const char*> src(static_cast<std::size_t>(peers));
    for (int p = 0; p < peers; ++p) src[static_cast<std::size_t>(p)] = v.at(p) + first * elem;
    if (op == IntOp::SumI64) {
      auto* out = reinterpret_cast<std::int64_t*>(acc);
      for (std::size_t j = 0; j < part.size(); ++j) {
        std::int64_t s = 0;
        for (int p = 0; p < peers; ++p)
          s += reinterpret_cast<const std::int64_t*>(src[static_cast<std::size_t>(p)])[j];
        out[j] = s;
      }
    } else {
      auto* out = reinterpret_cast<std::uint8_t*>(acc);
      for (std::size_t j = 0; j < part.size(); ++j) {
        std::uint8_t m = 0;
        for (int p = 0; p < peers; ++p)
          m = std::max(m, reinterpret_cast<const std::uint8_t*>(src[static_cast<std::size_t>(p)])[j]);
        out[j] = m;
      }
    }
    if (owner < 0)
      for (int p = 0; p < peers; ++p) std::memcpy(v.at(p) + first * elem, acc, part.size() * elem);
  }

  // Offsets of size() back-to-back blocks of count * unit bytes (or elements, unit 1); the
  // last entry is the total.
  std::vector<std::size_t> offsets(std::size_t count, std::size_t unit) const {
    std::vector<std::size_t> off(static_cast<std::size_t>(size()) + 1, 0);
    for (std::size_t r = 1; r < off.size(); ++r) off[r] = off[r - 1] + count * unit;
    return off;
  }

  // One node: every block k is summed by all node ranks together, each rank one part of it,
  // written in place into block k of its owner's buffer. The part a rank writes is read by
  // that rank alone (from every peer), so reads and writes never race: a sync before (inputs
  // complete) and one after (results visible, buffers free again). This is the step between
  // them, for `count` elements per rank.
  // With `clear`, each part's inputs other than the owner's block are zeroed as they are summed
  // (clears_inputs()): between the syncs nobody else reads them.
  std::function<void()> node_reduce_scatter_step(const WindowView& v, std::size_t count,
                                                 std::vector<std::size_t> start,
                                                 bool clear) const {
    return [this, v, count, start = std::move(start), clear] {
      if (count == 0) return;
      for (int k = 0; k < topo_->node_size; ++k) {
        const std::size_t s = start[static_cast<std::size_t>(k)];
        sum_part(v, s, count, v.f32(k) + s, clear);
      }
    };
  }

  // node_reduce_scatter_step with a count per block.
  std::function<void()> node_reduce_scatter_v_step(const WindowView& v,
                                                   std::vector<std::size_t> counts,
                                                   std::vector<std::size_t> start,
                                                   bool clear) const {
    return [this, v, counts = std::move(counts), start = std::move(start), clear] {
      for (int k = 0; k < topo_->node_size; ++k) {
        const std::size_t s = start[static_cast<std::size_t>(k)];
        const std::size_t n = counts[static_cast<std::size_t>(k)];
        if (n != 0) sum_part(v, s, n, v.f32(k) + s, clear);
      }
    };
  }

  // The uneven node all-gather: every node rank copies its part of every (destination,
  // block) pair, into every peer's buffer, so a single owner's block is copied by all ranks
  // together (each copies (N-1)/N of a buffer, as in the equal form) instead of by every
  // reader alone. Between the two syncs each byte is written by one rank and no rank writes
  // a block that is read (an owner's block is never a destination).
  std::function<void()> node_all_gather_v_step(const WindowView& v,
                                               std::vector<std::size_t> start) const {
    return [this, v, start = std::move(start)] {
      const int n = topo_->node_size;
      const int me = topo_->node_rank;
      for (int j = 0; j < n; ++j) {
        const int d = (me + j) % n;  // ranks begin with different destinations
        for (int p = 0; p < n; ++p) {
          if (p == d) continue;
          const std::size_t b = start[static_cast<std::size_t>(p)];
          const Range part = split_part(start[static_cast<std::size_t>(p) + 1] - b, n, me);
          if (part.empty()) continue;
          std::memcpy(v.at(d) + b + part.begin, v.at(p) + b + part.begin, part.size());
        }
      }
    };
  }

  // The step between the two syncs of a node all-gather: every rank's block is complete
  // before it; nobody reads this rank's buffer after it.
  std::function<void()> node_all_gather_step(const WindowView& v,
                                             std::vector<std::size_t> start) const {
    return [this, v, start = std::move(start)] {
      const int n = topo_->node_size;
      const int me = topo_->node_rank;
      char* mine = v.at(me);
      for (int j = 1; j < n; ++j) {  // start at the next rank: ranks read different peers
        const std::size_t p = static_cast<std::size_t>((me + j) % n);
        std::memcpy(mine + start[p], v.at(static_cast<int>(p)) + start[p], start[p + 1] - start[p]);
      }
    };
  }

  // Several nodes, each holding consecutive world ranks: node sum of the whole buffer into
  // the leader's segment; between leaders a reduce-scatter of the node ranges (out of place:
  // MPICH 4.0's in-place form corrupts memory for unequal counts), the leader's node range
  // written back at its own offset; then every rank copies its block from the leader.
  void hierarchical_reduce_scatter(const WindowView& v, std::span<const std::size_t> counts,
                                   const std::vector<std::size_t>& start) {
    const NodeTopology& t = *topo_;
    v.win->sync();
    sum_part(v, 0, start.back(), v.f32(0));
    v.win->sync();
    std::vector<std::size_t> node_count(static_cast<std::size_t>(t.num_nodes), 0);
    for (int w = 0; w < t.world_size; ++w)
      node_count[node_of(w)] += counts[static_cast<std::size_t>(w)];
    const std::size_t node_begin =
        start[static_cast<std::size_t>(t.node_first[static_cast<std::size_t>(t.node_index)])];
    if (t.node_rank == 0) {
      internode_ += (start.back() - node_count[static_cast<std::size_t>(t.node_index)]) * sizeof(float);
      std::vector<int> icounts(node_count.size());
      for (std::size_t n = 0; n < node_count.size(); ++n)
        icounts[n] = mpi::checked_int(node_count[n], "MPI_Reduce_scatter");
      std::vector<float> mine(node_count[static_cast<std::size_t>(t.node_index)]);
      dog_->run(
          dog_->current(),
          [&] {
            SHARDOPT_MPI(MPI_Reduce_scatter(v.f32(0), mine.data(), icounts.data(), MPI_FLOAT,
                                            MPI_SUM, t.leaders));
          },
          [&](MPI_Request* r) {
            SHARDOPT_MPI(MPI_Ireduce_scatter(v.f32(0), mine.data(), icounts.data(), MPI_FLOAT,
                                             MPI_SUM, t.leaders, r));
          });
      if (!mine.empty())
        std::memcpy(v.f32(0) + node_begin, mine.data(), mine.size() * sizeof(float));
    }
    v.win->sync();
    if (t.node_rank != 0) {
      const std::size_t me = static_cast<std::size_t>(t.world_rank);
      std::memcpy(v.f32(t.node_rank) + start[me], v.f32(0) + start[me], counts[me] * sizeof(float));
    }
    v.win->sync();  // the leader's buffer is its own again
  }

  // Several nodes: each rank's block into the leader's segment, leaders all-gather node
  // ranges (bytes), every other rank copies the whole result from its leader.
  void hierarchical_all_gather(const WindowView& v, const std::vector<std::size_t>& start) {
    const NodeTopology& t = *topo_;
    const std::size_t me = static_cast<std::size_t>(t.world_rank);
    v.win->sync();
    if (t.node_rank != 0) std::memcpy(v.at(0) + start[me], v.at(t.node_rank) + start[me], start[me + 1] - start[me]);
    v.win->sync();
    if (t.node_rank == 0) {
      const std::size_t n = static_cast<std::size_t>(t.node_index);
      const std::size_t first = static_cast<std::size_t>(t.node_first[n]);
      internode_ += start.back() - (start[first + static_cast<std::size_t>(t.node_ranks[n])] - start[first]);
      std::vector<int> recv(static_cast<std::size_t>(t.num_nodes)), displ(recv.size());
      for (std::size_t n = 0; n < recv.size(); ++n) {
        const std::size_t first = static_cast<std::size_t>(t.node_first[n]);
        const std::size_t last = first + static_cast<std::size_t>(t.node_ranks[n]);
        recv[n] = mpi::checked_int(start[last] - start[first], "MPI_Allgatherv");
        displ[n] = mpi::checked_int(start[first], "MPI_Allgatherv");
      }
      dog_->run(
          dog_->current(),
          [&] {
            SHARDOPT_MPI(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, v.at(0), recv.data(),
                                        displ.data(), MPI_BYTE, t.leaders));
          },
          [&](MPI_Request* r) {
            SHARDOPT_MPI(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, v.at(0), recv.data(),
                                         displ.data(), MPI_BYTE, t.leaders, r));
          });
    }
    v.win->sync();
    if (t.node_rank != 0) {
      char* mine = v.at(t.node_rank);
      const char* leader = v.at(0);
      std::memcpy(mine, leader, start[me]);
      std::memcpy(mine + start[me + 1], leader + start[me + 1], start.back() - start[me + 1]);
    }
    v.win->sync();
  }

  std::size_t node_of(int world_rank) const {
    const auto& f = topo_->node_first;
    return static_cast<std::size_t>(std::upper_bound(f.begin(), f.end(), world_rank) - f.begin() -
                                    1);
  }

  std::shared_ptr<Communicator> plain_;
  std::shared_ptr<NodeTopology> topo_;
  std::shared_ptr<mpi::Watchdog> dog_;
  std::vector<std::weak_ptr<ShmWindow>> windows_;
  ShmQueue queue_;
  bool blocking_ = false;  ///< SHARDOPT_SHM_BLOCKING=1: every start waits
  /// SHARDOPT_SHM_CLEAR_INPUTS=0 turns clears_inputs() off (A/B measurements, tests); the same
  /// on every rank (make_mpi_communicator agrees it).
  bool clear_inputs_ = true;
};

}  // namespace

std::shared_ptr<Communicator> make_shm_communicator(std::shared_ptr<Communicator> plain,
                                                    std::shared_ptr<NodeTopology> topo,
                                                    std::shared_ptr<mpi::Watchdog> watchdog,
                                                    bool clear_inputs) {
  return std::make_shared<ShmCommunicator>(std::move(plain), std::move(topo),
                                           std::move(watchdog), clear_inputs);
}

}  // namespace shardopt::shm
