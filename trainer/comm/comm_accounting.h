// How one call adds to CommStats, in one place for every Communicator implementation (MPI now,
// NCCL later), so the formulas of communicator.h are written once. A group of size 1 counts
// nothing.
#pragma once

#include <cstdint>

#include "trainer/comm/communicator.h"

namespace tetra {

// ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, SEND or RECV in a group of `group_size`
// ranks, `payload_bytes` as communicator.h defines it for that op.
void account_call(CommStats& stats, CommOp op, int group_size, int64_t payload_bytes);

// ALL_TO_ALL: `payload_bytes` this rank sends in all, `to_others_bytes` of them to other ranks.
void account_all_to_all(CommStats& stats, int group_size, int64_t payload_bytes, int64_t to_others_bytes);

}  // namespace tetra
