#include "server/service/calibration_path.h"

#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace oscarkv {
namespace {

// realpath(3) as a string; errno set on failure.
bool RealPath(const std::string& path, std::string* out) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return false;
  *out = buf;
  return true;
}

// True when `path` (absolute, normalized) is `dir` itself or below it.
bool IsInside(const std::string& path, const std::string& dir) {
  if (dir == "/") return absl::StartsWith(path, "/");
  return path == dir || absl::StartsWith(path, dir + "/");
}

}  // namespace

absl::StatusOr<std::string> RealCalibrationDir(const std::string& dir) {
  std::string real;
  if (!RealPath(dir, &real)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_dir '", dir, "': ", std::strerror(errno)));
  }
  struct stat st;
  if (::stat(real.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_dir '", dir, "' is not a directory"));
  }
  return real;
}

absl::StatusOr<std::string> ResolveCalibrationPath(const std::string& real_dir,
                                                   const std::string& path) {
  if (real_dir.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "LoadCalibration by path ('", path,
        "') is disabled on this server: start it with --calibration_dir=DIR to allow files "
        "inside DIR, or send the file's bytes as content"));
  }
  if (path.empty()) return absl::InvalidArgumentError("calibration path is empty");
  const std::filesystem::path joined =
      path.front() == '/' ? std::filesystem::path(path) : std::filesystem::path(real_dir) / path;
  std::string real;
  if (!RealPath(joined.string(), &real)) {
    const int err = errno;
    // Say NOT_FOUND only for names inside the directory, so a client cannot
    // probe for files elsewhere.
    if (!IsInside(joined.lexically_normal().string(), real_dir)) {
      return absl::PermissionDeniedError(
          absl::StrCat("calibration path '", path, "' is outside --calibration_dir ", real_dir));
    }
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(
          absl::StrCat("calibration file '", path, "' not found in --calibration_dir ", real_dir));
    }
    if (err == EACCES) {
      return absl::PermissionDeniedError(
          absl::StrCat("calibration file '", path, "': ", std::strerror(err)));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("calibration file '", path, "': ", std::strerror(err)));
  }
  if (!IsInside(real, real_dir)) {
    return absl::PermissionDeniedError(
        absl::StrCat("calibration path '", path, "' resolves outside --calibration_dir ", real_dir,
                     " (through `..` or a symlink); only files inside it can be loaded"));
  }
  struct stat st;
  if (::stat(real.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration path '", path, "' is not a regular file"));
  }
  return real;
}

}  // namespace oscarkv
