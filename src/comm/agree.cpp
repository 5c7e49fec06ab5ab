// agree.cpp: turn a failure on one rank into the same error on every rank.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt {

void agree_or_throw(Communicator& comm, Status local_status, const std::string& local_message) {
  double failed = local_status == Status::Ok ? 0.0 : 1.0;
  comm.all_reduce_sum_host(&failed, 1);
  if (failed == 0.0) return;
  throw_agreed_error(comm, local_status, local_message);
}

void throw_agreed_error(Communicator& comm, Status local_status,
                        const std::string& local_message) {
  // Rare path: share every rank's status and message, truncated to a fixed record.
  constexpr std::size_t kMsg = 480;
  struct Record {
    int status;
    char message[kMsg];
  };
  Record mine{};
  mine.status = static_cast<int>(local_status);
  std::strncpy(mine.message, local_message.c_str(), kMsg - 1);
  std::vector<Record> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather_bytes(&mine, all.data(), sizeof(Record));

  Status first = Status::Ok;
  std::string text;
  for (int r = 0; r < comm.size(); ++r) {
    const Record& rec = all[static_cast<std::size_t>(r)];
    if (rec.status == static_cast<int>(Status::Ok)) continue;
    if (first == Status::Ok) first = static_cast<Status>(rec.status);
    if (!text.empty()) text += "; ";
    text += "rank " + std::to_string(r) + ": " + rec.message;
  }
  // A rank that failed itself reports its own category; the others learn it remotely.
  const Status mine_or_remote = local_status != Status::Ok ? local_status : first;
  throw Error(mine_or_remote, text);
}

}  // namespace shardopt
