// fake_nccl.cpp: NCCL's collectives over MPI for the fake device, queued on fake streams
// like any other device work, with NCCL's rules enforced: device buffers only; in place only
// in NCCL's in-place form (otherwise the buffers must not overlap); no call on a
// non-blocking communicator while it is ncclInProgress; ncclGroupStart/End nesting; no
// destroy or abort inside a group. A broken rule is a problem() (the test aborts).
// ncclReduce and ncclBroadcast (the uneven collectives' grouped form) have a root; inside a
// group, as in NCCL, a call only records the collective and the non-blocking communicator
// reports ncclInProgress from ncclGroupEnd instead.
//
// ncclSend and ncclRecv: the calls of one group on one communicator are one transfer, all
// posted together (NCCL progresses a group's point-to-point operations concurrently, so a
// group that exchanges with every peer cannot deadlock); outside a group each is its own. A
// send matches the receive from its rank in the order both were called, as in NCCL; counts
// and types must agree (MPI reports a truncated receive as an error: the test aborts).
//
// Sums are taken in rank order, so every rank gets the same bits. A non-blocking
// communicator reports ncclInProgress after its set-up and after every other collective
// (the caller must poll ncclCommGetAsyncError). Communicators must span MPI_COMM_WORLD.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fake_control.hpp"
#include "fake_device.hpp"
#include "nccl.h"
#include "shardopt/bf16.hpp"

using namespace fakecuda;

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, size = 1;
  bool blocking = true;
  ncclResult_t state = ncclSuccess;
  int in_progress_polls = 0;
  bool finalizing = false;
  ncclResult_t injected = ncclSuccess;
  std::string last_error;
  unsigned seq = 0;
  unsigned calls = 0;
  std::vector<OpPtr> ops;
};

namespace {

std::set<ncclComm*>& live() {
  static std::set<ncclComm*> s;
  return s;
}
int group_depth = 0;
std::vector<std::function<void()>> deferred;
std::set<ncclComm*> grouped;  // non-blocking communicators with a collective in the open group
std::string global_error;
unsigned id_counter = 0;

ncclResult_t misuse(ncclComm* comm, ncclResult_t rc, const std::string& what) {
  (comm ? comm->last_error : global_error) = what;
  problem("NCCL rule broken: " + what);
  return rc;
}

std::size_t dtype_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    default: return 8;
  }
}

enum class Kind { AllReduce, ReduceScatter, AllGather, Reduce, Broadcast };

// A transfer made of MPI requests: done when all are; an abort cancels the receives and lets
// the sends (small, eager) finish on their own.
class RequestsTransfer : public Transfer {
 public:
  bool test() override {
    if (reqs_.empty()) return true;
    int done = 0;
    MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &done, MPI_STATUSES_IGNORE);
    return done != 0;
  }
  void cancel() override {
    for (std::size_t i = 0; i < reqs_.size(); ++i) {
      if (reqs_[i] == MPI_REQUEST_NULL) continue;
      if (receive_[i]) {
        MPI_Cancel(&reqs_[i]);
        MPI_Wait(&reqs_[i], MPI_STATUS_IGNORE);
      } else {
        MPI_Request_free(&reqs_[i]);
      }
    }
  }

 protected:
  std::vector<MPI_Request> reqs_;
  std::vector<bool> receive_;  // per request: a receive or a send
};

class MpiTransfer final : public RequestsTransfer {
 public:
  MpiTransfer(ncclComm* c, Kind k, ncclDataType_t t, std::size_t count, const void* send,
              void* recv, int root)
      : mpi_(c->mpi), rank_(c->rank), size_(c->size), kind_(k), type_(t),
        block_(count * dtype_size(t)), send_(send), recv_(recv), root_(root),
        tag_(static_cast<int>(c->seq++ % 32000)) {}

