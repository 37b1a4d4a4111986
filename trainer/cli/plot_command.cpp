// `tetra plot RUN_DIR... [--out FILE.svg|FILE.png] [--force]`: a picture of one or several runs
// from their metrics.jsonl, without any plotting tool: loss against steps and against tokens,
// validation loss, learning rate, gradient norm and throughput, one panel each, one curve per run
// (to compare layouts or hyper-parameters), written as SVG by Tetra itself. A .png is the SVG
// converted by an installed rsvg-convert or ImageMagick convert (exit 2 naming both when neither
// is installed). The default output is the first run directory's plot.svg. Exit 2 for a run
// directory without steps in metrics.jsonl, or an existing output without --force.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/cli/cli.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "trainer/core/output_path.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;

struct Series {
  std::vector<double> x, y;
};

struct Run {
  std::string name;
  Series loss, loss_tokens, val_loss, lr, grad_norm, throughput;
};

// True when `line` is a run's start event (the first line a run appends to metrics.jsonl).
bool is_start_event(const std::string& file, const std::string& line, int64_t n) {
  if (!line.starts_with("{\"event\":\"start\"")) return false;
  try {
    const nlohmann::json j = parse_json_line(file, line, n);
    return j.is_object() && j.value("event", "") == "start";
  } catch (const InputError&) {
    return false;
  }
}

// A run's steps from metrics.jsonl (the lines with a "step" key; a resumed run's later lines win).
// Every line is a JSON object; a step line's step is an integer >= 1 and its plotted values are
// numbers (or null: a non-finite value). One kind of damage is read past, with a warning naming the
// line: a line cut short by a write that did not finish (a full disk, a killed run) — the file's
// last line without its newline, or a line followed by (or glued to) a later run's start event.
Run read_run(const std::string& dir) {
  const fs::path path = fs::path(dir) / "metrics.jsonl";
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw InputError(fmt::format("tetra plot: {}: no metrics.jsonl (a run's logging.dir holds one)", dir));
  const std::string file = path.string();
  const std::string text = read_text(file, "metrics file", "give a run's logging.dir");
  Run r;
  r.name = fs::path(dir).lexically_normal().filename().string();
  if (r.name.empty()) r.name = fs::path(dir).lexically_normal().parent_path().filename().string();
  std::vector<std::string> lines;
  for (size_t start = 0; start < text.size();) {
    const size_t end = std::min(text.find('\n', start), text.size());
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  const bool cut_at_end = !text.empty() && text.back() != '\n';
  auto cut_short = [&](int64_t n, const char* how) {
    std::fprintf(stderr, "warning: %s:%lld: the line is cut short (a write that did not finish)%s; plotted "
                 "without it\n", file.c_str(), static_cast<long long>(n), how);
  };
  std::vector<nlohmann::json> steps;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    const auto n = static_cast<int64_t>(i + 1);
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = parse_json_line(file, line, n);
    } catch (const JsonSyntaxError&) {
      if (i + 1 == lines.size() && cut_at_end) {
        cut_short(n, ", the file's last");
        continue;
      }
      if (i + 1 < lines.size() && is_start_event(file, lines[i + 1], n + 1)) {
        cut_short(n, ", before a later run's start");
        continue;
      }
      const size_t glued = line.find("{\"event\":\"start\"", 1);
      if (glued != std::string::npos && is_start_event(file, line.substr(glued), n)) {
        cut_short(n, ", a later run's start event appended to it");
        continue;
      }
      throw;
    }
    if (!j.is_object())
      throw InputError(fmt::format("{}:{}: each line of metrics.jsonl is a JSON object, this one is {}", file, n,
                                   json_kind(j)));
    if (!j.contains("step")) continue;
    const std::string at = fmt::format("{}:{}", file, n);
    const int64_t step = json_integer(at, j["step"], "step");
    if (step < 1) throw InputError(fmt::format("{}: step: {} is not a step (steps count from 1)", at, step));
    for (const char* key : {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "ms"})
      if (j.contains(key) && !j[key].is_null()) json_number(at, j[key], key);
    // A resumed run repeats steps: the later line replaces the earlier ones from that step on.
    while (!steps.empty() && steps.back()["step"].get<int64_t>() >= step) steps.pop_back();
    steps.push_back(j);
  }
  if (steps.empty()) throw InputError(fmt::format("tetra plot: {}: metrics.jsonl holds no step", dir));
  double tokens = 0.0;
  for (const nlohmann::json& j : steps) {
    const double step = j["step"].get<double>();
    // A value no training writes (beyond 1e30 in size) would overflow the axes' arithmetic: not drawn,
    // as a non-finite one is not.
    auto number = [&](const char* key) {
      const double v = j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
      return std::abs(v) <= 1e30 ? v : NAN;
    };
    tokens += number("tokens_per_s") * number("ms") / 1e3;  // the step's tokens
    const double loss = number("loss");
    if (std::isfinite(loss) && !j.contains("skipped")) {
      r.loss.x.push_back(step), r.loss.y.push_back(loss);
      r.loss_tokens.x.push_back(tokens), r.loss_tokens.y.push_back(loss);
    }
    if (std::isfinite(number("val_loss"))) r.val_loss.x.push_back(step), r.val_loss.y.push_back(number("val_loss"));
    if (std::isfinite(number("lr"))) r.lr.x.push_back(step), r.lr.y.push_back(number("lr"));
    if (std::isfinite(number("grad_norm"))) r.grad_norm.x.push_back(step), r.grad_norm.y.push_back(number("grad_norm"));
    if (std::isfinite(number("tokens_per_s")))
      r.throughput.x.push_back(step), r.throughput.y.push_back(number("tokens_per_s"));
  }
  return r;
}


