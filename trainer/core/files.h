// Files: opening inputs that must be regular files, reading whole small files (configs, manifests,
// pointer files), and the one atomic writer, so that every caller refuses the same non-files in
// the same words and no reader can ever see half a file.
//
// Opening input files that must be regular files. A named pipe given where a file is expected
// blocks open() until a writer appears (forever, in practice); a directory opens but cannot be
// read or mapped ("Is a directory", "No such device"); a device reads endlessly. So every data
// input is opened without blocking and checked with fstat before a byte is read: anything but a
// regular file is an InputError that says what the path is.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <string_view>

namespace tetra {


// What a non-regular file is, for messages: "a directory", "a named pipe (FIFO)", "a character
// device", "a block device", "a socket", "a symbolic link"; "a regular file" for one.
std::string_view file_kind_name(mode_t mode);

// Opens `path` read-only (O_CLOEXEC) and returns the descriptor, which the caller closes.
// InputError, naming `role` and `path`, if it cannot be opened or is not a regular file:
//   "<role> <path> is a named pipe (FIFO), not a regular file; <fix>"
// `fix` says what to give instead (e.g. "give the dataset's prefix"); may be empty.
// Never blocks: a FIFO is opened with O_NONBLOCK, seen by fstat, and closed again.
int open_regular_file(const std::string& path, std::string_view role, std::string_view fix);

// The same check by path (stat, following symbolic links), for files another library opens.
// InputError if `path` exists and is not a regular file; a missing path passes (the caller
// reports that in its own words).
void check_not_special_file(const std::string& path, std::string_view role, std::string_view fix);


// The whole content of the regular file `path`, opened by open_regular_file (the same refusals,
// in the same words, naming `role` and `fix`).
std::string read_text(const std::string& path, std::string_view role, std::string_view fix = "");

// Creates the temporary file a writer of `path` fills before renaming it over `path`, write-only
// (O_CLOEXEC), and returns its descriptor; its name in *tmp: `path`.tmp, or, where a file of that
// name exists already (someone's own, or one a killed writer left), `path`.tmp.<pid>: an existing
// file is never truncated. Error naming the file and the reason.
int create_temp_beside(const std::string& path, std::string* tmp);

// Writes `text` to `path` atomically and durably: into `path`.tmp (create_temp_beside), fsync'd, renamed over `path`,
// the directory fsync'd. A reader sees the old content or the new, never a part. Error (a runtime
// failure) naming the file and the reason. `io_point`, if given, is called before each step that
// touches the disk ("write" / "fsync" with the path): the checkpoint fault tests kill there.
using IoPoint = std::function<void(const char* op, const std::string& path)>;
void write_file_atomic(const std::string& path, const std::string& text, const IoPoint& io_point = nullptr);

// The two steps of a durable rename, for callers that move whole directories (checkpoints):
// rename(2) (io point "rename", "from -> to") and the fsync of a directory (io point "fsync"), so
// that the rename survives a power loss. A filesystem that cannot sync a directory (EINVAL, some
// network and FUSE mounts) gets one warning: the rename is then as durable as it makes it.
// Error naming the paths and the reason.
void rename_path(const std::string& from, const std::string& to, const IoPoint& io_point = nullptr);
void fsync_directory(const std::string& dir, const IoPoint& io_point = nullptr);

// A file that grows by whole records and whose write failures must be seen without stopping the
// run (metrics.jsonl, a TensorBoard event file). Opened with O_APPEND; each record is written with
// write(2) until it is whole. The first failure is a warning naming the file and the reason, and
// the file is not written again by this process: a record after a partial one would be damage in
// the middle of the file, while a partial last record is what its readers skip.
class AppendFile {
 public:
  AppendFile() = default;
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  // Opens `path` for appending, creating it (mode 0644 less the umask). Returns 0, or the errno
  // of the failure.
  int open(const std::string& path);
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // Whether the file is empty or its last byte is `c` (a JSON-lines file: '\n').
  bool empty_or_ends_with(char c) const;
  // Appends `record` whole; after a failure (warned once) nothing. Returns whether it was written.
  bool append(std::string_view record);
  bool failed() const { return failed_; }

 private:
  int fd_ = -1;
  bool failed_ = false;
  std::string path_;
};

}  // namespace tetra
