// Test helper: opens a PutKv stream to argv[1] for sequence argv[2] (model
// "tiny"), sends some chunks, then kills itself with SIGKILL mid-stream.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <thread>
#include <vector>

#include "client/kv_client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: put_and_die host:port sequence_id\n");
    return 2;
  }
  const oscarkv::ModelLayout layout{2, 8, 2, 64};
  auto client = oscarkv::KvClient::Create(argv[1]);
  auto stream = client->OpenPut(argv[2], "tiny", layout, false, /*expected_tokens=*/0);
  if (!stream.ok()) return 3;
  std::vector<oscarkv::bf16_bits> k(40 * 128, 0x3f80), v(40 * 128, 0x3f80);
  for (int l = 0; l < 2; ++l) {
    if (!(*stream)->Write(l, 0, 40, k.data(), v.data()).ok()) return 4;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the chunks land
  std::fprintf(stdout, "sent\n");
  std::fflush(stdout);
  kill(getpid(), SIGKILL);
  return 0;
}
