// fake_runtime.cpp: the fake CUDA runtime (see fake_device.hpp for the model).
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "fake_control.hpp"
#include "fake_device.hpp"

struct CUstream_st {
  int id = 0;
  bool blocking = true;
  std::deque<fakecuda::OpPtr> pending;  // not yet done, in order
  fakecuda::OpPtr last;
  std::vector<std::uint64_t> clock;
  std::vector<fakecuda::OpPtr> wait_deps;  // cudaStreamWaitEvent, for the next op
};

struct CUevent_st {
  unsigned flags = 0;
  fakecuda::OpPtr marker;
  std::vector<std::uint64_t> clock;
};

namespace fakecuda {

struct Op {
  std::uint64_t id = 0;
  int stream = 0;
  std::vector<std::uint64_t> clock;
  std::vector<OpPtr> deps;  // ops of other streams that must be done first
  std::string name;
  std::function<void()> run;
  std::unique_ptr<Transfer> transfer;
  enum State { Queued, Posted, Done } state = Queued;
  bool abandoned = false;
  bool host_visible = false;  // writes pinned host memory: runs only in a host wait
  std::chrono::steady_clock::time_point done_at;
};

namespace {

using Clock = std::vector<std::uint64_t>;

void merge(Clock& a, const Clock& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (std::size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
}
std::uint64_t at(const Clock& c, int i) {
  return static_cast<std::size_t>(i) < c.size() ? c[static_cast<std::size_t>(i)] : 0;
}

struct AccessRecord {
  std::uintptr_t begin, end;
  bool write;
  int stream;
  std::uint64_t seq;  // the op's own clock component
  std::string name;
};

struct State {
  // Memory: one memfd, two mappings.
  static constexpr std::size_t kArena = std::size_t{1} << 35;  // 32 GiB of address space
  int fd = -1;
  char* lib = nullptr;  // PROT_NONE: what the library sees
  char* rw = nullptr;   // read/write: the fake's kernels and copies
  std::map<std::uintptr_t, std::size_t> allocs;  // library address -> bytes
  std::map<std::size_t, std::size_t> free_;      // arena offset -> bytes
  std::map<std::uintptr_t, std::size_t> pinned;
  std::map<std::uintptr_t, std::vector<AccessRecord>> shadow;  // per allocation

  // Work.
  CUstream_st legacy;
  std::set<CUstream_st*> streams;  // live, including &legacy
  std::set<CUevent_st*> events;
  int next_stream_id = 1;
  std::uint64_t next_op = 0;
  Clock host;
  std::map<std::uint64_t, OpPtr> ops_by_id;  // for happens_before()

  // Errors, log, knobs.
  cudaError_t last_error = cudaSuccess;
  bool collect = false;
  std::vector<std::string> problems;
  std::vector<LogEntry> log;
  int device = 0;
  int device_count = 8;
  int occupancy_queries = 0;
  Launch last_launch;

  std::mutex mutex;  // every entry point holds it; the device thread too while it runs work
  std::condition_variable wake;

  State() {
    fd = memfd_create("shardopt-fake-device", 0);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(kArena)) != 0) {
      std::perror("fake CUDA: memfd");
      std::abort();
    }
    void* a = mmap(nullptr, kArena, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    void* b = mmap(nullptr, kArena, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (a == MAP_FAILED || b == MAP_FAILED) {
      std::perror("fake CUDA: mmap");
      std::abort();
    }
    lib = static_cast<char*>(a);
    rw = static_cast<char*>(b);
    free_[0] = kArena;
    legacy.id = 0;
    streams.insert(&legacy);
    if (const char* n = std::getenv("SHARDOPT_FAKE_CUDA_DEVICES")) device_count = std::atoi(n);
  }
};

void device_loop();

State& st() {
  // Never destroyed: library destructors may run after main. The device thread starts once
  // the state exists.
  static State* s = [] {
    auto* state = new State;
    std::thread(device_loop).detach();
    return state;
  }();
  return *s;
}

CUstream_st* resolve(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy) return &st().legacy;
  if (st().streams.count(s) == 0) return nullptr;
  return s;
}

bool deps_done(const Op& op) {
  for (const OpPtr& d : op.deps)
    if (d->state != Op::Done) return false;
  return true;
}

// Runs or progresses `op` (at its stream's front, dependencies done); true once done.
bool execute(const OpPtr& op) {
  if (op->state == Op::Done) return true;
  if (op->abandoned) {
    op->state = Op::Done;
  } else if (op->transfer) {
    if (op->state == Op::Queued) {
      op->transfer->post();
      op->state = Op::Posted;
    }
    if (!op->transfer->test()) return false;
    op->transfer->finish();
  } else if (op->run) {
    op->run();
  }
  op->state = Op::Done;
  op->done_at = std::chrono::steady_clock::now();
  op->run = nullptr;
  op->transfer.reset();
  return true;
}

// One round over every stream: runs what can run. Copies into pinned host memory run only
// in a host wait (host_turn): the host sees them only once it has waited for them.
bool step_all(bool host_turn) {
  bool progressed = false;
  for (CUstream_st* s : st().streams) {
    while (!s->pending.empty()) {
      const OpPtr op = s->pending.front();
      if (op->state != Op::Done) {
        if (!deps_done(*op) || (op->host_visible && !host_turn && !op->abandoned)) break;
        if (!execute(op)) break;
      }
      s->pending.pop_front();
      progressed = true;
    }
  }
  return progressed;
}

// The device: runs queued work in the background, as a GPU does, so that a rank blocked in
// a host MPI call still takes part in the collectives it has queued.
void device_loop() {
  std::unique_lock<std::mutex> lock(st().mutex);
  for (;;) {
    const bool progressed = step_all(false);
    if (progressed) continue;
    bool in_flight = false;
    for (CUstream_st* s : st().streams)
      if (!s->pending.empty() && s->pending.front()->state == Op::Posted) in_flight = true;
    st().wake.wait_for(lock, std::chrono::microseconds(in_flight ? 20 : 2000));
  }
}

// Waits (lock held) until `op` is done; without `lock`, one round only. True when done.
bool complete(const OpPtr& op, std::unique_lock<std::mutex>* lock) {
  for (unsigned spins = 0;; ++spins) {
    step_all(true);
    if (op->state == Op::Done) return true;
    if (lock == nullptr) return false;
    lock->unlock();
    if (spins < 100) {
      sched_yield();
    } else {
      usleep(20);
    }
    lock->lock();
  }
}

void prune_shadow() {
  for (auto& [base, recs] : st().shadow)
    recs.erase(std::remove_if(recs.begin(), recs.end(),
                              [](const AccessRecord& r) { return r.seq <= at(st().host, r.stream); }),
               recs.end());
}

// The host has seen `clock` complete: everything queued later is ordered after it.
void host_saw(const Clock& clock) {
  merge(st().host, clock);
  prune_shadow();
}

void log(LogEntry::Kind kind, std::string name, std::uint64_t op = 0, int stream = -1) {
  st().log.push_back(LogEntry{kind, op, std::move(name), stream});
}

std::string hex(std::uintptr_t p) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%zx", static_cast<std::size_t>(p));
  return b;
}

// The allocation holding [p, p + bytes), or allocs.end().
std::map<std::uintptr_t, std::size_t>::const_iterator find_alloc(std::uintptr_t p, std::size_t bytes) {
  auto& a = st().allocs;
  auto it = a.upper_bound(p);
  if (it == a.begin()) return a.end();
  --it;
  if (p + bytes > it->first + it->second) return a.end();
  return it;
}

void check_access(const Op& op, const Access& x) {
  const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(st().lib);
  if (x.begin < lo || x.begin >= lo + State::kArena) return;  // host memory: not tracked
  if (x.end == x.begin) return;
  auto it = find_alloc(x.begin, x.end - x.begin);
  if (it == st().allocs.end()) {
    problem(op.name + " on stream " + std::to_string(op.stream) + " accesses [" + hex(x.begin) +
            ", " + hex(x.end) + "), which is not inside one live device allocation");
    return;
  }
  std::vector<AccessRecord>& recs = st().shadow[it->first];
  for (const AccessRecord& r : recs) {
    if (r.end <= x.begin || x.end <= r.begin || !(r.write || x.write)) continue;
    if (r.seq <= at(op.clock, r.stream)) continue;  // ordered
    problem("race: " + op.name + " (stream " + std::to_string(op.stream) + ") " +
            (x.write ? "writes" : "reads") + " [" + hex(std::max(x.begin, r.begin)) + ", " +
            hex(std::min(x.end, r.end)) + ") which " + r.name + " (stream " +
            std::to_string(r.stream) + ") " + (r.write ? "writes" : "reads") +
            ", and nothing orders the two (a missing cudaStreamWaitEvent or host wait)");
  }
}

void record_access(const Op& op, const Access& x) {
  const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(st().lib);
  if (x.begin < lo || x.begin >= lo + State::kArena || x.end == x.begin) return;
  auto it = find_alloc(x.begin, x.end - x.begin);
  if (it == st().allocs.end()) return;
  st().shadow[it->first].push_back(
      AccessRecord{x.begin, x.end, x.write, op.stream, at(op.clock, op.stream), op.name});
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
  }
}

