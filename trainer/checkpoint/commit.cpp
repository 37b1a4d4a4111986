#include "trainer/checkpoint/commit.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/checkpoint/manifest.h"
#include "trainer/core/files.h"
#include "kernels/common/check.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

int g_save_depth = 0;   // > 0 inside a save
int64_t g_io_calls = 0; // filesystem calls of saves so far (this process)

SaveFaultHooks g_faults;  // test-only (set_save_fault_hooks); none by default

// The filesystem steps of the protocol, each a fault-injection point (trainer/core/files.h).
void ckpt_rename(const std::string& from, const std::string& to) { rename_path(from, to, checkpoint_io_point); }
void ckpt_fsync_dir(const std::string& dir) { fsync_directory(dir, checkpoint_io_point); }

// Removes what a save no longer needs: best effort (a failure is logged, and the next save's
// recovery tries again), so that leftovers on a difficult filesystem never fail a save.
void remove_tree(const fs::path& path) {
  checkpoint_io_point("remove", path.string());
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) spdlog::warn("cannot remove {}: {} (the next save tries again)", path.string(), ec.message());
}

// Swaps two directory entries atomically; false where the filesystem cannot (EINVAL, ENOSYS).
bool exchange_paths(const std::string& a, const std::string& b) {
  if (g_faults.no_exchange) return false;
  checkpoint_io_point("exchange", a + " <-> " + b);
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
  throw Error(fmt::format("cannot exchange {} and {}: {}", a, b, std::strerror(errno)));
#else
  return false;
#endif
}

// A directory, following a symbolic link (checkpoint.dir is often a link to a shared filesystem).
bool is_dir(const fs::path& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// A checkpoint whose save committed: manifest.json is written last, inside the staging directory,
// before the directory takes its step_* name, so a step_* with a manifest is one that a save
// finished. Whether its contents are sound is read_manifest's and the loader's to say (a damaged
// checkpoint is refused loudly, never skipped for an older one).
bool complete(const fs::path& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::stat((p / "manifest.json").c_str(), &st) == 0 &&
         S_ISREG(st.st_mode);
}

// The names in `dir`; an Error naming it when it cannot be listed (never a silent empty list,
// which would start a run afresh beside its checkpoints).
std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) names.push_back(it->path().filename().string());
  if (ec) throw Error(fmt::format("checkpoint.dir: cannot list {}: {}", dir, ec.message()));
  return names;
}

CheckpointEntry::Kind kind_of_name(const std::string& n) {
  if (n[0] != '.') return CheckpointEntry::NAMED;
  return n.compare(n.size() - 4, 4, ".tmp") == 0 ? CheckpointEntry::STAGED : CheckpointEntry::SET_ASIDE;
}

bool exists_nofollow(const fs::path& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

}  // namespace

void checkpoint_io_point(const char* op, const std::string& path) {
  if (g_save_depth == 0) return;
  ++g_io_calls;
  if (!g_faults.call_log.empty()) {
    if (FILE* f = std::fopen(g_faults.call_log.c_str(), "a")) {
      std::fprintf(f, "%lld %s %s\n", static_cast<long long>(g_io_calls), op, path.c_str());
      std::fclose(f);
    }
  }
  if (g_faults.kill_at_call == g_io_calls) ::kill(::getpid(), SIGKILL);
}

void set_save_fault_hooks(const SaveFaultHooks& hooks) { g_faults = hooks; }

CheckpointSaveScope::CheckpointSaveScope() { ++g_save_depth; }
CheckpointSaveScope::~CheckpointSaveScope() { --g_save_depth; }

