#include "trainer/checkpoint/commit.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
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
#include "trainer/core/check.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

int g_save_depth = 0;   // > 0 inside a save
int64_t g_io_calls = 0; // filesystem calls of saves so far (this process)

int64_t fault_at() {
  static const int64_t at = [] {
    const char* v = std::getenv("TETRA_FAULT_SAVE_AT");
    return v && *v ? std::atoll(v) : 0;
  }();
  return at;
}

// The calls below name the filesystem operation they make; each is a fault-injection point and
// reports failure as an Error naming the path and the reason.
void fsync_path(const std::string& path, bool directory) {
  checkpoint_io_point("fsync", path);
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("{}: cannot open to sync: {}", path, std::strerror(errno)));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw Error(fmt::format("{}: fsync failed: {}", path, std::strerror(errno)));
}

void rename_path(const std::string& from, const std::string& to) {
  checkpoint_io_point("rename", from + " -> " + to);
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error(fmt::format("cannot rename {} to {}: {}", from, to, std::strerror(errno)));
}

void remove_tree(const fs::path& path) {
  checkpoint_io_point("remove", path.string());
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) throw Error(fmt::format("cannot remove {}: {}", path.string(), ec.message()));
}

// Swaps two directory entries atomically; false where the filesystem cannot (EINVAL, ENOSYS).
bool exchange_paths(const std::string& a, const std::string& b) {
  static const bool disabled = [] {
    const char* v = std::getenv("TETRA_FAULT_NO_EXCHANGE");
    return v && *v && std::string(v) != "0";
  }();
  if (disabled) return false;
  checkpoint_io_point("exchange", a + " <-> " + b);
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
  throw Error(fmt::format("cannot exchange {} and {}: {}", a, b, std::strerror(errno)));
#else
  return false;
#endif
}

bool is_dir(const fs::path& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// A checkpoint whose save committed: manifest.json is written last, inside the staging directory,
// before the directory takes its step_* name, so a step_* with a manifest is one that a save
// finished. Whether its contents are sound is read_manifest's and the loader's to say (a damaged
// checkpoint is refused loudly, never skipped for an older one).
bool complete(const fs::path& p) {
  struct stat st {};
  return is_dir(p) && ::stat((p / "manifest.json").c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

}  // namespace

void checkpoint_io_point(const char* op, const std::string& path) {
  if (g_save_depth == 0) return;
  ++g_io_calls;
  if (const char* log = std::getenv("TETRA_FAULT_SAVE_LOG"); log && *log) {
    if (FILE* f = std::fopen(log, "a")) {
      std::fprintf(f, "%lld %s %s\n", static_cast<long long>(g_io_calls), op, path.c_str());
      std::fclose(f);
    }
  }
  if (fault_at() == g_io_calls) ::kill(::getpid(), SIGKILL);
}

CheckpointSaveScope::CheckpointSaveScope() { ++g_save_depth; }
CheckpointSaveScope::~CheckpointSaveScope() { --g_save_depth; }

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  checkpoint_io_point("write", tmp);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) throw Error(fmt::format("{}: cannot write: {}", tmp, std::strerror(errno)));
  }
  fsync_path(tmp, false);
  rename_path(tmp, path);
  const std::string parent = fs::path(path).parent_path().string();
  fsync_path(parent.empty() ? "." : parent, true);
}

std::vector<CheckpointEntry> complete_checkpoints(const std::string& dir) {
  std::vector<CheckpointEntry> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const int64_t step = step_of_checkpoint_name(n);
    if (step < 0 || !complete(e.path())) continue;
    found.push_back({n, step, n[0] == '.'});
  }
  // A set-aside copy counts only where its step_* is not complete.
  std::vector<CheckpointEntry> out;
  for (const CheckpointEntry& c : found) {
    const bool shadowed = c.set_aside && std::any_of(found.begin(), found.end(), [&](const CheckpointEntry& o) {
                            return !o.set_aside && o.step == c.step;
                          });
    if (!shadowed) out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.step != b.step ? a.step < b.step : a.name < b.name;
  });
  return out;
}

void recover_checkpoint_dir(const std::string& dir) {
  std::vector<fs::path> stale, aside;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".step_", 0) != 0) continue;
    if (n.size() > 4 && (n.compare(n.size() - 4, 4, ".tmp") == 0 || n.compare(n.size() - 4, 4, ".del") == 0))
      stale.push_back(e.path());
    else if (step_of_checkpoint_name(n) >= 0)
      aside.push_back(e.path());
  }
  for (const fs::path& p : aside) {
    const fs::path named = fs::path(dir) / fmt::format("step_{:08d}", step_of_checkpoint_name(p.filename().string()));
    if (complete(named)) {
      stale.push_back(p);
    } else if (complete(p)) {
      if (fs::exists(named)) {  // an incomplete step_*: keep nothing of it, the set-aside copy is whole
        const fs::path del = fs::path(dir) / fmt::format(".{}.del", named.filename().string());
        rename_path(named.string(), del.string());
        stale.push_back(del);
      }
      rename_path(p.string(), named.string());
      spdlog::info("checkpoint {}: restored from {}, set aside by an interrupted save", named.string(), p.string());
    }
  }
  for (const fs::path& p : stale) remove_tree(p);
  if (!stale.empty()) fsync_path(dir, true);
}

