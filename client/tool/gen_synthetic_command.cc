// oscarkv gen-synthetic: writes a synthetic Q/K/V activation dump.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/tool/command.h"
#include "client/tool/flags.h"
#include "kernels/calib/activation_dump.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/synthetic.h"

namespace oscarkv::tool {
namespace {

constexpr char kUsage[] =
    "usage: oscarkv gen-synthetic --out FILE [--layers 2] [--q-heads 32] [--kv-heads 8]\n"
    "         [--head-dim 128] [--tokens 2048] [--seed 1] [--sample-seed 0]\n"
    "         [--dtype bf16|f16|f32] [--spec knob=value,...]\n"
    "Writes an activation dump (layers.{i}.q [n,Hq,D], layers.{i}.k/v [n,Hkv,D]) drawn\n"
    "from the seeded synthetic KV model (outlier key channels, correlated queries,\n"
    "attention sink, needle). --seed fixes the distribution, --sample-seed the tokens.\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "oscarkv gen-synthetic: %s\n", std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int RunGenSynthetic(int argc, char** argv) {
  Flags flags({"out", "layers", "q-heads", "kv-heads", "head-dim", "tokens", "seed",
               "sample-seed", "dtype", "spec"},
              {"help"});
  absl::Status st = flags.Parse(argc, argv);
  if (!st.ok() || flags.Switch("help") || !flags.Has("out")) {
    if (!st.ok()) std::fprintf(stderr, "oscarkv gen-synthetic: %s\n", std::string(st.message()).c_str());
    std::fprintf(flags.Switch("help") ? stdout : stderr, "%s", kUsage);
    return flags.Switch("help") && st.ok() ? 0 : 2;
  }
  SyntheticSpec spec;
  int layers = 0;
  auto get = [&](const char* name, int def, int* out) {
    auto v = flags.Int(name, def);
    if (!v.ok()) {
      st = v.status();
      return;
    }
    *out = *v;
  };
  get("layers", 2, &layers);
  get("q-heads", 32, &spec.num_q_heads);
  get("kv-heads", 8, &spec.num_kv_heads);
  get("head-dim", 128, &spec.head_dim);
  get("tokens", 2048, &spec.tokens);
  int seed = 1, sample_seed = 0;
  get("seed", 1, &seed);
  get("sample-seed", 0, &sample_seed);
  if (!st.ok()) return Fail(st);
  spec.seed = uint64_t(seed);
  spec.sample_seed = uint64_t(sample_seed);
  spec.num_queries = spec.tokens;
  st = SetSyntheticKnobs(&spec, flags.String("spec", ""));
  if (!st.ok()) return Fail(st);
  const std::string dtype_name = flags.String("dtype", "bf16");
  TensorDType dtype = dtype_name == "f32"   ? TensorDType::kF32
                      : dtype_name == "f16" ? TensorDType::kF16
                                            : TensorDType::kBF16;
  if (dtype_name != "f32" && dtype_name != "f16" && dtype_name != "bf16") {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--dtype \"", dtype_name, "\": want bf16, f16 or f32")));
  }
  ActivationDump dump;
  dump.layout = {layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim};
  st = ValidateLayout(dump.layout);
  if (!st.ok()) return Fail(st);
  for (int i = 0; i < layers; ++i) {
    auto layer = GenerateSyntheticLayer(spec, i);
    if (!layer.ok()) return Fail(layer.status());
    auto acts = ActivationsFromSynthetic(*layer);
    if (!acts.ok()) return Fail(acts.status());
    dump.layers.push_back(std::move(*acts));
    std::fprintf(stderr, "layer %d/%d generated (needle at token %d)\n", i + 1, layers, layer->needle);
  }
  st = WriteActivationDump(flags.String("out", ""), dump, dtype);
  if (!st.ok()) return Fail(st);
  std::fprintf(stderr, "wrote %s: %d layers x %d tokens, layout %s, %s\n",
               flags.String("out", "").c_str(), layers, spec.tokens,
               dump.layout.DebugString().c_str(), dtype_name.c_str());
  return 0;
}

}  // namespace oscarkv::tool
