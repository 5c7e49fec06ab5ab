// mpi_comm.cpp: Communicator over MPI collectives on host memory.
#include "shardopt/mpi_comm.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../cpu/kernels.hpp"
#include "mpi_util.hpp"
#include "mpi_watchdog.hpp"
#include "shm_kernels.hpp"
#include "shardopt/bf16.hpp"

namespace shardopt {
namespace {

using mpi::Watchdog;

// The reduction of the bf16 wire: each partial sum is computed in fp32 and rounded to bf16.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = float_to_bf16_bits(bf16_bits_to_float(a[i]) + bf16_bits_to_float(b[i]));
}

class LaunchQueue;

// One MPI operation: how to start it, the arrays MPI reads until it completes, and what to
// do after. The LaunchQueue decides when it starts.
class MpiRequest final : public CommRequest {
 public:
  std::vector<MPI_Request> requests;
  std::vector<bf16> wire;
  std::vector<bf16> wire_out;   ///< an uneven reduce-scatter's bf16 result
  std::vector<float> f32_out;   ///< an uneven reduce-scatter's fp32 result
  std::function<void(MpiRequest&)> launch;  ///< starts the MPI operation(s) into `requests`
  std::function<void()> on_complete;
  /// A request of several steps (the direct exchange): once the first `step` entries of
  /// `requests` (all of them when 0) have completed, advance() removes them, may start more,
  /// and returns whether the request has more to do.
  std::function<bool(MpiRequest&)> advance;
  std::size_t step = 0;

  MpiRequest(LaunchQueue& queue, std::shared_ptr<Watchdog> dog, const char* name)
      : queue_(queue), dog_(std::move(dog)), ticket_(dog_->enter(name)) {}
  ~MpiRequest() override;
  bool test() override;
  void wait() override;

 private:
  friend class LaunchQueue;
  bool test_started();  // MPI_Testall; completes the request when it reports done
  void wait_started();
  void finish() {
    done_ = true;
    if (on_complete) on_complete();
  }
  int front() const {
    return static_cast<int>(step == 0 ? requests.size() : std::min(step, requests.size()));
  }
  // The front step completed: the next one, or the end.
  void step_done() {
    if (!advance || !advance(*this)) finish();
  }
  LaunchQueue& queue_;
  std::shared_ptr<Watchdog> dog_;
  Watchdog::Ticket ticket_;  // numbered in call order, which is also the order of starts
  bool started_ = false;
  bool done_ = false;
};

// Starts a communicator's non-blocking collectives in call order, at most `limit` at a time.
// MPICH 4.0 (ch4) slows down sharply with several large non-blocking collectives outstanding
// on one communicator: with 16 started at once the overlapped stage-1 step took 162 ms
// against 30 ms without overlap; with one at a time, less than without overlap
// (bench_overlap, SHARDOPT_MPI_IN_FLIGHT=16 against the default; docs/performance.md).
// Requests over the limit start when an earlier one completes (seen in test or wait of any
// request of the communicator); a blocking collective first starts every queued one. So MPI
// sees each rank's collectives in the order that rank called them, as it requires.
class LaunchQueue {
 public:
  explicit LaunchQueue(std::size_t limit) : limit_(limit) {}

  void submit(MpiRequest* r) {
    waiting_.push_back(r);
    pump();
  }
  // Notices completions at the front and starts what they make room for.
  void poll() {
    while (!active_.empty() && active_.front()->test_started()) {
      active_.pop_front();
      pump();
    }
  }
  // Waits for earlier requests until r has started.
  void start(MpiRequest* r) {
    while (!r->started_) retire_front();
  }
  // Starts every queued request (before a blocking collective).
  void flush() {
    while (!waiting_.empty()) retire_front();
  }
  void completed(MpiRequest* r) {
    if (auto it = std::find(active_.begin(), active_.end(), r); it != active_.end())
      active_.erase(it);
    pump();
  }
  // A request going away without completing (its wait failed): the queue must not keep it.
  void forget(MpiRequest* r) {
    std::erase(waiting_, r);
    std::erase(active_, r);
  }

