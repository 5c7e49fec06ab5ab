// agree.cpp: turn a failure on one rank into the same error on every rank (collective(),
// agree()), and check that every rank is in the same collective call.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include "same_value.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"  // fnv1a64

namespace shardopt {
namespace {

// The rare path's record of one rank: its call, status and message, truncated.
struct Record {
  std::int32_t status;
  char what[44];
  char message[464];
};

void copy_truncated(char* dst, std::size_t size, std::string_view src) {
  const std::size_t n = std::min(size - 1, src.size());
  if (n > 0) std::memcpy(dst, src.data(), n);  // an empty view may have a null data()
  dst[n] = '\0';
}

// Every rank knows that some rank failed or that the calls differ: share every rank's record
// and throw the same combined Error everywhere.
[[noreturn]] void throw_agreed(Communicator& comm, std::string_view what,
                               const LocalOutcome& local) {
  Record mine{};
  mine.status = static_cast<std::int32_t>(local.status);
  copy_truncated(mine.what, sizeof mine.what, what);
  copy_truncated(mine.message, sizeof mine.message, local.message);
  std::vector<Record> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather_bytes(&mine, all.data(), sizeof(Record));

  Status first = Status::Ok;
  std::string failures;
  bool same_call = true;
  for (const Record& rec : all) same_call = same_call && std::strcmp(rec.what, all[0].what) == 0;
  for (int r = 0; r < comm.size(); ++r) {
    const Record& rec = all[static_cast<std::size_t>(r)];
    if (rec.status == static_cast<int>(Status::Ok)) continue;
    if (first == Status::Ok) first = static_cast<Status>(rec.status);
    if (!failures.empty()) failures += "; ";
    failures += "rank " + std::to_string(r) + ": " + rec.message;
  }
  std::string calls;
  if (!same_call) {
    calls = "ranks entered different collective calls:";
    for (int r = 0; r < comm.size(); ++r) {
      const char* w = all[static_cast<std::size_t>(r)].what;
      calls += r == 0 ? " rank " : ", rank ";
      calls += std::to_string(r);
      calls += *w != '\0' ? " in '" : " in an unnamed call";
      if (*w != '\0') calls.append(w).append("'");
    }
  }
  if (first == Status::Ok) throw Error(Status::InvalidState, calls);
  // A rank that failed itself reports its own category; the others learn it remotely.
  const Status mine_or_remote = local.ok() ? first : local.status;
  throw Error(mine_or_remote, calls.empty() ? failures : failures + " (" + calls + ")");
}

}  // namespace

LocalOutcome current_exception_outcome(std::string_view what) noexcept {
  try {
    const std::string prefix = what.empty() ? std::string() : std::string(what) + ": ";
    try {
      throw;
    } catch (const Error& e) {
      return {e.status(), e.what()};
    } catch (const std::filesystem::filesystem_error& e) {
      return {Status::Io, prefix + e.what()};
    } catch (const std::bad_alloc&) {
      return {Status::OutOfMemory, prefix + "out of host memory"};
    } catch (const std::exception& e) {
      return {Status::Internal, prefix + e.what()};
    } catch (...) {
      return {Status::Internal, prefix + "unknown exception"};
    }
  } catch (...) {  // no memory left for the message: the status still says what happened
    return {Status::OutOfMemory, {}};
  }
}

void agree(Communicator& comm, std::string_view what, const LocalOutcome& local) {
  double v[1 + same_value::kDoubles];
  v[0] = local.ok() ? 0.0 : 1.0;
  same_value::encode(fnv1a64(what.data(), what.size()), v + 1);
  comm.all_reduce_sum_host(v, std::size(v));
  if (v[0] == 0.0 && same_value::same(v + 1, comm.size())) return;
  throw_agreed(comm, what, local);
}

void agree_or_throw(Communicator& comm, Status local_status, const std::string& local_message) {
  agree(comm, {}, LocalOutcome{local_status, local_message});
}

void throw_agreed_error(Communicator& comm, Status local_status,
                        const std::string& local_message) {
  throw_agreed(comm, {}, LocalOutcome{local_status, local_message});
}

}  // namespace shardopt