bool sync_op(const OpPtr& op, const char* why, std::unique_lock<std::mutex>& lock) {
  log(LogEntry::HostSync, why);
  if (op && !complete(op, &lock)) return false;
  if (op) host_saw(op->clock);
  return true;
}

void sync_all(const char* why, std::unique_lock<std::mutex>& lock) {
  log(LogEntry::HostSync, why);
  for (CUstream_st* s : std::vector<CUstream_st*>(st().streams.begin(), st().streams.end()))
    if (s->last) {
      const OpPtr last = s->last;
      complete(last, &lock);
      host_saw(last->clock);
    }
}

}  // namespace

// ---- model API --------------------------------------------------------------------------------

void problem(const std::string& what) {
  if (st().collect) {
    st().problems.push_back(what);
    return;
  }
  std::fprintf(stderr, "fake CUDA device: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

cudaError_t fail(cudaError_t e, const std::string& what) {
  st().last_error = e;
  if (std::getenv("SHARDOPT_FAKE_CUDA_VERBOSE"))
    std::fprintf(stderr, "fake CUDA device: %s: %s\n", error_name(e), what.c_str());
  return e;
}

bool valid_stream(cudaStream_t s) { return resolve(s) != nullptr; }

void* dev(const void* p) {
  const auto q = reinterpret_cast<std::uintptr_t>(p);
  const auto lo = reinterpret_cast<std::uintptr_t>(st().lib);
  if (p == nullptr || q < lo || q >= lo + State::kArena) return const_cast<void*>(p);
  return st().rw + (q - lo);
}

bool is_device(const void* p, std::size_t bytes) {
  return find_alloc(reinterpret_cast<std::uintptr_t>(p), bytes) != st().allocs.end();
}

bool is_pinned(const void* p, std::size_t bytes) {
  const auto q = reinterpret_cast<std::uintptr_t>(p);
  auto it = st().pinned.upper_bound(q);
  if (it == st().pinned.begin()) return false;
  --it;
  return q + bytes <= it->first + it->second;
}

OpPtr enqueue(cudaStream_t stream, std::string name, std::vector<Access> accesses,
              std::function<void()> run, std::unique_ptr<Transfer> transfer) {
  CUstream_st* s = resolve(stream);
  if (s == nullptr) {
    fail(cudaErrorInvalidResourceHandle, name + ": invalid stream");
    return nullptr;
  }
  auto op = std::make_shared<Op>();
  op->id = ++st().next_op;
  op->stream = s->id;
  op->name = std::move(name);
  op->run = std::move(run);
  op->transfer = std::move(transfer);
  Clock c = s->clock;
  merge(c, st().host);
  // The legacy default stream: it waits for every blocking stream, and they wait for it.
  if (s->id == 0) {
    for (CUstream_st* t : st().streams)
      if (t != s && t->blocking && t->last) {
        op->deps.push_back(t->last);
        merge(c, t->last->clock);
      }
  } else if (s->blocking && st().legacy.last) {
    op->deps.push_back(st().legacy.last);
    merge(c, st().legacy.last->clock);
  }
  for (const OpPtr& w : s->wait_deps) op->deps.push_back(w);
  s->wait_deps.clear();
  if (c.size() <= static_cast<std::size_t>(s->id)) c.resize(static_cast<std::size_t>(s->id) + 1, 0);
  c[static_cast<std::size_t>(s->id)] += 1;
  op->clock = c;
  s->clock = c;
  for (const Access& a : accesses) check_access(*op, a);
  for (const Access& a : accesses) record_access(*op, a);
  s->pending.push_back(op);
  s->last = op;
  st().ops_by_id[op->id] = op;
  st().wake.notify_one();
  log(LogEntry::Queued, op->name, op->id, s->id);
  return op;
}

bool run_until(const OpPtr& op, std::unique_lock<std::mutex>* lock) { return complete(op, lock); }
std::unique_lock<std::mutex> lock_device() { return std::unique_lock<std::mutex>(st().mutex); }
void mark_host_visible(const OpPtr& op) { op->host_visible = true; }
bool op_done(const OpPtr& op) { return op->state == Op::Done; }

void abandon(const OpPtr& op) {
  if (op->state == Op::Done) return;
  if (op->state == Op::Posted && op->transfer) op->transfer->cancel();
  op->abandoned = true;
}

// ---- control API ------------------------------------------------------------------------------

std::size_t log_mark() {
  std::unique_lock<std::mutex> lock(st().mutex);
  return st().log.size();
}
std::vector<LogEntry> log_since(std::size_t mark) {
  std::unique_lock<std::mutex> lock(st().mutex);
  return {st().log.begin() + static_cast<std::ptrdiff_t>(std::min(mark, st().log.size())),
          st().log.end()};
}
bool happens_before(std::uint64_t a, std::uint64_t b) {
  std::unique_lock<std::mutex> lock(st().mutex);
  const OpPtr& x = st().ops_by_id.at(a);
  const OpPtr& y = st().ops_by_id.at(b);
  return at(x->clock, x->stream) <= at(y->clock, x->stream) && a != b;
}
void set_collect_problems(bool collect) {
  std::unique_lock<std::mutex> lock(st().mutex);
  st().collect = collect;
}
std::vector<std::string> take_problems() {
  std::unique_lock<std::mutex> lock(st().mutex);
  return std::exchange(st().problems, {});
}
int occupancy_queries() {
  std::unique_lock<std::mutex> lock(st().mutex);
  return st().occupancy_queries;
}
Launch last_grid_stride_launch() {
  std::unique_lock<std::mutex> lock(st().mutex);
  return st().last_launch;
}
void set_last_grid_stride_launch(Launch l) { st().last_launch = l; }

namespace {
// An op that completes `seconds` after it starts, without holding the device (a transfer:
// the device thread polls it), so that host waits and watchdogs go on meanwhile.
class Hold final : public Transfer {
 public:
  explicit Hold(double seconds) : seconds_(seconds) {}
  void post() override {
    end_ = std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(seconds_));
  }
  bool test() override { return std::chrono::steady_clock::now() >= end_; }
  void finish() override {}
  void cancel() override {}

 private:
  double seconds_;
  std::chrono::steady_clock::time_point end_;
};
}  // namespace

void hold_stream(cudaStream_t stream, double seconds) {
  std::unique_lock<std::mutex> lock(st().mutex);
  enqueue(stream, "hold", {}, nullptr, std::make_unique<Hold>(seconds));
}

}  // namespace fakecuda

