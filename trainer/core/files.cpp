#include "trainer/core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kernels/common/check.h"

namespace tetra {

namespace fs = std::filesystem;


std::string_view file_kind_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a named pipe (FIFO)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a file";
}

namespace {

[[noreturn]] void throw_not_regular(const std::string& path, std::string_view role,
                                    std::string_view fix, mode_t mode) {
  throw InputError(fmt::format("{} {} is {}, not a regular file{}{}", role, path,
                               file_kind_name(mode), fix.empty() ? "" : "; ", fix));
}

}  // namespace

int open_regular_file(const std::string& path, std::string_view role, std::string_view fix) {
  // O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer. It
  // changes nothing for a regular file (reads of regular files never block in that sense).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TETRA_INPUT_CHECK(fd >= 0, "cannot open {} {}: {}", role, path, std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw InputError(fmt::format("cannot stat {} {}: {}", role, path, std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_not_regular(path, role, fix, st.st_mode);
  }
  // Back to ordinary blocking reads (a no-op for regular files, but no surprise later).
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void check_not_special_file(const std::string& path, std::string_view role,
                            std::string_view fix) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return;
  if (!S_ISREG(st.st_mode)) throw_not_regular(path, role, fix, st.st_mode);
}


std::string read_text(const std::string& path, std::string_view role, std::string_view fix) {
  const int fd = open_regular_file(path, role, fix);
  std::string text;
  char buf[65536];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw InputError(fmt::format("cannot read {} {}: {}", role, path, std::strerror(err)));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

void fsync_directory(const std::string& dir, const IoPoint& io_point) {
  if (io_point) io_point("fsync", dir);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("{}: cannot open to sync: {}", dir, std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc == 0) return;
  // Some network and FUSE filesystems cannot sync a directory (EINVAL): the rename is then as
  // durable as that filesystem makes it, which is not a reason to fail the write.
  if (err == EINVAL || err == ENOTSUP) {
    static bool warned = false;
    if (!warned) spdlog::warn("{}: the filesystem cannot fsync a directory ({}); renames rely on its own "
                              "ordering", dir, std::strerror(err));
    warned = true;
    return;
  }
  throw Error(fmt::format("{}: fsync failed: {}", dir, std::strerror(err)));
}

void rename_path(const std::string& from, const std::string& to, const IoPoint& io_point) {
  if (io_point) io_point("rename", from + " -> " + to);
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error(fmt::format("cannot rename {} to {}: {}", from, to, std::strerror(errno)));
}

int create_temp_beside(const std::string& path, std::string* tmp) {
  *tmp = path + ".tmp";
  int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EEXIST) {
    *tmp = fmt::format("{}.tmp.{}", path, ::getpid());
    fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  }
  if (fd < 0) throw Error(fmt::format("{}: cannot create: {}", *tmp, std::strerror(errno)));
  return fd;
}

void write_file_atomic(const std::string& path, const std::string& text, const IoPoint& io_point) {
  if (io_point) io_point("write", path + ".tmp");
  // One descriptor writes, syncs and closes: a write-back error is reported on it. A failure
  // removes the temporary file it made.
  std::string tmp;
  const int fd = create_temp_beside(path, &tmp);
  auto fail = [&](const std::string& message) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error(message);
  };
  size_t at = 0;
  while (at < text.size()) {
    const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("{}: cannot write: {}", tmp, std::strerror(errno)));
    at += static_cast<size_t>(n);
  }
  if (io_point) io_point("fsync", tmp);
  if (::fsync(fd) != 0) fail(fmt::format("{}: fsync failed: {}", tmp, std::strerror(errno)));
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error(fmt::format("{}: close failed: {}", tmp, std::strerror(err)));
  }
  try {
    rename_path(tmp, path, io_point);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const std::string parent = fs::path(path).parent_path().string();
  fsync_directory(parent.empty() ? "." : parent, io_point);
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

int AppendFile::open(const std::string& path) {
  if (fd_ >= 0) ::close(fd_);
  path_ = path;
  failed_ = false;
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  return fd_ >= 0 ? 0 : errno;
}

bool AppendFile::empty_or_ends_with(char c) const {
  struct stat st;
  if (fd_ < 0 || ::fstat(fd_, &st) != 0 || st.st_size == 0) return true;
  // The descriptor is write-only: the last byte is read through another one.
  const int rd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (rd < 0) return true;
  char last = c;
  const bool read = ::pread(rd, &last, 1, st.st_size - 1) == 1;
  ::close(rd);
  return !read || last == c;
}

bool AppendFile::append(std::string_view record) {
  if (fd_ < 0 || failed_) return false;
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n = ::write(fd_, record.data() + done, record.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    const int err = n < 0 ? errno : ENOSPC;  // a write of 0 bytes: the device takes no more
    failed_ = true;
    spdlog::warn("{}: write failed: {}; nothing more is written to it in this run", path_,
                 std::strerror(err));
    return false;
  }
  return true;
}

}  // namespace tetra
