#include "trainer/plan/cluster.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <array>
#include <barrier>
#include <thread>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "kernels/backend.h"
#include "kernels/common/check.h"
#include "kernels/cpu/peak.h"
#include "trainer/core/json_text.h"

namespace tetra {

double GpuSpec::peak(Precision p) const {
  switch (p) {
    case Precision::BF16: return peak_bf16;
    case Precision::FP16: return peak_fp16;
    case Precision::FP32: return peak_fp32;
  }
  return peak_fp32;
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The datasheet and microbenchmark figures of each preset; docs/clusters.md gives the source of
// every number. Peaks are dense (no sparsity); fp32 is the CUDA-core rate (the backend uses no
// TF32). Bandwidths: nccl-tests bus bandwidth per GPU inside a DGX node, and the per-GPU NIC rate
// across nodes at the fraction nccl-tests reaches on it.
struct Preset {
  const char* name;
  double memory_gib, reserved_gib;
  int64_t sms, tile_m, tile_n;
  double bf16_tflops, fp32_tflops, gemm_eff, gemm_latency_us, hbm_gbps, hbm_eff, attn_fwd_eff, attn_bwd_eff, overhead_us;
  double intra_gbps, intra_us, inter_gbps, inter_us;
  std::vector<std::string> sources;
};

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"a100-80gb", 80.0, 1.0, 108, 128, 256, 312.0, 19.5, 0.869, 12.0, 2039.0, 0.90, 0.55, 0.45, 4.0,
       230.0, 5.0, 22.0, 12.0,
       {"A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16/fp16, 19.5 fp32, 2039 GB/s HBM2e, 108 SMs",
        "max achievable bf16 GEMM (ml-engineering MAMF): 271.2 TFLOP/s = 0.869 of peak",
        "GEMM latency 12 us: the H100's (triton-lang/triton#2339), not measured on A100",
        "FlashAttention-2 paper (A100, head dim 128, causal): ~0.55 of peak forward, ~0.45 backward",
        "DGX A100: NVLink 3 (600 GB/s bidirectional); nccl-tests all-reduce bus bandwidth ~230 GB/s",
        "DGX A100: 8 x ConnectX-6 HDR 200 Gb/s, one per GPU: 25 GB/s, ~22 GB/s bus bandwidth"}},
      {"h100-80gb", 79.6, 1.0, 132, 128, 256, 989.4, 66.9, 0.803, 12.0, 3350.0, 0.90, 0.60, 0.45, 4.0,
       370.0, 5.0, 45.0, 12.0,
       {"H100 SXM5 80GB datasheet: 989.4 TFLOP/s dense bf16/fp16, 66.9 fp32, 3.35 TB/s HBM3, 132 SMs",
        "max achievable bf16 GEMM (ml-engineering MAMF): 794.5 TFLOP/s = 0.803 of peak",
        "GEMM latency 12 us: cuBLAS bf16 on H100 reaches 52% of peak at 2048^3 and 25% at 2048x1024x1024 "
        "(triton-lang/triton#2339): 2048^3's FLOPs at 0.803 of peak plus 11.8 us",
        "FlashAttention-3 paper (H100, head dim 128, causal, 4k-16k): ~600 TFLOP/s forward, ~450 backward",
        "DGX H100: NVLink 4 (900 GB/s bidirectional); nccl-tests all-reduce bus bandwidth ~370 GB/s",
        "DGX H100: 8 x ConnectX-7 NDR 400 Gb/s, one per GPU: 50 GB/s, ~45 GB/s bus bandwidth"}},
      {"h200", 140.4, 1.0, 132, 128, 256, 989.4, 66.9, 0.803, 12.0, 4800.0, 0.90, 0.60, 0.45, 4.0,
       370.0, 5.0, 45.0, 12.0,
       {"H200 SXM 141GB datasheet: 989.4 TFLOP/s dense bf16/fp16, 66.9 fp32, 4.8 TB/s HBM3e, 132 SMs",
        "GEMM and attention fractions and the GEMM latency: the H100's (same SMs and clocks)",
        "DGX H200: NVLink 4 and 8 x ConnectX-7 400 Gb/s as DGX H100"}},
      {"b200", 179.0, 1.0, 148, 128, 256, 2250.0, 75.0, 0.75, 12.0, 8000.0, 0.90, 0.55, 0.45, 4.0,
       740.0, 5.0, 45.0, 12.0,
       {"B200 (DGX B200) datasheet: 2.25 PFLOP/s dense bf16/fp16, 75 TFLOP/s fp32, 8 TB/s HBM3e, 180 GB, 148 SMs",
        "GEMM fraction 0.75 (unverified), attention fractions and GEMM latency assumed as the H100's (unverified)",
        "DGX B200: NVLink 5 (1.8 TB/s bidirectional), bus bandwidth ~740 GB/s (unverified)",
        "DGX B200: 8 x ConnectX-7 400 Gb/s, one per GPU: 50 GB/s"}},
  };
  return p;
}

