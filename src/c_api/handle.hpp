// handle.hpp: what a C handle is, and the one wrapper every C entry point runs its body in
// (argument checks, exception -> status, last-error bookkeeping). Internal to src/c_api/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>

#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.h"

// The object behind shardopt_optimizer_t. `magic` is kLiveMagic while the handle is live;
// destroy zeroes it (and unregisters the handle) before freeing, so a stale handle is
// rejected instead of being dereferenced.
struct shardopt_optimizer_s {
  static constexpr std::uint64_t kLiveMagic = 0x5348415244305054ull;  // "SHARD0PT"
  std::uint64_t magic = kLiveMagic;
  std::unique_ptr<shardopt::ShardedOptimizer> opt;
  std::string last_error;
  bool lazy_gather = false;   ///< config gather_mode == SHARDOPT_GATHER_LAZY
  int comm_kind = SHARDOPT_COMM_AUTO;  ///< as requested in the config
  int simulate_nodes = 0;              ///< as requested in the config
  int mpi_in_flight = 0;               ///< as requested in the config
  std::string comm_name;      ///< behind shardopt_comm_name
  std::string published;      ///< behind shardopt_save_checkpoint's *published
};

namespace shardopt::capi {

using Handle = shardopt_optimizer_s;

/// The live handle `h`, or nullptr when it is null, destroyed or not one of ours. Never
/// reads memory of a handle that is not registered.
Handle* find_live(shardopt_optimizer_t h) noexcept;
/// find_live, throwing Error(InvalidArgument) naming what is wrong.
Handle& require_live(shardopt_optimizer_t h);
/// Registers a new handle owning `opt`.
shardopt_optimizer_t register_handle(std::unique_ptr<ShardedOptimizer> opt, bool lazy_gather);
/// Unregisters, zeroes the magic and frees.
void destroy_handle(Handle& h) noexcept;

/// The message behind shardopt_last_error(h).
const char* last_error_of(shardopt_optimizer_t h) noexcept;

/// Records a failure of C function `fn` (per handle when `h` is live, and per thread) and
/// returns its code. Never throws.
shardopt_status_t record_failure(Handle* h, const char* fn, Status s, const char* what) noexcept;

/// Runs body() and turns every exception into a status with a recorded message: the only
/// way exceptions are handled at the ABI.
template <class Body>
shardopt_status_t guarded(const char* fn, Handle* h, Body&& body) noexcept {
  const CallScope call(fn);  // names the C function in a collective timeout's report
  try {
    body();
    return SHARDOPT_SUCCESS;
  } catch (const Error& e) {
    return record_failure(h, fn, e.status(), e.what());
  } catch (const std::bad_alloc&) {
    return record_failure(h, fn, Status::OutOfMemory, "out of host memory");
  } catch (const std::exception& e) {
    return record_failure(h, fn, Status::Internal, e.what());
  } catch (...) {
    return record_failure(h, fn, Status::Internal, "unknown exception");
  }
}

/// The common entry point on an existing handle: validates it, then runs body(optimizer).
template <class Body>
shardopt_status_t on_handle(const char* fn, shardopt_optimizer_t h, Body&& body) noexcept {
  Handle* live = find_live(h);
  return guarded(fn, live, [&] { body(*(live != nullptr ? live : &require_live(h))->opt); });
}

/// Throws Error(InvalidArgument) when a required pointer argument is null.
template <class T>
T* non_null(T* p, const char* what) {
  require(p != nullptr, Status::InvalidArgument, std::string(what) + " is NULL");
  return p;
}

/// Every field of the config at its default, struct_size = sizeof(shardopt_config_t).
shardopt_config_t default_config();

/// What a caller's config asks for (read with the growable-struct rule), or why it cannot be
/// used (`problem` non-empty). Local; also checks that `out` is not NULL.
struct CreateRequest {
  OptimizerOptions options;
  int comm_kind = SHARDOPT_COMM_AUTO;
  int simulate_nodes = 0;
  int mpi_in_flight = 0;
  bool lazy_gather = false;
  std::string problem;
};
CreateRequest read_config(const shardopt_config_t* config, const shardopt_optimizer_t* out);

/// The options of `h` as a config: every field within config->struct_size (checked here).
void write_config(const Handle& h, shardopt_config_t* config);

/// Checks a growable struct's size: at least `min_size`, and on one of the field `ends` when
/// below sizeof (= ends.back()); `accept_larger`: a larger size (a newer caller) is fine.
/// Returns what is wrong, or "".
std::string struct_size_problem(const char* what, std::size_t given, std::size_t min_size,
                                std::span<const std::size_t> ends, bool accept_larger);

/// Writes the fields of `full` that lie within out->struct_size (already checked) into *out,
/// leaving struct_size and everything beyond it as they are.
template <class S>
void write_prefix(S* out, S full) {
  full.struct_size = out->struct_size;
  std::memcpy(out, &full, std::min(out->struct_size, sizeof(S)));
}

/// Collective over `comm`: every rank's config problem becomes the same error everywhere,
/// so a bad argument on one rank fails every rank instead of leaving the others waiting.
void agree_on_request(Communicator& comm, const CreateRequest& request);

/// Collective creation shared by shardopt_create and shardopt_create_mpi*: agrees on the
/// request over `comm`, then builds the optimizer into *out.
void create_on(std::shared_ptr<Communicator> comm, const CreateRequest& request,
               shardopt_optimizer_t* out);

}  // namespace shardopt::capi
