// The `oscarkv` tool's service subcommands: put, get, attend, stat, ls, drop,
// info. Each talks to one server (--server, default $OSCARKV_SERVER or
// localhost:50051) through the client library.
//
// Exit codes (scripts can rely on them): 0 ok; 1 other failure; 2 usage or
// invalid argument; 3 not found; 4 already exists; 5 resource exhausted;
// 6 server unavailable; 7 deadline exceeded. Errors go to stderr as
// "oscarkv <command>: <CODE>: <message>".
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/kv_client.h"
#include "client/local_attention.h"
#include "client/tool/command.h"
#include "client/tool/flags.h"
#include "kernels/calib/safetensors.h"
#include "kernels/numeric.h"

namespace oscarkv::tool {
namespace {

using Clock = std::chrono::steady_clock;

int ExitCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return 0;
    case absl::StatusCode::kInvalidArgument: return 2;
    case absl::StatusCode::kNotFound: return 3;
    case absl::StatusCode::kAlreadyExists: return 4;
    case absl::StatusCode::kResourceExhausted: return 5;
    case absl::StatusCode::kUnavailable: return 6;
    case absl::StatusCode::kDeadlineExceeded: return 7;
    default: return 1;
  }
}

int Fail(const char* cmd, const absl::Status& s) {
  std::fprintf(stderr, "oscarkv %s: %s: %s\n", cmd, absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return ExitCode(s.code());
}

// Parses flags; on --help or a usage error prints `usage` and sets *exit.
bool ParseOrUsage(Flags& flags, int argc, char** argv, const char* cmd, const char* usage,
                  int* exit) {
  absl::Status st = flags.Parse(argc, argv);
  if (st.ok() && flags.Has("timeout")) {
    // Read here so that a bad value is a usage error, not a 0 s deadline.
    const absl::StatusOr<double> t = flags.Double("timeout", 0);
    if (!t.ok()) {
      st = t.status();
    } else if (!(*t > 0)) {
      st = absl::InvalidArgumentError("--timeout: seconds, a number > 0");
    }
  }
  if (st.ok() && !flags.Switch("help")) return true;
  if (!st.ok()) std::fprintf(stderr, "oscarkv %s: %s\n", cmd, std::string(st.message()).c_str());
  std::fprintf(st.ok() ? stdout : stderr, "%s", usage);
  *exit = st.ok() ? 0 : 2;
  return false;
}

std::unique_ptr<KvClient> Connect(const Flags& flags) {
  const char* env = std::getenv("OSCARKV_SERVER");
  ClientOptions options;
  // Checked by ParseOrUsage.
  options.deadline =
      std::chrono::milliseconds(static_cast<int64_t>(1000 * flags.Double("timeout", 600).value()));
  return KvClient::Create(flags.String("server", env ? env : "localhost:50051"), options);
}

// A progress bar on stderr (only when it is a terminal, or with --progress).
class ProgressBar {
 public:
  ProgressBar(const char* what, bool force) : what_(what), on_(force || isatty(2)) {}
  void Update(int64_t done, int64_t total) {
    if (!on_) return;
    const auto now = Clock::now();
    if (now - last_ < std::chrono::milliseconds(100) && done < total) return;
    last_ = now;
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double mib = double(done) / (1 << 20);
    const double frac = total > 0 ? std::min(1.0, double(done) / double(total)) : 0.0;
    char bar[31];
    for (int i = 0; i < 30; ++i) bar[i] = i < int(frac * 30) ? '#' : '.';
    bar[30] = 0;
    std::fprintf(stderr, "\r%s [%s] %3d%% %.1f/%.1f MiB %.0f MiB/s   ", what_, bar,
                 int(frac * 100), mib, double(total) / (1 << 20), secs > 0 ? mib / secs : 0.0);
    std::fflush(stderr);
  }
  ~ProgressBar() {
    if (on_) std::fprintf(stderr, "\n");
  }

 private:
  const char* what_;
  bool on_;
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_{};
};

void PrintSequence(const v1::SequenceInfo& s) {
  std::printf(
      "%s\tmodel=%s\ttokens=%lld\tsink=%lld\thistory=%lld\trecent=%lld\tbytes=%lld\t"
      "bits=%.3f\tpinned=%d\trotation=%s(%s)\n",
      s.sequence_id().c_str(), s.model().c_str(), (long long)s.tokens(),
      (long long)s.sink_tokens(), (long long)s.history_tokens(), (long long)s.recent_tokens(),
      (long long)s.stored_bytes(), s.effective_bits(), s.pinned() ? 1 : 0,
      s.objective().c_str(), s.rotation_id().c_str());
}

// BF16 bits of a tensor of any float dtype.
std::vector<bf16_bits> ToBf16(const StoredTensor& t) {
  std::vector<bf16_bits> out(size_t(t.num_elements()));
  if (t.dtype == TensorDType::kBF16) {
    std::memcpy(out.data(), t.bytes.data(), out.size() * 2);
  } else {
    const std::vector<float> f = ToFloats(t);
    for (size_t i = 0; i < out.size(); ++i) out[i] = FloatToBf16(f[i]);
  }
  return out;
}

constexpr char kPutUsage[] =
    "usage: oscarkv put [--server HOST:PORT] --id ID --model MODEL [--pin] [--progress] FILE\n"
    "Streams layers.{i}.k / layers.{i}.v [T, Hkv, D] (BF16 taken bit-exact; F16/F32\n"
    "rounded to BF16) from a safetensors file (e.g. an activation dump) into the server.\n";

int RunPut(int argc, char** argv) {
  Flags flags({"server", "id", "model", "timeout"}, {"pin", "progress", "help"});
  int code = 0;
  if (!ParseOrUsage(flags, argc, argv, "put", kPutUsage, &code)) return code;
  if (!flags.Has("id") || !flags.Has("model") || flags.positional().size() != 1) {
    std::fprintf(stderr, "%s", kPutUsage);
    return 2;
  }
  auto client = Connect(flags);
  auto layout = client->ModelLayoutOf(flags.String("model", ""));
  if (!layout.ok()) return Fail("put", layout.status());
  auto bytes = ReadFileBytes(flags.positional()[0]);
  if (!bytes.ok()) return Fail("put", bytes.status());
  auto file = ParseSafetensors(*bytes);
  if (!file.ok()) return Fail("put", file.status());
  std::vector<bf16_bits> k, v;
  int64_t tokens = -1;
  for (int l = 0; l < layout->num_layers; ++l) {
    for (const char* kind : {"k", "v"}) {
      const std::string name = absl::StrCat("layers.", l, ".", kind);
      auto t = file->Get(name);
      if (!t.ok()) return Fail("put", t.status());
      const auto& shape = (*t)->shape;
      if (shape.size() != 3 || shape[1] != layout->num_kv_heads || shape[2] != layout->head_dim ||
          (tokens >= 0 && shape[0] != tokens)) {
        return Fail("put", absl::InvalidArgumentError(absl::StrCat(
                               name, " has shape ", ShapeString(shape), "; model needs [T, ",
                               layout->num_kv_heads, ", ", layout->head_dim,
                               "] with the same T in every layer")));
      }
      tokens = shape[0];
      std::vector<bf16_bits> b = ToBf16(**t);
      (kind[0] == 'k' ? k : v).insert((kind[0] == 'k' ? k : v).end(), b.begin(), b.end());
    }
  }
  ProgressBar bar("put", flags.Switch("progress"));
  const auto t0 = Clock::now();
  auto r = client->PutSequence(flags.String("id", ""), flags.String("model", ""), *layout, tokens,
                               k.data(), v.data(), flags.Switch("pin"),
                               [&](int64_t d, int64_t t) { bar.Update(d, t); });
  if (!r.ok()) return Fail("put", r.status());
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("stored %s: %lld tokens x %d layers, %.1f MiB BF16 in, %.1f MiB stored "
              "(%.2f bits/element, %.1fx), %.2f s (%.0f MiB/s)\n",
              flags.String("id", "").c_str(), (long long)r->tokens, layout->num_layers,
              double(r->bf16_bytes_sent) / (1 << 20), double(r->stored_bytes) / (1 << 20),
              r->effective_bits, r->effective_bits > 0 ? 16.0 / r->effective_bits : 0.0, secs,
              double(r->bf16_bytes_sent) / (1 << 20) / secs);
  return 0;
}

constexpr char kGetUsage[] =
    "usage: oscarkv get [--server HOST:PORT] --id ID [--format bf16|compressed] [--layers a,b]\n"
    "                   --out FILE [--progress]\n"
    "bf16: writes layers.{i}.k / .v [T, Hkv, D] BF16 (loadable by `oscarkv put`).\n"
    "compressed: writes layers.{i}.sink_k/.sink_v/.recent_k/.recent_v BF16 [n, Hkv, D],\n"
    "layers.{i}.pages U8 as stored (see kvcache.proto), layers.{i}.r_k/.r_v F32 [M, D, D].\n";

int RunGet(int argc, char** argv) {
  Flags flags({"server", "id", "format", "layers", "out", "timeout"}, {"progress", "help"});
  int code = 0;
  if (!ParseOrUsage(flags, argc, argv, "get", kGetUsage, &code)) return code;
  const std::string format = flags.String("format", "bf16");
  if (!flags.Has("id") || !flags.Has("out") || (format != "bf16" && format != "compressed")) {
    std::fprintf(stderr, "%s", kGetUsage);
    return 2;
  }
  std::vector<int> layers;
  if (flags.Has("layers")) {
    for (absl::string_view p : absl::StrSplit(flags.String("layers", ""), ',')) {
      int l = 0;
      if (!absl::SimpleAtoi(p, &l)) return Fail("get", absl::InvalidArgumentError("bad --layers"));
      layers.push_back(l);
    }
  }
  auto client = Connect(flags);
  ProgressBar bar("get", flags.Switch("progress"));
  auto fetched = client->GetKv(flags.String("id", ""),
                               format == "bf16" ? v1::KV_FORMAT_BF16 : v1::KV_FORMAT_COMPRESSED,
                               layers, true, [&](int64_t d, int64_t t) { bar.Update(d, t); });
  if (!fetched.ok()) return Fail("get", fetched.status());
  SafetensorsFile out;
  const v1::ModelLayout& l = fetched->info.layout();
  out.metadata = {{"format", format == "bf16" ? "oscarkv-activations" : "oscarkv-compressed"},
                  {"sequence_id", fetched->info.sequence_id()},
                  {"model", fetched->info.model()},
                  {"num_layers", std::to_string(l.num_layers())},
                  {"num_q_heads", std::to_string(l.num_q_heads())},
                  {"num_kv_heads", std::to_string(l.num_kv_heads())},
                  {"head_dim", std::to_string(l.head_dim())},
                  {"rotation_id", fetched->info.rotation_id()}};
  auto put_bf16 = [&](const std::string& name, const std::vector<bf16_bits>& x) {
    StoredTensor t;
    t.dtype = TensorDType::kBF16;
    t.shape = {int64_t(x.size() / (size_t(l.num_kv_heads()) * l.head_dim())), l.num_kv_heads(),
               l.head_dim()};
    t.bytes.assign(reinterpret_cast<const char*>(x.data()), x.size() * 2);
    out.tensors[name] = std::move(t);
  };
  for (int i = 0; i < int(fetched->layers.size()); ++i) {
    if (!fetched->present[i]) continue;
    const FetchedLayer& f = fetched->layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    if (format == "bf16") {
      put_bf16(p + "k", f.k);
      put_bf16(p + "v", f.v);
      continue;
    }
    put_bf16(p + "sink_k", f.sink_k);
    put_bf16(p + "sink_v", f.sink_v);
    put_bf16(p + "recent_k", f.recent_k);
    put_bf16(p + "recent_v", f.recent_v);
    StoredTensor pages;
    pages.dtype = TensorDType::kI32;  // raw page bytes, 4 per element
    pages.shape = {int64_t(f.pages.size() / 4)};
    pages.bytes.assign(reinterpret_cast<const char*>(f.pages.data()), f.pages.size());
    out.tensors[p + "pages_u8x4"] = std::move(pages);
    const int64_t d = l.head_dim();
    out.PutF32(p + "r_k", {f.num_matrices, d, d}, f.r_k.data());
    out.PutF32(p + "r_v", {f.num_matrices, d, d}, f.r_v.data());
  }
  auto bytes = SerializeSafetensors(out);
  if (!bytes.ok()) return Fail("get", bytes.status());
  const absl::Status w = WriteFileBytes(flags.String("out", ""), *bytes);
  if (!w.ok()) return Fail("get", w);
  std::printf("wrote %s: %s, %lld tokens, %.1f MiB received\n", flags.String("out", "").c_str(),
              format.c_str(), (long long)fetched->info.tokens(),
              double(fetched->bytes_received) / (1 << 20));
  return 0;
}

// --verify: the largest relative L2 difference accepted between the server's
// attention and the local one over the same pages. The CPU backend matches the
// local code to ~1e-7; the CUDA backend's default kernel keeps P·V's
// probabilities in 16-bit fixed point (relative L2 up to ~6e-5 in the GPU
// tests, single elements near zero up to ~5e-4; tests/gpu/cuda_attend_test.cc).
constexpr double kVerifyTolerance = 1e-3;

constexpr char kAttendUsage[] =
    "usage: oscarkv attend [--server HOST:PORT] --id ID [--layer 0] [--seed 1] [--verify]\n"
    "Runs one decode-attention query (seeded random, fp32 [Hq, D]) against a stored\n"
    "sequence on the server and prints per-head LSE and the latency. --verify also\n"
    "fetches the layer COMPRESSED, attends locally with the same math, and exits 1\n"
    "if the two outputs differ by more than 1e-3 (relative L2).\n";

int RunAttend(int argc, char** argv) {
  Flags flags({"server", "id", "layer", "seed", "timeout"}, {"verify", "help"});
  int code = 0;
  if (!ParseOrUsage(flags, argc, argv, "attend", kAttendUsage, &code)) return code;
  auto layer = flags.Int("layer", 0);
  auto seed = flags.Int("seed", 1);
  if (!flags.Has("id") || !layer.ok() || !seed.ok()) {
    std::fprintf(stderr, "%s", kAttendUsage);
    return 2;
  }
  auto client = Connect(flags);
  const std::string id = flags.String("id", "");
  auto info = client->Stat(id);
  if (!info.ok()) return Fail("attend", info.status());
  const ModelLayout layout{info->layout().num_layers(), info->layout().num_q_heads(),
                           info->layout().num_kv_heads(), info->layout().head_dim()};
  std::vector<float> q(size_t(layout.num_q_heads) * layout.head_dim);
  uint64_t s = uint64_t(*seed) * 0x9e3779b97f4a7c15ull + 1;
  for (float& x : q) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    x = float(int64_t(s % 2001) - 1000) / 1000.0f;
  }
  const auto t0 = Clock::now();
  auto out = client->Attend({AttendQuery{id, *layer, q.data()}}, layout, true);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!out.ok()) return Fail("attend", out.status());
  if (!(*out)[0].status.ok()) return Fail("attend", (*out)[0].status);
  std::printf("attend %s layer %d: %lld tokens, %.3f ms round trip\nlse:", id.c_str(), *layer,
              (long long)(*out)[0].tokens, ms);
  for (float x : (*out)[0].lse) std::printf(" %.4f", x);
  std::printf("\n");
  if (flags.Switch("verify")) {
    auto fetched = client->GetKv(id, v1::KV_FORMAT_COMPRESSED, {*layer}, true);
    if (!fetched.ok()) return Fail("attend", fetched.status());
    auto local = LocalAttention::Create(std::move(*fetched));
    if (!local.ok()) return Fail("attend", local.status());
    std::vector<float> o(q.size()), lse(layout.num_q_heads);
    const absl::Status st = (*local)->Attend(*layer, q.data(), o.data(), lse.data());
    if (!st.ok()) return Fail("attend", st);
    double diff = 0, d2 = 0, n2 = 0;
    for (size_t i = 0; i < o.size(); ++i) {
      const double d = double(o[i]) - double((*out)[0].out[i]);
      diff = std::max(diff, std::abs(d));
      d2 += d * d;
      n2 += double(o[i]) * double(o[i]);
    }
    const double rel = std::sqrt(d2 / std::max(n2, 1e-300));
    std::printf("local attention over fetched pages: max |diff| = %.3g, relative L2 %.3g\n", diff,
                rel);
    if (rel > kVerifyTolerance) {
      std::fprintf(stderr, "attend: the server's attention differs from the local one by %.3g "
                   "(relative L2; at most %.0e expected)\n", rel, kVerifyTolerance);
      return 1;
    }
  }
  return 0;
}