ClusterSpec from_preset(const Preset& p) {
  ClusterSpec c;
  c.name = p.name;
  c.nodes = 1;
  c.gpus_per_node = 8;
  c.gpu.memory_bytes = p.memory_gib * kGiB;
  c.gpu.reserved_bytes = p.reserved_gib * kGiB;
  c.gpu.sms = p.sms;
  c.gpu.tile_m = p.tile_m;
  c.gpu.tile_n = p.tile_n;
  c.gpu.peak_bf16 = c.gpu.peak_fp16 = p.bf16_tflops * 1e12;
  c.gpu.peak_fp32 = p.fp32_tflops * 1e12;
  c.gpu.gemm_efficiency = p.gemm_eff;
  c.gpu.gemm_latency = p.gemm_latency_us * 1e-6;
  c.gpu.hbm_bandwidth = p.hbm_gbps * 1e9;
  c.gpu.hbm_efficiency = p.hbm_eff;
  c.gpu.attention_forward_efficiency = p.attn_fwd_eff;
  c.gpu.attention_backward_efficiency = p.attn_bwd_eff;
  c.gpu.kernel_overhead = p.overhead_us * 1e-6;
  c.intra = {p.intra_gbps * 1e9, p.intra_us * 1e-6};
  c.inter = {p.inter_gbps * 1e9, p.inter_us * 1e-6};
  c.sources = p.sources;
  return c;
}

// Reads an object's keys with the path of each in errors; every key is required once and no
// other is allowed.
class Reader {
 public:
  Reader(const nlohmann::json& j, std::string path, std::string where)
      : j_(j), path_(std::move(path)), where_(std::move(where)) {
    if (!j_.is_object()) fail(path_.empty() ? "the cluster" : path_, "must be a JSON object");
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw InputError(fmt::format("{}: {}: {} (docs/clusters.md lists the keys)", where_, key, why));
  }
  std::string key(const std::string& k) const { return path_.empty() ? k : path_ + "." + k; }
  const nlohmann::json& at(const std::string& k) {
    seen_.insert(k);
    if (!j_.contains(k)) fail(key(k), "missing");
    return j_.at(k);
  }
  bool has(const std::string& k) const { return j_.contains(k); }
  double number(const std::string& k, double lo, double hi) {
    const nlohmann::json& v = at(k);
    if (!v.is_number()) fail(key(k), fmt::format("{} is not a number", v.dump()));
    const double x = v.get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) fail(key(k), fmt::format("{} is outside [{}, {}]", v.dump(), lo, hi));
    return x;
  }
  int64_t integer(const std::string& k, int64_t lo, int64_t hi) {
    const nlohmann::json& v = at(k);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}))
      fail(key(k), fmt::format("{} is not an integer of at most 2^63-1", v.dump()));
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) fail(key(k), fmt::format("{} is outside [{}, {}]", x, lo, hi));
    return x;
  }
  Reader object(const std::string& k) { return Reader(at(k), key(k), where_); }
  // Every key given was read.
  void done() const {
    for (const auto& [k, v] : j_.items())
      if (!seen_.count(k)) {
        std::string known;
        for (const std::string& s : seen_) known += (known.empty() ? "" : ", ") + s;
        fail(key(k), fmt::format("unknown key (the keys here are {})", known));
      }
  }

 private:
  const nlohmann::json& j_;
  std::string path_, where_;
  std::set<std::string> seen_;
};

