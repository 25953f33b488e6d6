// Where LoadCalibration(path) may read from. A client names a file on the
// server's filesystem, so path loading is off unless the operator names a
// directory (--calibration_dir); then only regular files that resolve inside
// it, after following every symlink and `..`, are read. The --calibration
// startup flag is the operator's own and is not limited.
//
// Thread-safety: stateless functions (they read the filesystem).
#ifndef OSCARKV_SERVER_SERVICE_CALIBRATION_PATH_H_
#define OSCARKV_SERVER_SERVICE_CALIBRATION_PATH_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace oscarkv {

// The real (absolute, symlink-free) path of the existing directory `dir`.
// INVALID_ARGUMENT naming `dir` when it is missing or not a directory.
absl::StatusOr<std::string> RealCalibrationDir(const std::string& dir);

// The bytes of the client's `path`: absolute, or relative to `real_dir`
// (from RealCalibrationDir). The path is resolved (every `..` and symlink) and
// must lead inside `real_dir`; the file is then read through one descriptor
// whose target is checked again after it is opened (the kernel's own name for
// the open file, /proc/self/fd), so a path component swapped for a symlink
// between the check and the open cannot redirect the read. Errors, each
// naming `path`:
//   PERMISSION_DENIED  `real_dir` empty (path loading disabled: the message
//                      says to start with --calibration_dir or send content),
//                      or `path` leads outside `real_dir`, or the opened file
//                      cannot be verified;
//   NOT_FOUND          no such file inside `real_dir`;
//   INVALID_ARGUMENT   empty, not a regular file, or larger than `max_bytes`.
absl::StatusOr<std::string> ReadCalibrationFile(const std::string& real_dir,
                                                const std::string& path, size_t max_bytes);

// Largest calibration file LoadCalibration reads by path.
inline constexpr size_t kMaxCalibrationFileBytes = size_t{1} << 30;

}  // namespace oscarkv

#endif  // OSCARKV_SERVER_SERVICE_CALIBRATION_PATH_H_
