#include "kernels/calib/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/numeric.h"

namespace oscarkv {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;

absl::StatusOr<TensorDType> ParseDType(const std::string& s) {
  if (s == "F32") return TensorDType::kF32;
  if (s == "F16") return TensorDType::kF16;
  if (s == "BF16") return TensorDType::kBF16;
  if (s == "F64") return TensorDType::kF64;
  if (s == "I32") return TensorDType::kI32;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype \"", s, "\""));
}

}  // namespace

const char* DTypeName(TensorDType d) {
  switch (d) {
    case TensorDType::kF32: return "F32";
    case TensorDType::kF16: return "F16";
    case TensorDType::kBF16: return "BF16";
    case TensorDType::kF64: return "F64";
    case TensorDType::kI32: return "I32";
  }
  return "?";
}

int DTypeSize(TensorDType d) {
  switch (d) {
    case TensorDType::kF16:
    case TensorDType::kBF16: return 2;
    case TensorDType::kF64: return 8;
    default: return 4;
  }
}

int64_t StoredTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void SafetensorsFile::PutF32(const std::string& name, std::vector<int64_t> shape,
                             const float* data) {
  StoredTensor t;
  t.dtype = TensorDType::kF32;
  t.shape = std::move(shape);
  t.bytes.assign(reinterpret_cast<const char*>(data), size_t(t.num_elements()) * 4);
  tensors[name] = std::move(t);
}

absl::StatusOr<const StoredTensor*> SafetensorsFile::Get(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) {
    return absl::InvalidArgumentError(absl::StrCat("missing tensor \"", name, "\""));
  }
  return &it->second;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::GetFloats(
    const std::string& name, const std::vector<int64_t>& shape) const {
  auto t = Get(name);
  if (!t.ok()) return t.status();
  if ((*t)->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" has shape ",
                                                   ShapeString((*t)->shape), ", expected ",
                                                   ShapeString(shape)));
  }
  if ((*t)->dtype == TensorDType::kI32) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" is I32, expected a float type"));
  }
  return ToFloats(**t);
}

std::vector<float> ToFloats(const StoredTensor& t) {
  const size_t n = size_t(t.num_elements());
  std::vector<float> out(n);
  const char* p = t.bytes.data();
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case TensorDType::kF32: std::memcpy(&out[i], p + 4 * i, 4); break;
      case TensorDType::kF64: {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = float(d);
        break;
      }
      case TensorDType::kF16:
      case TensorDType::kBF16: {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = t.dtype == TensorDType::kF16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
        break;
      }
      case TensorDType::kI32: {
        int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = float(v);
        break;
      }
    }
  }
  return out;
}

absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file) {
  nlohmann::json header = nlohmann::json::object();
  if (!file.metadata.empty()) {
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& [k, v] : file.metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (name == "__metadata__" || name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("invalid tensor name \"", name, "\""));
    }
    if (t.bytes.size() != size_t(t.num_elements()) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": ", t.bytes.size(),
                                                     " bytes do not match shape ",
                                                     ShapeString(t.shape)));
    }
    header[name] = {{"dtype", DTypeName(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string json = header.dump();
  while (json.size() % 8 != 0) json.push_back(' ');  // align the data section
  std::string out(8, '\0');
  const uint64_t len = json.size();
  for (int i = 0; i < 8; ++i) out[i] = char((len >> (8 * i)) & 0xff);
  out += json;
  for (const auto& [name, t] : file.tensors) out += t.bytes;
  return out;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: file is ", bytes.size(),
                                                   " bytes, shorter than the 8-byte header length"));
  }
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  if (len > kMaxHeaderBytes || len > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", len,
                                                   " exceeds the file (", bytes.size(),
                                                   " bytes): truncated or not safetensors"));
  }
  nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + len,
                                                nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError("safetensors: header is not a JSON object");
  }
  const uint64_t data_size = bytes.size() - 8 - len;
  const char* data = bytes.data() + 8 + len;
  SafetensorsFile file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return absl::InvalidArgumentError("safetensors: __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("safetensors: metadata \"", m.key(), "\" is not a string"));
        }
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("safetensors: tensor \"", name, "\": ");
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
        !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      return absl::InvalidArgumentError(where + "needs dtype, shape and data_offsets [begin, end]");
    }
    auto dtype = ParseDType(v["dtype"].get<std::string>());
    if (!dtype.ok()) return absl::InvalidArgumentError(where + std::string(dtype.status().message()));
    StoredTensor t;
    t.dtype = *dtype;
    uint64_t numel = 1;
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned() && !(s.is_number_integer() && s.get<int64_t>() >= 0)) {
        return absl::InvalidArgumentError(where + "shape entries must be non-negative integers");
      }
      const int64_t dim = s.get<int64_t>();
      if (dim > (int64_t(1) << 40)) return absl::InvalidArgumentError(where + "shape too large");
      t.shape.push_back(dim);
      numel *= uint64_t(dim);
      if (numel > (uint64_t(1) << 40)) return absl::InvalidArgumentError(where + "shape too large");
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return absl::InvalidArgumentError(where + "data_offsets must be non-negative integers");
    }
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, "data_offsets [", b, ", ", e,
                                                     ") outside the ", data_size,
                                                     "-byte data section (truncated file?)"));
    }
    if (e - b != numel * uint64_t(DTypeSize(t.dtype))) {
      return absl::InvalidArgumentError(absl::StrCat(where, e - b, " bytes do not match shape ",
                                                     ShapeString(t.shape), " of ",
                                                     DTypeName(t.dtype)));
    }
    t.bytes.assign(data + b, e - b);
    ranges.push_back({b, e});
    file.tensors[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::InvalidArgumentError("safetensors: tensors overlap in the data section");
    }
  }
  return file;
}

absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open \"", path, "\""));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading \"", path, "\""));
  return ss.str();
}

absl::Status WriteFileBytes(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write \"", tmp, "\""));
    out.write(bytes.data(), std::streamsize(bytes.size()));
    if (!out) return absl::DataLossError(absl::StrCat("short write to \"", tmp, "\""));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot rename \"", tmp, "\" to \"", path, "\""));
  }
  return absl::OkStatus();
}

}  // namespace oscarkv