// Open MPI's shared-memory transport between two processes on two cores of this kind of machine:
// the bus bandwidth of a 20 MiB all-reduce (Open MPI 4.1, --bind-to core: 4.6-5.4 GB/s) and the
// time of an 8-byte one (a few tenths of a microsecond; the trainer's collectives add their
// worker thread's hand-off, ~2 us). docs/clusters.md.
constexpr double kCpuLinkBandwidth = 5.0e9, kCpuLinkLatency = 2.0e-6;

}  // namespace

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.push_back(p.name);
  names.push_back("cpu-local");
  return names;
}

ClusterSpec cluster_from_json(const nlohmann::json& j, const std::string& where) {
  Reader r(j, "", where);
  ClusterSpec c;
  c.name = where;
  if (r.has("name")) {
    const nlohmann::json& n = r.at("name");
    if (!n.is_string()) r.fail("name", "must be a string");
    c.name = n.get<std::string>();
  }
  c.nodes = r.integer("nodes", 1, 1 << 20);
  c.gpus_per_node = r.integer("gpus_per_node", 1, 1024);
  Reader g = r.object("gpu");
  c.gpu.memory_bytes = g.number("memory_gib", 0.01, 1e6) * kGiB;
  c.gpu.reserved_bytes = g.number("reserved_gib", 0.0, 1e6) * kGiB;
  if (c.gpu.reserved_bytes >= c.gpu.memory_bytes) g.fail(g.key("reserved_gib"), "must be less than memory_gib");
  c.gpu.sms = g.integer("sms", 1, 1 << 20);
  {
    const nlohmann::json& t = g.at("gemm_tile");
    if (!t.is_array() || t.size() != 2 || !t[0].is_number_integer() || !t[1].is_number_integer() ||
        t[0].get<int64_t>() < 1 || t[1].get<int64_t>() < 1)
      g.fail(g.key("gemm_tile"), fmt::format("{} is not [rows, columns] of positive integers", t.dump()));
    c.gpu.tile_m = t[0].get<int64_t>();
    c.gpu.tile_n = t[1].get<int64_t>();
  }
  Reader p = g.object("peak_tflops");
  c.gpu.peak_bf16 = p.number("bf16", 1e-6, 1e9) * 1e12;
  c.gpu.peak_fp16 = p.number("fp16", 1e-6, 1e9) * 1e12;
  c.gpu.peak_fp32 = p.number("fp32", 1e-6, 1e9) * 1e12;
  p.done();
  c.gpu.gemm_efficiency = g.number("gemm_efficiency", 0.01, 1.0);
  c.gpu.hbm_bandwidth = g.number("hbm_gbps", 1e-3, 1e9) * 1e9;
  c.gpu.hbm_efficiency = g.number("hbm_efficiency", 0.01, 1.0);
  Reader a = g.object("attention_efficiency");
  c.gpu.attention_forward_efficiency = a.number("forward", 0.001, 1.0);
  c.gpu.attention_backward_efficiency = a.number("backward", 0.001, 1.0);
  a.done();
  c.gpu.kernel_overhead = g.number("kernel_overhead_us", 0.0, 1e6) * 1e-6;
  c.gpu.gemm_latency = g.number("gemm_latency_us", 0.0, 1e6) * 1e-6;
  g.done();
  for (const char* link : {"intra_node", "inter_node"}) {
    Reader l = r.object(link);
    LinkSpec s{l.number("bandwidth_gbps", 1e-6, 1e9) * 1e9, l.number("latency_us", 0.0, 1e9) * 1e-6};
    l.done();
    (std::string(link) == "intra_node" ? c.intra : c.inter) = s;
  }
  if (r.has("sources")) {
    const nlohmann::json& s = r.at("sources");
    if (!s.is_array()) r.fail("sources", "must be a list of strings");
    for (const nlohmann::json& e : s) {
      if (!e.is_string()) r.fail("sources", "must be a list of strings");
      c.sources.push_back(e.get<std::string>());
    }
  }
  r.done();
  return c;
}

