// `tetra trace merge DIR [--out FILE.json] [--svg FILE.svg [--step N]] [--force]`: the ranks' timelines of a
// run (training.profile_steps wrote DIR/trace/rank_R.json, or DIR is that trace folder) joined into
// one Chrome trace, every rank a process on the common time axis the files already share
// (trainer/train/step_trace.h); with --svg also a picture of it drawn by Tetra: one lane per rank
// and thread, spans stacked by nesting depth and coloured by kind. The default output is
// merged.json beside the rank files. Exit 2 for a folder without rank files, a file that is not a
// rank's timeline, files of different runs (profiling window, rank count, time axis) or a missing
// rank, or an existing output without --force.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/cli/cli.h"
#include "trainer/config/config.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "trainer/core/output_path.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int64_t kIdsPerRank = 1000000000;  // asynchronous span ids: made unique per rank

struct RankFile {
  int rank = 0;
  std::string path;
  json doc;
};

// The fields the merge and the picture read, checked once: a rank file that lacks one or holds
// another type is an input error naming the file and the field.
void check_rank_file(const RankFile& f) {
  const std::string& p = f.path;
  if (!f.doc.is_object() || !f.doc.contains("traceEvents") || !f.doc["traceEvents"].is_array() ||
      !f.doc.contains("otherData") || !f.doc["otherData"].is_object() || !f.doc["otherData"].contains("rank") ||
      !f.doc["otherData"].contains("profile_steps"))
    throw InputError(fmt::format("tetra trace merge: {}: not a rank's timeline (no traceEvents, otherData.rank "
                                 "and otherData.profile_steps)", p));
  const json& other = f.doc["otherData"];
  const int64_t rank = json_integer(p, other["rank"], "otherData.rank");
  if (rank != f.rank) throw InputError(fmt::format("tetra trace merge: {}: holds rank {}'s timeline", p, rank));
  const int64_t world = json_integer(p, json_member(p, other, "otherData", "world"), "otherData.world");
  if (world < 1 || world > kMaxRanks)
    throw InputError(fmt::format("{}: otherData.world: {} is outside [1, {}]", p, world, kMaxRanks));
  json_number(p, json_member(p, other, "otherData", "epoch_s"), "otherData.epoch_s");
  const json& window = other["profile_steps"];
  if (!window.is_array() || window.size() != 2)
    throw InputError(fmt::format("{}: otherData.profile_steps: must be [first, last], got {}", p, json_kind(window)));
  for (size_t i = 0; i < 2; ++i) json_integer(p, window[i], fmt::format("otherData.profile_steps[{}]", i));
  const json& events = f.doc["traceEvents"];
  for (size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    const std::string at = fmt::format("traceEvents[{}]", i);
    if (!e.is_object()) throw InputError(fmt::format("{}: {}: must be an object, got {}", p, at, json_kind(e)));
    for (const char* key : {"ph", "name", "cat"})
      if (e.contains(key)) json_string(p, e[key], at + "." + key);
    for (const char* key : {"pid", "tid"})
      if (e.contains(key)) {
        const int64_t v = json_integer(p, e[key], at + "." + key);
        if (v < 0 || v > INT32_MAX)
          throw InputError(fmt::format("{}: {}.{}: {} is outside [0, 2^31-1]", p, at, key, v));
      }
    if (e.contains("id")) {
      const int64_t id = json_integer(p, e["id"], at + ".id");
      if (id < 0 || id >= kIdsPerRank)
        throw InputError(fmt::format("{}: {}.id: {} is outside [0, {})", p, at, id, kIdsPerRank));
    }
    const std::string ph = e.value("ph", "");
    // Times in microseconds: within 30 years either side of the run's epoch (the picture's axis
    // is built from them).
    constexpr double kMaxUs = 1e15;
    auto time_us = [&](const json& v, const std::string& field, double lo) {
      const double t = json_number(p, v, field);
      if (!(t >= lo && t <= kMaxUs))
        throw InputError(fmt::format("{}: {}: {} is outside [{}, {}] microseconds", p, field, v.dump(), lo, kMaxUs));
    };
    if (ph == "X") {
      time_us(json_member(p, e, at, "ts"), at + ".ts", -kMaxUs);
      time_us(json_member(p, e, at, "dur"), at + ".dur", 0.0);
    } else if (e.contains("ts")) {
      time_us(e["ts"], at + ".ts", -kMaxUs);
    }
    if (ph == "M" && e.contains("args")) {
      const json& args = e["args"];
      if (!args.is_object()) throw InputError(fmt::format("{}: {}.args: must be an object, got {}", p, at, json_kind(args)));
      if (args.contains("name")) json_string(p, args["name"], at + ".args.name");
    }
  }
}

