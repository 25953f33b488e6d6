// oscarkv import-rotationzoo: published RotationZoo .pt files -> calibration file.
#include <cstdio>
#include <string>

#include "client/tool/command.h"
#include "client/tool/flags.h"
#include "kernels/calib/calibration_file.h"
#include "kernels/calib/rotationzoo.h"
#include "kernels/hadamard.h"

namespace oscarkv::tool {
namespace {

constexpr char kUsage[] =
    "usage: oscarkv import-rotationzoo K.pt V.pt --layout L,Hq,Hkv,D --out CALIB.safetensors\n"
    "         [--clip-k 0.96] [--clip-v 0.92]\n"
    "Reads the OSCAR authors' torch.save files without PyTorch, checks them against\n"
    "the layout (layer count, head_dim, orthogonality) and writes our calibration file.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "oscarkv import-rotationzoo: %s\n", std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int RunImportRotationZoo(int argc, char** argv) {
  Flags flags({"layout", "out", "clip-k", "clip-v"}, {"help"});
  absl::Status st = flags.Parse(argc, argv);
  if (!st.ok() || flags.Switch("help") || flags.positional().size() != 2 || !flags.Has("out") ||
      !flags.Has("layout")) {
    if (!st.ok()) std::fprintf(stderr, "oscarkv import-rotationzoo: %s\n", std::string(st.message()).c_str());
    std::fprintf(flags.Switch("help") ? stdout : stderr, "%s", kUsage);
    return flags.Switch("help") && st.ok() ? 0 : 2;
  }
  auto layout = ParseLayout(flags.String("layout", ""));
  if (!layout.ok()) return Fail(layout.status());
  auto clip_k = flags.Double("clip-k", 0.96), clip_v = flags.Double("clip-v", 0.92);
  if (!clip_k.ok()) return Fail(clip_k.status());
  if (!clip_v.ok()) return Fail(clip_v.status());
  auto rot = ImportRotationZoo(flags.positional()[0], flags.positional()[1], *layout,
                               float(*clip_k), float(*clip_v));
  if (!rot.ok()) return Fail(rot.status());
  double worst = 0;
  for (const auto& l : rot->layers) {
    worst = std::max({worst, OrthogonalityError(l.r_k.data(), layout->head_dim),
                      OrthogonalityError(l.r_v.data(), layout->head_dim)});
  }
  st = WriteCalibrationFile(flags.String("out", ""), *rot);
  if (!st.ok()) return Fail(st);
  std::printf("imported %d layers (%s), objective %s, max |R^T R - I| = %.2e, id %s\nwrote %s\n",
              layout->num_layers, layout->DebugString().c_str(), rot->objective.c_str(), worst,
              RotationId(*rot).c_str(), flags.String("out", "").c_str());
  return 0;
}

}  // namespace oscarkv::tool