// `s` as one word of a POSIX shell command.
std::string shell_quote(const std::string& s) {
  std::string o = "'";
  for (char c : s) o += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return o + "'";
}

std::string number_text(double v) {
  if (v == 0.0) return "0";
  const double a = std::abs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.2e}", v);
  return fmt::format("{:.4g}", v);
}

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"};

// One panel at (x0, y0) of size (w, h): axes, the extremes as tick labels, one polyline per run
// with points (class "series", data-run the run's name, data-series the panel's key).
std::string panel(const std::vector<Run>& runs, Series Run::*field, const std::string& key, const std::string& title,
                  const std::string& x_label, double x0, double y0, double w, double h) {
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymin = xmin, ymax = -xmin;
  for (const Run& r : runs) {
    const Series& s = r.*field;
    for (size_t i = 0; i < s.x.size(); ++i) {
      xmin = std::min(xmin, s.x[i]), xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]), ymax = std::max(ymax, s.y[i]);
    }
  }
  const double left = x0 + 70, right = x0 + w - 15, top = y0 + 30, bottom = y0 + h - 40;
  std::string o = fmt::format("<g class=\"panel\" data-series=\"{}\">\n", key);
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"14\" font-weight=\"bold\">{}</text>\n", left, y0 + 18,
                   xml_escape(title));
  o += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" stroke=\"#888\"/>\n",
                   left, top, right - left, bottom - top);
  if (!std::isfinite(xmin)) {
    o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"12\" fill=\"#888\">no values</text>\n</g>\n",
                     left + 10, (top + bottom) / 2);
    return o;
  }
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) ymax = ymin + std::max(1e-12, std::abs(ymin) * 0.01);
  auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * (right - left); };
  auto py = [&](double y) { return bottom - (y - ymin) / (ymax - ymin) * (bottom - top); };
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n", left - 4, top + 4,
                   number_text(ymax));
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n", left - 4, bottom,
                   number_text(ymin));
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">{}</text>\n", left, bottom + 14, number_text(xmin));
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n", right, bottom + 14,
                   number_text(xmax));
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n",
                   (left + right) / 2, bottom + 28, xml_escape(x_label));
  for (size_t k = 0; k < runs.size(); ++k) {
    const Series& s = runs[k].*field;
    if (s.x.empty()) continue;
    std::string points;
    for (size_t i = 0; i < s.x.size(); ++i) points += fmt::format("{}{:.2f},{:.2f}", i ? " " : "", px(s.x[i]), py(s.y[i]));
    o += fmt::format("<polyline class=\"series\" data-run=\"{}\" data-series=\"{}\" fill=\"none\" stroke=\"{}\" "
                     "stroke-width=\"1.5\" points=\"{}\"/>\n",
                     xml_escape(runs[k].name), key, kColors[k % std::size(kColors)], points);
  }
  return o + "</g>\n";
}

std::string svg(const std::vector<Run>& runs) {
  const double w = 420, h = 260;
  const int columns = 3;
  struct Panel {
    Series Run::*field;
    const char* key;
    const char* title;
    const char* x_label;
  };
  const Panel panels[] = {{&Run::loss, "loss", "training loss", "step"},
                          {&Run::loss_tokens, "loss_tokens", "training loss", "tokens"},
                          {&Run::val_loss, "val_loss", "validation loss", "step"},
                          {&Run::lr, "lr", "learning rate", "step"},
                          {&Run::grad_norm, "grad_norm", "gradient norm", "step"},
                          {&Run::throughput, "tokens_per_s", "tokens/s", "step"}};
  const double legend = 24.0 + 18.0 * static_cast<double>(runs.size());
  const double width = w * columns, height = h * 2 + legend;
  std::string o = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" "
      "height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\">\n<rect width=\"100%\" "
      "height=\"100%\" fill=\"white\"/>\n",
      width, height, width, height);
  for (size_t k = 0; k < runs.size(); ++k) {
    const double y = 20.0 + 18.0 * static_cast<double>(k);
    o += fmt::format("<g class=\"legend\"><line x1=\"20\" y1=\"{0:.1f}\" x2=\"44\" y2=\"{0:.1f}\" stroke=\"{1}\" "
                     "stroke-width=\"3\"/><text x=\"50\" y=\"{2:.1f}\" font-size=\"13\">{3}</text></g>\n",
                     y, kColors[k % std::size(kColors)], y + 4, xml_escape(runs[k].name));
  }
  for (size_t i = 0; i < std::size(panels); ++i) {
    const Panel& p = panels[i];
    o += panel(runs, p.field, p.key, p.title, p.x_label, w * static_cast<double>(i % columns),
               legend + h * static_cast<double>(i / columns), w, h);
  }
  return o + "</svg>\n";
}

