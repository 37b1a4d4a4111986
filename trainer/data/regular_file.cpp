// open_regular_file: see regular_file.h.
#include "trainer/data/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kernels/common/check.h"

namespace tetra {

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

}  // namespace tetra
