// Spreads sequences over several oscarkv servers by rendezvous (highest
// random weight) hashing of the sequence id: every client with the same
// server list picks the same server for a sequence, and adding or removing a
// server moves only the sequences that hashed to it.
//
// Thread-safety: as KvClient.
#ifndef OSCARKV_CLIENT_SHARDED_CLIENT_H_
#define OSCARKV_CLIENT_SHARDED_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "client/kv_client.h"

namespace oscarkv {

// Index of the server that owns `sequence_id` among `servers` (-1 if empty).
int RendezvousPick(const std::vector<std::string>& servers, const std::string& sequence_id);

class ShardedClient {
 public:
  // Precondition: `targets` is not empty.
  ShardedClient(const std::vector<std::string>& targets, ClientOptions options = {});

  size_t size() const { return clients_.size(); }
  KvClient& shard(size_t i) { return *clients_[i]; }
  // The client owning a sequence.
  KvClient& For(const std::string& sequence_id);

  absl::StatusOr<PutResult> PutSequence(const std::string& sequence_id, const std::string& model,
                                        const ModelLayout& layout, int64_t tokens,
                                        const bf16_bits* k, const bf16_bits* v, bool pin = false);
  absl::StatusOr<int64_t> Append(const std::string& sequence_id, const ModelLayout& layout,
                                 int layer, int64_t start_token, int64_t n, const bf16_bits* k,
                                 const bf16_bits* v);
  absl::StatusOr<FetchedSequence> GetKv(const std::string& sequence_id, v1::KvFormat format,
                                        const std::vector<int>& layers = {});
  // Splits the batch by owner, one Attend round trip per server involved (all
  // in flight at once), results in the order of `queries`. A server whose call
  // fails sets that status on its own items; the others keep their results.
  absl::StatusOr<std::vector<AttendOutput>> Attend(const std::vector<AttendQuery>& queries,
                                                   const ModelLayout& layout, bool return_lse);
  absl::StatusOr<int64_t> Drop(const std::string& sequence_id);
  absl::StatusOr<v1::SequenceInfo> Stat(const std::string& sequence_id);
  // Every server's sequences, merged and ordered by id.
  absl::StatusOr<std::vector<v1::SequenceInfo>> List(const std::string& model = "");

 private:
  std::vector<std::string> targets_;
  std::vector<std::unique_ptr<KvClient>> clients_;
};

}  // namespace oscarkv

#endif  // OSCARKV_CLIENT_SHARDED_CLIENT_H_
