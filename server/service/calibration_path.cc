#include "server/service/calibration_path.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

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

// The real path of `path` (see ReadCalibrationFile), inside `real_dir`.
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
  return real;
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

absl::StatusOr<std::string> ReadCalibrationFile(const std::string& real_dir,
                                                const std::string& path, size_t max_bytes) {
  OSCARKV_ASSIGN_OR_RETURN(const std::string real, ResolveCalibrationPath(real_dir, path));
  // O_NONBLOCK: a FIFO must not block the open; fstat below refuses it.
  const int fd = ::open(real.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("calibration file '", path, "' is gone"));
    }
    if (err == ELOOP) {
      return absl::PermissionDeniedError(
          absl::StrCat("calibration path '", path, "' became a symlink while it was opened"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("calibration file '", path, "': ", std::strerror(err)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  // What was opened, by the kernel's name for it, not by the path checked.
  char target[PATH_MAX];
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = ::readlink(self.c_str(), target, sizeof(target) - 1);
  if (n <= 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot verify where calibration path '", path, "' leads (", self, ": ",
        std::strerror(errno), ")"));
  }
  target[n] = '\0';
  if (!IsInside(target, real_dir)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "calibration path '", path, "' led outside --calibration_dir ", real_dir,
        " when it was opened"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration path '", path, "' is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file '", path, "' is ",
                                                   st.st_size, " bytes; at most ", max_bytes,
                                                   " are read"));
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      return absl::DataLossError(absl::StrCat("calibration file '", path, "': read ", got, " of ",
                                              bytes.size(), " bytes",
                                              r < 0 ? absl::StrCat(": ", std::strerror(errno))
                                                    : std::string()));
    }
    got += static_cast<size_t>(r);
  }
  return bytes;
}

}  // namespace oscarkv
