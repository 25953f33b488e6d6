#include "server/oscarkv_server.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/status_macros.h"
#include "server/service/calibration_path.h"
#ifdef OSCARKV_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace oscarkv {
namespace {

// "unix:PATH" / "unix://PATH" (a socket file) or "unix-abstract:NAME".
bool IsUnixSocketAddress(const std::string& address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

// True if a server accepts connections on the socket file of a "unix:"
// address. (An abstract name cannot be bound twice: gRPC reports that one.)
bool UnixSocketAnswers(const std::string& address) {
  if (!absl::StartsWith(address, "unix:")) return false;
  std::string path = address.substr(5);
  if (absl::StartsWith(path, "//")) path = path.substr(2);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return false;
  const bool answers = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return answers;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& kind, int cpu_threads,
                                                       int cuda_device) {
  if (kind == "cpu") return std::unique_ptr<Backend>(new CpuBackend(cpu_threads));
  if (kind == "cuda" || kind == "auto") {
#ifdef OSCARKV_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<Backend>> cuda = CreateCudaBackend(cuda_device);
    if (cuda.ok() || kind == "cuda") return cuda;
#else
    (void)cuda_device;
    if (kind == "cuda") {
      return absl::FailedPreconditionError(
          "--backend=cuda, but this build has no CUDA backend (nvcc was not found)");
    }
#endif
    return std::unique_ptr<Backend>(new CpuBackend(cpu_threads));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", kind, "' (expected auto, cpu or cuda)"));
}

absl::StatusOr<PoolSize> ParsePoolSize(const std::string& text) {
  std::string t = text;
  t.erase(std::remove_if(t.begin(), t.end(), ::isspace), t.end());
  size_t split = 0;
  while (split < t.size() && (std::isdigit(static_cast<unsigned char>(t[split])) || t[split] == '.')) {
    ++split;
  }
  double value = 0;
  if (split == 0 || !absl::SimpleAtod(t.substr(0, split), &value) || value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool size '", text,
                                                   "' must be bytes (e.g. 2GiB) or a fraction "
                                                   "in (0, 1) of available memory"));
  }
  std::string unit = t.substr(split);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    mult = 1024.0;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    mult = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tib" || unit == "tb") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("pool size '", text, "': unknown unit '",
                                                   unit, "' (use B, KiB, MiB, GiB, TiB)"));
  }
  PoolSize size;
  if (unit.empty() && value < 1.0) {
    size.fraction = value;  // of the backend's memory, known once it exists
  } else {
    const double bytes = value * mult;
    if (!(bytes < 0x1p63)) {  // also catches inf and NaN
      return absl::InvalidArgumentError(
          absl::StrCat("pool size '", text, "' is larger than this server can address"));
    }
    size.bytes = static_cast<size_t>(bytes);
  }
  return size;
}