std::vector<CheckpointEntry> complete_checkpoints(const std::string& dir) {
  std::vector<CheckpointEntry> found;
  for (const std::string& n : list_dir(dir)) {
    const int64_t step = step_of_checkpoint_name(n);
    if (step < 0 || !complete(fs::path(dir) / n)) continue;
    found.push_back({n, step, kind_of_name(n)});
  }
  // One entry per step: its step_* where complete, else a complete staged copy (the newer
  // state: a save that finished writing), else a set-aside one.
  std::sort(found.begin(), found.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.step != b.step ? a.step < b.step : a.kind < b.kind;
  });
  std::vector<CheckpointEntry> out;
  for (const CheckpointEntry& c : found)
    if (out.empty() || out.back().step != c.step) out.push_back(c);
  return out;
}

void recover_checkpoint_dir(const std::string& dir) {
  std::vector<std::string> names = list_dir(dir);
  std::sort(names.begin(), names.end());
  std::vector<fs::path> stale;
  bool renamed = false;
  for (const std::string& n : names) {
    // A pointer file an interrupted publish left (files.h's temporary names).
    if (n == "latest.tmp" || n.rfind("latest.tmp.", 0) == 0) {
      stale.push_back(fs::path(dir) / n);
      continue;
    }
    if (n.rfind(".step_", 0) != 0) continue;
    const fs::path p = fs::path(dir) / n;
    if (n.size() > 4 && n.compare(n.size() - 4, 4, ".del") == 0) {
      stale.push_back(p);
      continue;
    }
    const int64_t step = step_of_checkpoint_name(n);
    if (step < 0) continue;
    const fs::path named = fs::path(dir) / fmt::format("step_{:08d}", step);
    const bool staged = kind_of_name(n) == CheckpointEntry::STAGED;
    const fs::path other = fs::path(dir) / fmt::format(".step_{:08d}{}", step, staged ? ".old" : ".tmp");
    // Where step_* is missing or incomplete, the best complete copy takes its name: the staged
    // one (a save that finished writing), else the set-aside one.
    const bool take = !complete(named) && complete(p) && (staged || !complete(other));
    if (!take) {
      stale.push_back(p);
      continue;
    }
    if (exists_nofollow(named)) {  // an incomplete step_*: set it aside for removal
      const fs::path del = fs::path(dir) / fmt::format(".step_{:08d}.del", step);
      if (exists_nofollow(del)) remove_tree(del);
      ckpt_rename(named.string(), del.string());
      stale.push_back(del);
    }
    ckpt_rename(p.string(), named.string());
    renamed = true;
    spdlog::warn("checkpoint {}: restored from {}, left by an interrupted save", named.string(), p.string());
  }
  if (renamed) ckpt_fsync_dir(dir);
  for (const fs::path& p : stale)
    if (exists_nofollow(p)) remove_tree(p);
}

void commit_checkpoint(const std::string& dir, const std::string& name, const std::string& tmp_dir) {
  const std::string final_dir = (fs::path(dir) / name).string();
  std::string leftover;  // the copy a re-save replaced, removed once `latest` names the new one
  if (!exists_nofollow(final_dir)) {
    ckpt_rename(tmp_dir, final_dir);
  } else if (exchange_paths(tmp_dir, final_dir)) {
    leftover = tmp_dir;
  } else {
    const std::string aside = (fs::path(dir) / fmt::format(".{}.old", name)).string();
    if (exists_nofollow(aside)) {
      remove_tree(aside);
      if (exists_nofollow(aside)) throw Error(fmt::format("cannot remove {}, which a re-save of {} needs", aside, name));
    }
    ckpt_rename(final_dir, aside);
    ckpt_rename(tmp_dir, final_dir);
    leftover = aside;
  }
  ckpt_fsync_dir(dir);
  write_file_atomic((fs::path(dir) / "latest").string(), name + "\n", checkpoint_io_point);
  if (!leftover.empty()) remove_tree(leftover);
}

