// files.cpp: POSIX file I/O for checkpoints (see files.hpp).
#include "files.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "crc32c.hpp"
#include "shardopt/error.hpp"

namespace shardopt::ckpt {
namespace {

[[noreturn]] void io_error(const std::string& what, const fs::path& p, int err) {
  throw Error(Status::Io, "checkpoint: " + what + " '" + p.string() + "': " + std::strerror(err));
}

std::atomic<TestHook> g_hook{nullptr};

}  // namespace

void set_test_hook(TestHook hook) { g_hook.store(hook); }
void test_point(const char* point) {
  if (TestHook h = g_hook.load()) h(point);
}

// ---- OutFile ------------------------------------------------------------------------------

OutFile::OutFile(const fs::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) io_error("cannot create", path, errno);
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutFile::write(const void* data, std::size_t bytes) {
  crc_ = crc32c_update(crc_, data, bytes);
  bytes_ += bytes;
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) io_error("cannot write", path_, n < 0 ? errno : EIO);
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

void OutFile::close() {
  if (::fsync(fd_) != 0) io_error("cannot flush", path_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) io_error("cannot close", path_, errno);
}

// ---- InFile -------------------------------------------------------------------------------

InFile::InFile(const fs::path& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) io_error("cannot open", path, errno);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) io_error("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) io_error("not a regular file:", path, EINVAL);
  // Regular files ignore O_NONBLOCK; cleared anyway so that reads have the usual meaning.
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) io_error("cannot configure", path, errno);
  size_ = static_cast<std::uint64_t>(st.st_size);
}

InFile::~InFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InFile::read(void* data, std::size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::read(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_error("cannot read", path_, errno);
    if (n == 0)
      throw Error(Status::CorruptData, "checkpoint: '" + path_.string() + "' is truncated");
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

void InFile::read_at(std::uint64_t offset, void* data, std::size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_error("cannot read", path_, errno);
    if (n == 0)
      throw Error(Status::CorruptData, "checkpoint: '" + path_.string() + "' is truncated");
    p += n;
    bytes -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

std::vector<unsigned char> read_whole_file(const fs::path& path, std::size_t max_bytes) {
  InFile f(path);
  if (f.size() > max_bytes)
    throw Error(Status::CorruptData, "checkpoint: '" + path.string() + "' is implausibly large (" +
                                         std::to_string(f.size()) + " bytes)");
  std::vector<unsigned char> out(static_cast<std::size_t>(f.size()));
  f.read(out.data(), out.size());
  return out;
}

// ---- directories and publishing -------------------------------------------------------------

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) io_error("cannot open directory", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) io_error("cannot flush directory", dir, err);
  if (g_hook.load()) test_point(("fsync-dir " + dir.string()).c_str());
}

void create_directories_durably(const fs::path& dir) {
  const fs::path parent = dir.parent_path();
  if (dir.empty() || fs::is_directory(dir)) return;
  if (!parent.empty() && parent != dir) create_directories_durably(parent);
  std::error_code ec;
  if (!fs::create_directory(dir, ec) && !fs::is_directory(dir))
    io_error("cannot create directory", dir, ec ? ec.value() : ENOTDIR);
  sync_directory(parent.empty() ? fs::path(".") : parent);
}

void rename_path(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) io_error("cannot rename to " + to.string() + ":", from, errno);
}

void write_file_atomically(const fs::path& dir, const std::string& name, const std::string& bytes) {
  const fs::path tmp = dir / ("." + name + ".tmp");
  ::unlink(tmp.c_str());  // a leftover of a killed save
  OutFile f(tmp);
  f.write(bytes.data(), bytes.size());
  f.close();
  rename_path(tmp, dir / name);
  sync_directory(dir);
}

// ---- FileLock -------------------------------------------------------------------------------

std::unique_ptr<FileLock> FileLock::try_lock(const fs::path& path, const std::string& note,
                                             std::string* holder) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) io_error("cannot open the lock file", path, errno);
  std::unique_ptr<FileLock> lock(new FileLock(fd));
  struct stat st {};
  if (::fstat(fd, &st) != 0) io_error("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) io_error("not a regular file:", path, EINVAL);
  int rc = 0;
  do {
    rc = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      char buf[256];
      const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
      if (holder != nullptr) *holder = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "";
      return nullptr;
    }
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL)
      throw Error(Status::Unsupported, "checkpoint: the file system of '" + path.string() +
                                           "' cannot lock files: " + std::strerror(err));
    io_error("cannot lock", path, err);
  }
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, note.data(), note.size(), 0) < 0)
    io_error("cannot write", path, errno);
  return lock;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace shardopt::ckpt