  void post() override {
    const std::size_t in = kind_ == Kind::ReduceScatter ? block_ * static_cast<std::size_t>(size_) : block_;
    // A broadcast reads its send buffer on the root only, a reduce writes only the root's.
    if (kind_ != Kind::Broadcast || rank_ == root_)
      mine_.assign(static_cast<const char*>(dev(send_)), static_cast<const char*>(dev(send_)) + in);
    bufs_.assign(static_cast<std::size_t>(size_), {});
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const bool rooted = kind_ == Kind::Reduce || kind_ == Kind::Broadcast;
      // Reduce: everyone sends to the root, which receives from all; broadcast: the reverse.
      const bool recv = !rooted || (kind_ == Kind::Reduce ? rank_ == root_ : p == root_);
      const bool send = !rooted || (kind_ == Kind::Reduce ? p == root_ : rank_ == root_);
      auto& b = bufs_[static_cast<std::size_t>(p)];
      if (recv) {
        b.resize(block_);
        reqs_.emplace_back();
        receive_.push_back(true);
        MPI_Irecv(b.data(), static_cast<int>(block_), MPI_BYTE, p, tag_, mpi_, &reqs_.back());
      }
      if (send) {
        const char* out = mine_.data() + (kind_ == Kind::ReduceScatter ? block_ * static_cast<std::size_t>(p) : 0);
        reqs_.emplace_back();
        receive_.push_back(false);
        MPI_Isend(out, static_cast<int>(block_), MPI_BYTE, p, tag_, mpi_, &reqs_.back());
      }
    }
  }
  void finish() override {
    char* out = static_cast<char*>(dev(recv_));
    if (kind_ == Kind::AllGather) {
      for (int r = 0; r < size_; ++r)
        std::memcpy(out + block_ * static_cast<std::size_t>(r), part(r), block_);
      return;
    }
    if (kind_ == Kind::Broadcast) {
      if (block_ != 0) std::memcpy(out, part(root_), block_);
      return;
    }
    if (kind_ == Kind::Reduce && rank_ != root_) return;
    if (block_ == 0) return;
    const std::size_t n = block_ / dtype_size(type_);
    std::vector<char> acc(part(0), part(0) + block_);
    for (int r = 1; r < size_; ++r) add(acc.data(), part(r), n);
    std::memcpy(out, acc.data(), block_);
  }

 private:
  const char* part(int r) const {
    if (r != rank_) return bufs_[static_cast<std::size_t>(r)].data();
    return mine_.data() + (kind_ == Kind::ReduceScatter ? block_ * static_cast<std::size_t>(rank_) : 0);
  }
  void add(char* acc, const char* x, std::size_t n) const {
    for (std::size_t i = 0; i < n; ++i) {
      if (type_ == ncclFloat32) {
        float a, b;
        std::memcpy(&a, acc + 4 * i, 4);
        std::memcpy(&b, x + 4 * i, 4);
        a += b;
        std::memcpy(acc + 4 * i, &a, 4);
      } else if (type_ == ncclInt64) {  // integers: exact in any order
        std::int64_t a, b;
        std::memcpy(&a, acc + 8 * i, 8);
        std::memcpy(&b, x + 8 * i, 8);
        a = static_cast<std::int64_t>(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(b));
        std::memcpy(acc + 8 * i, &a, 8);
      } else if (type_ == ncclUint8) {  // ncclMax, the only uint8 reduction accepted
        const auto a = static_cast<unsigned char>(acc[i]), b = static_cast<unsigned char>(x[i]);
        acc[i] = static_cast<char>(a > b ? a : b);
      } else if (type_ == ncclFloat64) {
        double a, b;
        std::memcpy(&a, acc + 8 * i, 8);
        std::memcpy(&b, x + 8 * i, 8);
        a += b;
        std::memcpy(acc + 8 * i, &a, 8);
      } else {  // bf16: every partial sum rounded to bf16
        shardopt::bf16 a, b;
        std::memcpy(&a, acc + 2 * i, 2);
        std::memcpy(&b, x + 2 * i, 2);
        a = shardopt::to_bf16(shardopt::to_float(a) + shardopt::to_float(b));
        std::memcpy(acc + 2 * i, &a, 2);
      }
    }
  }

  MPI_Comm mpi_;
  int rank_, size_;
  Kind kind_;
  ncclDataType_t type_;
  std::size_t block_;
  const void* send_;
  void* recv_;
  int root_;
  int tag_;
  std::vector<char> mine_;
  std::vector<std::vector<char>> bufs_;
};

// The point-to-point calls of one group on one communicator (or one call outside a group).
class P2PTransfer final : public RequestsTransfer {
 public:
  struct Part {
    bool send;
    int peer;
    const void* send_buf;
    void* recv_buf;
    std::size_t bytes;
  };
  static constexpr int kTag = 32001;  // above the collectives' tags (0..31999)
  explicit P2PTransfer(ncclComm* c) : mpi_(c->mpi) {}
  std::vector<Part> parts;