std::vector<RankFile> read_rank_files(const fs::path& dir) {
  const std::regex name(R"(rank_(\d+)\.json)");
  std::vector<RankFile> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string file = e.path().filename().string();
    if (!std::regex_match(file, m, name)) continue;
    RankFile f;
    f.path = e.path().string();
    const std::string digits = m[1].str();
    if (digits.size() > 7 || std::stoll(digits) >= kMaxRanks)
      throw InputError(fmt::format("tetra trace merge: {}: rank {} is beyond any run's (at most {} ranks); remove "
                                   "the file", f.path, digits, kMaxRanks));
    f.rank = std::stoi(digits);
    f.doc = read_json_file(f.path, "rank timeline", "a run's trace folder holds rank_R.json files");
    check_rank_file(f);
    files.push_back(std::move(f));
  }
  std::sort(files.begin(), files.end(), [](const RankFile& a, const RankFile& b) { return a.rank < b.rank; });
  for (size_t i = 1; i < files.size(); ++i)
    if (files[i].rank == files[i - 1].rank)
      throw InputError(fmt::format("tetra trace merge: {} and {} both hold rank {}'s timeline; keep one",
                                   files[i - 1].path, files[i].path, files[i].rank));
  return files;
}

// ---- the picture --------------------------------------------------------------------------------
struct Box {
  double t0, t1;
  std::string name, cat;
  int depth = 0;
};

const char* colour(const std::string& cat) {
  static const std::map<std::string, const char*> c = {
      {"step", "#d9d9d9"},     {"phase", "#9ecae1"},    {"pipeline", "#a1d99b"}, {"op", "#fdae6b"},
      {"wait", "#fb6a4a"},     {"collective", "#bcbddc"}, {"p2p", "#c994c7"},    {"optimizer", "#fdd0a2"},
      {"checkpoint", "#74c476"}};
  const auto it = c.find(cat);
  return it == c.end() ? "#cccccc" : it->second;
}


