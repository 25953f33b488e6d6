// Benchmark helper: summarizes the per-block timelines of decode-attention
// calls (AttendLauncher::set_trace) as the times, from the call's first prep
// block start, at which the first, median and last block of each kernel pass
// each mark, and how long the split blocks' own phases take. Each figure is
// the median over the calls given.
#ifndef OSCARKV_TESTS_GPU_ATTEND_TRACE_SUMMARY_H_
#define OSCARKV_TESTS_GPU_ATTEND_TRACE_SUMMARY_H_

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/attend_kernels.h"

namespace oscarkv {
namespace gputest {

// First, median and last of a set of times (µs); n = how many blocks had it.
struct Spread {
  double first = 0, median = 0, last = 0;
  size_t n = 0;
};

inline Spread SpreadOf(std::vector<double> v) {
  Spread s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.first = v.front();
  s.median = v[v.size() / 2];
  s.last = v.back();
  return s;
}

// The median of v (the upper one of an even count; 0 when empty).
inline double Median(std::vector<double> v) { return SpreadOf(std::move(v)).median; }

// The call's first block start (ns; ~0 when no block has a timeline).
inline unsigned long long TraceStartNs(const AttendTrace& t) {
  using namespace cuda_attend;
  unsigned long long t0 = ~0ull;
  for (int k = 0; k < kTraceKernels; ++k) {
    for (size_t b = 0; b < t.blocks(k); ++b) {
      const unsigned long long s = t.rows[k][b * kTraceMarks + kTraceStart];
      if (s != 0) t0 = std::min(t0, s);
    }
  }
  return t0;
}

// A row's multiprocessor, and the unit its block ran (`block` unless the
// block claimed one: the high word of kTraceSm, unit + 1).
inline unsigned long long TraceSmOf(const unsigned long long* row) {
  return row[cuda_attend::kTraceSm] & 0xffffffffull;
}
inline unsigned long long TraceUnitOf(const unsigned long long* row, size_t block) {
  const unsigned long long claimed = row[cuda_attend::kTraceSm] >> 32;
  return claimed > 0 ? claimed - 1 : static_cast<unsigned long long>(block);
}

// One call's figures, by name ("split.waited" etc.), each a Spread.
inline std::map<std::string, Spread> TraceFigures(const AttendTrace& t) {
  using namespace cuda_attend;
  std::map<std::string, Spread> out;
  const unsigned long long t0 = TraceStartNs(t);
  if (t0 == ~0ull) return out;
  const char* kernel_names[kTraceKernels] = {"prep", "split", "merge"};
  // What each mark means in each kernel (attend_plan.h); "" = unused.
  const char* mark_names[kTraceKernels][kTraceMarks] = {
      {"start", "", "rk_product", "stats", "", "", "", "end"},
      {"start", "", "waited", "loop_done", "written", "exact_step1", "exact_done", "end"},
      {"start", "", "waited", "combined", "warp0_added", "", "", "end"},
  };
  for (int k = 0; k < kTraceKernels; ++k) {
    std::vector<double> at[kTraceMarks];
    std::vector<double> history_run, exact_run, block_run;
    // Split kernel, by multiprocessor: how many blocks ran on each, each
    // SM's last block end, each history part's (SM, loop time), and the
    // ends of history units with and without folded exact blocks
    // (exact-only units pass no kTraceWaited and are left out).
    std::map<unsigned long long, int> on_sm;
    std::map<unsigned long long, double> sm_end;
    std::vector<std::pair<unsigned long long, double>> history_on_sm;
    std::vector<double> end_exact, end_pages_only;
    for (size_t b = 0; b < t.blocks(k); ++b) {
      const unsigned long long* row = t.rows[k].data() + b * kTraceMarks;
      // Differences in integers first: a double cannot hold the raw ns.
      auto us = [&](int m) { return double(static_cast<long long>(row[m] - t0)) / 1e3; };
      const unsigned long long sm = TraceSmOf(row);
      for (int m = 0; m < kTraceMarks; ++m) {
        if (*mark_names[k][m] != '\0' && row[m] != 0) at[m].push_back(us(m));
      }
      if (row[kTraceStart] != 0 && row[kTraceEnd] != 0) {
        block_run.push_back(us(kTraceEnd) - us(kTraceStart));
      }
      if (k != kTraceSplit) continue;
      if (row[kTraceWaited] != 0 && row[kTraceLoopDone] != 0) {
        history_run.push_back(us(kTraceLoopDone) - us(kTraceWaited));
        if (row[kTraceStart] != 0) history_on_sm.emplace_back(sm, history_run.back());
      }
      if (row[kTraceExactFirstStep] != 0 && row[kTraceExactDone] != 0) {
        exact_run.push_back(us(kTraceExactDone) - us(kTraceExactFirstStep));
      }
      if (row[kTraceStart] == 0) continue;
      ++on_sm[sm];
      if (row[kTraceEnd] == 0) continue;
      auto [it, fresh] = sm_end.emplace(sm, us(kTraceEnd));
      if (!fresh) it->second = std::max(it->second, us(kTraceEnd));
      if (row[kTraceWaited] != 0) {
        (row[kTraceExactDone] != 0 ? end_exact : end_pages_only).push_back(us(kTraceEnd));
      }
    }
    for (int m = 0; m < kTraceMarks; ++m) {
      if (!at[m].empty()) {
        out[std::string(kernel_names[k]) + "." + mark_names[k][m]] = SpreadOf(at[m]);
      }
    }
    out[std::string(kernel_names[k]) + ".block_us"] = SpreadOf(block_run);
    if (k == kTraceSplit) {
      out["split.history_loop_us"] = SpreadOf(history_run);
      out["split.exact_rest_us"] = SpreadOf(exact_run);
      std::map<int, std::vector<double>> loop_by_count;
      for (const auto& [sm, loop] : history_on_sm) loop_by_count[on_sm[sm]].push_back(loop);
      for (auto& [count, v] : loop_by_count) {
        out["split.history_loop_us@" + std::to_string(count)] = SpreadOf(std::move(v));
      }
      std::vector<double> ends;
      for (const auto& [sm, end] : sm_end) ends.push_back(end);
      out["split.sm_end"] = SpreadOf(std::move(ends));
      out["split.end@with_exact"] = SpreadOf(std::move(end_exact));
      out["split.end@pages_only"] = SpreadOf(std::move(end_pages_only));
    }
  }
  return out;
}

// Prints the median over `calls` of every figure, one line per figure, as
// "first / median / last (blocks)", in µs from the first prep block's start.
inline void PrintTraceSummary(const std::vector<AttendTrace>& calls, const char* indent) {
  std::map<std::string, std::vector<Spread>> all;
  for (const AttendTrace& t : calls) {
    for (const auto& [name, s] : TraceFigures(t)) all[name].push_back(s);
  }
  // Kernel order, then the marks in the order a block with only a history
  // part, or only an exact part, passes them (a unit with both passes its
  // exact marks first under the exact-first kernel, last otherwise).
  const char* order[] = {
      "prep.start",          "prep.rk_product",     "prep.stats",          "prep.end",
      "prep.block_us",       "split.start",         "split.waited",        "split.loop_done",
      "split.written",       "split.exact_step1",   "split.exact_done",    "split.end",
      "split.block_us",      "split.history_loop_us", "split.exact_rest_us",   "merge.start",
      "merge.waited",        "merge.warp0_added",   "merge.combined",      "merge.end",
      "merge.block_us"};
  std::vector<std::string> names(std::begin(order), std::end(order));
  // After the split's figures: its loops by blocks per SM, its SMs' ends.
  const auto split_end = std::find(names.begin(), names.end(), "split.exact_rest_us") + 1;
  std::vector<std::string> per_sm;
  for (const auto& [name, v] : all) {
    if (name.rfind("split.history_loop_us@", 0) == 0) per_sm.push_back(name);
  }
  per_sm.push_back("split.sm_end");
  per_sm.push_back("split.end@with_exact");
  per_sm.push_back("split.end@pages_only");
  names.insert(split_end, per_sm.begin(), per_sm.end());
  for (const std::string& name : names) {
    const auto it = all.find(name);
    if (it == all.end() || it->second.empty() || it->second[0].n == 0) continue;
    std::vector<double> f, m, l;
    for (const Spread& s : it->second) {
      f.push_back(s.first);
      m.push_back(s.median);
      l.push_back(s.last);
    }
    std::printf("%s%-25s %7.2f / %7.2f / %7.2f us  (%zu %s)\n", indent, name.c_str(), Median(f),
                Median(m), Median(l), it->second[0].n, name == "split.sm_end" ? "SMs" : "blocks");
  }
}

}  // namespace gputest
}  // namespace oscarkv

#endif  // OSCARKV_TESTS_GPU_ATTEND_TRACE_SUMMARY_H_
