// The communicators of the group kinds of the rank grid, for this rank. Created once at start-up
// and passed explicitly to whatever communicates (no global group state).
//
// Each group has two roles, chosen by where a call's buffers live:
//   host memory     tp, pp, dp, ... (get()): MPI communicators. Checkpoint metadata, weights
//                   gathered for export, 1-bit Adam's compressed messages and exact sums, barriers.
//   backend memory  backend(kind): every call on buffers from Backend::alloc (activations,
//                   gradient buckets, pipeline boundaries, MoE tokens and counts, and the scalars
//                   reduced through backend scratch: loss, gradient norm, step-guard and stop
//                   flags). Where backend memory is host memory (the CPU backend) this is the host
//                   communicator itself, the same object; otherwise what the factory given to
//                   use_backend_memory() made (the staged communicator on the guarded-memory test
//                   backend, NCCL on GPUs).
// A group's traffic is the sum of both roles' CommStats (stats()).
//
// For a GPU backend's communicators (NCCL through the factory): their wait() may only order the
// result before later backend ops on a stream, without blocking the host; the trainer reads
// results of backend-memory collectives only through copy_to_host, which synchronises. A group of
// one rank needs a backend-memory communicator too wherever backend memory is not host memory:
// the host role's size-1 communicator copies with memmove.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trainer/comm/communicator.h"
#include "trainer/comm/rank_grid.h"

namespace tetra {

// Makes the backend-memory communicator of one group: its name, members (global ranks, in group
// order) and host communicator. Called on every rank for every group kind in the same order (a
// collective, as creating an NCCL communicator is). A null result: the host communicator serves.
using BackendCommFactory = std::function<std::unique_ptr<Communicator>(
    const std::string& name, const std::vector<int>& members, Communicator& host)>;

struct ProcessGroups {
  RankGrid grid;
  GridCoord coord;
  int rank = 0;  // global
  std::unique_ptr<Communicator> tp, pp, dp, ep, edp, mp, embedding, world, cp, etp, eshare;  // host memory

  // Collective over MPI_COMM_WORLD: every rank calls it with the same grid, in the same order
  // relative to its other collective calls. The grid's world must be MPI's world size. Without
  // MPI running, a grid of world 1 gives size-1 communicators. Backend memory is host memory
  // until use_backend_memory() says otherwise.
  static ProcessGroups create(const RankGrid& grid, int rank);

  // The host-memory communicator of `kind`.
  Communicator& get(GroupKind kind) const;
  // The communicator for buffers in backend memory.
  Communicator& backend(GroupKind kind) const;
  // Replaces the backend-memory communicators by `factory`'s (an empty factory: the host ones).
  // Collective (see BackendCommFactory). The communicators it makes must go before what they
  // use (a backend): use_backend_memory({}) releases them.
  void use_backend_memory(const BackendCommFactory& factory);

  // What group `kind` moved through both of its communicators (each counted once).
  CommStats stats(GroupKind kind) const;
  // Sets the group's counters to `s` (restoring a snapshot of stats()).
  void set_stats(GroupKind kind, const CommStats& s);

 private:
  std::array<std::unique_ptr<Communicator>, kGroupKinds> backend_;  // null: the host one serves
};

}  // namespace tetra