  void post() override {
    bufs_.assign(parts.size(), {});
    reqs_.assign(parts.size(), MPI_REQUEST_NULL);
    receive_.assign(parts.size(), false);
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      receive_[i] = !p.send;
      auto& b = bufs_[i];
      if (p.send) {
        const char* from = static_cast<const char*>(dev(p.send_buf));
        b.assign(from, from + p.bytes);
        MPI_Isend(b.data(), static_cast<int>(p.bytes), MPI_BYTE, p.peer, kTag, mpi_, &reqs_[i]);
      } else {
        b.resize(p.bytes);
        MPI_Irecv(b.data(), static_cast<int>(p.bytes), MPI_BYTE, p.peer, kTag, mpi_, &reqs_[i]);
      }
    }
  }
  void finish() override {
    for (std::size_t i = 0; i < parts.size(); ++i)
      if (!parts[i].send && parts[i].bytes != 0) std::memcpy(dev(parts[i].recv_buf), bufs_[i].data(), parts[i].bytes);
  }

 private:
  MPI_Comm mpi_;
  std::vector<std::vector<char>> bufs_;
};

// The open group's point-to-point transfer of each communicator, with its stream.
struct OpenP2P {
  std::unique_ptr<P2PTransfer> transfer;
  cudaStream_t stream;
  std::vector<Access> acc;
};
std::map<ncclComm*, std::shared_ptr<OpenP2P>> open_p2p;

ncclResult_t usable(ncclComm* comm, const char* call) {
  if (comm == nullptr || live().count(comm) == 0)
    return misuse(nullptr, ncclInvalidArgument, std::string(call) + ": invalid communicator");
  if (comm->state == ncclInProgress)
    return misuse(comm, ncclInvalidUsage,
                  std::string(call) + " called while the non-blocking communicator is "
                                      "ncclInProgress (poll ncclCommGetAsyncError first)");
  if (comm->injected != ncclSuccess) {  // as NCCL: the pending error, until aborted
    comm->last_error = std::string(call) + ": the communicator has an asynchronous error";
    return comm->injected;
  }
  return ncclSuccess;
}

