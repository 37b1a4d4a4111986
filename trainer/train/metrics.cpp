#include "trainer/train/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kernels/common/check.h"

namespace tetra {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

MetricsWriter::MetricsWriter(const std::string& dir, bool tensorboard) {
  if (dir.empty()) return;
  if (tensorboard) tensorboard_ = std::make_unique<TensorBoardWriter>(dir + "/tensorboard");
  const std::string path = dir + "/metrics.jsonl";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (const int err = jsonl_.open(path); err != 0)
    throw InputError(fmt::format("logging.dir: cannot open {} for appending: {}; choose a writable directory", path,
                                 ec ? ec.message() : std::strerror(err)));
  // A write that did not finish (a full disk, a killed run) left a cut last line: this run's lines
  // start on a line of their own, and readers skip the cut one.
  if (!jsonl_.empty_or_ends_with('\n')) {
    spdlog::warn("{}: the last line is cut short (an earlier write did not finish); this run's lines start on a "
                 "new line", path);
    jsonl_.append("\n");
  }
}

void MetricsWriter::event(const std::string& event_json) {
  if (!jsonl_.is_open()) return;
  jsonl_.append(event_json + '\n');
}

MoeTokenSpread token_spread(const MoeLayerStats& l) {
  MoeTokenSpread t;
  if (l.tokens_per_expert.empty()) return t;
  t.min = *std::min_element(l.tokens_per_expert.begin(), l.tokens_per_expert.end());
  t.max = *std::max_element(l.tokens_per_expert.begin(), l.tokens_per_expert.end());
  double sum = 0.0;
  for (int64_t n : l.tokens_per_expert) sum += static_cast<double>(n);
  t.mean = sum / static_cast<double>(l.tokens_per_expert.size());
  return t;
}

std::string MetricsWriter::format_line(const StepMetrics& m) {
  std::string line = fmt::format(
      "step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f}{} | {:.1f} ms{} | {:.0f} tok/s | "
      "MFU {:.1f}% | ETA {}",
      m.step, std::to_string(m.total_steps).size(), m.total_steps, m.loss, m.lr, m.grad_norm,
      m.clip < 1.0 ? " (clipped)" : "", m.ms, m.planned_ms ? fmt::format(" (planned {:.1f})", *m.planned_ms) : "",
      m.tokens_per_s, 100.0 * m.mfu, format_duration(m.eta_s));
  if (m.val_loss) line += fmt::format(" | val loss {:.4f}", *m.val_loss);
  if (m.pipeline)
    line += fmt::format(" | bubble {:.0f}% (ideal {:.0f}%)", 100.0 * m.pipeline->bubble, 100.0 * m.pipeline->ideal_bubble);
  if (m.loss_scale) line += fmt::format(" | loss scale {}", *m.loss_scale);
  if (m.skipped) line += fmt::format(" | SKIPPED ({})", *m.skipped);
  if (m.moe && m.moe->over_bound_world > 0)
    line += fmt::format(" | moe over bound {}", m.moe->over_bound_world);
  if (m.moe)
    for (const MoeLayerStats& l : m.moe->layers) {
      const MoeTokenSpread t = token_spread(l);
      line += fmt::format(" | moe{} tokens/expert {}/{:.1f}/{} dropped {} aux {:.4f} z {:.3f}", l.layer, t.min,
                          t.mean, t.max, l.dropped, l.aux_loss, l.z_loss);
    }
  // The expert-parallel exchanges' time the step spent waiting on them (not hidden behind the experts).
  if (m.moe && m.moe->dispatch_bytes + m.moe->combine_bytes > 0)
    line += fmt::format(" | moe experts {:.1f} ms, exchanges {:.1f} ms exposed", 1e3 * m.moe->expert_s,
                        1e3 * (m.moe->dispatch_s + m.moe->combine_s));
  for (const CommRecord& c : m.comm)
    line += fmt::format(" | {} {:.2f} MB, {:.1f} ms{}", c.group, c.sent_bytes / 1e6, c.blocked_ms,
                        c.measured == c.predicted ? "" : " (UNEXPECTED VOLUME)");
  return line;
}

std::vector<std::pair<std::string, double>> MetricsWriter::tensorboard_scalars(const StepMetrics& m) {
  std::vector<std::pair<std::string, double>> v = {
      {"train/loss", m.loss}, {"train/lr", m.lr}, {"train/grad_norm", m.grad_norm}, {"train/clip", m.clip},
      {"train/step_ms", m.ms}, {"train/tokens_per_s", m.tokens_per_s}, {"train/mfu", m.mfu},
      {"train/consumed_samples", static_cast<double>(m.consumed_samples)}, {"train/skipped", m.skipped ? 1.0 : 0.0}};
  if (m.planned_ms) v.push_back({"train/planned_step_ms", *m.planned_ms});
  if (m.val_loss) v.push_back({"val/loss", *m.val_loss});
  if (m.loss_scale) v.push_back({"train/loss_scale", *m.loss_scale});
  if (m.pipeline) v.push_back({"pipeline/bubble", m.pipeline->bubble});
  for (const CommRecord& c : m.comm) {
    v.push_back({"comm/" + c.group + "/sent_bytes", c.sent_bytes});
    v.push_back({"comm/" + c.group + "/blocked_ms", c.blocked_ms});
  }
  if (m.moe) {
    for (const MoeLayerStats& l : m.moe->layers) {
      const MoeTokenSpread t = token_spread(l);
      const std::string p = fmt::format("moe/layer{}/", l.layer);
      v.push_back({p + "tokens_per_expert_min", static_cast<double>(t.min)});
      v.push_back({p + "tokens_per_expert_max", static_cast<double>(t.max)});
      v.push_back({p + "dropped", static_cast<double>(l.dropped)});
      v.push_back({p + "max_rows", static_cast<double>(l.max_rows)});
      v.push_back({p + "over_bound", static_cast<double>(l.over_bound)});
      v.push_back({p + "aux_loss", l.aux_loss});
      v.push_back({p + "z_loss", l.z_loss});
    }
    v.push_back({"moe/expert_ms", 1e3 * m.moe->expert_s});
    v.push_back({"moe/dispatch_ms", 1e3 * m.moe->dispatch_s});
    v.push_back({"moe/combine_ms", 1e3 * m.moe->combine_s});
  }
  return v;
}

void MetricsWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  if (tensorboard_) tensorboard_->scalars(step, values);
}

