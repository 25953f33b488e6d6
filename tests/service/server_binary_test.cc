// The real oscarkv-server binary as a child process: flags, health SERVING,
// reflection listing the services, a put/get/attend round trip, /metrics over
// HTTP, and a graceful exit on SIGTERM; the demo client against it when the
// server refuses its prefill.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <thread>

#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "service_fixture.h"

extern char** environ;

namespace oscarkv::testing {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

// Starts args[0] with its stderr (and its stdout too when `with_stdout`) into
// a pipe whose read end comes back in *read_fd (-1 when nothing started).
// Returns the child's pid, or -1.
pid_t SpawnWithPipe(std::vector<std::string> args, bool with_stdout, int* read_fd) {
  *read_fd = -1;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (with_stdout) posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    return -1;
  }
  *read_fd = fds[0];
  return pid;
}

class ChildServer {
 public:
  explicit ChildServer(std::vector<std::string> args) {
    args.insert(args.begin(), OSCARKV_SERVER_BINARY);
    int fd = -1;
    pid_ = SpawnWithPipe(std::move(args), /*with_stdout=*/false, &fd);
    if (fd >= 0 && (err_ = fdopen(fd, "r")) == nullptr) close(fd);
  }
  ~ChildServer() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (err_) fclose(err_);
  }
  // Reads stderr until the startup banner; returns the log read so far.
  std::string ReadBanner() {
    std::string log;
    char line[4096];
    while (err_ && fgets(line, sizeof(line), err_)) {
      log += line;
      if (log.find("metrics:") != std::string::npos || log.find("oscarkv-server: ") == 0 &&
          log.find("listening") == std::string::npos) {
        break;
      }
    }
    return log;
  }
  std::string ReadRest() {
    std::string log;
    char line[4096];
    while (err_ && fgets(line, sizeof(line), err_)) log += line;
    return log;
  }
  int Terminate() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  FILE* err_ = nullptr;
  bool reaped_ = false;
};

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, size_t(n));
  close(fd);
  return out;
}

TEST(ServerBinary, ServesHealthReflectionRpcsAndMetricsThenExitsOnSigterm) {
  ChildServer child({"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--backend=cpu",
                     "--pool_size=8MiB", "--model=tiny:2:8:2:64", "--sink_tokens=8",
                     "--recent_window=16", "--page_tokens=8", "--exact_fraction=0.5",
                     "--shutdown_grace_seconds=3"});
  ASSERT_GT(child.pid(), 0);
  const std::string banner = child.ReadBanner();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(banner, m, std::regex("listening on port (\\d+)"))) << banner;
  const int port = std::stoi(m[1]);
  ASSERT_TRUE(std::regex_search(banner, m, std::regex("/metrics \\(port (\\d+)\\)"))) << banner;
  const int metrics_port = std::stoi(m[1]);
  const std::string target = "127.0.0.1:" + std::to_string(port);
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());

  // Health: SERVING.
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ASSERT_TRUE(health->Check(&ctx, hreq, &hresp).ok());
    EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // Reflection lists our service and health.
  {
    auto refl = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
    grpc::ClientContext ctx;
    auto stream = refl->ServerReflectionInfo(&ctx);
    grpc::reflection::v1alpha::ServerReflectionRequest req;
    req.set_list_services("");
    ASSERT_TRUE(stream->Write(req));
    grpc::reflection::v1alpha::ServerReflectionResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    std::vector<std::string> names;
    for (const auto& s : resp.list_services_response().service()) names.push_back(s.name());
    EXPECT_THAT(names, Contains("oscarkv.v1.KvCache"));
    EXPECT_THAT(names, Contains("grpc.health.v1.Health"));
    // The health service's descriptor is resolvable too.
    grpc::reflection::v1alpha::ServerReflectionRequest file_req;
    file_req.set_file_containing_symbol("grpc.health.v1.Health");
    ASSERT_TRUE(stream->Write(file_req));
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_TRUE(resp.has_file_descriptor_response()) << resp.DebugString();
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  // A round trip through the client library.
  auto client = KvClient::Create(target);
  const KvData data = MakeKv(TinyLayout(), 70, 1);
  ASSERT_TRUE(client->PutSequence("bin", kTinyModel, TinyLayout(), 70, data.k.data(), data.v.data()).ok());
  auto got = client->GetKv("bin", v1::KV_FORMAT_BF16);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->layers[1].k.size(), data.row() * 70);
  const std::vector<float> q = RandomQuery(TinyLayout(), 2);
  auto att = client->Attend({AttendQuery{"bin", 0, q.data()}}, TinyLayout(), true);
  ASSERT_TRUE(att.ok() && (*att)[0].status.ok());
  EXPECT_EQ((*att)[0].tokens, 70);

  const std::string metrics = HttpGet(metrics_port, "/metrics");
  EXPECT_THAT(metrics, HasSubstr("oscarkv_sequences{state=\"committed\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("oscarkv_rpc_duration_seconds_count{code=\"OK\",method=\"PutKv\"} 1"));

  // SIGTERM: graceful stop and exit 0 within the grace period (idle client
  // connections, like this test's, hold the drain until the grace deadline at
  // most) plus the metrics exposer's ~2 s teardown.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(child.Terminate(), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3 + 4));
  EXPECT_THAT(child.ReadRest(), HasSubstr("stopped"));
}