bool overlap(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

ncclResult_t collective(const char* name, Kind kind, const void* send, void* recv,
                        std::size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm* comm,
                        cudaStream_t stream, int root = 0) {
  auto lock = lock_device();
  if (const ncclResult_t rc = usable(comm, name)) return rc;
  const bool rooted = kind == Kind::Reduce || kind == Kind::Broadcast;
  if (rooted && (root < 0 || root >= comm->size))
    return misuse(comm, ncclInvalidArgument, std::string(name) + ": root out of range");
  // Reductions: sums of fp32, fp64, bf16 and int64, maxima of uint8 (what shardopt uses).
  const bool sums = op == ncclSum && (type == ncclFloat32 || type == ncclFloat64 ||
                                      type == ncclBfloat16 || type == ncclInt64);
  const bool maxima = op == ncclMax && type == ncclUint8;
  if (kind != Kind::AllGather && kind != Kind::Broadcast && !sums && !maxima)
    return misuse(comm, ncclInvalidArgument,
                  std::string(name) + ": the fake sums fp32, fp64, bf16, int64 and takes maxima of uint8");
  if (!valid_stream(stream))
    return misuse(comm, ncclInvalidArgument, std::string(name) + ": invalid stream");
  const std::size_t es = dtype_size(type), n = static_cast<std::size_t>(comm->size);
  const std::size_t block = count * es;
  const std::size_t sb = kind == Kind::ReduceScatter ? block * n : block;
  const std::size_t rb = kind == Kind::AllGather ? block * n : block;
  // NCCL reads a broadcast's send buffer on the root only and writes a reduce's receive
  // buffer on the root only.
  const bool reads_send = kind != Kind::Broadcast || comm->rank == root;
  const bool writes_recv = kind != Kind::Reduce || comm->rank == root;
  if ((reads_send && !is_device(send, sb)) || (writes_recv && !is_device(recv, rb)))
    return misuse(comm, ncclInvalidArgument,
                  std::string(name) + ": send and receive buffers must be device memory");
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  const std::size_t own = block * static_cast<std::size_t>(comm->rank);
  bool in_place = false;
  if (kind == Kind::AllReduce || rooted) in_place = s == r;
  if (kind == Kind::ReduceScatter) in_place = r == s + own;
  if (kind == Kind::AllGather) in_place = s == r + own;
  if (reads_send && writes_recv && !in_place && overlap(s, sb, r, rb))
    return misuse(comm, ncclInvalidArgument,
                  std::string(name) + ": the buffers overlap without being NCCL's in-place form");
  const auto sp = reinterpret_cast<std::uintptr_t>(s), rp = reinterpret_cast<std::uintptr_t>(r);
  std::vector<Access> acc;
  if (reads_send) acc.push_back({sp, sp + sb, false});
  if (writes_recv) acc.push_back({rp, rp + rb, true});
  auto issue = [=] {
    OpPtr o = enqueue(stream, name, acc, nullptr,
                      std::make_unique<MpiTransfer>(comm, kind, type, count, send, recv, root));
    std::erase_if(comm->ops, [](const OpPtr& x) { return op_done(x); });
    comm->ops.push_back(o);
  };
  if (group_depth > 0) {
    // Recorded only; a non-blocking communicator is ncclInProgress after ncclGroupEnd.
    deferred.push_back(issue);
    if (!comm->blocking) grouped.insert(comm);
    return ncclSuccess;
  }
  issue();
  if (!comm->blocking && ++comm->calls % 2 == 0) {
    comm->state = ncclInProgress;
    comm->in_progress_polls = 1;
    return ncclInProgress;
  }
  return ncclSuccess;
}

ncclResult_t point_to_point(const char* name, bool send, const void* sbuf, void* rbuf, std::size_t count,
                            ncclDataType_t type, int peer, ncclComm* comm, cudaStream_t stream) {
  auto lock = lock_device();
  if (const ncclResult_t rc = usable(comm, name)) return rc;
  if (peer < 0 || peer >= comm->size)
    return misuse(comm, ncclInvalidArgument, std::string(name) + ": peer out of range");
  if (!valid_stream(stream)) return misuse(comm, ncclInvalidArgument, std::string(name) + ": invalid stream");
  const std::size_t bytes = count * dtype_size(type);
  const void* buf = send ? sbuf : rbuf;
  if (bytes != 0 && !is_device(buf, bytes))
    return misuse(comm, ncclInvalidArgument, std::string(name) + ": the buffer must be device memory");
  const auto at = reinterpret_cast<std::uintptr_t>(buf);
  const Access a{at, at + bytes, !send};
  const P2PTransfer::Part part{send, peer, sbuf, rbuf, bytes};
  const auto issue = [comm](const std::shared_ptr<OpenP2P>& o) {
    OpPtr op = enqueue(o->stream, "ncclSend/ncclRecv", o->acc, nullptr, std::move(o->transfer));
    std::erase_if(comm->ops, [](const OpPtr& x) { return op_done(x); });
    comm->ops.push_back(op);
  };
  if (group_depth > 0) {
    std::shared_ptr<OpenP2P>& o = open_p2p[comm];
    if (!o) {
      o = std::make_shared<OpenP2P>();
      o->transfer = std::make_unique<P2PTransfer>(comm);
      o->stream = stream;
      deferred.push_back([o, issue] { issue(o); });  // in call order among the group's collectives
    } else if (o->stream != stream) {
      return misuse(comm, ncclInvalidUsage, std::string(name) + ": one group's calls on one communicator use one stream");
    }
    o->transfer->parts.push_back(part);
    o->acc.push_back(a);
    if (!comm->blocking) grouped.insert(comm);
    return ncclSuccess;
  }
  auto o = std::make_shared<OpenP2P>();
  o->transfer = std::make_unique<P2PTransfer>(comm);
  o->transfer->parts.push_back(part);
  o->stream = stream;
  o->acc.push_back(a);
  issue(o);
  return ncclSuccess;
}

}  // namespace

