#include "client/sharded_client.h"

#include <algorithm>
#include <cstdint>
#include <future>

#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

// FNV-1a 64 followed by a splitmix64 finalizer: stable across platforms and
// builds (std::hash is not).
uint64_t Hash64(const std::string& a, const std::string& b) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const std::string& s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 1099511628211ull;
    }
  };
  mix(a);
  h ^= 0xff;
  h *= 1099511628211ull;
  mix(b);
  h += 0x9e3779b97f4a7c15ull;
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

}  // namespace

int RendezvousPick(const std::vector<std::string>& servers, const std::string& sequence_id) {
  int best = -1;
  uint64_t best_score = 0;
  for (size_t i = 0; i < servers.size(); ++i) {
    const uint64_t score = Hash64(servers[i], sequence_id);
    if (best < 0 || score > best_score) {
      best = int(i);
      best_score = score;
    }
  }
  return best;
}

ShardedClient::ShardedClient(const std::vector<std::string>& targets, ClientOptions options)
    : targets_(targets) {
  for (const std::string& t : targets) clients_.push_back(KvClient::Create(t, options));
}

KvClient& ShardedClient::For(const std::string& sequence_id) {
  return *clients_[RendezvousPick(targets_, sequence_id)];
}

absl::StatusOr<PutResult> ShardedClient::PutSequence(const std::string& id,
                                                     const std::string& model,
                                                     const ModelLayout& layout, int64_t tokens,
                                                     const bf16_bits* k, const bf16_bits* v,
                                                     bool pin) {
  return For(id).PutSequence(id, model, layout, tokens, k, v, pin);
}

absl::StatusOr<int64_t> ShardedClient::Append(const std::string& id, const ModelLayout& layout,
                                              int layer, int64_t start, int64_t n,
                                              const bf16_bits* k, const bf16_bits* v) {
  return For(id).Append(id, layout, layer, start, n, k, v);
}

absl::StatusOr<FetchedSequence> ShardedClient::GetKv(const std::string& id, v1::KvFormat format,
                                                     const std::vector<int>& layers) {
  return For(id).GetKv(id, format, layers);
}

absl::StatusOr<std::vector<AttendOutput>> ShardedClient::Attend(
    const std::vector<AttendQuery>& queries, const ModelLayout& layout, bool return_lse) {
  std::vector<std::vector<size_t>> by_shard(clients_.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    by_shard[RendezvousPick(targets_, queries[i].sequence_id)].push_back(i);
  }
  // One round trip per server involved, all in flight at once, so that the
  // servers compute in parallel.
  std::vector<std::future<absl::StatusOr<std::vector<AttendOutput>>>> pending(clients_.size());
  for (size_t s = 0; s < clients_.size(); ++s) {
    if (by_shard[s].empty()) continue;
    std::vector<AttendQuery> part;
    for (size_t i : by_shard[s]) part.push_back(queries[i]);
    pending[s] = clients_[s]->AttendAsync(std::move(part), layout, return_lse);
  }
  // A server whose call failed fails its own items only: the other servers
  // may already have applied their fused appends, so the batch is not redone.
  std::vector<AttendOutput> out(queries.size());
  for (size_t s = 0; s < clients_.size(); ++s) {
    if (!pending[s].valid()) continue;
    absl::StatusOr<std::vector<AttendOutput>> res = pending[s].get();
    for (size_t j = 0; j < by_shard[s].size(); ++j) {
      if (res.ok()) {
        out[by_shard[s][j]] = std::move((*res)[j]);
      } else {
        out[by_shard[s][j]].status = res.status();
      }
    }
  }
  return out;
}

absl::StatusOr<int64_t> ShardedClient::Drop(const std::string& id) { return For(id).Drop(id); }

absl::StatusOr<v1::SequenceInfo> ShardedClient::Stat(const std::string& id) {
  return For(id).Stat(id);
}

absl::StatusOr<std::vector<v1::SequenceInfo>> ShardedClient::List(const std::string& model) {
  std::vector<v1::SequenceInfo> all;
  for (auto& c : clients_) {
    OSCARKV_ASSIGN_OR_RETURN(std::vector<v1::SequenceInfo> part, c->List(model));
    for (auto& s : part) all.push_back(std::move(s));
  }
  std::sort(all.begin(), all.end(), [](const v1::SequenceInfo& a, const v1::SequenceInfo& b) {
    return a.sequence_id() < b.sequence_id();
  });
  return all;
}

}  // namespace oscarkv