TEST(ServerBinary, FractionalPoolSizeSaysWhichMemoryItIsOf) {
  ChildServer child({"--listen=127.0.0.1:0", "--metrics_listen=", "--backend=cpu",
                     "--pool_size=0.001", "--model=tiny:2:8:2:64"});
  ASSERT_GT(child.pid(), 0);
  const std::string banner = child.ReadBanner();
  EXPECT_THAT(banner, HasSubstr("(0.001 of "));
  EXPECT_THAT(banner, HasSubstr("MiB available host memory)"));
  EXPECT_THAT(banner, HasSubstr("LoadCalibration by path: off (--calibration_dir)"));
  EXPECT_THAT(banner, HasSubstr("limits: 64 models, streams idle at most 60000 ms"));
  EXPECT_EQ(child.Terminate(), 0);
}

TEST(ServerBinary, BadPoolSizeExitsNamingIt) {
  ChildServer child({"--listen=127.0.0.1:0", "--metrics_listen=", "--pool_size=0.5x"});
  ASSERT_GT(child.pid(), 0);
  EXPECT_THAT(child.ReadRest(), HasSubstr("pool size '0.5x': unknown unit 'x'"));
  int status = 0;
  waitpid(child.pid(), &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2);
}

TEST(ServerBinary, ModelLimitAndStreamIdleTimeoutFlagsAreCheckedAndShown) {
  for (const auto& [flag, message] :
       std::vector<std::pair<std::string, std::string>>{
           {"--max_models=0", "--max_models must be >= 1, got 0"},
           {"--stream_idle_timeout_ms=-5", "--stream_idle_timeout_ms must be >= 0"},
           {"--stream_idle_timeout_ms=9223372036854775807", "and at most 604800000 (a week)"}}) {
    ChildServer child({"--listen=127.0.0.1:0", "--metrics_listen=", flag});
    ASSERT_GT(child.pid(), 0);
    EXPECT_THAT(child.ReadRest(), HasSubstr(message));
    int status = 0;
    waitpid(child.pid(), &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << flag;
  }
  ChildServer child({"--listen=127.0.0.1:0", "--metrics_listen=", "--backend=cpu",
                     "--pool_size=16MiB", "--model=tiny:2:8:2:64", "--max_models=3",
                     "--stream_idle_timeout_ms=0"});
  ASSERT_GT(child.pid(), 0);
  EXPECT_THAT(child.ReadBanner(), HasSubstr("limits: 3 models, streams idle without limit"));
  EXPECT_EQ(child.Terminate(), 0);
}

TEST(ServerBinary, BadFlagsExitWithAClearMessage) {
  ChildServer child({"--listen=127.0.0.1:0", "--metrics_listen=", "--eviction=sometimes"});
  ASSERT_GT(child.pid(), 0);
  const std::string log = child.ReadRest();
  EXPECT_THAT(log, HasSubstr("--eviction must be lru or refuse"));
  int status = 0;
  waitpid(child.pid(), &status, 0);
}

#ifdef OSCARKV_DEMO_BINARY
struct ChildResult {
  bool exited = false;  // false: still running at the deadline (killed)
  int code = -1;
  std::string output;  // stdout and stderr
};

// Runs a program with stdout and stderr into one pipe; kills it at the deadline.
ChildResult RunWithDeadline(std::vector<std::string> args, std::chrono::seconds limit) {
  ChildResult r;
  int out_fd = -1;
  const pid_t pid = SpawnWithPipe(std::move(args), /*with_stdout=*/true, &out_fd);
  if (pid < 0) return r;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{out_fd, POLLIN, 0};
    if (poll(&p, 1, 50) > 0) {
      const ssize_t n = read(out_fd, buf, sizeof(buf));
      if (n <= 0) break;  // EOF: the child closed its output
      r.output.append(buf, size_t(n));
    }
  }
  int status = 0;
  do {  // at least once, also when the output ended right at the deadline
    if (waitpid(pid, &status, WNOHANG) == pid) {
      r.exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  if (!r.exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  } else if (WIFEXITED(status)) {
    r.code = WEXITSTATUS(status);
  }
  close(out_fd);
  return r;
}

// A prefill the server refuses part-way (its pool is far too small): the demo
// says why and exits 1. It used to hang: its generator thread waited for room
// in the queue that the failed stream would never drain.
TEST(ServerBinary, DemoReportsARefusedPrefillAndExits) {
  ChildServer server({"--listen=127.0.0.1:0", "--metrics_listen=", "--backend=cpu",
                      "--pool_size=2MiB", "--model=deep:8:8:2:64"});
  ASSERT_GT(server.pid(), 0);
  const std::string banner = server.ReadBanner();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(banner, m, std::regex("listening on port (\\d+)"))) << banner;
  const ChildResult demo =
      RunWithDeadline({OSCARKV_DEMO_BINARY, "--server=127.0.0.1:" + std::string(m[1]),
                       "--model=deep", "--tokens=8192", "--oscar=false"},
                      std::chrono::seconds(60));
  EXPECT_TRUE(demo.exited) << "the demo hung:\n" << demo.output;
  EXPECT_EQ(demo.code, 1) << demo.output;
  EXPECT_THAT(demo.output, HasSubstr("PutKv: RESOURCE_EXHAUSTED"));
  EXPECT_EQ(server.Terminate(), 0);
}
#endif  // OSCARKV_DEMO_BINARY

}  // namespace
}  // namespace oscarkv::testing