namespace fakecuda {
void nccl_inject_async_error(ncclResult_t error) {
  auto lock = lock_device();
  for (ncclComm* c : live()) c->injected = error;
}
}  // namespace fakecuda

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  auto lock = lock_device();
  std::memset(id, 0, sizeof *id);
  std::snprintf(id->internal, sizeof id->internal, "fake-nccl %u", ++id_counter);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  auto lock = lock_device();
  *out = nullptr;
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (nranks != world || rank < 0 || rank >= nranks)
    return misuse(nullptr, ncclInvalidUsage,
                  "ncclCommInitRank: the fake NCCL supports communicators over MPI_COMM_WORLD only");
  auto* c = new ncclComm;
  MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &c->mpi);
  c->rank = rank;
  c->size = nranks;
  // Every rank must have joined with the same id and a distinct rank.
  std::vector<ncclUniqueId> ids(static_cast<std::size_t>(nranks));
  MPI_Allgather(&id, sizeof id, MPI_BYTE, ids.data(), sizeof id, MPI_BYTE, c->mpi);
  std::vector<int> ranks(static_cast<std::size_t>(nranks));
  MPI_Allgather(&rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, c->mpi);
  for (int r = 0; r < nranks; ++r)
    if (std::memcmp(&ids[static_cast<std::size_t>(r)], &id, sizeof id) != 0 ||
        ranks[static_cast<std::size_t>(r)] != r) {
      delete c;
      return misuse(nullptr, ncclInvalidUsage, "ncclCommInitRank: ranks disagree on the id or ranks");
    }
  c->blocking = config == nullptr || config->blocking != 0;
  live().insert(c);
  *out = c;
  if (!c->blocking) {
    c->state = ncclInProgress;
    c->in_progress_polls = 2;
    return ncclInProgress;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  auto lock = lock_device();
  if (comm == nullptr || live().count(comm) == 0) return ncclInvalidArgument;
  if (comm->injected != ncclSuccess) {
    *async_error = comm->injected;
    return ncclSuccess;
  }
  if (comm->state == ncclInProgress) {
    if (comm->finalizing) {
      bool all = true;
      for (const OpPtr& o : comm->ops) all = run_until(o, nullptr) && all;
      if (all) comm->state = ncclSuccess;
    } else if (--comm->in_progress_polls <= 0) {
      comm->state = ncclSuccess;
    }
  }
  *async_error = comm->state;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  auto lock = lock_device();
  if (const ncclResult_t rc = usable(comm, "ncclCommFinalize")) return rc;
  if (comm->blocking) {
    for (const OpPtr& o : comm->ops) run_until(o, &lock);
    return ncclSuccess;
  }
  comm->finalizing = true;
  comm->state = ncclInProgress;
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  auto lock = lock_device();
  if (comm == nullptr || live().count(comm) == 0)
    return misuse(nullptr, ncclInvalidArgument, "ncclCommDestroy: invalid communicator");
  if (group_depth > 0) return misuse(comm, ncclInvalidUsage, "ncclCommDestroy inside a group");
  for (const OpPtr& o : comm->ops) run_until(o, &lock);
  live().erase(comm);
  MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  auto lock = lock_device();
  if (comm == nullptr || live().count(comm) == 0)
    return misuse(nullptr, ncclInvalidArgument, "ncclCommAbort: invalid communicator");
  if (group_depth > 0) return misuse(comm, ncclInvalidUsage, "ncclCommAbort inside a group");
  for (const OpPtr& o : comm->ops) abandon(o);
  live().erase(comm);
  // The MPI communicator is left alone: cancelled operations may still reference it.
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  auto lock = lock_device();
  if (comm == nullptr) return ncclInvalidArgument;
  *count = comm->size;
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  auto lock = lock_device();
  if (comm == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  auto lock = lock_device();
  if (comm != nullptr && live().count(comm) != 0) return comm->last_error.c_str();
  return global_error.c_str();
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective("ncclAllReduce", Kind::AllReduce, sendbuff, recvbuff, count, datatype, op,
                    comm, stream);
}
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return collective("ncclReduceScatter", Kind::ReduceScatter, sendbuff, recvbuff, recvcount,
                    datatype, op, comm, stream);
}
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclAllGather", Kind::AllGather, sendbuff, recvbuff, sendcount, datatype,
                    ncclSum, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclReduce", Kind::Reduce, sendbuff, recvbuff, count, datatype, op, comm,
                    stream, root);
}
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective("ncclBroadcast", Kind::Broadcast, sendbuff, recvbuff, count, datatype,
                    ncclSum, comm, stream, root);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return point_to_point("ncclSend", true, sendbuff, nullptr, count, datatype, peer, comm, stream);
}
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return point_to_point("ncclRecv", false, nullptr, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart(void) {
  auto lock = lock_device();
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd(void) {
  auto lock = lock_device();
  if (group_depth == 0) return misuse(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth == 0) {
    auto work = std::move(deferred);
    deferred.clear();
    open_p2p.clear();  // the deferred work holds the transfers
    for (auto& w : work) w();
    // Non-blocking communicators that took part report ncclInProgress until polled.
    const bool pending = !grouped.empty();
    for (ncclComm* c : grouped) {
      if (live().count(c) == 0) continue;
      c->state = ncclInProgress;
      c->in_progress_polls = 1;
    }
    grouped.clear();
    if (pending) return ncclInProgress;
  }
  return ncclSuccess;
}

}  // extern "C"
