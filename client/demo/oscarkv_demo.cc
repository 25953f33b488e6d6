// oscarkv-demo: drives a running oscarkv-server the way a disaggregated
// deployment does, over real gRPC:
//   1. a prefill worker streams a long Qwen3-8B-shaped K/V cache (synthetic,
//      with the structure of real caches: outlier channels, sink, needle) for
//      every layer with PutKv;
//   2. a decode worker runs decode steps with the fused Append+Attend RPC, one
//      round trip per layer per step, and checks each output of the probe
//      layers against attention over the uncompressed BF16 cache;
//   3. another worker fetches the cache COMPRESSED with GetKv and attends
//      locally with the same kernels;
// and prints memory saved, attention error and latencies.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/kv_client.h"
#include "client/local_attention.h"
#include "kernels/calib/calibrate.h"
#include "kernels/calib/calibration_file.h"
#include "kernels/calib/fidelity.h"
#include "kernels/calib/safetensors.h"
#include "kernels/calib/synthetic.h"
#include "kernels/cpu/attention_cpu.h"

ABSL_FLAG(std::string, server, "localhost:50051", "oscarkv-server address");
ABSL_FLAG(std::string, model, "qwen3-8b", "registered model whose shape the cache takes");
ABSL_FLAG(int, tokens, 32768, "prefill tokens per layer");
ABSL_FLAG(int, layers, 0,
          "layers to use (0: all of the model's); fewer registers a reduced copy of the "
          "model's shape on the server");
ABSL_FLAG(int, decode_steps, 8, "decode steps (each: fused Append+Attend on every layer)");
ABSL_FLAG(int, probe_layers, 3, "layers whose outputs are checked against BF16 attention");
ABSL_FLAG(std::string, id, "", "sequence id (default: demo-<pid>)");
ABSL_FLAG(bool, keep, false, "keep the sequence on the server at the end");
ABSL_FLAG(bool, oscar, true,
          "calibrate OSCAR rotations on a held-out draw of the same synthetic model, register "
          "them with LoadCalibration and store the cache with them (false: the model's own "
          "rotation, the data-free Hadamard default)");
ABSL_FLAG(int, calib_tokens, 1024, "tokens per layer of the calibration draw (--oscar)");

namespace oscarkv {
namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

// Relative L2 error ‖a − b‖ / ‖b‖.
double RelError(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    e += double(a[i] - b[i]) * (a[i] - b[i]);
    n += double(b[i]) * b[i];
  }
  return std::sqrt(e / std::max(n, 1e-30));
}

