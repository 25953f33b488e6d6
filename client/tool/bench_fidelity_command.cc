// oscarkv bench-fidelity: attention fidelity of no rotation / Hadamard / OSCAR.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/tool/command.h"
#include "client/tool/flags.h"
#include "kernels/calib/calibration_file.h"
#include "kernels/calib/fidelity_bench.h"
#include "kernels/calib/rotationzoo.h"
#include "kernels/calib/safetensors.h"

namespace oscarkv::tool {
namespace {

constexpr char kUsage[] =
    "usage: oscarkv bench-fidelity [--layers 2] [--q-heads 32] [--kv-heads 8] [--head-dim 128]\n"
    "         [--calib-tokens 2048] [--tokens 4096] [--queries 16] [--trials 8] [--seed 1]\n"
    "         [--group-size 0] [--sink 64] [--recent 256] [--value-target proxy|exact]\n"
    "         [--calibration FILE] [--real-queries K.pt [--real-layer 0]] [--no-ablation]\n"
    "         [--per-head]   (calibrate one rotation per KV head instead of per layer)\n"
    "         [--spec knob=value,...]   (SyntheticSpec fields, e.g. key_private_std=6)\n"
    "Calibrates on one synthetic draw per layer and measures, on --trials held-out draws,\n"
    "attention-output relative error vs BF16, logit RMS error, KL of attention weights,\n"
    "needle top-1 retention and effective bits, with and without sink/recent protection.\n"
    "--calibration adds a method using that file's rotations; --real-queries draws\n"
    "queries from the query covariance recovered from a RotationZoo key file.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "oscarkv bench-fidelity: %s\n", std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int RunBenchFidelity(int argc, char** argv) {
  Flags flags({"layers", "q-heads", "kv-heads", "head-dim", "calib-tokens", "tokens", "queries",
               "trials", "seed", "group-size", "sink", "recent", "value-target", "calibration",
               "real-queries", "real-layer", "spec"},
              {"no-ablation", "per-head", "help"});
  absl::Status st = flags.Parse(argc, argv);
  if (!st.ok() || flags.Switch("help")) {
    if (!st.ok()) std::fprintf(stderr, "oscarkv bench-fidelity: %s\n", std::string(st.message()).c_str());
    std::fprintf(st.ok() ? stdout : stderr, "%s", kUsage);
    return st.ok() ? 0 : 2;
  }
  FidelityBenchOptions o;
  int seed = 1, real_layer = 0;
  struct IntFlag {
    const char* name;
    int def;
    int* out;
  } ints[] = {{"layers", 2, &o.layers},
              {"q-heads", 32, &o.spec.num_q_heads},
              {"kv-heads", 8, &o.spec.num_kv_heads},
              {"head-dim", 128, &o.spec.head_dim},
              {"calib-tokens", 2048, &o.calib_tokens},
              {"tokens", 4096, &o.test_tokens},
              {"queries", 16, &o.test_queries},
              {"trials", 8, &o.trials},
              {"seed", 1, &seed},
              {"group-size", 0, &o.fidelity.group_size},
              {"sink", 64, &o.fidelity.sink_tokens},
              {"recent", 256, &o.fidelity.recent_window},
              {"real-layer", 0, &real_layer}};
  for (const IntFlag& f : ints) {
    auto v = flags.Int(f.name, f.def);
    if (!v.ok()) return Fail(v.status());
    *f.out = *v;
  }
  o.spec.seed = uint64_t(seed);
  st = SetSyntheticKnobs(&o.spec, flags.String("spec", ""));
  if (!st.ok()) return Fail(st);
  o.calibration.group_size = o.fidelity.group_size;
  const std::string vt = flags.String("value-target", "proxy");
  if (vt != "proxy" && vt != "exact") {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--value-target \"", vt, "\": want proxy or exact")));
  }
  o.calibration.value_target = vt == "exact" ? ValueTarget::kExactSoftmax : ValueTarget::kLogitProxy;
  o.include_ablation = !flags.Switch("no-ablation");
  o.calibration.per_head = flags.Switch("per-head");
  if (flags.Has("real-queries")) {
    auto bytes = ReadFileBytes(flags.String("real-queries", ""));
    if (!bytes.ok()) return Fail(bytes.status());
    auto zoo = ParseRotationZoo(*bytes);
    if (!zoo.ok()) return Fail(zoo.status());
    if (real_layer < 0 || real_layer >= int(zoo->rotation.size()) || zoo->dim != o.spec.head_dim ||
        zoo->eigenvalues[real_layer].empty()) {
      return Fail(absl::InvalidArgumentError("--real-queries: layer out of range, no eigenvalues, or head_dim mismatch"));
    }
    auto basis = QueryBasisFromRotation(zoo->rotation[real_layer], zoo->eigenvalues[real_layer], zoo->dim);
    if (!basis.ok()) return Fail(basis.status());
    o.spec.query_basis = std::move(*basis);
    o.spec.query_eigenvalues.assign(zoo->eigenvalues[real_layer].begin(), zoo->eigenvalues[real_layer].end());
  }
  ModelRotation extra;
  if (flags.Has("calibration")) {
    auto rot = ReadCalibrationFile(flags.String("calibration", ""));
    if (!rot.ok()) return Fail(rot.status());
    extra = std::move(*rot);
    o.extra = &extra;
    o.extra_name = "file:" + extra.objective;
  }
  o.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  auto rows = RunFidelityBench(o);
  if (!rows.ok()) return Fail(rows.status());
  std::printf("bench-fidelity: %d layers x %d held-out draws of %d tokens (%d queries), calibrated on %d other tokens;\n"
              "layout Hq=%d Hkv=%d D=%d, G=%d, sink %d, recent %d, value target %s, %s rotations, seed %d%s\n\n",
              o.layers, o.trials, o.test_tokens, o.test_queries, o.calib_tokens, o.spec.num_q_heads,
              o.spec.num_kv_heads, o.spec.head_dim,
              o.fidelity.group_size ? o.fidelity.group_size : o.spec.head_dim,
              o.fidelity.sink_tokens, o.fidelity.recent_window, vt.c_str(),
              o.calibration.per_head ? "per-head" : "per-layer", seed,
              flags.Has("real-queries") ? ", real query covariance" : "");
  std::printf("%s", FormatFidelityTable(*rows).c_str());
  return 0;
}

}  // namespace oscarkv::tool
