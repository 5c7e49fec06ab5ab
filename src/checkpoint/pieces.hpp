// pieces.hpp: the one place where the checkpoint code learns, from the optimizer's layout,
// which parts of which parameters a rank's state arrays hold. Everything else in the
// checkpoint code works from the returned pieces' param, in_param and local fields only.
#pragma once

#include <cstddef>
#include <vector>

#include "shardopt/optimizer.hpp"

namespace shardopt::ckpt {

enum class PieceSet {
  Held,     ///< every piece this rank's state arrays hold (what a load must fill)
  Written,  ///< the pieces this rank saves: its 1/N share, so that every element is saved
            ///< by exactly one rank (data-parallel ranks hold everything but save a share)
};

/// Pieces of parameters in this rank's state; `local` is the offset into the state arrays
/// as copy_state_to_host / copy_state_from_host address them. Local.
std::vector<ShardPiece> owned_pieces(const ShardedOptimizer& opt, PieceSet which);

/// Length of this rank's state arrays (pieces and padding). Local.
std::size_t owned_state_elems(const ShardedOptimizer& opt);

}  // namespace shardopt::ckpt