int RunSimple(int argc, char** argv, const char* cmd) {
  Flags flags({"server", "id", "model", "timeout"}, {"help"});
  const std::string usage = absl::StrCat(
      "usage: oscarkv ", cmd, " [--server HOST:PORT]",
      std::string(cmd) == "ls" ? " [--model M]" : std::string(cmd) == "info" ? "" : " --id ID",
      "\n");
  int code = 0;
  if (!ParseOrUsage(flags, argc, argv, cmd, usage.c_str(), &code)) return code;
  const std::string c = cmd;
  if ((c == "stat" || c == "drop") && !flags.Has("id")) {
    std::fprintf(stderr, "%s", usage.c_str());
    return 2;
  }
  auto client = Connect(flags);
  if (c == "stat") {
    auto s = client->Stat(flags.String("id", ""));
    if (!s.ok()) return Fail(cmd, s.status());
    PrintSequence(*s);
  } else if (c == "ls") {
    auto list = client->List(flags.String("model", ""));
    if (!list.ok()) return Fail(cmd, list.status());
    for (const auto& s : *list) PrintSequence(s);
  } else if (c == "drop") {
    auto freed = client->Drop(flags.String("id", ""));
    if (!freed.ok()) return Fail(cmd, freed.status());
    std::printf("dropped %s, freed %lld bytes\n", flags.String("id", "").c_str(), (long long)*freed);
  } else {
    auto info = client->Info();
    if (!info.ok()) return Fail(cmd, info.status());
    std::printf("server %s version %s\nbackend %s (%s)\npool %.1f MiB total, %.1f MiB free\n"
                "sequences %lld, evictions %lld, policy %s, max message %lld bytes\n",
                client->target().c_str(), info->version().c_str(), info->backend().c_str(),
                info->backend_description().c_str(), double(info->pool().total_bytes()) / (1 << 20),
                double(info->pool().free_bytes()) / (1 << 20), (long long)info->sequences(),
                (long long)info->evictions(), info->eviction_policy().c_str(),
                (long long)info->max_message_bytes());
    for (const auto& m : info->models()) {
      std::printf("model %s: layers=%d q_heads=%d kv_heads=%d head_dim=%d S0=%d W=%d P=%d G=%d "
                  "rotation=%s%s id=%s sequences=%lld\n",
                  m.name().c_str(), m.layout().num_layers(), m.layout().num_q_heads(),
                  m.layout().num_kv_heads(), m.layout().head_dim(), m.tiers().sink_tokens(),
                  m.tiers().recent_window(), m.tiers().page_tokens(), m.tiers().group_size(),
                  m.objective().c_str(), m.calibrated() ? "" : " (data-free default)",
                  m.rotation_id().c_str(), (long long)m.sequences());
    }
  }
  return 0;
}

}  // namespace

int RunServicePut(int argc, char** argv) { return RunPut(argc, argv); }
int RunServiceGet(int argc, char** argv) { return RunGet(argc, argv); }
int RunServiceAttend(int argc, char** argv) { return RunAttend(argc, argv); }
int RunServiceStat(int argc, char** argv) { return RunSimple(argc, argv, "stat"); }
int RunServiceLs(int argc, char** argv) { return RunSimple(argc, argv, "ls"); }
int RunServiceDrop(int argc, char** argv) { return RunSimple(argc, argv, "drop"); }
int RunServiceInfo(int argc, char** argv) { return RunSimple(argc, argv, "info"); }

}  // namespace oscarkv::tool