nlohmann::json cluster_to_json(const ClusterSpec& c) {
  return {{"name", c.name},
          {"nodes", c.nodes},
          {"gpus_per_node", c.gpus_per_node},
          {"gpu",
           {{"memory_gib", c.gpu.memory_bytes / kGiB},
            {"reserved_gib", c.gpu.reserved_bytes / kGiB},
            {"sms", c.gpu.sms},
            {"gemm_tile", {c.gpu.tile_m, c.gpu.tile_n}},
            {"peak_tflops", {{"bf16", c.gpu.peak_bf16 / 1e12}, {"fp16", c.gpu.peak_fp16 / 1e12}, {"fp32", c.gpu.peak_fp32 / 1e12}}},
            {"gemm_efficiency", c.gpu.gemm_efficiency},
            {"hbm_gbps", c.gpu.hbm_bandwidth / 1e9},
            {"hbm_efficiency", c.gpu.hbm_efficiency},
            {"attention_efficiency",
             {{"forward", c.gpu.attention_forward_efficiency}, {"backward", c.gpu.attention_backward_efficiency}}},
            {"kernel_overhead_us", c.gpu.kernel_overhead * 1e6},
            {"gemm_latency_us", c.gpu.gemm_latency * 1e6}}},
          {"intra_node", {{"bandwidth_gbps", c.intra.bandwidth / 1e9}, {"latency_us", c.intra.latency * 1e6}}},
          {"inter_node", {{"bandwidth_gbps", c.inter.bandwidth / 1e9}, {"latency_us", c.inter.latency * 1e6}}},
          {"sources", c.sources}};
}

