// files.hpp: the POSIX file operations a crash-safe checkpoint needs: exclusive creation,
// full writes, reads that cannot block on a FIFO or device, fsync of files and directories,
// atomic publish by rename, and a lock that dies with its process. Errors are Error(Status::Io) naming the file and the system's
// reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace shardopt::ckpt {

namespace fs = std::filesystem;

/// A file being written: created exclusively (never overwrites), CRC-32C of everything
/// written kept on the way. close() flushes to stable storage (fsync) before closing.
class OutFile {
 public:
  explicit OutFile(const fs::path& path);
  ~OutFile();  ///< closes without syncing when close() was not reached (error paths)
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  void write(const void* data, std::size_t bytes);
  void close();
  std::uint32_t crc() const { return crc_; }
  std::uint64_t bytes() const { return bytes_; }

 private:
  fs::path path_;
  int fd_ = -1;
  std::uint32_t crc_ = 0;
  std::uint64_t bytes_ = 0;
};

/// A regular file being read. Opened without blocking (O_NONBLOCK, then fstat): a FIFO,
/// device or other non-regular file is refused at once instead of hanging in open().
class InFile {
 public:
  explicit InFile(const fs::path& path);
  ~InFile();
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;
  std::uint64_t size() const { return size_; }
  /// Reads exactly `bytes` (Error(CorruptData) if the file ends first).
  void read(void* data, std::size_t bytes);
  /// Reads exactly `bytes` at `offset` (Error(CorruptData) if the file ends first).
  void read_at(std::uint64_t offset, void* data, std::size_t bytes);

 private:
  fs::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

/// Reads a whole file of at most max_bytes (larger: Error(CorruptData)).
std::vector<unsigned char> read_whole_file(const fs::path& path, std::size_t max_bytes);
/// Writes `bytes` to dir/name atomically: a temporary, fsync, rename, fsync of dir.
void write_file_atomically(const fs::path& dir, const std::string& name, const std::string& bytes);
/// fsync of a directory, so that entries created or renamed in it are durable.
void sync_directory(const fs::path& dir);
/// Creates `dir` and any missing parents, fsyncing the parent of each directory created, so
/// that the new entries survive a power loss.
void create_directories_durably(const fs::path& dir);
/// rename(2): atomic replacement within one file system.
void rename_path(const fs::path& from, const fs::path& to);

/// An exclusive lock (flock(2)) on a file, held until this object is destroyed. The kernel
/// releases it when the process ends, however it ends, so a lock file left by a killed
/// process blocks nobody: the file is only where the lock lives.
class FileLock {
 public:
  /// Locks `path` (created if missing) without waiting and writes `note` (who holds it)
  /// into the file. Returns nullptr when another open file (of this or another process)
  /// holds the lock, with *holder = that holder's note ("" if it wrote none yet). Throws
  /// Error(Unsupported) when the file system cannot lock (ENOLCK, EOPNOTSUPP, ...) and
  /// Error(Io) for other failures.
  static std::unique_ptr<FileLock> try_lock(const fs::path& path, const std::string& note,
                                            std::string* holder);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

/// Test-only: called at named points of a save (see checkpoint.cpp), so tests can kill a
/// process or inject a failure at a known moment, and with "fsync-dir PATH" after each
/// directory fsync. Null (the default) costs one branch.
using TestHook = void (*)(const char* point);
void set_test_hook(TestHook hook);
void test_point(const char* point);

}  // namespace shardopt::ckpt
