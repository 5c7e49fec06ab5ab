// shm_comm.cpp: reduce-scatter and all-gather over MPI-3 shared-memory windows inside a
// node, MPI collectives between node leaders.
//
// Inside a node every rank addresses every peer's segment of a window directly. A
// reduce-scatter sums each output block across the peers' buffers, the work of every block
// split between all node ranks (so uneven blocks, as in stage-2 buckets, still use every
// core); an all-gather copies the peers' blocks. ShmWindow::sync() (MPI_Win_sync + node
// barrier) separates the phases in which a buffer is read from those in which it is written.
//
// Summation order: within a node, node ranks 0, 1, 2, ... left to right in fp32 (node ranks
// follow world ranks). Across nodes, the node sums are combined by MPI_Reduce_scatter on the
// leaders (MPI's own order).
#include "shm_comm.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <cstring>
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

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(std::shared_ptr<Communicator> plain, std::shared_ptr<NodeTopology> topo)
      : plain_(std::move(plain)), topo_(std::move(topo)) {}

  int rank() const override { return topo_->world_rank; }
  int size() const override { return topo_->world_size; }
  std::string name() const override {
    if (topo_->num_nodes == 1) return "mpi-shm";
    return "mpi-shm-hierarchical(" + std::to_string(topo_->num_nodes) + " nodes)";
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    plain_->all_reduce_sum(buf, count, type);
  }
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    plain_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    plain_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    plain_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override { plain_->barrier(); }

  Allocation allocate_collective_buffer(MemoryTracker* tracker, MemCategory category,
                                        std::size_t bytes) override {
    if (bytes == 0) return {};
    // Shared segments live in tmpfs, which overcommits: a full /dev/shm (containers default
    // to 64 MiB) would fault on first touch instead of failing here. Every rank falls back to
    // its backend's memory (and plain MPI) if any node lacks the room.
    const std::size_t node_bytes = bytes * static_cast<std::size_t>(topo_->node_size);
    double short_of_room = shm_has_room(node_bytes) ? 0 : 1;
    plain_->all_reduce_sum_host(&short_of_room, 1);
    if (short_of_room != 0) return {};
    auto win = std::make_shared<ShmWindow>(topo_, bytes);
    std::erase_if(windows_, [](const std::weak_ptr<ShmWindow>& w) { return w.expired(); });
    windows_.push_back(win);
    char* data = win->mine();
    return Allocation(data, bytes, std::move(win), tracker, category);
  }

  void reduce_scatter_sum_inplace(float* buf, std::span<const std::size_t> counts) override {
    require(counts.size() == static_cast<std::size_t>(size()), Status::InvalidArgument,
            "reduce_scatter: need one count per rank");
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    const WindowView v = find(buf, total * sizeof(float));
    if (v.win == nullptr || !hierarchy_usable()) {
      plain_->reduce_scatter_sum_inplace(buf, counts);
    } else if (topo_->num_nodes == 1) {
      node_reduce_scatter(v, counts);
    } else {
      hierarchical_reduce_scatter(v, counts, total);
    }
  }

  void all_gather_inplace(void* buf, std::size_t count_per_rank, CommType type) override {
    const std::size_t block = count_per_rank * mpi::type_size(type);
    const WindowView v = find(buf, block * static_cast<std::size_t>(size()));
    if (v.win == nullptr || !hierarchy_usable()) {
      plain_->all_gather_inplace(buf, count_per_rank, type);
    } else if (topo_->num_nodes == 1) {
      node_all_gather(v, block);
    } else {
      hierarchical_all_gather(v, count_per_rank, type);
    }
  }

 private:
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
        return WindowView{win.get(), static_cast<std::size_t>(c - mine)};
    }
    return {};
  }

  // dst[0, n) = sum over node ranks of their [begin, begin + n); this rank does its part.
  void sum_part(const WindowView& v, std::size_t begin, std::size_t n, float* dst) const {
    const Range part = split_part(n, topo_->node_size, topo_->node_rank);
    if (part.empty()) return;
    std::vector<const float*> src(static_cast<std::size_t>(topo_->node_size));
    for (int p = 0; p < topo_->node_size; ++p)
      src[static_cast<std::size_t>(p)] = v.f32(p) + begin + part.begin;
    sum_rows(dst + part.begin, src.data(), topo_->node_size, part.size());
  }

  // One node: block k is summed by all node ranks together, straight into the front of rank
  // k's buffer when that region has already been consumed (it lies in blocks summed
  // earlier, separated by a sync), else in place at block k and moved by rank k at the end.
  void node_reduce_scatter(const WindowView& v, std::span<const std::size_t> counts) {
    const int n = topo_->node_size;
    std::vector<std::size_t> start(counts.size() + 1, 0);
    for (std::size_t k = 0; k < counts.size(); ++k) start[k + 1] = start[k] + counts[k];
    v.win->sync();   // every rank's input is complete
    int synced = 0;  // blocks [0, synced) are summed and seen by every rank
    bool move_mine = false;
    for (int k = 0; k < n; ++k) {
      const std::size_t c = counts[static_cast<std::size_t>(k)];
      if (c == 0) continue;
      const std::size_t s = start[static_cast<std::size_t>(k)];
      const bool to_front = k == 0 || c <= s;
      if (to_front && k > 0) {
        int last = 0;  // the last block overlapping [0, c) of rank k's buffer
        while (start[static_cast<std::size_t>(last) + 1] < c) ++last;
        if (last >= synced) {
          v.win->sync();
          synced = k;
        }
      }
      if (!to_front && k == topo_->node_rank) move_mine = true;
      sum_part(v, s, c, v.f32(k) + (to_front ? 0 : s));
    }
    v.win->sync();  // results complete; nobody reads a peer's buffer after this
    if (move_mine) {
      float* mine = v.f32(topo_->node_rank);
      const std::size_t r = static_cast<std::size_t>(topo_->node_rank);
      std::memmove(mine, mine + start[r], counts[r] * sizeof(float));
    }
  }

  void node_all_gather(const WindowView& v, std::size_t block) {
    const int n = topo_->node_size;
    const int me = topo_->node_rank;
    v.win->sync();  // every rank's block is complete
    char* mine = v.at(me);
    for (int j = 1; j < n; ++j) {  // start at the next rank: ranks read different peers
      const std::size_t p = static_cast<std::size_t>((me + j) % n);
      std::memcpy(mine + p * block, v.at(static_cast<int>(p)) + p * block, block);
    }
    v.win->sync();  // nobody reads this rank's buffer any more
  }

  // Several nodes, each holding consecutive world ranks: node sum of the whole buffer into
  // the leader's segment, reduce-scatter of node ranges between leaders, then every rank
  // copies its block out of the leader's result.
  void hierarchical_reduce_scatter(const WindowView& v, std::span<const std::size_t> counts,
                                   std::size_t total) {
    const NodeTopology& t = *topo_;
    v.win->sync();
    sum_part(v, 0, total, v.f32(0));
    v.win->sync();
    std::vector<std::size_t> node_count(static_cast<std::size_t>(t.num_nodes), 0);
    for (int w = 0; w < t.world_size; ++w)
      node_count[node_of(w)] += counts[static_cast<std::size_t>(w)];
    if (t.node_rank == 0) {
      std::vector<int> icounts(node_count.size());
      for (std::size_t n = 0; n < node_count.size(); ++n)
        icounts[n] = mpi::checked_int(node_count[n], "MPI_Reduce_scatter");
      SHARDOPT_MPI(MPI_Reduce_scatter(MPI_IN_PLACE, v.f32(0), icounts.data(), MPI_FLOAT, MPI_SUM,
                                      t.leaders));
    }
    v.win->sync();
    if (t.node_rank != 0) {
      const std::size_t first =
          static_cast<std::size_t>(t.node_first[static_cast<std::size_t>(t.node_index)]);
      std::size_t offset = 0;  // my block within the node's range
      for (std::size_t w = first; w < static_cast<std::size_t>(t.world_rank); ++w)
        offset += counts[w];
      std::memcpy(v.f32(t.node_rank), v.f32(0) + offset,
                  counts[static_cast<std::size_t>(t.world_rank)] * sizeof(float));
    }
    v.win->sync();  // the leader's buffer is its own again
  }

  void hierarchical_all_gather(const WindowView& v, std::size_t count_per_rank, CommType type) {
    const NodeTopology& t = *topo_;
    const std::size_t block = count_per_rank * mpi::type_size(type);
    const std::size_t me = static_cast<std::size_t>(t.world_rank);
    v.win->sync();
    if (t.node_rank != 0) std::memcpy(v.at(0) + me * block, v.at(t.node_rank) + me * block, block);
    v.win->sync();
    if (t.node_rank == 0) {
      std::vector<int> recv(static_cast<std::size_t>(t.num_nodes)), displ(recv.size());
      for (std::size_t n = 0; n < recv.size(); ++n) {
        recv[n] = mpi::checked_int(static_cast<std::size_t>(t.node_ranks[n]) * count_per_rank,
                                   "MPI_Allgatherv");
        displ[n] = mpi::checked_int(static_cast<std::size_t>(t.node_first[n]) * count_per_rank,
                                    "MPI_Allgatherv");
      }
      // Equal nodes (the usual case) take MPI_Allgather: MPICH runs it markedly faster than
      // the v-variant with the same counts (2x at 16M floats on two ranks here).
      if (std::all_of(recv.begin(), recv.end(), [&](int r) { return r == recv[0]; })) {
        SHARDOPT_MPI(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, v.at(0), recv[0],
                                   mpi::datatype(type), t.leaders));
      } else {
        SHARDOPT_MPI(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, v.at(0), recv.data(),
                                    displ.data(), mpi::datatype(type), t.leaders));
      }
    }
    v.win->sync();
    if (t.node_rank != 0) {
      char* mine = v.at(t.node_rank);
      const char* leader = v.at(0);
      const std::size_t all = block * static_cast<std::size_t>(t.world_size);
      std::memcpy(mine, leader, me * block);
      std::memcpy(mine + (me + 1) * block, leader + (me + 1) * block, all - (me + 1) * block);
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
  std::vector<std::weak_ptr<ShmWindow>> windows_;
};

}  // namespace

std::shared_ptr<Communicator> make_shm_communicator(std::shared_ptr<Communicator> plain,
                                                    std::shared_ptr<NodeTopology> topo) {
  return std::make_shared<ShmCommunicator>(std::move(plain), std::move(topo));
}

}  // namespace shardopt::shm
