#include "server/group/trainer_collectives.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/collective/collective_engine.h"
#include "server/group/group.h"
#include "server/group/group_table.h"

namespace flatshard::server {
namespace {

// The "units" of the two phases (in each collective's fingerprint; the shards' units are
// >= 0, the agreements of End and Commit -2 and -3): a rank that all-reduces while another
// commits fails with a mismatch instead of exchanging the wrong records.
constexpr int64_t kHeaderUnit = -16;
constexpr int64_t kDataUnit = -17;

enum class Kind : uint8_t { kAllReduce = 1, kBroadcast = 2 };

const char* KindName(uint8_t kind) {
  return kind == static_cast<uint8_t>(Kind::kAllReduce) ? "AllReduce" : "Broadcast";
}
const char* OpName(uint8_t op) {
  switch (static_cast<ValuesOp>(op)) {
    case ValuesOp::kSum:
      return "sum";
    case ValuesOp::kMax:
      return "max";
    case ValuesOp::kMin:
      return "min";
  }
  return "unknown";
}
const char* TypeName(uint8_t type) {
  return type == static_cast<uint8_t>(ValuesType::kFloat64) ? "float64" : "float32";
}

template <typename T>
void ReduceInRankOrder(const std::string& all, int32_t world_size, ValuesOp op, std::string* out) {
  const size_t n = out->size() / sizeof(T);
  std::vector<T> acc(n), next(n);
  std::memcpy(acc.data(), all.data(), n * sizeof(T));
  for (int32_t r = 1; r < world_size; ++r) {
    std::memcpy(next.data(), all.data() + static_cast<size_t>(r) * n * sizeof(T), n * sizeof(T));
    for (size_t i = 0; i < n; ++i) {
      switch (op) {
        case ValuesOp::kSum:
          acc[i] += next[i];
          break;
        case ValuesOp::kMax:  // NaN wins, as torch's max
          acc[i] = (acc[i] != acc[i] || acc[i] > next[i]) ? acc[i] : next[i];
          break;
        case ValuesOp::kMin:
          acc[i] = (acc[i] != acc[i] || acc[i] < next[i]) ? acc[i] : next[i];
          break;
      }
    }
  }
  std::memcpy(out->data(), acc.data(), n * sizeof(T));
}

}  // namespace

// What each rank all-gathers first: every rank checks every header alike.
struct TrainerCollectives::Header {
  uint8_t ok = 1;  // 0: this rank's input is bad (text says why)
  uint8_t kind = 0;
  uint8_t op = 0;    // AllReduce
  uint8_t type = 0;  // AllReduce
  int32_t root = 0;  // Broadcast
  uint64_t bytes = 0;
  char text[112] = {};
};

void TrainerCollectives::AllReduce(const Caller& caller, ValuesType type, ValuesOp op,
                                   std::string values, absl::Time deadline, BytesCallback done) {
  Header h;
  h.kind = static_cast<uint8_t>(Kind::kAllReduce);
  h.op = static_cast<uint8_t>(op);
  h.type = static_cast<uint8_t>(type);
  h.bytes = values.size();
  const size_t item = type == ValuesType::kFloat64 ? 8 : 4;
  std::string why;
  if (op != ValuesOp::kSum && op != ValuesOp::kMax && op != ValuesOp::kMin) {
    why = "op is not sum, max or min";
  } else if (type != ValuesType::kFloat32 && type != ValuesType::kFloat64) {
    why = "dtype is not float32 or float64";
  } else if (values.size() % item != 0) {
    why = absl::StrCat(values.size(), " bytes are not whole ", TypeName(h.type), " values");
  } else if (values.size() > kMaxAllReduceBytes) {
    why = absl::StrCat(values.size(), " bytes exceed the limit of ", kMaxAllReduceBytes);
  }
  if (!why.empty()) {
    h.ok = 0;
    std::memcpy(h.text, why.data(), std::min(why.size(), sizeof(h.text) - 1));
  }
  Run(caller, h, std::move(values), deadline, std::move(done));
}

void TrainerCollectives::Broadcast(const Caller& caller, int32_t root, std::string data,
                                   absl::Time deadline, BytesCallback done) {
  Header h;
  h.kind = static_cast<uint8_t>(Kind::kBroadcast);
  h.root = root;
  h.bytes = data.size();
  if (data.size() > kMaxBroadcastBytes) {
    const std::string why =
        absl::StrCat(data.size(), " bytes exceed the limit of ", kMaxBroadcastBytes);
    h.ok = 0;
    std::memcpy(h.text, why.data(), std::min(why.size(), sizeof(h.text) - 1));
  }
  Run(caller, h, std::move(data), deadline, std::move(done));
}

void TrainerCollectives::Run(const Caller& caller, const Header& mine, std::string data,
                             absl::Time deadline, BytesCallback done) {
  std::shared_ptr<collective::CollectiveGroup> coll;
  int32_t world_size = 0;
  {
    std::shared_ptr<Group> held = table_->FindOrGone(caller.group);
    absl::MutexLock lock(&held->mu);
    absl::Status s = shutting_down_->load() ? absl::UnavailableError("flatshardd is shutting down")
                                            : CheckCallerLocked(*held, caller);
    if (!s.ok()) {
      done(std::move(s));
      return;
    }
    coll = held->coll;
    world_size = held->world_size;
  }
  Header header = mine;
  if (header.ok && header.kind == static_cast<uint8_t>(Kind::kBroadcast) &&
      (header.root < 0 || header.root >= world_size)) {
    const std::string why =
        absl::StrCat("root ", header.root, " is out of range [0, ", world_size, ")");
    header.ok = 0;
    std::memcpy(header.text, why.data(), std::min(why.size(), sizeof(header.text) - 1));
  }
  struct State {
    Header mine;
    std::vector<Header> all;
    std::string data;
    std::string gathered;
  };
  auto st = std::make_shared<State>();
  st->mine = header;
  st->all.resize(world_size);
  st->data = std::move(data);
  std::vector<collective::CollectiveOp> ops;
  ops.push_back(collective::CollectiveOp::AllGather(
      kHeaderUnit, collective::ConstBuffer{&st->mine, sizeof(Header)},
      collective::MutableBuffer{st->all.data(), st->all.size() * sizeof(Header)}));
  ops.back().name = absl::StrCat(KindName(header.kind), " header");
  const std::string group = caller.group;
  const int32_t rank = caller.rank;
  coll->SubmitAll(
      rank, std::move(ops), deadline - clock_->Now(),
      [clock = clock_, st, coll, group, rank, world_size, deadline,
       done = std::move(done)](absl::Status s) mutable {
        if (!s.ok()) {
          done(std::move(s));
          return;
        }
        const Header& first = st->all[0];
        const std::string what = absl::StrCat("group ", group, ": ", KindName(first.kind));
        for (int32_t r = 0; r < world_size; ++r) {
          const Header& h = st->all[r];
          std::string why;
          if (!h.ok) {
            why = std::string(h.text, strnlen(h.text, sizeof(h.text)));
          } else if (h.kind != first.kind) {
            why = absl::StrCat("called ", KindName(h.kind), ", rank 0 ", KindName(first.kind));
          } else if (h.bytes != first.bytes) {
            why = absl::StrCat("passed ", h.bytes, " bytes, rank 0 ", first.bytes);
          } else if (h.type != first.type) {
            why =
                absl::StrCat("passed ", TypeName(h.type), " values, rank 0 ", TypeName(first.type));
          } else if (h.op != first.op) {
            why = absl::StrCat("asked for ", OpName(h.op), ", rank 0 for ", OpName(first.op));
          } else if (h.root != first.root) {
            why = absl::StrCat("named root ", h.root, ", rank 0 root ", first.root);
          }
          if (!why.empty()) {
            done(absl::InvalidArgumentError(absl::StrCat(what, ": rank ", r, " ", why)));
            return;
          }
        }
        if (first.bytes == 0) {
          done(std::string());
          return;
        }
        std::vector<collective::CollectiveOp> data_ops;
        const bool all_reduce = first.kind == static_cast<uint8_t>(Kind::kAllReduce);
        if (all_reduce) {
          st->gathered.resize(first.bytes * world_size);
          data_ops.push_back(collective::CollectiveOp::AllGather(
              kDataUnit, collective::ConstBuffer{st->data.data(), st->data.size()},
              collective::MutableBuffer{st->gathered.data(), st->gathered.size()}));
        } else {
          data_ops.push_back(collective::CollectiveOp::Broadcast(
              kDataUnit, collective::MutableBuffer{st->data.data(), st->data.size()}, first.root));
        }
        data_ops.back().name = what;
        coll->SubmitAll(
            rank, std::move(data_ops), deadline - clock->Now(),
            [st, world_size, all_reduce, done = std::move(done)](absl::Status s) mutable {
              if (!s.ok()) {
                done(std::move(s));
                return;
              }
              if (!all_reduce) {
                done(std::move(st->data));
                return;
              }
              const Header& h = st->all[0];
              const auto op = static_cast<ValuesOp>(h.op);
              if (static_cast<ValuesType>(h.type) == ValuesType::kFloat64) {
                ReduceInRankOrder<double>(st->gathered, world_size, op, &st->data);
              } else {
                ReduceInRankOrder<float>(st->gathered, world_size, op, &st->data);
              }
              done(std::move(st->data));
            });
      });
}

}  // namespace flatshard::server
