// Dinic's maximum flow, then the nodes that can still reach the sink.
//
// Capacities are doubles as the partitioner makes them (sizes times factors, infinity for bans). An
// augmentation lowers each arc of its path by the path's smallest residual, so that arc's residual
// becomes exactly zero (x - x == 0 in IEEE arithmetic): every augmentation saturates an arc, as with
// integers, and the level argument that bounds the phases holds.
#include "maxflow.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>

namespace memprof {
namespace {

class Network {
 public:
  Network(int64_t n, const int64_t* src, const int64_t* dst, const double* cap, int64_t m)
      : n_(n), first_(static_cast<size_t>(n) + 1, 0), to_(2 * static_cast<size_t>(m)),
        rev_(2 * static_cast<size_t>(m)), res_(2 * static_cast<size_t>(m)) {
    for (int64_t i = 0; i < m; ++i) {
      if (src[i] < 0 || src[i] >= n || dst[i] < 0 || dst[i] >= n) {
        throw std::invalid_argument("edge " + std::to_string(i) + " names a node outside 0.." + std::to_string(n - 1));
      }
      if (!(cap[i] >= 0.0)) throw std::invalid_argument("edge " + std::to_string(i) + " has a negative or NaN capacity");
      ++first_[static_cast<size_t>(src[i]) + 1];
      ++first_[static_cast<size_t>(dst[i]) + 1];
    }
    for (size_t u = 0; u < static_cast<size_t>(n); ++u) first_[u + 1] += first_[u];
    std::vector<size_t> next(first_.begin(), first_.end() - 1);
    for (int64_t i = 0; i < m; ++i) {  // each edge: its arc (residual = capacity) and its reverse (0)
      const size_t a = next[static_cast<size_t>(src[i])]++;
      const size_t b = next[static_cast<size_t>(dst[i])]++;
      to_[a] = dst[i];
      res_[a] = cap[i];
      rev_[a] = b;
      to_[b] = src[i];
      res_[b] = 0.0;
      rev_[b] = a;
    }
  }

  double max_flow(int64_t s, int64_t t) {
    double flow = 0.0;
    std::vector<size_t> current(first_.size());
    std::vector<size_t> path;  // arcs from s
    while (levels(s, t)) {
      std::copy(first_.begin(), first_.end(), current.begin());
      int64_t u = s;
      for (;;) {
        if (u == t) {
          flow += augment(path);
          size_t k = 0;  // back to the tail of the first arc it saturated
          while (res_[path[k]] > 0.0) ++k;
          path.resize(k);
          u = k == 0 ? s : to_[path[k - 1]];
          continue;
        }
        const auto uu = static_cast<size_t>(u);
        size_t& a = current[uu];
        while (a < first_[uu + 1] && !(res_[a] > 0.0 && level_[static_cast<size_t>(to_[a])] == level_[uu] + 1)) ++a;
        if (a < first_[uu + 1]) {
          path.push_back(a);
          u = to_[a];
          continue;
        }
        level_[uu] = -1;  // a dead end for the rest of this phase
        if (path.empty()) break;
        path.pop_back();
        u = path.empty() ? s : to_[path.back()];
      }
    }
    return flow;
  }

  std::vector<uint8_t> reaching(int64_t t) const {
    std::vector<uint8_t> seen(static_cast<size_t>(n_), 0);
    std::vector<int64_t> queue{t};
    seen[static_cast<size_t>(t)] = 1;
    for (size_t q = 0; q < queue.size(); ++q) {
      const auto v = static_cast<size_t>(queue[q]);
      for (size_t a = first_[v]; a < first_[v + 1]; ++a) {  // u -> v is the reverse of v's arc to u
        const int64_t u = to_[a];
        if (!seen[static_cast<size_t>(u)] && res_[rev_[a]] > 0.0) {
          seen[static_cast<size_t>(u)] = 1;
          queue.push_back(u);
        }
      }
    }
    return seen;
  }

 private:
  bool levels(int64_t s, int64_t t) {
    level_.assign(static_cast<size_t>(n_), -1);
    std::vector<int64_t> queue{s};
    level_[static_cast<size_t>(s)] = 0;
    for (size_t q = 0; q < queue.size(); ++q) {
      const auto u = static_cast<size_t>(queue[q]);
      for (size_t a = first_[u]; a < first_[u + 1]; ++a) {
        const auto v = static_cast<size_t>(to_[a]);
        if (res_[a] > 0.0 && level_[v] < 0) {
          level_[v] = level_[u] + 1;
          queue.push_back(to_[a]);
        }
      }
    }
    return level_[static_cast<size_t>(t)] >= 0;
  }

  double augment(const std::vector<size_t>& path) {
    double push = std::numeric_limits<double>::infinity();
    for (const size_t a : path) push = std::min(push, res_[a]);
    if (std::isinf(push)) throw std::invalid_argument("a path of infinite capacity joins the source to the sink");
    for (const size_t a : path) {
      res_[a] -= push;
      res_[rev_[a]] += push;
    }
    return push;
  }

  int64_t n_;
  std::vector<size_t> first_;  // node u's arcs are [first_[u], first_[u + 1])
  std::vector<int64_t> to_;
  std::vector<size_t> rev_;
  std::vector<double> res_;
  std::vector<int64_t> level_;
};

}  // namespace

MinCut min_cut(int64_t n, const int64_t* src, const int64_t* dst, const double* cap, int64_t m, int64_t s,
               int64_t t) {
  if (n <= 0 || s < 0 || s >= n || t < 0 || t >= n || s == t) {
    throw std::invalid_argument("the source and the sink must be two of the network's nodes");
  }
  Network net(n, src, dst, cap, m);
  MinCut out;
  out.value = net.max_flow(s, t);
  out.sink_side = net.reaching(t);
  return out;
}

}  // namespace memprof