// ---- the runtime API ----------------------------------------------------------------------------

using namespace fakecuda;

namespace {

cudaError_t ok() { return cudaSuccess; }

// Copies [src, src + n) to dst at run time, through the read/write mapping.
std::function<void()> copier(void* dst, const void* src, std::size_t n) {
  return [dst, src, n] { std::memmove(dev(dst), dev(src), n); };
}

cudaError_t memcpy_async(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                         cudaStream_t stream, bool sync, std::unique_lock<std::mutex>& lock) {
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaMemcpy: invalid stream");
  if (n == 0) return ok();
  const bool dd = is_device(dst, n), sd = is_device(src, n);
  if (kind == cudaMemcpyDefault)
    kind = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
              : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  const bool want_dd = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_sd = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (dd != want_dd || sd != want_sd)
    return fail(cudaErrorInvalidValue, "cudaMemcpy: the pointers do not match the copy kind "
                                       "(or a device range is outside its allocation)");
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  std::vector<Access> acc = {{s, s + n, false}, {d, d + n, true}};
  const char* names[] = {"memcpy HtoH", "memcpy HtoD", "memcpy DtoH", "memcpy DtoD"};
  std::function<void()> run;
  if (kind == cudaMemcpyHostToDevice && !is_pinned(src, n)) {
    // Pageable source: the runtime stages it before returning.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + n);
    run = [dst, staged] { std::memcpy(dev(dst), staged->data(), staged->size()); };
  } else {
    run = copier(dst, src, n);
  }
  const bool pinned_dst = kind == cudaMemcpyDeviceToHost && is_pinned(dst, n);
  if (pinned_dst) std::memset(dst, 0xFF, n);  // in flight: the host must not read it yet
  OpPtr op = enqueue(stream, names[kind], std::move(acc), std::move(run));
  if (!op) return cudaErrorInvalidResourceHandle;
  if (pinned_dst) mark_host_visible(op);
  // Pageable destinations are written before the call returns (the runtime waits).
  if (sync || (kind == cudaMemcpyDeviceToHost && !pinned_dst))
    sync_op(op, sync ? "cudaMemcpy" : "cudaMemcpyAsync to pageable memory", lock);
  return ok();
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  std::unique_lock<std::mutex> lock(st().mutex);
  *count = st().device_count;
  if (st().device_count <= 0) return fail(cudaErrorNoDevice, "no fake devices");
  return ok();
}
cudaError_t cudaGetDevice(int* device) {
  std::unique_lock<std::mutex> lock(st().mutex);
  *device = st().device;
  return ok();
}
cudaError_t cudaSetDevice(int device) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (device < 0 || device >= st().device_count) return fail(cudaErrorInvalidDevice, "cudaSetDevice");
  st().device = device;
  return ok();
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (device < 0 || device >= st().device_count) return fail(cudaErrorInvalidDevice, "attribute");
  if (attr != cudaDevAttrMultiProcessorCount) return fail(cudaErrorInvalidValue, "attribute");
  *value = kFakeSmCount;
  return ok();
}
cudaError_t cudaDeviceSynchronize(void) {
  std::unique_lock<std::mutex> lock(st().mutex);
  sync_all("cudaDeviceSynchronize", lock);
  return ok();
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void* func,
                                                          int block_size, size_t) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (func == nullptr || block_size <= 0) return fail(cudaErrorInvalidValue, "occupancy");
  ++st().occupancy_queries;
  *num_blocks = kFakeBlocksPerSm;
  return ok();
}
cudaError_t cudaGetLastError(void) {
  std::unique_lock<std::mutex> lock(st().mutex);
  return std::exchange(st().last_error, cudaSuccess);
}
cudaError_t cudaPeekAtLastError(void) {
  std::unique_lock<std::mutex> lock(st().mutex);
  return st().last_error;
}
const char* cudaGetErrorName(cudaError_t e) { return error_name(e); }
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    default: return "unknown error";
  }
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  std::unique_lock<std::mutex> lock(st().mutex);
  *ptr = nullptr;
  if (size == 0) return ok();
  const std::size_t bytes = (size + 255) / 256 * 256;
  auto& fl = st().free_;
  for (auto it = fl.begin(); it != fl.end(); ++it) {
    if (it->second < bytes) continue;
    const std::size_t off = it->first, len = it->second;
    fl.erase(it);
    if (len > bytes) fl[off + bytes] = len - bytes;
    // Fresh device memory holds garbage, as on a GPU.
    std::memset(st().rw + off, 0xCD, size);
    *ptr = st().lib + off;
    st().allocs[reinterpret_cast<std::uintptr_t>(*ptr)] = bytes;
    return ok();
  }
  return fail(cudaErrorMemoryAllocation, "fake device arena exhausted");
}