void rotate_checkpoints(const std::string& dir, int64_t keep, const std::string& current) {
  if (keep <= 0) return;
  const int64_t now = step_of_checkpoint_name(current);
  // This run's line of checkpoints: steps up to the one just saved. Steps beyond it (left by a run
  // this one rolled back from) are never rotated away; the saves that reach them replace them.
  std::vector<CheckpointEntry> line;
  for (const CheckpointEntry& c : complete_checkpoints(dir))
    if (c.kind == CheckpointEntry::NAMED && c.step <= now) line.push_back(c);
  if (line.size() <= static_cast<size_t>(keep)) return;
  std::vector<fs::path> doomed;
  for (size_t i = 0; i + static_cast<size_t>(keep) < line.size(); ++i) {
    if (line[i].name == current) continue;
    const fs::path del = fs::path(dir) / fmt::format(".step_{:08d}.del", line[i].step);
    if (exists_nofollow(del)) remove_tree(del);
    ckpt_rename((fs::path(dir) / line[i].name).string(), del.string());
    spdlog::info("checkpoint {}: removed (checkpoint.keep = {})", (fs::path(dir) / line[i].name).string(), keep);
    doomed.push_back(del);
  }
  if (doomed.empty()) return;
  ckpt_fsync_dir(dir);
  for (const fs::path& p : doomed) remove_tree(p);
}

int lock_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("checkpoint.dir: cannot create {}: {}", dir, ec.message()));
  const std::string path = (fs::path(dir) / ".lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw InputError(fmt::format("checkpoint.dir: cannot create {}: {}", path, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
    // Who holds it, for the message another run would print (best effort).
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    const std::string who = fmt::format("pid {} on {}\n", ::getpid(), host);
    if (::ftruncate(fd, 0) == 0) {
      [[maybe_unused]] const ssize_t written = ::pwrite(fd, who.data(), who.size(), 0);
    }
    return fd;
  }
  const int err = errno;
  if (err == EWOULDBLOCK) {
    char buf[300] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    throw InputError(fmt::format("checkpoint.dir {} is in use by another run ({} holds {}): two runs on one "
                                 "directory would overwrite each other's checkpoints; wait for it to end, or give "
                                 "this run its own checkpoint.dir", dir, n > 0 ? trim(std::string(buf, static_cast<size_t>(n))) : "a process",
                                 path));
  }
  ::close(fd);
  spdlog::warn("checkpoint.dir {}: the filesystem cannot lock {} ({}): nothing keeps a second run off this "
               "directory", dir, path, std::strerror(err));
  return -1;
}

namespace {

// Complete steps newer than `step`: a run resuming from an older step is told which checkpoints
// its saves will replace.
void warn_newer(const std::vector<CheckpointEntry>& done, int64_t step, const std::string& dir) {
  std::string newer;
  for (const CheckpointEntry& c : done)
    if (c.step > step) newer += (newer.empty() ? "" : ", ") + c.name;
  if (!newer.empty())
    spdlog::warn("{} holds checkpoints newer than step {} ({}): this run's saves replace those of the steps "
                 "they reach; the others stay until then", dir, step, newer);
}

}  // namespace