void commit_checkpoint(const std::string& dir, const std::string& name, const std::string& tmp_dir) {
  const std::string final_dir = (fs::path(dir) / name).string();
  if (!fs::exists(final_dir)) {
    rename_path(tmp_dir, final_dir);
  } else if (exchange_paths(tmp_dir, final_dir)) {
    fsync_path(dir, true);
    remove_tree(tmp_dir);  // the copy it replaced
  } else {
    const std::string aside = (fs::path(dir) / fmt::format(".{}.old", name)).string();
    if (fs::exists(aside)) remove_tree(aside);
    rename_path(final_dir, aside);
    rename_path(tmp_dir, final_dir);
    fsync_path(dir, true);
    remove_tree(aside);
  }
  fsync_path(dir, true);
  write_file_atomic((fs::path(dir) / "latest").string(), name + "\n");
}

void rotate_checkpoints(const std::string& dir, int64_t keep, const std::string& current) {
  if (keep <= 0) return;
  std::vector<CheckpointEntry> done = complete_checkpoints(dir);
  if (done.size() <= static_cast<size_t>(keep)) return;
  std::vector<fs::path> doomed;
  for (size_t i = 0; i + static_cast<size_t>(keep) < done.size(); ++i) {
    if (done[i].name == current) continue;
    const fs::path del = fs::path(dir) / fmt::format(".step_{:08d}{}.del", done[i].step, done[i].set_aside ? ".old" : "");
    rename_path((fs::path(dir) / done[i].name).string(), del.string());
    doomed.push_back(del);
  }
  if (doomed.empty()) return;
  fsync_path(dir, true);
  for (const fs::path& p : doomed) remove_tree(p);
}

std::string checkpoint_to_resume(const CheckpointConfig& cfg) {
  if (cfg.resume != "auto" && cfg.resume != "none") {
    struct stat st {};
    if (::stat(cfg.resume.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        !fs::exists(fs::path(cfg.resume) / "manifest.json"))
      throw InputError(fmt::format("checkpoint.resume: {} is not a checkpoint (no manifest.json); give a "
                                   "step_* directory, \"auto\" or \"none\"", cfg.resume));
    return cfg.resume;
  }
  if (cfg.dir.empty() || !is_dir(cfg.dir)) return "";
  const std::vector<CheckpointEntry> done = complete_checkpoints(cfg.dir);
  if (cfg.resume == "none") {
    if (!done.empty())
      throw InputError(fmt::format(
          "checkpoint.dir {} already holds {} checkpoint(s) (the newest {}) and checkpoint.resume is \"none\": "
          "this run's saves would replace `latest` and checkpoint.keep would rotate them away; set "
          "checkpoint.resume to \"auto\" to continue from them, or choose an empty checkpoint.dir",
          cfg.dir, done.size(), done.back().name));
    return "";
  }
  const fs::path latest = fs::path(cfg.dir) / "latest";
  std::string named;
  struct stat st {};
  if (::lstat(latest.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode))
      throw InputError(fmt::format("{} is not a regular file; remove it (it is rewritten at the next save)",
                                   latest.string()));
    std::ifstream f(latest, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    named = trim(ss.str());
    if (named.empty() || named.find('/') != std::string::npos || named == "." || named == ".." ||
        named.find('\0') != std::string::npos || step_of_checkpoint_name(named) < 0)
      throw InputError(fmt::format("{} names \"{}\", which is not a checkpoint directory of {} (a step_* name "
                                   "with no '/'); fix or remove {}, or set checkpoint.resume to a step_* directory",
                                   latest.string(), named, cfg.dir, latest.string()));
    for (const CheckpointEntry& c : done)
      if (c.name == named) return (fs::path(cfg.dir) / named).string();
  }
  if (done.empty()) {
    if (named.empty()) return "";
    throw InputError(fmt::format("{} names \"{}\", which is not a complete checkpoint, and {} holds no other; set "
                                 "checkpoint.resume to another step_* directory or \"none\"", latest.string(),
                                 named, cfg.dir));
  }
  const std::string path = (fs::path(cfg.dir) / done.back().name).string();
  spdlog::info("checkpoint.resume auto: {}; resuming from the newest complete checkpoint, {} (step {})",
               named.empty() ? fmt::format("{} is missing", latest.string())
                             : fmt::format("{} names \"{}\", which is not a complete checkpoint", latest.string(), named),
               path, done.back().step);
  return path;
}

}  // namespace tetra
