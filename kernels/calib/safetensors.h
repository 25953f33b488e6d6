// Minimal safetensors reader/writer: 8-byte little-endian header length, a
// JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}},
// then the raw little-endian tensor bytes. Used for calibration files and
// activation dumps. Parsing never throws: every malformed input (short file,
// bad JSON, offsets outside the data, size/shape mismatch, unknown dtype)
// becomes InvalidArgument naming the problem. Not thread-safe per object.
#ifndef OSCARKV_KERNELS_CALIB_SAFETENSORS_H_
#define OSCARKV_KERNELS_CALIB_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace oscarkv {

enum class TensorDType { kF32, kF16, kBF16, kF64, kI32 };

const char* DTypeName(TensorDType dtype);  // "F32", "F16", "BF16", "F64", "I32"
int DTypeSize(TensorDType dtype);

struct StoredTensor {
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;  // little-endian, row-major

  int64_t num_elements() const;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, StoredTensor> tensors;  // by name

  // F32 tensor from host floats.
  void PutF32(const std::string& name, std::vector<int64_t> shape, const float* data);
  // Looks up `name`, checks its shape, and converts F32/F16/BF16/F64 to fp32.
  absl::StatusOr<std::vector<float>> GetFloats(const std::string& name,
                                               const std::vector<int64_t>& shape) const;
  absl::StatusOr<const StoredTensor*> Get(const std::string& name) const;
};

absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file);
absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes);

// Whole-file helpers; errors name the path.
absl::StatusOr<std::string> ReadFileBytes(const std::string& path);
absl::Status WriteFileBytes(const std::string& path, const std::string& bytes);

// Converts `count` elements of a tensor buffer to fp32.
std::vector<float> ToFloats(const StoredTensor& tensor);

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_SAFETENSORS_H_