void MetricsWriter::write(const StepMetrics& m) {
  if (tensorboard_) tensorboard_->scalars(m.step, tensorboard_scalars(m));
  if (!jsonl_.is_open()) return;
  nlohmann::ordered_json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["lr"] = m.lr;
  j["grad_norm"] = m.grad_norm;
  j["clip"] = m.clip;
  j["ms"] = m.ms;
  if (m.planned_ms) j["planned_ms"] = *m.planned_ms;
  j["tokens_per_s"] = m.tokens_per_s;
  j["mfu"] = m.mfu;
  j["consumed_samples"] = m.consumed_samples;
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  if (m.sample) j["sample"] = *m.sample;
  if (m.pipeline)
    j["pipeline"] = {{"schedule", m.pipeline->schedule},
                     {"bubble", m.pipeline->bubble},
                     {"ideal_bubble", m.pipeline->ideal_bubble},
                     {"bubble_per_rank", m.pipeline->bubble_per_rank},
                     {"peak_in_flight", m.pipeline->peak_in_flight}};
  if (m.skipped) j["skipped"] = *m.skipped;
  if (m.loss_scale) {
    j["loss_scale"] = *m.loss_scale;
    j["overflow"] = m.overflow;
  }
  if (m.moe) {
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (const MoeLayerStats& l : m.moe->layers) {
      const MoeTokenSpread t = token_spread(l);
      layers.push_back({{"layer", l.layer},
                        {"tokens_per_expert", {{"min", t.min}, {"mean", t.mean}, {"max", t.max}}},
                        {"dropped", l.dropped},
                        {"rows", {{"max", l.max_rows}, {"bound", l.bound_rows}}},
                        {"over_bound", l.over_bound},
                        {"aux_loss", l.aux_loss},
                        {"z_loss", l.z_loss}});
    }
    j["moe"] = {{"layers", layers},
                {"over_bound", m.moe->over_bound_world},
                {"expert_ms", 1e3 * m.moe->expert_s},
                {"dispatch_ms", 1e3 * m.moe->dispatch_s},
                {"combine_ms", 1e3 * m.moe->combine_s},
                {"dispatch_bytes", m.moe->dispatch_bytes},
                {"combine_bytes", m.moe->combine_bytes}};
  }
  if (!m.comm.empty()) {
    auto volume = [](const GroupVolume& v) {
      nlohmann::ordered_json o;
      for (int i = 0; i < kCommOps; ++i)
        if (v.calls[i] != 0 || v.payload_bytes[i] != 0)
          o[comm_op_name(static_cast<CommOp>(i))] = {{"calls", v.calls[i]}, {"payload_bytes", v.payload_bytes[i]}};
      return o;
    };
    nlohmann::ordered_json comm;
    for (const CommRecord& c : m.comm)
      comm[c.group] = {{"sent_bytes", c.sent_bytes},
                       {"blocked_ms", c.blocked_ms},
                       {"measured", volume(c.measured)},
                       {"predicted", volume(c.predicted)},
                       {"match", c.measured == c.predicted}};
    j["comm"] = comm;
  }
  // A sample may end inside a UTF-8 character (a byte-level BPE decodes bytes): replace, not throw.
  jsonl_.append(j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + '\n');
}

}  // namespace tetra