// Attention over an uncompressed BF16 cache (the baseline an engine would run).
std::vector<float> Bf16Attention(const SyntheticLayer& L, int tokens, const float* q) {
  std::vector<float> out(size_t(L.num_q_heads) * L.head_dim);
  for (int h = 0; h < L.num_kv_heads; ++h) {
    AttendBf16KvHead(L.k.data(), L.v.data(), tokens, L.num_kv_heads, L.head_dim, L.num_q_heads,
                     1.0f / std::sqrt(float(L.head_dim)), q, out.data(), nullptr, h);
  }
  return out;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "oscarkv-demo: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

int Main() {
  const std::string server = absl::GetFlag(FLAGS_server);
  ClientOptions copts;
  copts.deadline = std::chrono::minutes(10);
  auto client = KvClient::Create(server, copts);
  auto info = client->Info();
  if (!info.ok()) {
    return Fail("cannot reach the server at " + server + " (start it with oscarkv-server)",
                info.status());
  }
  std::string model = absl::GetFlag(FLAGS_model);
  auto full = client->ModelLayoutOf(model);
  if (!full.ok()) return Fail("model", full.status());
  ModelLayout layout = *full;
  const int want_layers = absl::GetFlag(FLAGS_layers);
  if (want_layers > 0 && want_layers < layout.num_layers) {
    layout.num_layers = want_layers;
    const std::string reduced = absl::StrCat(model, "-", want_layers, "l");
    v1::LoadCalibrationRequest req;
    req.set_model(reduced);
    req.mutable_hadamard_layout()->set_num_layers(layout.num_layers);
    req.mutable_hadamard_layout()->set_num_q_heads(layout.num_q_heads);
    req.mutable_hadamard_layout()->set_num_kv_heads(layout.num_kv_heads);
    req.mutable_hadamard_layout()->set_head_dim(layout.head_dim);
    auto reg = client->LoadCalibration(req);
    if (!reg.ok() && reg.status().code() != absl::StatusCode::kAlreadyExists) {
      return Fail("registering " + reduced, reg.status());
    }
    std::printf("NOTE: using %d of %s's %d layers (model %s) to keep the demo short; "
                "--layers=0 runs all of them.\n",
                layout.num_layers, model.c_str(), full->num_layers, reduced.c_str());
    model = reduced;
  }
  const int T = absl::GetFlag(FLAGS_tokens);
  const int steps = std::max(1, absl::GetFlag(FLAGS_decode_steps));
  const int L = layout.num_layers;
  std::string id = absl::GetFlag(FLAGS_id);
  if (id.empty()) id = absl::StrCat("demo-", getpid());
  std::vector<int> probes;
  const int np = std::min(std::max(1, absl::GetFlag(FLAGS_probe_layers)), L);
  for (int i = 0; i < np; ++i) probes.push_back(np == 1 ? 0 : i * (L - 1) / (np - 1));

  std::printf("oscarkv demo against %s (backend %s)\n  model %s: %d layers, %d q heads, %d kv "
              "heads, head_dim %d; %d prefill tokens, %d decode steps\n",
              server.c_str(), info->backend_description().c_str(), model.c_str(), L,
              layout.num_q_heads, layout.num_kv_heads, layout.head_dim, T, steps);

  // ---- 1. prefill worker: generate layer by layer (one thread ahead) and stream.
  SyntheticSpec spec;
  spec.num_q_heads = layout.num_q_heads;
  spec.num_kv_heads = layout.num_kv_heads;
  spec.head_dim = layout.head_dim;
  spec.tokens = T + steps;  // the decode tokens continue the same stream
  spec.num_queries = steps;
  spec.seed = 2026;
  // ---- 0. OSCAR: calibrate on other tokens of the same distribution, register.
  if (absl::GetFlag(FLAGS_oscar)) {
    const auto t_cal = Clock::now();
    SyntheticSpec cal = spec;
    cal.tokens = std::max(256, absl::GetFlag(FLAGS_calib_tokens));
    cal.num_queries = cal.tokens;
    cal.sample_seed = 77;  // held out: the stored cache uses sample_seed 0
    ModelRotation rot;
    rot.layout = layout;
    rot.objective = "oscar";
    for (int l = 0; l < layout.num_layers; ++l) {
      auto data = GenerateSyntheticLayer(cal, l);
      if (!data.ok()) return Fail("calibration data", data.status());
      auto acts = ActivationsFromSynthetic(*data);
      if (!acts.ok()) return Fail("calibration data", acts.status());
      auto lr = CalibrateLayer(*acts, CalibrationOptions(), nullptr);
      if (!lr.ok()) return Fail("calibration", lr.status());
      rot.layers.push_back(std::move(*lr));
      std::printf("\r  calibrating OSCAR rotations: layer %d/%d", l + 1, layout.num_layers);
      std::fflush(stdout);
    }
    auto file = CalibrationToSafetensors(rot);
    if (!file.ok()) return Fail("calibration file", file.status());
    auto bytes = SerializeSafetensors(*file);
    if (!bytes.ok()) return Fail("calibration file", bytes.status());
    const std::string calibrated = model + "-oscar-demo";
    v1::LoadCalibrationRequest req;
    req.set_model(calibrated);
    req.set_content(*bytes);
    req.set_replace(true);
    auto reg = client->LoadCalibration(req);
    if (!reg.ok() && reg.status().code() == absl::StatusCode::kNotFound) {
      req.set_replace(false);
      reg = client->LoadCalibration(req);
    }
    if (!reg.ok() && reg.status().code() != absl::StatusCode::kFailedPrecondition) {
      return Fail("LoadCalibration", reg.status());
    }
    std::printf("\r  calibrated OSCAR rotations for %d layers on %d held-out tokens each in %.1f "
                "s; registered as model %s (%s)\n",
                layout.num_layers, cal.tokens,
                std::chrono::duration<double>(Clock::now() - t_cal).count(), calibrated.c_str(),
                reg.ok() ? ("rotation " + reg->rotation_id()).c_str() : "already in use");
    model = calibrated;
  }
  const size_t row = layout.kv_row_elems();
  const size_t qsize = size_t(layout.num_q_heads) * layout.head_dim;
  std::vector<SyntheticLayer> kept(L);  // probe layers whole; others: queries + decode tokens
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<int, SyntheticLayer>> ready;
  absl::Status gen_status;
  bool stop_generating = false;  // the stream failed: no one takes more layers
  std::thread generator([&] {
    for (int l = 0; l < L; ++l) {
      auto layer = GenerateSyntheticLayer(spec, l);
      std::unique_lock<std::mutex> lock(mu);
      if (!layer.ok()) {
        gen_status = layer.status();
        cv.notify_all();
        return;
      }
      cv.wait(lock, [&] { return ready.size() < 2 || stop_generating; });
      if (stop_generating) return;
      ready.emplace_back(l, std::move(*layer));
      cv.notify_all();
    }
  });
  // Ends the generator early (it may be waiting for room in `ready`).
  auto stop_generator = [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop_generating = true;
    }
    cv.notify_all();
    generator.join();
  };
  const auto t_put = Clock::now();
  auto stream = client->OpenPut(id, model, layout, /*pin=*/false, /*expected_tokens=*/T);
  if (!stream.ok()) {
    stop_generator();
    return Fail("PutKv", stream.status());
  }
  const int64_t chunk_tokens = std::max<int64_t>(1, client->PutChunkBytes() / int64_t(row * 4));
  for (int l = 0; l < L; ++l) {
    std::pair<int, SyntheticLayer> item;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !ready.empty() || !gen_status.ok(); });
      if (!gen_status.ok()) break;
      item = std::move(ready.front());
      ready.pop_front();
      cv.notify_all();
    }
    SyntheticLayer& s = item.second;
    for (int64_t t = 0; t < T; t += chunk_tokens) {
      const int64_t n = std::min<int64_t>(chunk_tokens, T - t);
      const absl::Status w = (*stream)->Write(l, t, n, s.k.data() + t * row, s.v.data() + t * row);
      if (!w.ok()) {
        stop_generator();
        return Fail("PutKv", w);
      }
    }
    if (std::find(probes.begin(), probes.end(), l) == probes.end()) {
      // Keep only what the decode worker needs: queries and decode tokens.
      s.k.erase(s.k.begin(), s.k.begin() + size_t(T) * row);
      s.v.erase(s.v.begin(), s.v.begin() + size_t(T) * row);
      s.k.shrink_to_fit();
      s.v.shrink_to_fit();
    }
    kept[l] = std::move(s);
    std::printf("\r  prefill: layer %d/%d streamed", l + 1, L);
    std::fflush(stdout);
  }
  generator.join();
  if (!gen_status.ok()) return Fail("synthetic data", gen_status);
  auto put = (*stream)->Finish();
  if (!put.ok()) return Fail("PutKv", put.status());
  const double put_s = std::chrono::duration<double>(Clock::now() - t_put).count();
  const double bf16_gib = double(put->bf16_bytes_sent) / (1 << 30);
  std::printf("\r  prefill: %d layers x %d tokens, %.2f GiB BF16 streamed and encoded in %.1f s "
              "(%.2f GiB/s, synthetic generation overlapped)\n",
              L, T, bf16_gib, put_s, bf16_gib / put_s);

  // ---- 2. decode worker: fused Append+Attend, one round trip per layer per step.
  auto session = client->OpenAttend();
  if (!session.ok()) return Fail("Attend", session.status());
  std::vector<double> rtt_ms, err_remote;
  std::vector<std::vector<float>> last_out(L);
  for (int s = 0; s < steps; ++s) {
    for (int l = 0; l < L; ++l) {
      const SyntheticLayer& sl = kept[l];
      const bool probe = std::find(probes.begin(), probes.end(), l) != probes.end();
      const size_t tok = probe ? size_t(T + s) : size_t(s);  // row of the new token
      AttendQuery q{id, l, sl.q.data() + size_t(s) * qsize, sl.k.data() + tok * row,
                    sl.v.data() + tok * row, int64_t(T + s)};
      const auto t0 = Clock::now();
      auto r = (*session)->Call({q}, {layout}, /*return_lse=*/true);
      rtt_ms.push_back(Ms(Clock::now() - t0));
      if (!r.ok()) return Fail("Attend", r.status());
      if (!(*r)[0].status.ok()) return Fail("Attend item", (*r)[0].status);
      last_out[l] = (*r)[0].out;
      if (probe) {
        err_remote.push_back(RelError((*r)[0].out, Bf16Attention(sl, T + s + 1, q.q)));
      }
    }
  }
  (void)(*session)->Close();
  std::printf("  decode: %d steps x %d layers of fused Append+Attend over %d tokens: round trip "
              "p50 %.2f ms, p99 %.2f ms per layer (%.1f ms per token for all layers)\n",
              steps, L, T + steps, Percentile(rtt_ms, 0.5), Percentile(rtt_ms, 0.99),
              Percentile(rtt_ms, 0.5) * L);

  // ---- 3. fetch COMPRESSED and attend locally.
  const auto t_get = Clock::now();
  auto fetched = client->GetKv(id, v1::KV_FORMAT_COMPRESSED, {}, /*include_rotation=*/true);
  if (!fetched.ok()) return Fail("GetKv", fetched.status());
  const double get_s = std::chrono::duration<double>(Clock::now() - t_get).count();
  const int64_t fetched_bytes = fetched->bytes_received;
  const v1::SequenceInfo stat = fetched->info;
  auto local = LocalAttention::Create(std::move(*fetched));
  if (!local.ok()) return Fail("local attention", local.status());
  std::vector<double> err_local, diff_local, local_ms;
  for (int l : probes) {
    const SyntheticLayer& sl = kept[l];
    const float* q = sl.q.data() + size_t(steps - 1) * qsize;
    std::vector<float> out(qsize), lse(layout.num_q_heads);
    const auto t0 = Clock::now();
    const absl::Status st = (*local)->Attend(l, q, out.data(), lse.data());
    local_ms.push_back(Ms(Clock::now() - t0));
    if (!st.ok()) return Fail("local attention", st);
    err_local.push_back(RelError(out, Bf16Attention(sl, T + steps, q)));
    diff_local.push_back(RelError(out, last_out[l]));
  }
  std::printf("  local: fetched %.1f MiB COMPRESSED (all layers, with rotations) in %.2f s; "
              "local attention %.2f ms per layer on this CPU\n",
              double(fetched_bytes) / (1 << 20), get_s, Percentile(local_ms, 0.5));

  // ---- the same probe layers through the codec locally with other rotations
  // (kernels/calib/fidelity, fp64): what the rotation buys.
  struct Method {
    const char* name;
    std::vector<double> err;
  };
  const std::string stored_name = stat.objective() + " (as stored)";
  std::vector<Method> methods = {
      {"no rotation", {}}, {"Hadamard", {}}, {stored_name.c_str(), {}}};
  {
    auto hadamard = HadamardRotation(layout);
    if (!hadamard.ok()) return Fail("Hadamard", hadamard.status());
    FidelityOptions fo;
    fo.sink_tokens = int(stat.tiers().sink_tokens());
    fo.recent_window = int(stat.recent_tokens());
    // One probe layer (the middle one): the fp64 reference over 32K tokens is
    // the slow part of the demo on a small CPU.
    for (int l : {probes[probes.size() / 2]}) {
      LayerRotation stored;
      stored.num_matrices = 1;
      const LayerRotation* rots[3] = {nullptr, &hadamard->layers[l], nullptr};
      const LayerRotation identity = IdentityLayerRotation(layout.head_dim, 0.96f, 0.92f);
      rots[0] = &identity;
      // The server's rotation for this layer, as GetKv shipped it.
      auto again = client->GetKv(id, v1::KV_FORMAT_COMPRESSED, {l}, true);
      if (!again.ok()) return Fail("GetKv", again.status());
      stored.num_matrices = again->layers[l].num_matrices;
      stored.r_k = again->layers[l].r_k;
      stored.r_v = again->layers[l].r_v;
      stored.clip_k = again->layers[l].clip_k;
      stored.clip_v = again->layers[l].clip_v;
      rots[2] = &stored;
      for (int m = 0; m < 3; ++m) {
        auto f = MeasureFidelity(kept[l], *rots[m], fo);
        if (!f.ok()) return Fail("fidelity", f.status());
        methods[m].err.push_back(f->output_rel_error);
      }
    }
  }

  // ---- summary
  const double bf16_bytes = double(T + steps) * L * row * 2 * 2;
  const double stored = double(stat.stored_bytes());
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0 : s / v.size();
  };
  auto maxv = [](const std::vector<double>& v) {
    return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
  };
  std::printf(
      "\nsummary (%s, %lld tokens, rotation %s)\n"
      "  memory: BF16 cache %.1f MiB -> stored %.1f MiB in the pool: %.1f%% saved (%.2fx), "
      "%.2f bits/element (sink %lld + recent %lld tokens per layer stay BF16)\n"
      "  attention error vs BF16 attention (relative L2, %zu probe layer-steps): server mean "
      "%.4f max %.4f; local mean %.4f; local vs server %.2g\n"
      "  latency: PutKv %.2f GiB/s, Attend p50 %.2f ms / p99 %.2f ms per layer, GetKv %.2f s\n",
      id.c_str(), (long long)stat.tokens(), stat.objective().c_str(), bf16_bytes / (1 << 20),
      stored / (1 << 20), 100.0 * (1.0 - stored / bf16_bytes), bf16_bytes / stored,
      stat.effective_bits(), (long long)stat.sink_tokens(), (long long)stat.recent_tokens(),
      err_remote.size(), mean(err_remote), maxv(err_remote), mean(err_local), maxv(diff_local),
      bf16_gib / put_s, Percentile(rtt_ms, 0.5), Percentile(rtt_ms, 0.99), get_s);
  std::printf("  rotation matters (probe layer %d, codec applied locally in fp64, relative L2 "
              "attention error vs BF16, %d decode queries):",
              probes[probes.size() / 2], steps);
  for (const Method& m : methods) {
    double s = 0;
    for (double e : m.err) s += e;
    std::printf(" %s %.4f%s", m.name, m.err.empty() ? 0.0 : s / m.err.size(),
                &m == &methods.back() ? "\n" : ";");
  }
  if (absl::GetFlag(FLAGS_keep)) {
    std::printf("\nkept sequence %s on the server.\n", id.c_str());
  } else {
    auto dropped = client->Drop(id);
    if (!dropped.ok()) return Fail("DropSequence", dropped.status());
  }
  std::printf(
      "\nPoint your own client at the server while it runs:\n"
      "  oscarkv info --server=%s        # backend, pool, models\n"
      "  oscarkv put  --server=%s --id my-seq --model %s kv.safetensors\n"
      "  C++: auto c = oscarkv::KvClient::Create(\"%s\"); c->PutSequence(...); "
      "c->OpenAttend(); c->GetKv(...)\n"
      "  metrics: curl http://<server host>:9464/metrics (its --metrics_listen); stop the "
      "server with Ctrl-C / SIGTERM\n",
      server.c_str(), server.c_str(), model.c_str(), server.c_str());
  return 0;
}

}  // namespace
}  // namespace oscarkv

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "oscarkv-demo --server=HOST:PORT: prefill -> fused decode attention -> compressed fetch "
      "against a running oscarkv-server");
  absl::FlagsUsageConfig usage;  // --help lists this file's flags (the binary name differs)
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "demo/oscarkv_demo.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  // Each finished line reaches a log file at once, also when the demo is
  // stopped part-way (a timeout used to swallow the buffered summary lines).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  return oscarkv::Main();
}
