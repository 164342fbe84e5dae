// Opt-in timing of set_checkpoint_pool_state's steps (graph_state.cpp), for
// benches/gpu/ckpt_state_bench.py: built with SLOTPOOL_TORCH_PHASES=1 (slotpool_torch's loader
// then defines the macro below), each step's end is stamped and
// the extension's graph_state_phases() returns the last call's steps in microseconds.
// Otherwise every stamp compiles to nothing.
#pragma once

#ifdef SLOTPOOL_TORCH_PHASES
#include <chrono>
#include <utility>
#include <vector>
#endif

namespace slotpool_torch {

#ifdef SLOTPOOL_TORCH_PHASES
// The last call's stamps on this thread: (step, steady clock in microseconds).
inline std::vector<std::pair<const char*, double>>& phase_stamps() {
  thread_local std::vector<std::pair<const char*, double>> v;
  return v;
}
// Stamp the end of `step` (`start`: a new call begins, the stamps so far are dropped).
inline void phase(const char* step, bool start = false) {
  auto& v = phase_stamps();
  if (start) {
    v.clear();
  }
  v.emplace_back(step, std::chrono::duration<double, std::micro>(
                           std::chrono::steady_clock::now().time_since_epoch())
                           .count());
}
#else
inline void phase(const char*, bool = false) {}
#endif

}  // namespace slotpool_torch
