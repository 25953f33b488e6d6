// oscarkv calibrate: activation dump -> calibration file (or --hadamard).
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/tool/command.h"
#include "client/tool/flags.h"
#include "kernels/calib/activation_dump.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/calibration_file.h"
#include "kernels/rotation.h"

namespace oscarkv::tool {
namespace {

constexpr char kUsage[] =
    "usage: oscarkv calibrate --dump ACTIVATIONS.safetensors --out CALIB.safetensors\n"
    "         [--layout L,Hq,Hkv,D]   (checked against the dump when given)\n"
    "         [--per-head] [--value-target proxy|exact] [--targets attention|self]\n"
    "         [--fit-clip] [--clip-k 0.96] [--clip-v 0.92] [--group-size G]\n"
    "       oscarkv calibrate --hadamard --layout L,Hq,Hkv,D --out CALIB.safetensors\n"
    "Keys: eigenvectors of the GQA group's query covariance; values: the causal\n"
    "softmax attention-weighted value covariance (exact, O(n^2)) or its logit\n"
    "second-moment proxy; R = U·H·P_br. --targets self is the KᵀK/VᵀV ablation.\n"
    "--hadamard writes the data-free R = H for any layout.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "oscarkv calibrate: %s\n", std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int RunCalibrate(int argc, char** argv) {
  Flags flags({"dump", "out", "value-target", "targets", "clip-k", "clip-v", "group-size",
               "layout"},
              {"per-head", "fit-clip", "hadamard", "help"});
  absl::Status st = flags.Parse(argc, argv);
  if (!st.ok() || flags.Switch("help") || !flags.Has("out") ||
      (!flags.Has("dump") && !flags.Switch("hadamard"))) {
    if (!st.ok()) std::fprintf(stderr, "oscarkv calibrate: %s\n", std::string(st.message()).c_str());
    std::fprintf(flags.Switch("help") ? stdout : stderr, "%s", kUsage);
    return flags.Switch("help") && st.ok() ? 0 : 2;
  }
  const std::string out = flags.String("out", "");
  auto clip_k = flags.Double("clip-k", 0.96);
  auto clip_v = flags.Double("clip-v", 0.92);
  auto group = flags.Int("group-size", 0);
  if (!clip_k.ok()) return Fail(clip_k.status());
  if (!clip_v.ok()) return Fail(clip_v.status());
  if (!group.ok()) return Fail(group.status());
  if (flags.Switch("hadamard")) {
    auto layout = ParseLayout(flags.String("layout", ""));
    if (!layout.ok()) return Fail(layout.status());
    auto rot = HadamardRotation(*layout, float(*clip_k), float(*clip_v));
    if (!rot.ok()) return Fail(rot.status());
    st = WriteCalibrationFile(out, *rot);
    if (!st.ok()) return Fail(st);
    std::fprintf(stderr, "wrote %s: data-free Hadamard rotation for %s (id %s)\n", out.c_str(),
                 layout->DebugString().c_str(), RotationId(*rot).c_str());
    return 0;
  }
  CalibrationOptions opt;
  opt.per_head = flags.Switch("per-head");
  opt.fit_clip = flags.Switch("fit-clip");
  opt.clip_k = float(*clip_k);
  opt.clip_v = float(*clip_v);
  opt.group_size = *group;
  const std::string vt = flags.String("value-target", "proxy");
  if (vt != "proxy" && vt != "exact") {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--value-target \"", vt, "\": want proxy or exact")));
  }
  opt.value_target = vt == "exact" ? ValueTarget::kExactSoftmax : ValueTarget::kLogitProxy;
  const std::string targets = flags.String("targets", "attention");
  if (targets != "attention" && targets != "self") {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--targets \"", targets, "\": want attention or self")));
  }
  opt.targets = targets == "self" ? TargetKind::kSelfCovariance : TargetKind::kAttention;

  auto dump = ReadActivationDump(flags.String("dump", ""));
  if (!dump.ok()) return Fail(dump.status());
  std::fprintf(stderr, "dump %s: layout %s\n", flags.String("dump", "").c_str(),
               dump->layout.DebugString().c_str());
  if (flags.Has("layout")) {
    auto want = ParseLayout(flags.String("layout", ""));
    if (!want.ok()) return Fail(want.status());
    if (!(*want == dump->layout)) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("the dump has layout ", dump->layout.DebugString(), ", --layout says ",
                       want->DebugString())));
    }
  }
  ModelRotation rot;
  rot.layout = dump->layout;
  rot.objective = opt.targets == TargetKind::kSelfCovariance
                      ? "oscar-ablation:kkt/vvt"
                      : absl::StrCat("oscar:qqt/", vt == "exact" ? "sst" : "logit-proxy");
  rot.per_head = opt.per_head;
  std::vector<LayerCalibrationReport> reports;
  for (int i = 0; i < dump->layout.num_layers; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    LayerCalibrationReport rep;
    auto layer = CalibrateLayer(dump->layers[i], opt, &rep);
    if (!layer.ok()) {
      return Fail(absl::Status(layer.status().code(),
                               absl::StrCat("layer ", i, ": ", layer.status().message())));
    }
    rot.layers.push_back(std::move(*layer));
    reports.push_back(rep);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "layer %d/%d: %d tokens, top eig share K %.3f V %.3f, clip K %.2f V %.2f (%.2f s)\n",
                 i + 1, dump->layout.num_layers, dump->layers[i].tokens, rep.top_eig_share_k,
                 rep.top_eig_share_v, rep.clip_k, rep.clip_v, sec);
  }
  st = WriteCalibrationFile(out, rot);
  if (!st.ok()) return Fail(st);
  std::printf("calibration summary: %s, objective %s, grouping %s, id %s\n",
              rot.layout.DebugString().c_str(), rot.objective.c_str(),
              rot.per_head ? "head" : "layer", RotationId(rot).c_str());
  std::printf("%-6s %-14s %-14s %-7s %-7s\n", "layer", "top_eig_K", "top_eig_V", "clip_K", "clip_V");
  for (size_t i = 0; i < reports.size(); ++i) {
    std::printf("%-6zu %-14.4f %-14.4f %-7.2f %-7.2f\n", i, reports[i].top_eig_share_k,
                reports[i].top_eig_share_v, reports[i].clip_k, reports[i].clip_v);
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

}  // namespace oscarkv::tool