// `step` > 0: only the spans within step `step` (from its first rank's start to its last rank's end).
std::string timeline_svg(const json& merged, int64_t step) {
  double from = -INFINITY, to = INFINITY;
  if (step > 0) {
    from = INFINITY, to = -INFINITY;
    for (const json& e : merged["traceEvents"])
      if (e.value("ph", "") == "X" && e.value("cat", "") == "step" && e.value("name", "") == fmt::format("step {}", step)) {
        from = std::min(from, e["ts"].get<double>());
        to = std::max(to, e["ts"].get<double>() + e["dur"].get<double>());
      }
    if (!(from < to)) throw InputError(fmt::format("--step {}: no rank's timeline holds that step", step));
  }
  // Lanes: (pid, tid) of the complete ("X") events, in rank then thread order.
  std::map<std::pair<int, int>, std::vector<Box>> lanes;
  std::map<std::pair<int, int>, std::string> lane_names;
  std::map<int, std::string> process_names;
  double lo = INFINITY, hi = -INFINITY;
  for (const json& e : merged["traceEvents"]) {
    const std::string ph = e.value("ph", "");
    const int pid = e.value("pid", 0), tid = e.value("tid", 0);
    if (ph == "M" && e.value("name", "") == "thread_name") lane_names[{pid, tid}] = e["args"].value("name", "");
    if (ph == "M" && e.value("name", "") == "process_name") process_names[pid] = e["args"].value("name", "");
    if (ph != "X") continue;
    const double t0 = e["ts"].get<double>(), t1 = t0 + e["dur"].get<double>();
    if (t0 < from || t1 > to) continue;
    lanes[{pid, tid}].push_back(Box{t0, t1, e.value("name", ""), e.value("cat", ""), 0});
    lo = std::min(lo, t0), hi = std::max(hi, t1);
  }
  if (lanes.empty()) throw InputError("tetra trace merge --svg: the timelines hold no span to draw");
  const double width = 1400, left = 240, right = 20, row = 14, gap = 10;
  auto x = [&](double t) { return left + (t - lo) / std::max(hi - lo, 1.0) * (width - left - right); };
  std::string body;
  double y = 40;
  for (auto& [key, boxes] : lanes) {
    // Depth: a span inside the one before it on its lane sits one row lower (spans nest).
    std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) {
      return a.t0 != b.t0 ? a.t0 < b.t0 : a.t1 > b.t1;
    });
    std::vector<double> open;  // end times of the enclosing spans
    int depth_max = 0;
    for (Box& b : boxes) {
      while (!open.empty() && open.back() <= b.t0) open.pop_back();
      b.depth = static_cast<int>(open.size());
      open.push_back(b.t1);
      depth_max = std::max(depth_max, b.depth);
    }
    const std::string lane = fmt::format("{} · {}", process_names.count(key.first) ? process_names[key.first]
                                                                                   : fmt::format("rank {}", key.first),
                                         lane_names.count(key) ? lane_names[key] : fmt::format("thread {}", key.second));
    body += fmt::format("<g class=\"lane\" data-pid=\"{}\" data-tid=\"{}\">\n<text x=\"6\" y=\"{:.1f}\" "
                        "font-size=\"10\">{}</text>\n", key.first, key.second, y + 10, xml_escape(lane));
    for (const Box& b : boxes) {
      const double x0 = x(b.t0), w = std::max(x(b.t1) - x0, 0.5), yy = y + b.depth * row;
      body += fmt::format("<rect class=\"span\" data-cat=\"{}\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" "
                          "height=\"{:.1f}\" fill=\"{}\" stroke=\"#555\" stroke-width=\"0.2\"><title>{} ({:.3f} ms)"
                          "</title></rect>\n", xml_escape(b.cat), x0, yy, w, row - 1, colour(b.cat), xml_escape(b.name),
                          (b.t1 - b.t0) / 1e3);
      if (w > 7.0 * static_cast<double>(b.name.size()))
        body += fmt::format("<text x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"9\">{}</text>\n", x0 + 2, yy + row - 4,
                            xml_escape(b.name));
    }
    body += "</g>\n";
    y += (depth_max + 1) * row + gap;
  }
  // The time axis, in ms from the first span.
  std::string axis;
  const double span_ms = (hi - lo) / 1e3;
  const double tick = std::pow(10.0, std::floor(std::log10(std::max(span_ms, 1e-3) / 5)));
  for (double t = 0; t <= span_ms + 1e-9; t += tick)
    axis += fmt::format("<line x1=\"{0:.2f}\" y1=\"28\" x2=\"{0:.2f}\" y2=\"{1:.1f}\" stroke=\"#eee\"/><text x=\"{0:.2f}\" "
                        "y=\"24\" font-size=\"9\" text-anchor=\"middle\">{2:g} ms</text>\n",
                        x(lo + t * 1e3), y, t);
  std::string legend;
  double lx = left;
  for (const char* cat : {"step", "phase", "pipeline", "op", "wait", "collective", "optimizer", "checkpoint"}) {
    legend += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.1f}\" "
                          "y=\"{:.1f}\" font-size=\"10\">{}</text>\n", lx, y + 6, colour(cat), lx + 14, y + 15, cat);
    lx += 90;
  }
  return fmt::format("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
                     "width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\">\n<rect width=\"100%\" "
                     "height=\"100%\" fill=\"white\"/>\n<text x=\"6\" y=\"14\" font-size=\"12\">timeline, {} ranks, "
                     "{:.1f} ms</text>\n{}{}{}</svg>\n",
                     width, y + 30, process_names.size(), span_ms, axis, body, legend);
}

// `text` to `path` through the one atomic writer (trainer/core/files.h); a failure is bad input
// (the output path given), named with its option.
void write_output(const std::string& path, const std::string& text, const char* option) {
  try {
    write_file_atomic(path, text);
  } catch (const Error& e) {
    throw InputError(fmt::format("{} {}: cannot write it: {}", option, path, e.what()));
  }
}

class TraceCommand final : public Command {
 public:
  explicit TraceCommand(CLI::App& tetra) {
    cmd_ = tetra.add_subcommand("trace", "work with the timelines of training.profile_steps");
    cmd_->require_subcommand(1);
    merge_ = cmd_->add_subcommand("merge", "join the ranks' timelines (DIR/trace/rank_R.json) into one Chrome trace "
                                           "for Perfetto or chrome://tracing");
    merge_->add_option("dir", dir_, "a run's logging.dir, or its trace folder")->required();
    merge_->add_option("-o,--out", out_, "the merged trace (default: merged.json beside the rank files)");
    merge_->add_option("--svg", svg_, "also draw the timeline as an SVG picture");
    merge_->add_option("--step", step_, "draw only this step (its spans on every rank)")->check(whole_number_in(1, INT64_MAX));
    merge_->add_flag("--force", force_, "replace existing outputs");
  }
  CLI::App& app() override { return *cmd_; }

  int run(int*, char***, const RuntimeOptions&) override { return exit_code_of([this] { return merge(); }); }