absl::StatusOr<size_t> ResolvePoolBytes(const ServerOptions& options, const Backend& backend,
                                        std::string* note) {
  if (note != nullptr) note->clear();
  const double fraction = options.pool_size.fraction;
  if (fraction == 0) return options.pool_size.bytes;
  if (!(fraction > 0 && fraction < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool fraction ", fraction, " must be in (0, 1) of available memory"));
  }
  const std::string memory = backend.AvailableMemoryName();
  absl::StatusOr<size_t> available = backend.AvailableBytes();
  if (!available.ok()) {
    return absl::Status(available.status().code(),
                        absl::StrCat("pool size ", fraction, " of ", memory, ": ",
                                     available.status().message()));
  }
  const size_t bytes = static_cast<size_t>(fraction * double(*available));
  if (note != nullptr) {
    *note = absl::StrCat(fraction, " of ", *available >> 20, " MiB ", memory);
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<OscarkvServer>> OscarkvServer::Start(
    const ServerOptions& options, std::shared_ptr<prometheus::Registry> registry,
    CalibrationReader calibration_reader) {
  if (options.attend_inline_items < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attend_inline_items must be -1 (auto) or a count >= 0, got ",
        options.attend_inline_items));
  }
  if (options.max_models < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_models must be >= 1, got ", options.max_models));
  }
  if (options.stream_idle_timeout.count() < 0 ||
      options.stream_idle_timeout > kMaxStreamIdleTimeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream idle timeout must be in [0, ", kMaxStreamIdleTimeout.count(),
        "] ms (0: none), got ", options.stream_idle_timeout.count()));
  }
  std::unique_ptr<OscarkvServer> s(new OscarkvServer(options.max_models));
  OSCARKV_ASSIGN_OR_RETURN(s->backend_,
                           CreateBackend(options.backend, options.cpu_threads, options.cuda_device));
  OSCARKV_RETURN_IF_ERROR(ValidateTiers(options.tiers));
  // After the backend: a fraction is of its memory (the GPU's for CUDA).
  OSCARKV_ASSIGN_OR_RETURN(const size_t pool_bytes,
                           ResolvePoolBytes(options, *s->backend_, &s->pool_size_note_));
  std::string calibration_dir;
  if (!options.calibration_dir.empty()) {
    OSCARKV_ASSIGN_OR_RETURN(calibration_dir, RealCalibrationDir(options.calibration_dir));
  }
  if (options.models.empty()) return absl::InvalidArgumentError("no model to serve (--model)");
  if (options.models.size() > static_cast<size_t>(options.max_models)) {
    return absl::InvalidArgumentError(absl::StrCat("--model names ", options.models.size(),
                                                   " models, more than --max_models ",
                                                   options.max_models));
  }

  // Calibration files by model name.
  std::vector<std::pair<std::string, std::string>> calibs;
  for (const std::string& c : options.calibrations) {
    std::vector<std::string> kv = absl::StrSplit(c, absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].empty() || kv[1].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("calibration '", c, "' must be model=path"));
    }
    calibs.emplace_back(kv[0], kv[1]);
  }
  size_t page_bytes = 0, block_bytes = 0;
  for (const std::string& spec : options.models) {
    OSCARKV_ASSIGN_OR_RETURN(auto parsed, ParseModelSpec(spec));
    ModelRotation rotation;
    auto calib = std::find_if(calibs.begin(), calibs.end(),
                              [&](const auto& c) { return c.first == parsed.first; });
    if (calib != calibs.end()) {
      if (!calibration_reader) {
        return absl::FailedPreconditionError(
            "this build has no calibration file reader; drop --calibration");
      }
      OSCARKV_ASSIGN_OR_RETURN(rotation, calibration_reader(calib->second, true, &parsed.second));
      if (!(rotation.layout == parsed.second)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "calibration ", calib->second, " is for layout ", rotation.layout.DebugString(),
            " but model ", parsed.first, " is ", parsed.second.DebugString()));
      }
    } else {
      OSCARKV_ASSIGN_OR_RETURN(rotation,
                               HadamardRotation(parsed.second, options.clip_k, options.clip_v));
    }
    OSCARKV_ASSIGN_OR_RETURN(auto entry, MakeModelEntry(parsed.first, std::move(rotation),
                                                        options.tiers, options.group_size,
                                                        *s->backend_));
    page_bytes = std::max(page_bytes, entry->geom.page_bytes());
    block_bytes = std::max(block_bytes, entry->geom.exact_block_bytes());
    OSCARKV_RETURN_IF_ERROR(s->models_.Register(std::move(entry), /*replace=*/false));
  }
  for (const auto& c : calibs) {
    if (!s->models_.Find(c.first).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration for '", c.first, "', which no --model names"));
    }
  }

  PoolOptions pool_options;
  pool_options.total_bytes = pool_bytes;
  pool_options.exact_fraction = options.exact_fraction;
  pool_options.page_bytes = page_bytes;
  pool_options.block_bytes = block_bytes;
  OSCARKV_ASSIGN_OR_RETURN(s->pool_, PagePool::Create(s->backend_.get(), pool_options));
  s->store_ = std::make_unique<SequenceStore>(s->backend_.get(), s->pool_.get(), &s->models_,
                                              options.eviction);
  for (const auto& m : s->models_.List()) OSCARKV_RETURN_IF_ERROR(s->store_->ProbeModel(*m));

  s->registry_ = std::move(registry);
  if (s->registry_) {
    s->metrics_ = std::make_unique<ServerMetrics>(*s->registry_);
    OscarkvServer* self = s.get();
    s->collectable_ = MakeRefreshingCollectable(s->registry_, [self] {
      self->metrics_->Refresh(self->store_->Stats(), self->models_.List());
    });
  }

  ServiceContext ctx;
  ctx.store = s->store_.get();
  ctx.models = &s->models_;
  ctx.backend = s->backend_.get();
  ctx.metrics = s->metrics_.get();
  s->executor_ = std::make_unique<ComputeExecutor>(options.compute_threads);
  ctx.executor = s->executor_.get();
  ctx.attend_inline_items = options.attend_inline_items >= 0 ? options.attend_inline_items
                            : s->backend_->ComputesOnHost() ? 0
                                                            : kAttendInlineItems;
  ctx.calibration_reader = std::move(calibration_reader);
  ctx.calibration_dir = std::move(calibration_dir);
  ctx.tiers = options.tiers;
  ctx.group_size = options.group_size;
  ctx.clip_k = options.clip_k;
  ctx.clip_v = options.clip_v;
  ctx.max_message_bytes = options.max_message_bytes;
  ctx.stream_idle_timeout = options.stream_idle_timeout;
  ctx.version = options.version;
  s->service_ = std::make_unique<KvCacheService>(std::move(ctx));

  const bool unix_socket = IsUnixSocketAddress(options.listen_address);
  if (unix_socket && UnixSocketAnswers(options.listen_address)) {
    // gRPC would unlink the socket file and take the address over silently.
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               ": another server answers there (in use)"));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address, " (in use or invalid)"));
  }
  if (unix_socket) {
    // A socket has no port: gRPC's selected_port holds 1 there (it only says
    // the bind worked), so port() answers 0 and address() the socket.
    s->unix_socket_ = options.listen_address;
    s->port_ = 0;
  }
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  return s;
}

void OscarkvServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->Shutdown(deadline);
}

void OscarkvServer::Wait() {
  if (server_) server_->Wait();
}

OscarkvServer::~OscarkvServer() {
  Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  Wait();
}

}  // namespace oscarkv
