#include "train/attention_supervision.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>

namespace llava {
namespace {

class SupervisedAttentionCache : public KvCache {
 public:
  SupervisedAttentionCache(std::unique_ptr<KvCache> inner, std::vector<int> layers,
                           std::vector<AttentionTarget> targets, std::vector<at::Tensor>* terms,
                           AttentionReport* report, int64_t first_row)
      : inner_(std::move(inner)),
        layers_(std::move(layers)),
        targets_(std::move(targets)),
        terms_(terms),
        report_(report),
        first_row_(first_row) {}

  const KvLayout& layout() const override { return inner_->layout(); }
  void Append(int layer, const at::Tensor& k, const at::Tensor& v) override {
    inner_->Append(layer, k, v);
  }
  at::Tensor Keys(int layer) const override { return inner_->Keys(layer); }
  at::Tensor Values(int layer) const override { return inner_->Values(layer); }
  int64_t Length(int layer) const override { return inner_->Length(layer); }
  const std::vector<int64_t>& Positions(int layer) const override {
    return inner_->Positions(layer);
  }
  bool WantsAttentionProbs(int layer) const override {
    return !targets_.empty() && std::find(layers_.begin(), layers_.end(), layer) != layers_.end();
  }
  // probs [heads, rows, len]: the query blocks of the one forward pass arrive in row order.
  void ObserveAttention(int layer, const at::Tensor& probs) override {
    int64_t& first = rows_seen_.try_emplace(layer, first_row_).first->second;
    const int64_t rows = probs.size(1);
    for (const AttentionTarget& t : targets_) {
      if (t.row < first || t.row >= first + rows) continue;
      const at::Tensor row = probs.select(1, t.row - first);  // [heads, len]
      auto mass_on = [&](const std::vector<int64_t>& columns) {
        return row.index_select(1, at::tensor(columns, at::kLong)).sum(1);  // [heads]
      };
      at::Tensor term = at::zeros({}, probs.options());
      for (const auto& part : t.parts) term = term - at::log(mass_on(part)[0] + 1e-6);
      terms_->push_back(term / static_cast<double>(t.parts.size()));
      if (report_ == nullptr) continue;
      std::vector<int64_t> all;  // parts may share a patch where objects overlap: count it once
      for (const auto& part : t.parts) all.insert(all.end(), part.begin(), part.end());
      std::sort(all.begin(), all.end());
      all.erase(std::unique(all.begin(), all.end()), all.end());
      auto& [sums, answers] = (*report_)[{layer, t.kind}];
      const at::Tensor m = mass_on(all).detach().to(at::kDouble).contiguous();
      sums.resize(m.size(0));
      for (int64_t h = 0; h < m.size(0); ++h) sums[h] += m.data_ptr<double>()[h];
      ++answers;
    }
    first += rows;
  }
  void OnForwardDone(int64_t n_new) override { inner_->OnForwardDone(n_new); }
  void OnPromptChunkDone(int64_t n_new) override { inner_->OnPromptChunkDone(n_new); }
  int64_t NextPosition() const override { return inner_->NextPosition(); }
  KvStats Stats() const override { return inner_->Stats(); }

 private:
  std::unique_ptr<KvCache> inner_;
  std::vector<int> layers_;
  std::vector<AttentionTarget> targets_;
  std::vector<at::Tensor>* terms_;
  AttentionReport* report_;
  const int64_t first_row_;
  std::map<int, int64_t> rows_seen_;  // per layer, the sequence's next row to be observed
};

}  // namespace

std::unique_ptr<KvCache> NewSupervisedAttentionCache(std::unique_ptr<KvCache> inner,
                                                     std::vector<int> layers,
                                                     std::vector<AttentionTarget> targets,
                                                     std::vector<at::Tensor>* terms,
                                                     AttentionReport* report, int64_t first_row) {
  return std::make_unique<SupervisedAttentionCache>(std::move(inner), std::move(layers),
                                                    std::move(targets), terms, report, first_row);
}

void PrintAttentionReport(const AttentionReport& report) {
  std::printf("attention mass on the objects the question names (mean per answer, by head):\n");
  for (const auto& [key, value] : report) {
    std::printf("  layer %d  %-10s %5d answers:", key.first, key.second.c_str(), value.second);
    for (double sum : value.first) std::printf(" %.3f", sum / value.second);
    std::printf("\n");
  }
}

}  // namespace llava
