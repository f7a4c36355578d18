#pragma once
// A small Prometheus metrics registry: counters, gauges and histograms, each a family of
// children told apart by label values, rendered in the text exposition format 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/).
//
//   metrics::CounterFamily& rpcs = metrics::DefaultRegistry().AddCounter(
//       "flatshard_rpcs_total", "RPCs answered", {"method", "code"});
//   rpcs.WithLabels({"JoinGroup", "OK"}).Increment();
//   std::string text = metrics::DefaultRegistry().Render();
//
// Hot path: WithLabels takes a reader lock and one hash lookup (a writer lock only the first
// time a label combination appears); Increment/Set/Observe are atomic operations. Callers
// with fixed labels may keep the returned reference: children live as long as the registry.
//
// Thread safety: Registry, the families and their children are thread-safe. Families live as
// long as their Registry; the default registry lives for the whole process.

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::metrics {

// A monotonically increasing value.
class Counter {
 public:
  // REQUIRES: v >= 0 (a negative amount is ignored).
  void Increment(double v = 1.0) {
    if (v > 0) value_.fetch_add(v, std::memory_order_relaxed);
  }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted in fixed buckets (upper bounds, ascending; +Inf is implicit).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);

  const std::vector<double>& bounds() const { return bounds_; }
  // Per-bucket counts (not cumulative), bounds().size() + 1 of them (the last is +Inf).
  std::vector<uint64_t> BucketCounts() const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0};
};

// Latency buckets in seconds, 100 us to 60 s.
std::vector<double> DefaultLatencyBuckets();

namespace internal {

enum class MetricType { kCounter, kGauge, kHistogram };

class FamilyBase {
 public:
  FamilyBase(MetricType type, std::string name, std::string help,
             std::vector<std::string> label_names)
      : type_(type),
        name_(std::move(name)),
        help_(std::move(help)),
        label_names_(std::move(label_names)) {}
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  MetricType type() const { return type_; }
  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Appends the family's HELP, TYPE and sample lines.
  virtual void RenderTo(std::string* out) const = 0;

 protected:
  void RenderHeader(std::string* out) const;
  // `{a="x",b="y"` (no closing brace, so histograms can add `le`); "" without labels.
  std::string LabelPrefix(const std::vector<std::string>& values) const;

 private:
  const MetricType type_;
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

// A family of children of type T, keyed by their label values.
template <typename T>
class Family : public FamilyBase {
 public:
  // `bounds`: histograms' bucket bounds (ascending); unused otherwise.
  Family(MetricType type, std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bounds = {})
      : FamilyBase(type, std::move(name), std::move(help), std::move(label_names)),
        bounds_(std::move(bounds)) {}

  // The child for these label values (one per label name, in order), created on first use.
  // REQUIRES: values.size() == label_names().size() (else the values are padded or cut).
  T& WithLabels(std::initializer_list<absl::string_view> values) {
    return WithLabels(std::vector<absl::string_view>(values));
  }
  T& WithLabels(const std::vector<absl::string_view>& values);

  void RenderTo(std::string* out) const override;

 private:
  std::unique_ptr<T> NewChild() const {
    if constexpr (std::is_same_v<T, Histogram>) {
      return std::make_unique<T>(bounds_);
    } else {
      return std::make_unique<T>();
    }
  }

  const std::vector<double> bounds_;
  struct Child {
    std::vector<std::string> values;
    std::unique_ptr<T> metric;
  };
  mutable absl::Mutex mu_;
  // Keyed by the label values joined with '\xff' (which no UTF-8 text contains).
  absl::node_hash_map<std::string, Child> children_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal

using CounterFamily = internal::Family<Counter>;
using GaugeFamily = internal::Family<Gauge>;
using HistogramFamily = internal::Family<Histogram>;

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a family, or returns the one already registered under `name` (its help and
  // labels are kept). A family without labels gets its single child at once, so it is
  // rendered (as 0) before anything happened. Names and label names must match
  // [a-zA-Z_:][a-zA-Z0-9_:]*; a bad name or a name registered with another type is a
  // programming error (FS_CHECK).
  CounterFamily& AddCounter(const std::string& name, const std::string& help,
                            std::vector<std::string> label_names = {});
  GaugeFamily& AddGauge(const std::string& name, const std::string& help,
                        std::vector<std::string> label_names = {});
  HistogramFamily& AddHistogram(const std::string& name, const std::string& help,
                                std::vector<std::string> label_names,
                                std::vector<double> bounds = DefaultLatencyBuckets());

  // Every family in registration order, children sorted by label values.
  std::string Render() const;

 private:
  internal::FamilyBase* Find(const std::string& name, internal::MetricType type) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<internal::FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
};

// The process-wide registry the daemon's instrumentation writes to and /metrics renders.
Registry& DefaultRegistry();

// A sample value as Prometheus reads it: integers exactly, "+Inf", "-Inf", "NaN", otherwise
// the shortest round-tripping decimal.
std::string FormatValue(double v);
// Escapes `\`, `"` and newlines for a label value.
std::string EscapeLabelValue(absl::string_view v);

}  // namespace flatshard::metrics
