// A minimum s-t cut for the remat pass: the min-cut partitioner's flow networks (a node per FX value,
// tens of thousands of edges), where networkx's Python max-flow was most of the pass's time
// (docs/benchmarks.md, session 23). Plain C++; no torch or Python headers here.
#pragma once

#include <cstdint>
#include <vector>

namespace memprof {

struct MinCut {
  double value = 0.0;
  // Per node: whether it can reach the sink in the residual network of a maximum flow. This side is
  // the same for every maximum flow, and it is the sink side networkx's minimum_cut returns.
  std::vector<uint8_t> sink_side;
};

// The edges are src[i] -> dst[i] with capacity cap[i] (>= 0; infinity allowed), nodes 0..n-1.
// Throws std::invalid_argument on a bad node index, a negative or NaN capacity, or a path of
// infinite capacity from s to t (no finite cut).
MinCut min_cut(int64_t n, const int64_t* src, const int64_t* dst, const double* cap, int64_t m, int64_t s,
               int64_t t);

}  // namespace memprof