ClusterSpec cpu_local_cluster(Precision precision, int threads_per_rank, double rank_peak, bool quick,
                              bool concurrent) {
  ClusterSpec c;
  c.name = "cpu-local";
  c.nodes = 1;
  const int threads = std::max(1, threads_per_rank);
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  c.gpus_per_node = std::max<long>(1, cores / threads);
  // The ranks whose kernels run at once while measuring (concurrent: the node's; else one: the
  // caller's, when the node's other ranks measure at the same time in their own processes).
  const int ranks = concurrent ? static_cast<int>(c.gpus_per_node) : 1;
  const bool bf16 = precision == Precision::BF16;
  // Every figure is one rank's, with its threads.
  const double peak = rank_peak > 0 ? rank_peak : measure_cpu_peak_gflops(threads, bf16) * 1e9;
  // fp16 GEMMs run in fp32 on the CPU; the other precisions' peaks are not measured (nor needed).
  c.gpu.peak_fp32 = c.gpu.peak_fp16 = c.gpu.peak_bf16 = peak;
  c.gpu.sms = 1;
  c.gpu.tile_m = c.gpu.tile_n = 1;  // no waves to quantise
  {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    c.gpu.memory_bytes = static_cast<double>(pages) * static_cast<double>(page) / static_cast<double>(c.gpus_per_node);
    c.gpu.reserved_bytes = 0.25 * kGiB;  // the process, MPI and the libraries
  }
  const DType act = precision_dtype(precision);
  const size_t es = dtype_size(act);
  const int reps = quick ? 2 : 10;
  // Unlike a GPU's memory, a CPU's memory bandwidth and caches are shared by the node's ranks:
  // every rate is measured with all of them running the same kernel at once (each on its own
  // backend and buffers), and is the slowest rank's.
  auto measure = [&](const std::function<std::function<void()>(Backend&, std::vector<void*>&)>& setup) {
    std::vector<double> best(static_cast<size_t>(ranks), 0.0);
    std::barrier sync(ranks);
    auto one = [&](int r) {
      std::unique_ptr<Backend> be = make_cpu_backend(threads);
      std::vector<void*> buffers;
      const std::function<void()> f = setup(*be, buffers);
      f();  // warm
      double b = 1e30;
      for (int i = 0; i < reps; ++i) {
        sync.arrive_and_wait();
        const auto t0 = std::chrono::steady_clock::now();
        f();
        b = std::min(b, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      best[static_cast<size_t>(r)] = b;
      for (void* p : buffers) be->free(p);
    };
    std::vector<std::thread> others;
    for (int r = 1; r < ranks; ++r) others.emplace_back(one, r);
    one(0);
    for (std::thread& t : others) t.join();
    return *std::max_element(best.begin(), best.end());
  };
  auto buffer = [](Backend& be, std::vector<void*>& keep, size_t n) {
    void* p = be.alloc(n);
    be.memset_zero(p, n);
    keep.push_back(p);
    return p;
  };
  auto gemm = [&](int64_t M, int64_t N, int64_t K) {
    return measure([&, M, N, K](Backend& be, std::vector<void*>& keep) -> std::function<void()> {
      void* A = buffer(be, keep, static_cast<size_t>(M * K) * es);
      void* B = buffer(be, keep, static_cast<size_t>(K * N) * es);
      void* C = buffer(be, keep, static_cast<size_t>(M * N) * es);
      return [&be, A, B, C, M, N, K, act] { be.gemm(false, false, M, N, K, 1.0f, A, K, B, N, act, 0.0f, C, N, act); };
    });
  };
  // GEMM: the best of transformer-like shapes (the rate MAMF means: the most a GEMM reaches).
  double best_gemm = 0.0;
  const std::vector<std::array<int64_t, 3>> shapes =
      quick ? std::vector<std::array<int64_t, 3>>{{512, 1024, 768}}
            : std::vector<std::array<int64_t, 3>>{{1024, 1024, 1024}, {2048, 768, 768}, {1024, 3072, 768}};
  for (const auto& [M, N, K] : shapes) best_gemm = std::max(best_gemm, 2.0 * static_cast<double>(M * N * K) / gemm(M, N, K));
  c.gpu.gemm_efficiency = std::min(1.0, best_gemm / peak);
  // What a small GEMM takes beyond its FLOPs at that rate.
  c.gpu.gemm_latency = std::max(0.0, gemm(32, 64, 64) - 2.0 * 32 * 64 * 64 / best_gemm);
  // Streaming: a copy (read + write) much larger than the caches.
  {
    const size_t n = (quick ? size_t{16} : size_t{64}) << 20;
    const double t = measure([&](Backend& be, std::vector<void*>& keep) -> std::function<void()> {
      void* a = buffer(be, keep, n);
      void* b = buffer(be, keep, n);
      return [&be, a, b, n] { be.copy(b, a, n); };
    });
    c.gpu.hbm_bandwidth = 2.0 * static_cast<double>(n) / t;
    c.gpu.hbm_efficiency = 1.0;
  }
  // Fused causal attention, forward and backward (FLOPs as the flash-attention papers count them:
  // 4 T^2 HS NH / 2 forward, 2.5 times that backward).
  {
    const int64_t B = 1, T = quick ? 256 : 512, NH = 4, HS = 64;
    const size_t qkv_n = static_cast<size_t>(B * T * 3 * NH * HS), o_n = static_cast<size_t>(B * T * NH * HS);
    const double flops = 4.0 * static_cast<double>(B * T * T * HS * NH) / 2.0;
    auto attention = [&](bool backward) {
      return measure([&, backward](Backend& be, std::vector<void*>& keep) -> std::function<void()> {
        void* qkv = buffer(be, keep, qkv_n * es);
        void* out = buffer(be, keep, o_n * es);
        void* dout = buffer(be, keep, o_n * es);
        void* dqkv = buffer(be, keep, qkv_n * es);
        float* lse = static_cast<float*>(buffer(be, keep, static_cast<size_t>(B * NH * T) * 4));
        be.attention_forward(out, lse, qkv, B, T, NH, NH, HS, act);
        if (backward)
          return [=, &be] { be.attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NH, HS, act); };
        return [=, &be] { be.attention_forward(out, lse, qkv, B, T, NH, NH, HS, act); };
      });
    };
    c.gpu.attention_forward_efficiency = std::min(1.0, flops / attention(false) / peak);
    c.gpu.attention_backward_efficiency = std::min(1.0, 2.5 * flops / attention(true) / peak);
  }
  // The least an op takes: a tiny add.
  c.gpu.kernel_overhead = measure([&](Backend& be, std::vector<void*>& keep) -> std::function<void()> {
    void* a = buffer(be, keep, 256);
    return [&be, a] { be.add(a, a, a, 16, DType::F32); };
  });
  // Open MPI's shared-memory transport between two cores of one machine (docs/clusters.md).
  c.intra = {kCpuLinkBandwidth, kCpuLinkLatency};
  c.inter = c.intra;
  c.sources = {fmt::format("measured now on this machine with {} rank(s) of {} thread(s) busy at once: peak {:.1f} "
                           "GFLOP/s ({}), GEMM {:.0f}% of it (+{:.0f} us), streaming {:.1f} GB/s, attention {:.0f}% / "
                           "{:.0f}% of peak (forward / backward)",
                           ranks, threads, peak / 1e9, to_string(precision), 100 * c.gpu.gemm_efficiency,
                           c.gpu.gemm_latency * 1e6, c.gpu.hbm_bandwidth / 1e9, 100 * c.gpu.attention_forward_efficiency,
                           100 * c.gpu.attention_backward_efficiency),
               "links: Open MPI shared memory between two cores (docs/clusters.md)"};
  return c;
}

std::optional<ClusterSpec> cluster_for_gpu(const std::string& gpu_name, int64_t world) {
  // The SXM parts of the presets; a PCIe or NVL variant has other clocks and links: no preset.
  const std::pair<const char*, const char*> names[] = {
      {"A100-SXM4-80GB", "a100-80gb"}, {"H100 80GB HBM3", "h100-80gb"}, {"H200", "h200"}, {"B200", "b200"}};
  for (const auto& [pattern, preset] : names)
    if (gpu_name.find(pattern) != std::string::npos && gpu_name.find("NVL") == std::string::npos &&
        gpu_name.find("PCIe") == std::string::npos) {
      ClusterSpec c = load_cluster(preset, Precision::BF16);
      c.nodes = std::max<int64_t>(1, (world + c.gpus_per_node - 1) / c.gpus_per_node);
      return c;
    }
  return std::nullopt;
}

ClusterSpec load_cluster(const std::string& name_or_path, Precision precision, int64_t nodes) {
  ClusterSpec c;
  bool found = false;
  for (const Preset& p : presets())
    if (name_or_path == p.name) c = from_preset(p), found = true;
  if (!found && name_or_path == "cpu-local") c = cpu_local_cluster(precision), found = true;
  if (!found) {
    std::error_code ec;
    if (!std::filesystem::exists(name_or_path, ec)) {
      std::string names;
      for (const std::string& n : cluster_preset_names()) names += (names.empty() ? "" : ", ") + n;
      throw InputError(fmt::format("--cluster {}: neither a preset ({}) nor a file", name_or_path, names));
    }
    const nlohmann::json j = read_json_file(name_or_path, "--cluster", "give a cluster JSON file or a preset name");
    c = cluster_from_json(j, name_or_path);
  }
  if (nodes > 0) c.nodes = nodes;
  return c;
}

}  // namespace tetra