std::string checkpoint_to_resume(const CheckpointConfig& cfg, int64_t last_save) {
  if (cfg.resume.kind == ResumeKind::PATH) {
    const std::string& path = cfg.resume.path;
    if (!is_dir(path) || !complete(path))
      throw InputError(fmt::format("checkpoint.resume: {} is not a checkpoint (no manifest.json); give a "
                                   "step_* directory, \"auto\" or \"none\"", path));
    if (!cfg.dir.empty() && is_dir(cfg.dir))
      warn_newer(complete_checkpoints(cfg.dir), step_of_checkpoint_name(fs::path(path).filename().string()),
                 cfg.dir);
    return path;
  }
  if (cfg.dir.empty() || !is_dir(cfg.dir)) return "";
  const std::vector<CheckpointEntry> done = complete_checkpoints(cfg.dir);
  if (cfg.resume.kind == ResumeKind::NONE) {
    if (!done.empty())
      throw InputError(fmt::format(
          "checkpoint.dir {} already holds {} checkpoint(s) (the newest {}) and checkpoint.resume is \"none\": "
          "this run's saves would replace `latest` and checkpoint.keep would rotate them away; set "
          "checkpoint.resume to \"auto\" to continue from them, or choose an empty checkpoint.dir",
          cfg.dir, done.size(), done.back().name));
    return "";
  }
  // A step_* directory is renamed into place only once complete (a replaced one is set aside
  // first), so one without its manifest was damaged or copied in part. A save of its step would
  // replace it: refused while it lies beyond the checkpoint this run resumes from (-1: none).
  auto refuse_damaged_beyond = [&](int64_t resume_step) {
    for (const std::string& n : list_dir(cfg.dir)) {
      const int64_t step = step_of_checkpoint_name(n);
      if (step < 0 || kind_of_name(n) != CheckpointEntry::NAMED || step <= resume_step || step > last_save ||
          complete(fs::path(cfg.dir) / n))
        continue;
      if (!is_dir(fs::path(cfg.dir) / n))  // a file or a link in a checkpoint's place
        throw InputError(fmt::format("checkpoint.dir {} holds {}, which is not a directory; this run would replace "
                                     "it when it saves step {}: move it out of {}",
                                     cfg.dir, n, step, cfg.dir));
      throw InputError(fmt::format(
          "checkpoint.dir {} holds {} without its manifest.json (not a complete checkpoint: damaged, or copied in "
          "part){}; this run would replace it when it saves step {}: restore its manifest.json, or move it out of {}",
          cfg.dir, n,
          resume_step < 0 ? std::string(" and no complete checkpoint")
                          : fmt::format(", newer than the checkpoint to resume from (step {})", resume_step),
          step, cfg.dir));
    }
  };
  const fs::path latest = fs::path(cfg.dir) / "latest";
  std::string named;
  struct stat st {};
  if (::lstat(latest.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode))
      throw InputError(fmt::format("{} is not a regular file; remove it (it is rewritten at the next save)",
                                   latest.string()));
    named = trim(read_text(latest.string(), "checkpoint pointer file"));
    if (named.empty() || named.find('/') != std::string::npos || named[0] == '.' ||
        named.find('\0') != std::string::npos || step_of_checkpoint_name(named) < 0)
      throw InputError(fmt::format("{} names \"{}\", which is not a checkpoint directory of {} (a step_* name "
                                   "with no '/'); fix or remove {}, or set checkpoint.resume to a step_* directory",
                                   latest.string(), named, cfg.dir, latest.string()));
    const int64_t step = step_of_checkpoint_name(named);
    for (const CheckpointEntry& c : done)
      if (c.step == step) {
        if (c.name != named)
          spdlog::warn("checkpoint.resume auto: {} names {}, which an interrupted save left as {}: resuming from it",
                       latest.string(), named, c.name);
        warn_newer(done, step, cfg.dir);
        refuse_damaged_beyond(step);
        return (fs::path(cfg.dir) / c.name).string();
      }
  }
  if (done.empty()) {
    if (named.empty()) {
      refuse_damaged_beyond(-1);
      return "";
    }
    throw InputError(fmt::format("{} names \"{}\", which is not a complete checkpoint, and {} holds no other; set "
                                 "checkpoint.resume to another step_* directory or \"none\"", latest.string(),
                                 named, cfg.dir));
  }
  refuse_damaged_beyond(done.back().step);
  const std::string path = (fs::path(cfg.dir) / done.back().name).string();
  spdlog::warn("checkpoint.resume auto: {}; resuming from the newest complete checkpoint, {} (step {})",
               named.empty() ? fmt::format("{} is missing", latest.string())
                             : fmt::format("{} names \"{}\", which is not a complete checkpoint", latest.string(), named),
               path, done.back().step);
  return path;
}

}  // namespace tetra