class PlotCommand final : public Command {
 public:
  explicit PlotCommand(CLI::App& tetra) {
    cmd_ = tetra.add_subcommand("plot", "draw runs' loss, validation loss, learning rate, gradient norm and throughput "
                                        "from their metrics.jsonl (SVG, or PNG through an installed converter)");
    cmd_->add_option("runs", runs_, "run directories (each a logging.dir holding metrics.jsonl)")->required();
    cmd_->add_option("-o,--out", out_, "FILE.svg or FILE.png (default: the first run's plot.svg)");
    cmd_->add_flag("--force", force_, "replace an existing output file");
  }
  CLI::App& app() override { return *cmd_; }

  int run(int*, char***, const RuntimeOptions&) override { return exit_code_of([this] { return plot(); }); }

 private:
  int plot() {
    std::vector<Run> runs;
    for (const std::string& d : runs_) runs.push_back(read_run(d));
    // Two directories of the same name: their paths tell them apart.
    for (size_t i = 0; i < runs.size(); ++i)
      for (size_t j = 0; j < runs.size(); ++j)
        if (i != j && runs[i].name == runs[j].name) runs[i].name = runs_[i];
    const std::string out = out_.empty() ? (fs::path(runs_.front()) / "plot.svg").string() : out_;
    const std::string ext = fs::path(out).extension().string();
    if (ext != ".svg" && ext != ".png")
      throw InputError(fmt::format("--out {}: the picture is .svg or .png", out));
    std::vector<std::string> inputs;
    for (const std::string& r : runs_) inputs.push_back((fs::path(r) / "metrics.jsonl").string());
    check_output_file("--out", out, force_, inputs);
    std::string converter;
    if (ext == ".png") {
      // ImageMagick's convert by its version line: another program may take the name.
      if (std::system("command -v rsvg-convert >/dev/null 2>&1") == 0)
        converter = "rsvg-convert";
      else if (std::system("convert -version 2>/dev/null | grep -q ImageMagick") == 0)
        converter = "convert";
      if (converter.empty())
        throw InputError(fmt::format("--out {}: a PNG needs rsvg-convert (librsvg2-bin) or ImageMagick's convert, "
                                     "and neither is installed; write .svg instead", out));
    }
    std::string svg_path;  // the picture the converter reads: out.svg.tmp beside the PNG (files.h)
    if (ext == ".svg") {
      try {
        write_file_atomic(out, svg(runs));
      } catch (const Error& e) {
        throw InputError(fmt::format("--out {}: cannot write it: {}", out, e.what()));
      }
    } else {
      {
        int fd = -1;
        try {
          fd = create_temp_beside(out + ".svg", &svg_path);
        } catch (const Error& e) {
          throw InputError(fmt::format("--out {}: cannot write the picture beside it: {}", out, e.what()));
        }
        const std::string text = svg(runs);
        const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
        ::close(fd);
        if (!written) {
          fs::remove(svg_path);
          throw InputError(fmt::format("--out {}: cannot write the picture beside it ({})", out, svg_path));
        }
      }
      const std::string cmd = converter == "rsvg-convert"
                                  ? fmt::format("rsvg-convert -o {} {}", shell_quote(out), shell_quote(svg_path))
                                  : fmt::format("convert {} {}", shell_quote(svg_path), shell_quote(out));
      const int rc = std::system(cmd.c_str());
      fs::remove(svg_path);
      if (rc != 0) {
        std::fprintf(stderr, "error: %s failed (%d) converting the plot to %s\n", converter.c_str(), rc, out.c_str());
        return 1;
      }
    }
    std::printf("%s\n", out.c_str());
    return 0;
  }

  CLI::App* cmd_ = nullptr;
  std::vector<std::string> runs_;
  std::string out_;
  bool force_ = false;
};

}  // namespace

std::unique_ptr<Command> add_plot_command(CLI::App& tetra) { return std::make_unique<PlotCommand>(tetra); }

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&') o += "&amp;";
    else if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

}  // namespace tetra::cli
