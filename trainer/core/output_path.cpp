#include "trainer/core/output_path.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

namespace fs = std::filesystem;

void check_output_dir(const std::string& what, const std::string& path, uint64_t bytes_needed) {
  if (path.find('\0') != std::string::npos)
    throw InputError(fmt::format("{}: the path contains a NUL character; give a path without one", what));
  if (path.empty()) throw InputError(fmt::format("{}: the path is empty", what));
  // The deepest part of the path that exists: the directory itself, or the parent it would be
  // created in.
  fs::path at = fs::path(path);
  struct stat st {};
  while (::stat(at.c_str(), &st) != 0) {
    if (errno != ENOENT && errno != ENOTDIR)
      throw InputError(fmt::format("{}: cannot use {}: {} ({})", what, path, std::strerror(errno), at.string()));
    const fs::path parent = at.parent_path();
    if (parent.empty() || parent == at) {
      at = ".";
      if (::stat(".", &st) != 0)
        throw InputError(fmt::format("{}: cannot use {}: the working directory is gone", what, path));
      break;
    }
    at = parent;
  }
  const bool exists = at == fs::path(path);
  if (!S_ISDIR(st.st_mode))
    throw InputError(exists ? fmt::format("{}: {} exists and is not a directory; choose a directory (or a path "
                                          "to create)", what, path)
                            : fmt::format("{}: cannot create {}: {} is not a directory", what, path, at.string()));
  if (::access(at.c_str(), W_OK | X_OK) != 0)
    throw InputError(fmt::format("{}: {}{} is not writable: {}; choose a writable directory", what,
                                 exists ? "" : fmt::format("cannot create {}: ", path), at.string(),
                                 std::strerror(errno)));
  if (bytes_needed == 0) return;
  struct statvfs vfs {};
  if (::statvfs(at.c_str(), &vfs) != 0) return;  // not knowable here
  const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
  if (avail < bytes_needed)
    throw InputError(fmt::format("{}: {} has {:.1f} MiB free, but this run writes {:.1f} MiB there; free space or "
                                 "choose another directory", what, at.string(), avail / 1048576.0,
                                 bytes_needed / 1048576.0));
}

void check_output_file(const std::string& what, const std::string& path, bool force,
                       const std::vector<std::string>& inputs) {
  if (path.find('\0') != std::string::npos)
    throw InputError(fmt::format("{}: the path contains a NUL character; give a path without one", what));
  if (path.empty()) throw InputError(fmt::format("{}: the path is empty", what));
  const fs::path p(path);
  const std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..")
    throw InputError(fmt::format("{} {}: names a directory; give a file name", what, path));
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode) && !force)
    throw InputError(fmt::format("{} {}: is a symbolic link (pass --force to replace the link)", what, path));
  for (const std::string& input : inputs) {
    std::error_code ec;
    if (fs::equivalent(path, input, ec))
      throw InputError(fmt::format("{} {}: is also an input ({}): writing it would destroy what is read; write "
                                   "elsewhere", what, path, input));
  }
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw InputError(fmt::format("{} {}: is a directory; give a file name", what, path));
    if (!S_ISREG(st.st_mode))
      throw InputError(fmt::format("{} {}: exists and is not a regular file; give a file name", what, path));
    if (!force) throw InputError(fmt::format("{} {}: the file exists (pass --force to replace it)", what, path));
  }
  const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw InputError(fmt::format("{} {}: the directory {} does not exist; create it first", what, path,
                                 parent.string()));
  if (::access(parent.c_str(), W_OK | X_OK) != 0)
    throw InputError(fmt::format("{} {}: the directory {} is not writable: {}", what, path, parent.string(),
                                 std::strerror(errno)));
}

}  // namespace tetra
