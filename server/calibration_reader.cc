#include "server/calibration_reader.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

#ifdef OSCARKV_HAVE_CALIB
#include "kernels/calib/calibration_file.h"
#include "kernels/calib/rotationzoo.h"
#include "kernels/calib/safetensors.h"
#endif

namespace oscarkv {

CalibrationReader DefaultCalibrationReader() {
#ifdef OSCARKV_HAVE_CALIB
  return [](const std::string& source, bool is_path,
            const ModelLayout* expected) -> absl::StatusOr<ModelRotation> {
    if (!is_path) {
      absl::StatusOr<SafetensorsFile> file = ParseSafetensors(source);
      if (!file.ok()) return file.status();
      return CalibrationFromSafetensors(*file, expected);
    }
    constexpr char kZoo[] = "rotationzoo:";
    if (absl::StartsWith(source, kZoo)) {
      // A directory holding k_rotation_*.pt and v_rotation_*.pt.
      const std::string dir = source.substr(sizeof(kZoo) - 1);
      std::string paths[2];
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
        const std::string name = entry.path().filename().string();
        if (!absl::EndsWith(name, ".pt")) continue;
        if (absl::StartsWith(name, "k_rotation_")) paths[0] = entry.path().string();
        if (absl::StartsWith(name, "v_rotation_")) paths[1] = entry.path().string();
      }
      if (ec || paths[0].empty() || paths[1].empty()) {
        return absl::InvalidArgumentError(
            "rotationzoo:" + dir + " must be a directory holding k_rotation_*.pt and "
            "v_rotation_*.pt");
      }
      if (expected == nullptr) {
        return absl::InvalidArgumentError(
            "RotationZoo import needs the model layout: give it at start with "
            "--model and --calibration");
      }
      return ImportRotationZoo(paths[0], paths[1], *expected);
    }
    return ReadCalibrationFile(source, expected);
  };
#else
  return nullptr;
#endif
}

}  // namespace oscarkv
