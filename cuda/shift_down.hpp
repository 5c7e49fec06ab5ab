// shift_down.hpp: moving a block to a lower offset of the same buffer with plain copies,
// none of which overlaps itself (cudaMemcpy's contract).
#pragma once

#include <cstddef>
#include <vector>

namespace shardopt::dev {

struct Move {
  std::size_t dst, src, count;  ///< element offsets and length
};

/// Copies that move [from, from + len) to [0, len) when issued in order: chunks of at most
/// `from` elements, front to back, so each chunk's source lies past everything written
/// before it and its destination ends where its source begins. Empty when from == 0.
inline std::vector<Move> shift_down_moves(std::size_t from, std::size_t len) {
  std::vector<Move> moves;
  if (from == 0) return moves;
  for (std::size_t done = 0; done < len; done += from) {
    const std::size_t n = len - done < from ? len - done : from;
    moves.push_back({done, from + done, n});
  }
  return moves;
}

}  // namespace shardopt::dev
