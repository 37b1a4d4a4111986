// ProcessGroups::create: one make_mpi_communicator call per group kind, in a fixed order; the
// backend-memory role of each group (process_groups.h).
#include "trainer/comm/process_groups.h"

#include <mpi.h>

#include "kernels/common/check.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/mpi_communicator.h"
#include "trainer/comm/mpi_world.h"

namespace tetra {

ProcessGroups ProcessGroups::create(const RankGrid& grid, int rank) {
  int world = 1, mpi_rank = 0;
  if (dist_initialized()) {
    MPI_Comm_size(dist_world(), &world);
    MPI_Comm_rank(dist_world(), &mpi_rank);
  }
  TETRA_CHECK(grid.world() == world, "the rank grid has {} ranks but MPI runs {} processes", grid.world(), world);
  TETRA_CHECK(rank == mpi_rank, "ProcessGroups::create for rank {} on MPI rank {}", rank, mpi_rank);
  ProcessGroups g;
  g.grid = grid;
  g.coord = grid.coord(rank);
  g.rank = rank;
  const auto make = [&](GroupKind kind) {
    return make_mpi_communicator(group_kind_name(kind), grid.group(kind, rank));
  };
  g.tp = make(GroupKind::TP);
  g.pp = make(GroupKind::PP);
  g.dp = make(GroupKind::DP);
  g.ep = make(GroupKind::EP);
  g.edp = make(GroupKind::EDP);
  g.mp = make(GroupKind::MP);
  g.embedding = make(GroupKind::EMBEDDING);
  g.world = make(GroupKind::WORLD);
  g.cp = make(GroupKind::CP);
  g.etp = make(GroupKind::ETP);
  g.eshare = make(GroupKind::ESHARE);
  return g;
}

Communicator& ProcessGroups::get(GroupKind kind) const {
  switch (kind) {
    case GroupKind::TP: return *tp;
    case GroupKind::PP: return *pp;
    case GroupKind::DP: return *dp;
    case GroupKind::EP: return *ep;
    case GroupKind::EDP: return *edp;
    case GroupKind::MP: return *mp;
    case GroupKind::EMBEDDING: return *embedding;
    case GroupKind::WORLD: return *world;
    case GroupKind::CP: return *cp;
    case GroupKind::ETP: return *etp;
    case GroupKind::ESHARE: return *eshare;
  }
  throw Error("ProcessGroups::get: unknown group kind");
}

Communicator& ProcessGroups::backend(GroupKind kind) const {
  const auto& b = backend_[static_cast<size_t>(kind)];
  return b ? *b : get(kind);
}

void ProcessGroups::use_backend_memory(const BackendCommFactory& factory) {
  for (auto& b : backend_) b.reset();
  if (!factory) return;
  for (int k = 0; k < kGroupKinds; ++k) {
    Communicator& host = get(static_cast<GroupKind>(k));
    backend_[static_cast<size_t>(k)] = factory(host.name(), host.members(), host);
  }
}

CommStats ProcessGroups::stats(GroupKind kind) const {
  CommStats s = get(kind).stats();
  if (const auto& b = backend_[static_cast<size_t>(kind)]) s.add(b->stats());
  return s;
}

void ProcessGroups::set_stats(GroupKind kind, const CommStats& s) {
  get(kind).stats() = s;
  if (const auto& b = backend_[static_cast<size_t>(kind)]) b->stats().reset();
}

}  // namespace tetra
