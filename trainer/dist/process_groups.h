// One communicator per group kind of the rank grid, for this rank. Created once at start-up and
// passed explicitly to whatever communicates (no global group state).
#pragma once

#include <memory>

#include "trainer/dist/communicator.h"
#include "trainer/dist/rank_grid.h"

namespace tetra {

struct ProcessGroups {
  RankGrid grid;
  GridCoord coord;
  int rank = 0;  // global
  std::unique_ptr<Communicator> tp, pp, dp, ep, edp, mp, embedding, world;

  // Collective over MPI_COMM_WORLD: every rank calls it with the same grid, in the same order
  // relative to its other collective calls. The grid's world must be MPI's world size. Without
  // MPI running, a grid of world 1 gives size-1 communicators.
  static ProcessGroups create(const RankGrid& grid, int rank);

  Communicator& get(GroupKind kind) const;
};

}  // namespace tetra