cudaError_t cudaFree(void* ptr) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (ptr == nullptr) return ok();
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = st().allocs.find(p);
  if (it == st().allocs.end()) return fail(cudaErrorInvalidValue, "cudaFree of an unknown pointer");
  sync_all("cudaFree", lock);  // cudaFree synchronizes the device
  const std::size_t off = p - reinterpret_cast<std::uintptr_t>(st().lib), len = it->second;
  st().allocs.erase(it);
  st().shadow.erase(p);
  fallocate(st().fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
            static_cast<off_t>(len));
  auto& fl = st().free_;
  auto [ins, fresh] = fl.emplace(off, len);
  (void)fresh;
  auto next = std::next(ins);
  if (next != fl.end() && ins->first + ins->second == next->first) {
    ins->second += next->second;
    fl.erase(next);
  }
  if (ins != fl.begin()) {
    auto prev = std::prev(ins);
    if (prev->first + prev->second == ins->first) {
      prev->second += ins->second;
      fl.erase(ins);
    }
  }
  return ok();
}

// The arena's free bytes (its address space: the memfd holds only what is written).
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  std::unique_lock<std::mutex> lock(st().mutex);
  *free = 0;
  for (const auto& [off, len] : st().free_) *free += len;
  *total = State::kArena;
  return ok();
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  std::unique_lock<std::mutex> lock(st().mutex);
  *ptr = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  if (*ptr == nullptr) return fail(cudaErrorMemoryAllocation, "cudaMallocHost");
  st().pinned[reinterpret_cast<std::uintptr_t>(*ptr)] = size;
  return ok();
}
cudaError_t cudaFreeHost(void* ptr) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (ptr == nullptr) return ok();
  if (st().pinned.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0)
    return fail(cudaErrorInvalidValue, "cudaFreeHost of an unknown pointer");
  sync_all("cudaFreeHost", lock);
  std::free(ptr);
  return ok();
}
cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  {
    std::unique_lock<std::mutex> lock(st().mutex);
    if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaMallocAsync");
  }
  return cudaMalloc(ptr, size);
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaFreeAsync");
  if (ptr == nullptr) return ok();
  if (st().allocs.count(reinterpret_cast<std::uintptr_t>(ptr)) == 0)
    return fail(cudaErrorInvalidValue, "cudaFreeAsync of an unknown pointer");
  const std::size_t n = st().allocs[reinterpret_cast<std::uintptr_t>(ptr)];
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  // The free is ordered on the stream like a write of the whole block.
  enqueue(stream, "cudaFreeAsync", {{p, p + n, true}}, [ptr] {
    st().allocs.erase(reinterpret_cast<std::uintptr_t>(ptr));
    st().shadow.erase(reinterpret_cast<std::uintptr_t>(ptr));
  });
  return ok();
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  std::unique_lock<std::mutex> lock(st().mutex);
  return memcpy_async(dst, src, count, kind, nullptr, true, lock);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  return memcpy_async(dst, src, count, kind, stream, false, lock);
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (!valid_stream(stream)) return fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync");
  if (count == 0) return ok();
  if (!is_device(ptr, count)) return fail(cudaErrorInvalidValue, "cudaMemset of non-device memory");
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  enqueue(stream, "memset", {{p, p + count, true}},
          [ptr, value, count] { std::memset(dev(ptr), value, count); });
  return ok();
}
cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  const cudaError_t rc = cudaMemsetAsync(ptr, value, count, nullptr);
  std::unique_lock<std::mutex> lock(st().mutex);
  if (rc == cudaSuccess) sync_op(st().legacy.last, "cudaMemset", lock);
  return rc;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  std::unique_lock<std::mutex> lock(st().mutex);
  auto* s = new CUstream_st;
  s->id = st().next_stream_id++;
  s->blocking = (flags & cudaStreamNonBlocking) == 0;
  s->clock = st().host;
  st().streams.insert(s);
  *stream = s;
  return ok();
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (stream == nullptr || stream == cudaStreamLegacy || st().streams.count(stream) == 0)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy");
  // Queued work still runs (CUDA completes it); the handle dies now.
  if (stream->last) complete(stream->last, &lock);
  st().streams.erase(stream);
  delete stream;
  return ok();
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  CUstream_st* s = resolve(stream);
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize");
  sync_op(s->last, "cudaStreamSynchronize", lock);
  return ok();
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  CUstream_st* s = resolve(stream);
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery");
  log(LogEntry::HostQuery, "cudaStreamQuery");
  if (s->last && !complete(s->last, nullptr)) return cudaErrorNotReady;
  if (s->last) host_saw(s->last->clock);
  return ok();
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  std::unique_lock<std::mutex> lock(st().mutex);
  CUstream_st* s = resolve(stream);
  if (s == nullptr || st().events.count(event) == 0)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent");
  if (!event->marker) return ok();  // never recorded: nothing to wait for
  s->wait_deps.push_back(event->marker);
  merge(s->clock, event->clock);
  return ok();
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  std::unique_lock<std::mutex> lock(st().mutex);
  auto* e = new CUevent_st;
  e->flags = flags;
  st().events.insert(e);
  *event = e;
  return ok();
}
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (st().events.erase(event) == 0) return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy");
  delete event;
  return ok();
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (st().events.count(event) == 0) return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord");
  OpPtr op = enqueue(stream, "event record", {}, nullptr);
  if (!op) return cudaErrorInvalidResourceHandle;
  event->marker = op;
  event->clock = op->clock;
  return ok();
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (st().events.count(event) == 0) return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery");
  log(LogEntry::HostQuery, "cudaEventQuery");
  if (!event->marker) return ok();
  if (!complete(event->marker, nullptr)) return cudaErrorNotReady;
  host_saw(event->clock);
  return ok();
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (st().events.count(event) == 0)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize");
  sync_op(event->marker, "cudaEventSynchronize", lock);
  return ok();
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  std::unique_lock<std::mutex> lock(st().mutex);
  if (st().events.count(start) == 0 || st().events.count(end) == 0 ||
      ((start->flags | end->flags) & cudaEventDisableTiming) != 0 || !start->marker || !end->marker)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime");
  if (start->marker->state != Op::Done || end->marker->state != Op::Done) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(end->marker->done_at - start->marker->done_at).count();
  return ok();
}

}  // extern "C"