 private:
  void retire_front() {
    MpiRequest* r = active_.front();  // non-empty whenever something waits (limit >= 1)
    r->wait_started();
    active_.pop_front();
    pump();
  }
  void pump() {
    while (!waiting_.empty() && active_.size() < limit_) {
      MpiRequest* r = waiting_.front();
      waiting_.pop_front();
      r->started_ = true;
      active_.push_back(r);
      r->launch(*r);
    }
  }
  std::size_t limit_;
  std::deque<MpiRequest*> waiting_;  // submitted, not started
  std::deque<MpiRequest*> active_;   // started, completion not seen yet
};

MpiRequest::~MpiRequest() {
  if (done_) return;
  try {
    wait();
  } catch (...) {  // a destructor cannot report; the next collective will
  }
  queue_.forget(this);
}

bool MpiRequest::test() {
  if (done_) return true;
  dog_->throw_if_failed();
  queue_.poll();
  if (!started_ || done_) return done_;
  if (test_started()) queue_.completed(this);
  return done_;
}

void MpiRequest::wait() {
  if (done_) return;
  dog_->throw_if_failed();
  queue_.start(this);
  wait_started();
  queue_.completed(this);
}

bool MpiRequest::test_started() {
  while (!done_) {
    int flag = 0;
    SHARDOPT_MPI(MPI_Testall(front(), requests.data(), &flag, MPI_STATUSES_IGNORE));
    if (!flag) break;
    step_done();
  }
  return done_;
}

void MpiRequest::wait_started() {
  while (!done_) {
    dog_->wait(ticket_, front(), requests.data());
    step_done();
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm parent, std::size_t in_flight, bool direct,
                  std::shared_ptr<Watchdog> dog)
      : queue_(in_flight), dog_(std::move(dog)), direct_(direct) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, Status::InvalidState, "MPI is not initialised");
    SHARDOPT_MPI(MPI_Comm_dup(parent, &comm_));
    SHARDOPT_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    SHARDOPT_MPI(MPI_Comm_rank(comm_, &rank_));
    SHARDOPT_MPI(MPI_Comm_size(comm_, &size_));
    SHARDOPT_MPI(MPI_Op_create(&bf16_sum, 1, &bf16_sum_op_));
    // The direct exchange's messages get a duplicate of their own (the watchdog's questions
    // travel point to point on comm_), made whatever the exchange: ranks that chose
    // differently still make the same collective calls until make_mpi_communicator's check.
    SHARDOPT_MPI(MPI_Comm_dup(comm_, &data_comm_));
    SHARDOPT_MPI(MPI_Comm_set_errhandler(data_comm_, MPI_ERRORS_RETURN));
    tag_space_ = mpi::tag_space();  // make_mpi_communicator keeps in_flight below it
    dog_->attach(comm_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Op_free(&bf16_sum_op_);
    MPI_Comm_free(&data_comm_);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  void set_collective_timeout(double seconds) override { dog_->set_timeout(seconds); }
  std::uint64_t internode_bytes() const override { return internode_; }

  // An fp32 wire takes the direct exchange unless MpiExchange::Collective chose MPI's. MPI's
  // in-place reduce-scatter leaves the result at the start of the buffer; it is moved to the
  // rank's own block when the request completes (NCCL's convention), so no temporary is
  // needed with an fp32 wire.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    const int n = mpi::checked_int(count, "MPI_Ireduce_scatter_block");
    mpi::checked_int(count * static_cast<std::size_t>(size_), "MPI_Ireduce_scatter_block");
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    if (direct_ && wire == CommType::F32) {
      count_internode(count, 4);
      return start_direct_reduce_scatter(
          buf, std::vector<std::size_t>(static_cast<std::size_t>(size_), count), "reduce_scatter_sum");
    }
    auto req = std::make_unique<MpiRequest>(queue_, dog_, "reduce_scatter_sum");
    count_internode(count, wire == CommType::BF16 ? 2 : 4);
    float* own = buf + static_cast<std::size_t>(rank_) * count;
    if (wire == CommType::BF16) {
      // Send bf16: convert, reduce the bf16 values, convert this rank's block back in place.
      req->launch = [this, buf, n, count](MpiRequest& r) {
        const std::size_t total = count * static_cast<std::size_t>(size_);
        r.wire.resize(total);
        cpu::cast_f32_to_bf16(buf, r.wire.data(), total);
        r.requests.resize(1);
        SHARDOPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, r.wire.data(), n, MPI_UINT16_T,
                                               bf16_sum_op_, comm_, &r.requests[0]));
      };
      MpiRequest* r = req.get();
      req->on_complete = [r, own, count] { cpu::cast_bf16_to_f32(r->wire.data(), own, count); };
    } else {
      req->launch = [this, buf, n](MpiRequest& r) {
        r.requests.resize(1);
        SHARDOPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm_,
                                               &r.requests[0]));
      };
      if (rank_ != 0)
        req->on_complete = [buf, own, count] { std::memcpy(own, buf, count * sizeof(float)); };
    }
    queue_.submit(req.get());
    return req;
  }

  // Uneven reduce-scatter: an fp32 wire takes the direct exchange unless MpiExchange::
  // Collective chose MPI's: MPI_Ireduce_scatter with recvcounts, out of place (MPICH 4.0's
  // in-place form corrupts memory for unequal counts) into a result the request owns, copied
  // to this rank's block on completion. Counts (and their sum) above INT_MAX are refused.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    const std::vector<std::size_t> off = uneven_offsets(counts, size_, "reduce_scatter_sum_v");
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter_sum_v: wire F32 or BF16");
    std::vector<int> icounts(counts.size());
    for (std::size_t r = 0; r < counts.size(); ++r)
      icounts[r] = mpi::checked_int(counts[r], "MPI_Ireduce_scatter");
    mpi::checked_int(off.back(), "MPI_Ireduce_scatter");
    const std::size_t me = static_cast<std::size_t>(rank_);
    const std::size_t mine = counts[me];
    float* own = buf + off[me];
    const bool bf = wire == CommType::BF16;
    internode_ += static_cast<std::uint64_t>(off.back() - mine) * (bf ? 2 : 4);
    if (direct_ && !bf)
      return start_direct_reduce_scatter(buf, {counts.begin(), counts.end()},
                                         "reduce_scatter_sum_v");
    auto req = std::make_unique<MpiRequest>(queue_, dog_, "reduce_scatter_sum_v");
    MpiRequest* rq = req.get();
    const int owner = single_owner(counts);
    if (owner >= 0) {
      // One rank owns every element (its block starts at 0): a reduce to it, which MPICH
      // runs as fast as the equal reduce-scatter's pattern allows, where its irregular
      // reduce-scatter took about 3x the equal one's time (bench_collectives).
      const int n = icounts[static_cast<std::size_t>(owner)];
      req->launch = [this, buf, n, owner, bf](MpiRequest& r) {
        void* data = buf;
        if (bf) {
          r.wire.resize(static_cast<std::size_t>(n));
          cpu::cast_f32_to_bf16(buf, r.wire.data(), static_cast<std::size_t>(n));
          data = r.wire.data();
        }
        r.requests.resize(1);
        const bool root = rank_ == owner;
        SHARDOPT_MPI(MPI_Ireduce(root ? MPI_IN_PLACE : data, root ? data : nullptr, n,
                                 bf ? MPI_UINT16_T : MPI_FLOAT, bf ? bf16_sum_op_ : MPI_SUM, owner,
                                 comm_, &r.requests[0]));
      };
      if (bf && rank_ == owner)
        req->on_complete = [rq, buf, mine] { cpu::cast_bf16_to_f32(rq->wire.data(), buf, mine); };
    } else if (bf) {
      req->launch = [this, buf, icounts, total = off.back(), mine](MpiRequest& r) {
        r.wire.resize(total);
        r.wire_out.resize(mine);
        cpu::cast_f32_to_bf16(buf, r.wire.data(), total);
        r.requests.resize(1);
        SHARDOPT_MPI(MPI_Ireduce_scatter(r.wire.data(), r.wire_out.data(), icounts.data(),
                                         MPI_UINT16_T, bf16_sum_op_, comm_, &r.requests[0]));
      };
      req->on_complete = [rq, own, mine] { cpu::cast_bf16_to_f32(rq->wire_out.data(), own, mine); };
    } else {
      req->launch = [this, buf, icounts, mine](MpiRequest& r) {
        r.f32_out.resize(mine);
        r.requests.resize(1);
        SHARDOPT_MPI(MPI_Ireduce_scatter(buf, r.f32_out.data(), icounts.data(), MPI_FLOAT,
                                         MPI_SUM, comm_, &r.requests[0]));
      };
      req->on_complete = [rq, own, mine] {
        if (mine != 0) std::memcpy(own, rq->f32_out.data(), mine * sizeof(float));
      };
    }
    queue_.submit(req.get());
    return req;
  }

  // Uneven all-gather: MPI_Iallgatherv in place; counts and offsets above INT_MAX refused.
  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    const std::vector<std::size_t> off = uneven_offsets(counts, size_, "all_gather_v");
    require(type == CommType::F32 || type == CommType::U16, Status::InvalidArgument,
            "all_gather_v: type F32 or U16");
    std::vector<int> icounts(counts.size()), displ(counts.size());
    for (std::size_t r = 0; r < counts.size(); ++r) {
      icounts[r] = mpi::checked_int(counts[r], "MPI_Iallgatherv");
      displ[r] = mpi::checked_int(off[r], "MPI_Iallgatherv");
    }
    mpi::checked_int(off.back(), "MPI_Iallgatherv");
    auto req = std::make_unique<MpiRequest>(queue_, dog_, "all_gather_v");
    internode_ += static_cast<std::uint64_t>(off.back() - counts[static_cast<std::size_t>(rank_)]) *
                  mpi::type_size(type);
    const int owner = single_owner(counts);
    req->launch = [this, buf, icounts, displ, type, owner](MpiRequest& r) {
      r.requests.resize(1);
      if (owner >= 0) {  // one rank owns every element: a broadcast from it
        SHARDOPT_MPI(MPI_Ibcast(buf, icounts[static_cast<std::size_t>(owner)], mpi::datatype(type),
                                owner, comm_, &r.requests[0]));
        return;
      }
      SHARDOPT_MPI(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, icounts.data(),
                                   displ.data(), mpi::datatype(type), comm_, &r.requests[0]));
    };
    queue_.submit(req.get());
    return req;
  }

  // ---- the direct exchange (MpiExchange::Direct) ------------------------------------------------
  //
  // MPICH's reduce-scatter runs at 3.3-3.9x its memory-traffic floor and its irregular forms
  // slower still (docs/performance.md); sending each block straight to its owner and summing
  // there moves every byte once. Point to point on data_comm_, with a tag per request (the
  // requests' call order is the same on every rank, the order their chunks are posted in is
  // not), so requests in flight together (mpi_in_flight > 1) never match each other's messages;
  // within one request, chunks between two ranks match in posting order (MPI's non-overtaking
  // rule).

  static constexpr std::size_t kDirectChunk = std::size_t{1} << 18;  ///< elements per peer
  static constexpr std::size_t kDirectDepth = 2;  ///< chunks in flight per request

  int next_tag() { return static_cast<int>(direct_seq_++ % static_cast<std::uint64_t>(tag_space_)); }

  // Every rank sends block j (counts[j] elements at offset_j) to rank j in chunks of
  // kDirectChunk, at most kDirectDepth chunks in flight; the owner sums each chunk when it
  // has arrived, in rank order (shm::sum_rows: ((block_0 + block_1) + block_2) + ..., the
  // shared-memory communicator's order), so the result is the same at any chunking, and
  // equal to the shared-memory communicator's on one node, bit for bit. Work advances in
  // test() and wait(): each completed chunk is summed and the next one posted.
  std::unique_ptr<CommRequest> start_direct_reduce_scatter(float* buf,
                                                           std::vector<std::size_t> counts,
                                                           const char* name) {
    struct State {
      std::vector<std::size_t> counts, off;
      std::size_t chunks = 0, posted = 0, summed = 0;
      std::vector<float> scratch;  // kDirectDepth slots of size() * kDirectChunk
      int tag = 0;
    };
    auto st = std::make_shared<State>();
    const std::size_t P = static_cast<std::size_t>(size_);
    const std::size_t me = static_cast<std::size_t>(rank_);
    st->off.assign(P + 1, 0);
    std::size_t most = 0;
    for (std::size_t r = 0; r < P; ++r) {
      st->off[r + 1] = st->off[r] + counts[r];
      most = std::max(most, counts[r]);
    }
    st->counts = std::move(counts);
    st->chunks = P > 1 ? (most + kDirectChunk - 1) / kDirectChunk : 0;
    st->tag = next_tag();
    auto req = std::make_unique<MpiRequest>(queue_, dog_, name);
    req->step = 2 * (P - 1);
    const auto part = [st](std::size_t r, std::size_t c) {  // chunk c of block r: elements
      const std::size_t begin = c * kDirectChunk;
      return begin < st->counts[r] ? std::min(kDirectChunk, st->counts[r] - begin) : 0;
    };
    const auto post = [this, st, buf, P, me, part](MpiRequest& r) {
      const std::size_t c = st->posted++;
      float* slot = st->scratch.data() + (c % kDirectDepth) * P * kDirectChunk;
      const std::size_t base = r.requests.size();
      r.requests.resize(base + 2 * (P - 1), MPI_REQUEST_NULL);
      MPI_Request* q = r.requests.data() + base;
      // Peers in the order me + 1, me + 2, ...: at more than two ranks the senders of one
      // owner take turns.
      for (std::size_t d = 1; d < P; ++d) {
        const std::size_t j = (me + P - d) % P;  // receive from me - d while sending to me + d
        if (const std::size_t n = part(me, c))
          SHARDOPT_MPI(MPI_Irecv(slot + j * kDirectChunk, static_cast<int>(n), MPI_FLOAT,
                                 static_cast<int>(j), st->tag, data_comm_, q + d - 1));
      }
      for (std::size_t d = 1; d < P; ++d) {
        const std::size_t j = (me + d) % P;
        if (const std::size_t n = part(j, c))
          SHARDOPT_MPI(MPI_Isend(buf + st->off[j] + c * kDirectChunk, static_cast<int>(n),
                                 MPI_FLOAT, static_cast<int>(j), st->tag, data_comm_,
                                 q + P - 1 + d - 1));
      }
    };
    req->launch = [this, st, P, me, post](MpiRequest& r) {
      if (st->chunks == 0) return;
      if (st->counts[me] != 0) {
        std::vector<float> s;
        if (!scratch_pool_.empty()) {
          s = std::move(scratch_pool_.back());
          scratch_pool_.pop_back();
        }
        s.resize(kDirectDepth * P * kDirectChunk);
        st->scratch = std::move(s);
      }
      while (st->posted < std::min(st->chunks, kDirectDepth)) post(r);
    };
    req->advance = [this, st, buf, P, me, part, post](MpiRequest& r) {
      if (st->summed == st->chunks) return false;
      const std::size_t c = st->summed++;
      if (const std::size_t n = part(me, c)) {
        float* own = buf + st->off[me] + c * kDirectChunk;
        const float* slot = st->scratch.data() + (c % kDirectDepth) * P * kDirectChunk;
        std::vector<const float*> src(P);
        for (std::size_t j = 0; j < P; ++j) src[j] = j == me ? own : slot + j * kDirectChunk;
        shm::sum_rows(own, src.data(), static_cast<int>(P), n);
      }
      r.requests.erase(r.requests.begin(),
                       r.requests.begin() + static_cast<std::ptrdiff_t>(r.step));
      if (st->posted < st->chunks) post(r);
      if (st->summed < st->chunks) return true;
      if (!st->scratch.empty()) scratch_pool_.push_back(std::move(st->scratch));
      return false;
    };
    queue_.submit(req.get());
    return req;
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    const int n = mpi::checked_int(count, "MPI_Iallreduce");
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "all_reduce: wire F32 or BF16");
    auto req = std::make_unique<MpiRequest>(queue_, dog_, "start_all_reduce_sum");
    // A ring all-reduce: a reduce-scatter and an all-gather of blocks of count / N.
    count_internode(2 * (count / static_cast<std::size_t>(size_)), wire == CommType::BF16 ? 2 : 4);
    if (wire == CommType::BF16) {
      req->launch = [this, buf, n, count](MpiRequest& r) {
        r.wire.resize(count);
        cpu::cast_f32_to_bf16(buf, r.wire.data(), count);
        r.requests.resize(1);
        SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, r.wire.data(), n, MPI_UINT16_T, bf16_sum_op_,
                                    comm_, &r.requests[0]));
      };
      MpiRequest* r = req.get();
      req->on_complete = [r, buf, count] { cpu::cast_bf16_to_f32(r->wire.data(), buf, count); };
    } else {
      req->launch = [this, buf, n](MpiRequest& r) {
        r.requests.resize(1);
        SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm_,
                                    &r.requests[0]));
      };
    }
    queue_.submit(req.get());
    return req;
  }

  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    // Blocks are multiples of the layout's 64-element alignment in practice: moving them as
    // 64-element units keeps int counts valid for buckets of up to 2^37 elements per rank.
    const std::size_t unit = count % 64 == 0 ? 64 : 1;
    const int n = mpi::checked_int(count / unit, "MPI_Iallgather");
    mpi::checked_int(count / unit * static_cast<std::size_t>(size_), "MPI_Iallgather");
    auto req = std::make_unique<MpiRequest>(queue_, dog_, "all_gather");
    count_internode(count, mpi::type_size(type));
    req->launch = [this, buf, n, unit, type](MpiRequest& r) {
      MPI_Datatype elem = mpi::datatype(type);
      if (unit > 1) {
        SHARDOPT_MPI(MPI_Type_contiguous(static_cast<int>(unit), elem, &elem));
        SHARDOPT_MPI(MPI_Type_commit(&elem));
      }
      r.requests.resize(1);
      const int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, n, elem, comm_,
                                    &r.requests[0]);
      if (unit > 1) MPI_Type_free(&elem);  // MPI keeps it alive until the operation completes
      mpi::check(rc, "MPI_Iallgather");
    };
    queue_.submit(req.get());
    return req;
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: type F32 or F64");
    const std::size_t elem = mpi::type_size(type);
    constexpr std::size_t kChunk = std::size_t{1} << 30;
    const Watchdog::Ticket t = dog_->enter("all_reduce_sum");
    queue_.flush();  // MPI must see the collectives in call order
    for (std::size_t off = 0; off < count; off += kChunk) {
      const int n = static_cast<int>(std::min(kChunk, count - off));
      void* at = static_cast<char*>(buf) + off * elem;
      const MPI_Datatype dt = mpi::datatype(type);
      dog_->run(
          t, [&] { SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, at, n, dt, MPI_SUM, comm_)); },
          [&](MPI_Request* r) {
            SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, at, n, dt, MPI_SUM, comm_, r));
          });
    }
  }

  // Reproducible mode: blocking, with the watchdog's timeout like all_reduce_sum.
  void reduce_scatter_int(void* buf, std::size_t count, IntOp op) override {
    const int n = mpi::checked_int(count, "MPI_Reduce_scatter_block");
    mpi::checked_int(count * static_cast<std::size_t>(size_), "MPI_Reduce_scatter_block");
    const auto [dt, mop, elem] = int_op(op);
    const Watchdog::Ticket t = dog_->enter("reduce_scatter_int");
    queue_.flush();
    dog_->run(
        t, [&] { SHARDOPT_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, n, dt, mop, comm_)); },
        [&](MPI_Request* r) {
          SHARDOPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf, n, dt, mop, comm_, r));
        });
    // MPI leaves the result at the start of the buffer; NCCL's convention is block rank().
    if (rank_ != 0)
      std::memcpy(static_cast<char*>(buf) + static_cast<std::size_t>(rank_) * count * elem, buf,
                  count * elem);
  }

  // Reproducible mode's direct exchange: chunks of every rank's block go to their owner
  // (MPI_Alltoallv of elem_bytes-sized elements into a scratch buffer of about
  // kCombineScratch bytes), which combines them.
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out, std::size_t count,
                              BlockCombiner& op) override {
    constexpr std::size_t kCombineScratch = std::size_t{8} << 20;
    const std::size_t ranks = static_cast<std::size_t>(size_);
    mpi::checked_int(count * ranks, "MPI_Alltoallv");
    const std::size_t chunk = std::max<std::size_t>(1, kCombineScratch / elem_bytes / ranks);
    const Watchdog::Ticket t = dog_->enter("reduce_scatter_combine");
    queue_.flush();
    if (count == 0) return true;
    combine_scratch_.resize(std::min(chunk, count) * ranks * elem_bytes);
    MPI_Datatype elem = MPI_DATATYPE_NULL;
    SHARDOPT_MPI(MPI_Type_contiguous(mpi::checked_int(elem_bytes, "MPI_Type_contiguous"), MPI_BYTE, &elem));
    SHARDOPT_MPI(MPI_Type_commit(&elem));
    struct FreeType {
      MPI_Datatype* t;
      ~FreeType() { MPI_Type_free(t); }
    } free_elem{&elem};
    std::vector<int> counts(ranks), sdispl(ranks), rdispl(ranks);
    std::vector<const void*> src(ranks);
    float* own = out + static_cast<std::size_t>(rank_) * count;
    for (std::size_t c0 = 0; c0 < count; c0 += chunk) {
      const std::size_t k = std::min(chunk, count - c0);
      for (std::size_t r = 0; r < ranks; ++r) {
        counts[r] = static_cast<int>(k);
        sdispl[r] = static_cast<int>(r * count + c0);
        rdispl[r] = static_cast<int>(r * k);
        src[r] = combine_scratch_.data() + r * k * elem_bytes;
      }
      dog_->run(
          t,
          [&] {
            SHARDOPT_MPI(MPI_Alltoallv(in, counts.data(), sdispl.data(), elem,
                                       combine_scratch_.data(), counts.data(), rdispl.data(), elem,
                                       comm_));
          },
          [&](MPI_Request* r) {
            SHARDOPT_MPI(MPI_Ialltoallv(in, counts.data(), sdispl.data(), elem,
                                        combine_scratch_.data(), counts.data(), rdispl.data(), elem,
                                        comm_, r));
          });
      op.combine(own + c0, src.data(), size_, k);
    }
    return true;
  }

  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    const int n = mpi::checked_int(count, "MPI_Allreduce");
    const auto [dt, mop, elem] = int_op(op);
    const Watchdog::Ticket t = dog_->enter("all_reduce_int");
    queue_.flush();
    dog_->run(
        t, [&] { SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, buf, n, dt, mop, comm_)); },
        [&](MPI_Request* r) {
          SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, n, dt, mop, comm_, r));
        });
  }

  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    const int n = mpi::checked_int(bytes, "MPI_Allgather");
    const Watchdog::Ticket t = dog_->enter("all_gather_bytes");
    queue_.flush();
    dog_->run(
        t, [&] { SHARDOPT_MPI(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_)); },
        [&](MPI_Request* r) {
          SHARDOPT_MPI(MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, r));
        });
  }

  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    const int n = mpi::checked_int(bytes, "MPI_Bcast");
    const Watchdog::Ticket t = dog_->enter("broadcast_bytes");
    queue_.flush();
    dog_->run(
        t, [&] { SHARDOPT_MPI(MPI_Bcast(buf, n, MPI_BYTE, root, comm_)); },
        [&](MPI_Request* r) { SHARDOPT_MPI(MPI_Ibcast(buf, n, MPI_BYTE, root, comm_, r)); });
  }

  void barrier() override {
    const Watchdog::Ticket t = dog_->enter("barrier");
    queue_.flush();
    dog_->run(
        t, [&] { SHARDOPT_MPI(MPI_Barrier(comm_)); },
        [&](MPI_Request* r) { SHARDOPT_MPI(MPI_Ibarrier(comm_, r)); });
  }

 private:
  struct IntOpMpi {
    MPI_Datatype type;
    MPI_Op op;
    std::size_t elem;
  };
  static IntOpMpi int_op(IntOp op) {
    return op == IntOp::SumI64 ? IntOpMpi{MPI_INT64_T, MPI_SUM, sizeof(std::int64_t)}
                               : IntOpMpi{MPI_UINT8_T, MPI_MAX, 1};
  }

  // The rank that owns every element of an uneven collective, if exactly one has a non-zero
  // count (and there are at least two ranks); -1 otherwise.
  static int single_owner(std::span<const std::size_t> counts) {
    int owner = -1;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      if (counts[r] == 0) continue;
      if (owner >= 0) return -1;
      owner = static_cast<int>(r);
    }
    return counts.size() > 1 ? owner : -1;
  }

  // internode_bytes(): every rank a node of its own; a collective over blocks of `count`
  // elements of `elem` bytes moves the other ranks' blocks.
  void count_internode(std::size_t count, std::size_t elem) {
    internode_ += static_cast<std::uint64_t>(count) * elem * static_cast<std::uint64_t>(size_ - 1);
  }

  LaunchQueue queue_;
  std::shared_ptr<Watchdog> dog_;
  bool direct_ = false;              ///< fp32 reduce-scatters: the direct exchange
  MPI_Comm data_comm_ = MPI_COMM_NULL;  ///< the direct exchange's messages
  int tag_space_ = 1;                ///< MPI_TAG_UB + 1: tags of direct requests cycle through it
  std::uint64_t direct_seq_ = 0;     ///< direct requests made, in call order (the same everywhere)
  std::vector<std::vector<float>> scratch_pool_;  ///< direct reduce-scatters' chunk buffers
  std::vector<char> combine_scratch_;  ///< reduce_scatter_combine's chunk, reused
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_op_ = MPI_OP_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t internode_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> mpi::make_plain_communicator(MPI_Comm comm, std::size_t in_flight,
                                                           std::shared_ptr<Watchdog> watchdog,
                                                           bool direct) {
  return std::make_shared<MpiCommunicator>(comm, in_flight, direct, std::move(watchdog));
}

}  // namespace shardopt
