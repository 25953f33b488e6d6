#include "kernels/calib/activation_dump.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

StoredTensor Encode(const std::vector<float>& x, std::vector<int64_t> shape, TensorDType dtype) {
  StoredTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  if (dtype == TensorDType::kF32) {
    t.bytes.assign(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    return t;
  }
  t.bytes.resize(x.size() * 2);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t h = dtype == TensorDType::kF16 ? FloatToFp16(x[i]) : FloatToBf16(x[i]);
    std::memcpy(&t.bytes[2 * i], &h, 2);
  }
  return t;
}

}  // namespace

absl::StatusOr<ActivationDump> ParseActivationDump(const SafetensorsFile& f) {
  auto fmt = f.metadata.find("format");
  if (fmt != f.metadata.end() && fmt->second != kActivationFormat) {
    return absl::InvalidArgumentError(absl::StrCat("activation dump: metadata format is \"",
                                                   fmt->second, "\", expected \"",
                                                   kActivationFormat, "\""));
  }
  int num_layers = 0;
  while (f.tensors.count(absl::StrCat("layers.", num_layers, ".q"))) ++num_layers;
  if (num_layers == 0) {
    return absl::InvalidArgumentError("activation dump: no tensor \"layers.0.q\"");
  }
  for (const auto& [name, t] : f.tensors) {
    int idx = -1;
    const size_t dot = name.find('.', 7);
    if (name.rfind("layers.", 0) != 0 || dot == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(name.data() + 7, dot - 7), &idx) || idx < 0 ||
        idx >= num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "activation dump: unexpected tensor \"", name, "\" (layers must be numbered 0..",
          num_layers - 1, " without gaps, each with q, k, v)"));
    }
  }
  ActivationDump dump;
  for (int i = 0; i < num_layers; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    const StoredTensor *q, *k, *v;
    OSCARKV_ASSIGN_OR_RETURN(q, f.Get(p + "q"));
    OSCARKV_ASSIGN_OR_RETURN(k, f.Get(p + "k"));
    OSCARKV_ASSIGN_OR_RETURN(v, f.Get(p + "v"));
    for (const StoredTensor* t : {q, k, v}) {
      if (t->shape.size() != 3) {
        return absl::InvalidArgumentError(absl::StrCat("activation dump: ", p,
                                                       "q/k/v must be [n, heads, D], got ",
                                                       ShapeString(t->shape)));
      }
      if (t->dtype != TensorDType::kF32 && t->dtype != TensorDType::kF16 &&
          t->dtype != TensorDType::kBF16) {
        return absl::InvalidArgumentError(absl::StrCat("activation dump: ", p,
                                                       "q/k/v must be F32, F16 or BF16"));
      }
    }
    if (k->shape != v->shape || q->shape[0] != k->shape[0] || q->shape[2] != k->shape[2]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "activation dump: layer ", i, " has inconsistent shapes: q ", ShapeString(q->shape),
          ", k ", ShapeString(k->shape), ", v ", ShapeString(v->shape),
          " (need q [n, Hq, D], k and v [n, Hkv, D])"));
    }
    ModelLayout layer_layout{num_layers, int(q->shape[1]), int(k->shape[1]), int(q->shape[2])};
    if (i == 0) {
      dump.layout = layer_layout;
      auto status = ValidateLayout(dump.layout);
      if (!status.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("activation dump: ", status.message()));
      }
    } else if (!(layer_layout == dump.layout)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "activation dump: layer ", i, " has layout ", layer_layout.DebugString(),
          ", layer 0 has ", dump.layout.DebugString()));
    }
    LayerActivations a;
    a.tokens = int(q->shape[0]);
    a.num_q_heads = dump.layout.num_q_heads;
    a.num_kv_heads = dump.layout.num_kv_heads;
    a.head_dim = dump.layout.head_dim;
    a.q = ToFloats(*q);
    a.k = ToFloats(*k);
    a.v = ToFloats(*v);
    absl::Status status = ValidateActivations(a, dump.layout);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("activation dump: layer ", i, ": ",
                                                     status.message()));
    }
    dump.layers.push_back(std::move(a));
  }
  for (const char* key : {"num_layers", "num_q_heads", "num_kv_heads", "head_dim"}) {
    auto it = f.metadata.find(key);
    if (it == f.metadata.end()) continue;
    const int want = std::string(key) == "num_layers"    ? dump.layout.num_layers
                     : std::string(key) == "num_q_heads" ? dump.layout.num_q_heads
                     : std::string(key) == "num_kv_heads" ? dump.layout.num_kv_heads
                                                          : dump.layout.head_dim;
    if (it->second != std::to_string(want)) {
      return absl::InvalidArgumentError(absl::StrCat("activation dump: metadata ", key, " = ",
                                                     it->second, " but the tensors say ", want));
    }
  }
  return dump;
}

absl::StatusOr<ActivationDump> ReadActivationDump(const std::string& path) {
  OSCARKV_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path));
  auto f = ParseSafetensors(bytes);
  if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", f.status().message()));
  auto dump = ParseActivationDump(*f);
  if (!dump.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", dump.status().message()));
  }
  return dump;
}

absl::StatusOr<SafetensorsFile> ActivationDumpToSafetensors(const ActivationDump& dump,
                                                            TensorDType dtype) {
  if (dtype != TensorDType::kF32 && dtype != TensorDType::kF16 && dtype != TensorDType::kBF16) {
    return absl::InvalidArgumentError("activation dump dtype must be F32, F16 or BF16");
  }
  OSCARKV_RETURN_IF_ERROR(ValidateLayout(dump.layout));
  if (int(dump.layers.size()) != dump.layout.num_layers) {
    return absl::InvalidArgumentError("activation dump: layer count does not match the layout");
  }
  SafetensorsFile f;
  const ModelLayout& l = dump.layout;
  f.metadata = {{"format", kActivationFormat},
                {"num_layers", std::to_string(l.num_layers)},
                {"num_q_heads", std::to_string(l.num_q_heads)},
                {"num_kv_heads", std::to_string(l.num_kv_heads)},
                {"head_dim", std::to_string(l.head_dim)}};
  for (int i = 0; i < l.num_layers; ++i) {
    const LayerActivations& a = dump.layers[i];
    OSCARKV_RETURN_IF_ERROR(ValidateActivations(a, l));
    const std::string p = absl::StrCat("layers.", i, ".");
    f.tensors[p + "q"] = Encode(a.q, {a.tokens, l.num_q_heads, l.head_dim}, dtype);
    f.tensors[p + "k"] = Encode(a.k, {a.tokens, l.num_kv_heads, l.head_dim}, dtype);
    f.tensors[p + "v"] = Encode(a.v, {a.tokens, l.num_kv_heads, l.head_dim}, dtype);
  }
  return f;
}

absl::Status WriteActivationDump(const std::string& path, const ActivationDump& dump,
                                 TensorDType dtype) {
  OSCARKV_ASSIGN_OR_RETURN(SafetensorsFile f, ActivationDumpToSafetensors(dump, dtype));
  OSCARKV_ASSIGN_OR_RETURN(std::string bytes, SerializeSafetensors(f));
  return WriteFileBytes(path, bytes);
}

}  // namespace oscarkv
