#include "server/metrics/registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace flatshard::metrics {
namespace {

bool ValidName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

absl::string_view TypeName(internal::MetricType type) {
  switch (type) {
    case internal::MetricType::kCounter:
      return "counter";
    case internal::MetricType::kGauge:
      return "gauge";
    case internal::MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Byte counters must stay exact: integers up to 2^53 print as integers.
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  // Prefer the shortest form that reads back as the same double.
  for (int precision = 6; precision < 17; ++precision) {
    char shorter[32];
    std::snprintf(shorter, sizeof(shorter), "%.*g", precision, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

std::string EscapeLabelValue(absl::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::vector<double> DefaultLatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // Prometheus buckets are "less than or equal": the first bound >= v.
  const size_t i =
      static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::BucketCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  for (size_t i = 0; i < out.size(); ++i) out[i] = buckets_[i].load(std::memory_order_relaxed);
  return out;
}

namespace internal {

void FamilyBase::RenderHeader(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n# TYPE ", name_, " ",
                  TypeName(type_), "\n");
}

std::string FamilyBase::LabelPrefix(const std::vector<std::string>& values) const {
  if (label_names_.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < label_names_.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, label_names_[i], "=\"",
                    EscapeLabelValue(i < values.size() ? values[i] : ""), "\"");
  }
  return out;
}

template <typename T>
T& Family<T>::WithLabels(const std::vector<absl::string_view>& values) {
  const std::string key = absl::StrJoin(values, "\xff");
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = children_.find(key);
    if (it != children_.end()) return *it->second.metric;
  }
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = children_.try_emplace(key);
  if (inserted) {
    for (absl::string_view v : values) it->second.values.emplace_back(v);
    it->second.values.resize(label_names().size());
    it->second.metric = NewChild();
  }
  return *it->second.metric;
}

namespace {

template <typename T>
void RenderSample(const std::string& name, const std::string& labels, const T& metric,
                  std::string* out) {
  absl::StrAppend(out, name, labels, labels.empty() ? "" : "}", " ", FormatValue(metric.value()),
                  "\n");
}

void RenderSample(const std::string& name, const std::string& labels, const Histogram& h,
                  std::string* out) {
  const std::vector<uint64_t> counts = h.BucketCounts();
  const std::string sep = labels.empty() ? "{" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    cumulative += counts[i];
    const std::string le = i < h.bounds().size() ? FormatValue(h.bounds()[i]) : "+Inf";
    absl::StrAppend(out, name, "_bucket", sep, "le=\"", le, "\"} ", cumulative, "\n");
  }
  const std::string closed = labels.empty() ? "" : labels + "}";
  // The sum and count come from their own atomics; a concurrent Observe may make them
  // differ from the buckets by one observation, which Prometheus tolerates.
  absl::StrAppend(out, name, "_sum", closed, " ", FormatValue(h.sum()), "\n");
  absl::StrAppend(out, name, "_count", closed, " ", cumulative, "\n");
}

}  // namespace

template <typename T>
void Family<T>::RenderTo(std::string* out) const {
  RenderHeader(out);
  std::vector<std::pair<const std::vector<std::string>*, const T*>> sorted;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [key, child] : children_) {
      sorted.emplace_back(&child.values, child.metric.get());
    }
  }
  // Children are never removed, so the pointers stay valid without the lock.
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return *a.first < *b.first; });
  for (const auto& [values, metric] : sorted) {
    RenderSample(name(), LabelPrefix(*values), *metric, out);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace internal

internal::FamilyBase* Registry::Find(const std::string& name, internal::MetricType type) const {
  for (const auto& f : families_) {
    if (f->name() == name) {
      FS_CHECK(f->type() == type) << "metric " << name << " registered with another type";
      return f.get();
    }
  }
  return nullptr;
}

namespace {

void CheckNames(const std::string& name, const std::vector<std::string>& labels) {
  FS_CHECK(ValidName(name)) << "bad metric name '" << name << "'";
  for (const std::string& l : labels) {
    FS_CHECK(ValidName(l) && l != "le") << "bad label name '" << l << "' of " << name;
  }
}

}  // namespace

CounterFamily& Registry::AddCounter(const std::string& name, const std::string& help,
                                    std::vector<std::string> label_names) {
  CheckNames(name, label_names);
  absl::MutexLock lock(&mu_);
  if (auto* f = Find(name, internal::MetricType::kCounter)) return *static_cast<CounterFamily*>(f);
  const bool unlabelled = label_names.empty();
  auto family = std::make_unique<CounterFamily>(internal::MetricType::kCounter, name, help,
                                                std::move(label_names));
  if (unlabelled) family->WithLabels({});
  families_.push_back(std::move(family));
  return *static_cast<CounterFamily*>(families_.back().get());
}

GaugeFamily& Registry::AddGauge(const std::string& name, const std::string& help,
                                std::vector<std::string> label_names) {
  CheckNames(name, label_names);
  absl::MutexLock lock(&mu_);
  if (auto* f = Find(name, internal::MetricType::kGauge)) return *static_cast<GaugeFamily*>(f);
  const bool unlabelled = label_names.empty();
  auto family = std::make_unique<GaugeFamily>(internal::MetricType::kGauge, name, help,
                                              std::move(label_names));
  if (unlabelled) family->WithLabels({});
  families_.push_back(std::move(family));
  return *static_cast<GaugeFamily*>(families_.back().get());
}

HistogramFamily& Registry::AddHistogram(const std::string& name, const std::string& help,
                                        std::vector<std::string> label_names,
                                        std::vector<double> bounds) {
  CheckNames(name, label_names);
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  absl::MutexLock lock(&mu_);
  if (auto* f = Find(name, internal::MetricType::kHistogram)) {
    return *static_cast<HistogramFamily*>(f);
  }
  const bool unlabelled = label_names.empty();
  auto family = std::make_unique<HistogramFamily>(internal::MetricType::kHistogram, name, help,
                                                  std::move(label_names), std::move(bounds));
  if (unlabelled) family->WithLabels({});
  families_.push_back(std::move(family));
  return *static_cast<HistogramFamily*>(families_.back().get());
}

std::string Registry::Render() const {
  std::vector<const internal::FamilyBase*> families;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& f : families_) families.push_back(f.get());
  }
  std::string out;
  for (const internal::FamilyBase* f : families) f->RenderTo(&out);
  return out;
}

Registry& DefaultRegistry() {
  static Registry* const registry = new Registry();
  return *registry;
}

}  // namespace flatshard::metrics
