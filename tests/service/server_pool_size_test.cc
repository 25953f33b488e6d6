// --pool_size: bytes with a unit, or a fraction of the backend's available
// memory (host memory for CPU, free device memory for CUDA) resolved once the
// backend exists; bad values are refused naming the value.
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "service_fixture.h"

namespace oscarkv::testing {
namespace {

using ::testing::HasSubstr;

size_t PhysicalHostBytes() {
  return size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
}

TEST(PoolSize, BytesWithUnitsParseToBytes) {
  auto mib = ParsePoolSize("512MiB");
  ASSERT_TRUE(mib.ok()) << mib.status();
  EXPECT_EQ(mib->bytes, size_t{512} << 20);
  EXPECT_EQ(mib->fraction, 0);
  auto plain = ParsePoolSize("1073741824");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->bytes, size_t{1} << 30);
  auto g = ParsePoolSize("1.5G");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->bytes, size_t{3} << 29);
}

TEST(PoolSize, FractionIsKeptForTheBackendToResolve) {
  auto half = ParsePoolSize("0.5");
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(half->fraction, 0.5);
  EXPECT_EQ(half->bytes, 0u);
}

TEST(PoolSize, BadValuesAreInvalidArgumentNamingTheValue) {
  for (const std::string bad : {"0", "-0.5", "abc", "", "0.0"}) {
    auto p = ParsePoolSize(bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr("'" + bad + "'")) << bad;
  }
  auto unit = ParsePoolSize("0.5x");
  EXPECT_EQ(unit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unit.status().message()), HasSubstr("unknown unit 'x'"));
  // Beyond what a size_t holds: an error, not an undefined conversion.
  for (const std::string huge : {"100000000000T", "1e30", "inf"}) {
    auto p = ParsePoolSize(huge);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << huge;
  }
}

TEST(PoolSize, FractionOnCpuIsOfAvailableHostMemory) {
  CpuBackend cpu(1);
  ServerOptions o;
  o.pool_size.fraction = 0.5;
  std::string note;
  auto bytes = ResolvePoolBytes(o, cpu, &note);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto available = cpu.AvailableBytes();
  ASSERT_TRUE(available.ok()) << available.status();
  EXPECT_GT(*bytes, 0u);
  EXPECT_LE(*bytes, *available);  // half of it a moment ago
  EXPECT_LE(*available, PhysicalHostBytes());
  EXPECT_THAT(note, HasSubstr("0.5 of "));
  EXPECT_THAT(note, HasSubstr("available host memory"));
}

TEST(PoolSize, BytesAreUsedAsGivenWithoutANote) {
  CpuBackend cpu(1);
  ServerOptions o;
  o.pool_size.bytes = size_t{3} << 20;
  std::string note = "stale";
  auto bytes = ResolvePoolBytes(o, cpu, &note);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, size_t{3} << 20);
  EXPECT_EQ(note, "");
}

TEST(PoolSize, FractionOutsideZeroOneIsInvalidArgument) {
  CpuBackend cpu(1);
  ServerOptions o;
  for (double bad : {1.5, 1.0, -0.25}) {
    o.pool_size.fraction = bad;
    auto bytes = ResolvePoolBytes(o, cpu, nullptr);
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(bytes.status().message()), HasSubstr("must be in (0, 1)"));
  }
}

// A backend that keeps Backend's default AvailableBytes (it cannot tell its
// free memory); everything else is the CPU backend's.
class BackendWithoutMemoryReport final : public CpuBackendWrapper {
 public:
  std::string name() const override { return "opaque"; }
};

TEST(PoolSize, FractionOfABackendThatCannotReportItsMemoryIsUnimplemented) {
  BackendWithoutMemoryReport backend;
  ServerOptions o;
  o.pool_size.fraction = 0.5;
  auto bytes = ResolvePoolBytes(o, backend, nullptr);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(bytes.status().message()),
              HasSubstr("backend opaque cannot report its available memory; give the pool size "
                        "in bytes"));
  o.pool_size.fraction = 0;
  o.pool_size.bytes = size_t{1} << 20;  // bytes need no report
  auto given = ResolvePoolBytes(o, backend, nullptr);
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(*given, size_t{1} << 20);
}

TEST(PoolSize, ServerSizesItsPoolFromTheBackendsMemory) {
  ServerOptions o = TinyServerOptions();
  o.tiers = TierConfig{32, 64, 32};  // pages of 32 tokens: the CUDA backend serves them too
  o.pool_size.fraction = 0.001;
  TestServer ts(o);
  ASSERT_NE(ts.server, nullptr);
  const Backend& backend = ts.server->backend();
  EXPECT_GT(ts.server->pool().total_bytes(), 0u);
  EXPECT_THAT(ts.server->pool_size_note(), HasSubstr("0.001 of "));
  if (backend.name() == "cpu") {
    EXPECT_LE(ts.server->pool().total_bytes(), PhysicalHostBytes() / 1000);
    EXPECT_THAT(ts.server->pool_size_note(), HasSubstr("available host memory"));
  } else {
    EXPECT_THAT(ts.server->pool_size_note(), HasSubstr("device memory"));
  }
  auto info = ts.client->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(size_t(info->pool().total_bytes()), ts.server->pool().total_bytes());
}

}  // namespace
}  // namespace oscarkv::testing
