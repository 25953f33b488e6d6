// Reading PyTorch `torch.save` files without PyTorch: a reader for the
// uncompressed ("stored") zip archive torch writes, and a restricted
// unpickler that understands exactly the opcodes and globals a saved dict of
// fp32 tensors uses. Any other global (the way a malicious pickle runs code)
// is refused, as are truncated or corrupted archives (CRC-32 checked).
// Pure functions over caller-owned bytes; thread-safe.
#ifndef OSCARKV_KERNELS_CALIB_TORCH_PICKLE_H_
#define OSCARKV_KERNELS_CALIB_TORCH_PICKLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace oscarkv {

// Entries of a zip archive, name → contents (stored entries only).
absl::StatusOr<std::map<std::string, std::string>> ReadStoredZip(const std::string& bytes);

// A decoded Python value. Tensors reference a storage entry of the archive.
struct PyValue;
using PyRef = std::shared_ptr<PyValue>;
struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kTuple, kList, kDict, kGlobal,
                    kStorage, kTensor, kMark };
  Kind kind = Kind::kNone;
  int64_t i = 0;         // kBool, kInt
  double f = 0;          // kFloat
  std::string s;         // kString; kGlobal "module name"; kStorage: archive key
  std::vector<PyRef> items;                      // kTuple, kList
  std::vector<std::pair<PyRef, PyRef>> entries;  // kDict, in insertion order
  // kStorage: element type ("float", "double"); kTensor: storage, offset, shape, stride.
  std::string storage_type;
  PyRef storage;
  int64_t offset = 0;
  std::vector<int64_t> shape, stride;

  // Dict lookup by string or integer key; nullptr when absent.
  PyRef Get(const std::string& key) const;
  PyRef Get(int64_t key) const;
};

// Unpickles `pickle` (protocols 2–4) allowing only the globals
// torch._utils._rebuild_tensor_v2, torch.{Float,Double}Storage and
// collections.OrderedDict. Errors say which opcode/global and where.
absl::StatusOr<PyRef> RestrictedUnpickle(const std::string& pickle);

// A loaded torch.save archive: the unpickled root and the raw storages by key.
struct TorchArchive {
  PyRef root;
  std::map<std::string, std::string> storages;  // data/<key> contents
};
absl::StatusOr<TorchArchive> ReadTorchArchive(const std::string& bytes);

// The fp32 contents of a contiguous tensor (checks dtype, stride and bounds).
absl::StatusOr<std::vector<float>> TensorFloats(const TorchArchive& archive, const PyValue& tensor);

}  // namespace oscarkv

#endif  // OSCARKV_KERNELS_CALIB_TORCH_PICKLE_H_