 private:
  int merge() {
    fs::path dir(dir_);
    if (fs::is_directory(dir / "trace")) dir /= "trace";
    if (!fs::is_directory(dir))
      throw InputError(fmt::format("tetra trace merge: {}: not a folder (give a run's logging.dir or its trace "
                                   "folder)", dir_));
    std::vector<RankFile> files = read_rank_files(dir);
    if (files.empty())
      throw InputError(fmt::format("tetra trace merge: {}: no rank_R.json (a run with training.profile_steps "
                                   "writes them)", dir.string()));
    if (step_ > 0 && svg_.empty()) throw InputError("--step draws one step of the picture: give --svg too");
    // One run's files: the same window and time axis (rank 0's clock at time 0), every rank present.
    const json& first = files.front().doc["otherData"];
    const json window = first["profile_steps"];
    const int world = first.value("world", 0);
    for (const RankFile& f : files) {
      const json& o = f.doc["otherData"];
      if (o.value("world", 0) != world || std::abs(o.value("epoch_s", 0.0) - first.value("epoch_s", 0.0)) > 1e-6)
        throw InputError(fmt::format("tetra trace merge: {} (a run of {} ranks) and {} (of {}) do not share a time "
                                     "axis: timelines of different runs; keep one run's files in the folder",
                                     files.front().path, world, f.path, o.value("world", 0)));
      if (o["profile_steps"] != window)
        throw InputError(fmt::format("tetra trace merge: {} profiled steps {} where {} profiled {}: timelines of "
                                     "different runs", f.path, o["profile_steps"].dump(), files.front().path,
                                     window.dump()));
    }
    if (files.back().rank >= world)
      throw InputError(fmt::format("tetra trace merge: {}: rank {}'s file in a run of {} ranks: a timeline of "
                                   "another run; keep one run's files in the folder", files.back().path,
                                   files.back().rank, world));
    if (static_cast<int>(files.size()) != world) {
      // The ranks without a file (the first few, if many).
      std::string missing;
      int count = 0;
      for (int r = 0, k = 0; r < world; ++r) {
        if (k < static_cast<int>(files.size()) && files[k].rank == r) {
          ++k;
          continue;
        }
        if (++count <= 8) missing += fmt::format("{}rank_{}.json", missing.empty() ? "" : ", ", r);
      }
      if (count > 8) missing += fmt::format(" and {} more", count - 8);
      throw InputError(fmt::format("tetra trace merge: {}: {} rank file(s) of a run of {} ranks: {} {} missing "
                                   "(copy it from the node that ran that rank, or profile again)",
                                   dir.string(), files.size(), world, missing, count == 1 ? "is" : "are"));
    }
    json merged;
    merged["displayTimeUnit"] = "ms";
    merged["otherData"]["ranks"] = json::array();
    merged["otherData"]["profile_steps"] = window;
    merged["traceEvents"] = json::array();
    for (RankFile& f : files) {
      merged["otherData"]["ranks"].push_back(f.doc["otherData"]);
      for (json& e : f.doc["traceEvents"]) {
        // Asynchronous spans' ids are per rank: made unique across ranks.
        if (e.contains("id")) e["id"] = static_cast<int64_t>(f.rank) * kIdsPerRank + e["id"].get<int64_t>();
        merged["traceEvents"].push_back(std::move(e));
      }
    }
    const std::string out = out_.empty() ? (dir / "merged.json").string() : out_;
    std::vector<std::string> inputs;
    for (const RankFile& f : files) inputs.push_back(f.path);
    check_output_file("--out", out, force_, inputs);
    if (!svg_.empty()) {
      check_output_file("--svg", svg_, force_, inputs);
      TETRA_INPUT_CHECK(fs::absolute(svg_).lexically_normal() != fs::absolute(out).lexically_normal(),
                        "--svg {} is the --out file too: give the picture and the merged trace different names", svg_);
    }
    const std::string picture = svg_.empty() ? "" : timeline_svg(merged, step_);  // refused before anything is written
    write_output(out, merged.dump() + "\n", "--out");
    std::printf("%s (%zu ranks, %zu events)\n", out.c_str(), files.size(), merged["traceEvents"].size());
    if (!svg_.empty()) {
      write_output(svg_, picture, "--svg");
      std::printf("%s\n", svg_.c_str());
    }
    return 0;
  }

  CLI::App* cmd_ = nullptr;
  CLI::App* merge_ = nullptr;
  std::string dir_, out_, svg_;
  int64_t step_ = 0;
  bool force_ = false;
};

}  // namespace

std::unique_ptr<Command> add_trace_command(CLI::App& tetra) { return std::make_unique<TraceCommand>(tetra); }

}  // namespace tetra::cli
