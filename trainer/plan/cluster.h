// The machine a layout is planned for (`tetra plan --cluster`): nodes of identical accelerators,
// each with its memory, arithmetic peak per precision, memory bandwidth and the achievable
// fractions of them, and the two links a process group can span (inside a node, across nodes).
//
// A cluster is a built-in preset (a100-80gb, h100-80gb, h200, b200: datasheet peaks and published
// microbenchmarks, docs/clusters.md; cpu-local: this machine, measured when it is asked for) or a
// JSON file with the same keys:
//
//   {"name": "my-h100", "nodes": 8, "gpus_per_node": 8,
//    "gpu": {"memory_gib": 79.6, "reserved_gib": 3, "sms": 132, "gemm_tile": [128, 256],
//            "peak_tflops": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
//            "gemm_efficiency": 0.80, "hbm_gbps": 3350, "hbm_efficiency": 0.90,
//            "attention_efficiency": {"forward": 0.60, "backward": 0.45}, "kernel_overhead_us": 4,
//            "gemm_latency_us": 12},
//    "intra_node": {"bandwidth_gbps": 370, "latency_us": 5},
//    "inter_node": {"bandwidth_gbps": 45, "latency_us": 12}}
//
// Bandwidths are collective bus bandwidths per GPU in GB/s (10^9 bytes/s: nccl-tests' busbw, so a
// ring all-reduce of S bytes over g ranks takes 2 (g-1)/g S / bandwidth); efficiencies are
// fractions of the peak the best kernel reaches. Every key but `name` is required in a file; a
// wrong, missing or unknown key is an InputError naming it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/common/dtype.h"
#include "trainer/config/config.h"

namespace tetra {

struct LinkSpec {
  double bandwidth = 0.0;  // bytes/s per GPU (bus bandwidth)
  double latency = 0.0;    // seconds per ring step
};

struct GpuSpec {
  double memory_bytes = 0.0;    // what the device has
  double reserved_bytes = 0.0;  // taken before the trainer allocates (context, library workspaces)
  int64_t sms = 1;              // streaming multiprocessors (cores on a CPU): the GEMM wave width
  int64_t tile_m = 128, tile_n = 256;  // output tile of one GEMM work unit
  double peak_bf16 = 0.0, peak_fp16 = 0.0, peak_fp32 = 0.0;  // FLOP/s, dense
  double gemm_efficiency = 1.0;  // best GEMM FLOP/s / peak (large shapes)
  double hbm_bandwidth = 0.0;    // bytes/s
  double hbm_efficiency = 1.0;   // best streaming kernel / hbm_bandwidth
  double attention_forward_efficiency = 1.0, attention_backward_efficiency = 1.0;  // fused attention / peak
  double kernel_overhead = 0.0;  // seconds: the least a kernel takes (launch and tail)
  // seconds a GEMM takes beyond its FLOPs at the best rate (launch, prologue, pipeline fill,
  // epilogue): what makes small GEMMs slow (2048^3 reaches 52% of an H100's peak, 8192^3 81%)
  double gemm_latency = 0.0;
  double peak(Precision p) const;  // of the GEMMs of a run in this precision
};

struct ClusterSpec {
  std::string name;
  int64_t nodes = 1, gpus_per_node = 1;
  GpuSpec gpu;
  LinkSpec intra, inter;
  std::vector<std::string> sources;  // where the figures come from (one line each)
  int64_t gpus() const { return nodes * gpus_per_node; }
};

// The preset names, in the order help lists them.
std::vector<std::string> cluster_preset_names();

// `name_or_path`: a preset name or a JSON file. `nodes` > 0 overrides the node count (a preset
// has one node). cpu-local measures this machine's kernels at `precision` (cpu_local_cluster). InputError on a
// bad file, naming the key.
ClusterSpec load_cluster(const std::string& name_or_path, Precision precision, int64_t nodes = 0);

// From JSON text already read (`where` names it in errors).
ClusterSpec cluster_from_json(const nlohmann::json& j, const std::string& where);
nlohmann::json cluster_to_json(const ClusterSpec& c);

// This machine as a cluster of one node whose "GPUs" are its ranks, `threads_per_rank` cores each
// (cpu-local: one): peak, GEMM, attention and streaming rates measured now with the CPU backend's
// own kernels at `precision` and that many threads; links: the shared-memory transport's figures
// (docs/clusters.md). A CPU's memory bandwidth and caches are shared by the node's ranks: every
// rate is measured with all of them running the kernel at once (`concurrent`: threads of this
// process; false: this process alone, while the node's other ranks measure in theirs, as a
// training run's ranks do). `rank_peak` > 0 is the FMA peak already measured for those threads.
// `quick`: smaller kernels, two timings each (~0.1 s: the training log's planned step time).
ClusterSpec cpu_local_cluster(Precision precision, int threads_per_rank = 1, double rank_peak = 0.0,
                              bool quick = false, bool concurrent = true);

// The preset of a GPU by its name as the driver reports it ("NVIDIA H100 80GB HBM3" is h100-80gb),
// with `world` ranks on as many nodes as they fill; none for a GPU without a preset.
std::optional<ClusterSpec> cluster_for_gpu(const std::string& gpu_name, int64_t world);

}  // namespace tetra
