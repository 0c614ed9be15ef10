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
  KvStorage Storage(int layer) const override { return inner_->Storage(layer); }
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
    const int64_t rows = probs.size(1), len = probs.size(2);
    // The block's targets in one gather from head 0's probabilities: every part's entries as
    // flat indices into its [rows, len], each tagged with its part. (A row selected per target
    // made, in the backward pass, a zero tensor of the whole block for each target.)
    std::vector<int64_t> flat, part_of, target_of_part;
    std::vector<double> parts_per_target;
    std::vector<const AttentionTarget*> hit;
    for (const AttentionTarget& t : targets_) {
      if (t.row < first || t.row >= first + rows) continue;
      for (const auto& part : t.parts) {
        for (int64_t column : part) {
          flat.push_back((t.row - first) * len + column);
          part_of.push_back(static_cast<int64_t>(target_of_part.size()));
        }
        target_of_part.push_back(static_cast<int64_t>(hit.size()));
      }
      parts_per_target.push_back(static_cast<double>(t.parts.size()));
      hit.push_back(&t);
    }
    first += rows;
    if (hit.empty()) return;
    const at::Tensor head0 = probs.select(0, 0).reshape({-1});  // [rows * len]
    const at::Tensor mass =
        at::zeros({static_cast<int64_t>(target_of_part.size())}, probs.options())
            .index_add(0, at::tensor(part_of, at::kLong),
                       head0.index_select(0, at::tensor(flat, at::kLong)));
    // Per target: the mean over its parts of -log(mass + 1e-6).
    const at::Tensor terms =
        at::zeros({static_cast<int64_t>(hit.size())}, probs.options())
            .index_add(0, at::tensor(target_of_part, at::kLong), -at::log(mass + 1e-6)) /
        at::tensor(parts_per_target, probs.options());
    terms_->push_back(terms);
    if (report_ == nullptr) return;
    const at::Tensor detached = probs.detach();
    for (const AttentionTarget* t : hit) {
      std::vector<int64_t> all;  // parts may share a patch where objects overlap: count it once
      for (const auto& part : t->parts) all.insert(all.end(), part.begin(), part.end());
      std::sort(all.begin(), all.end());
      all.erase(std::unique(all.begin(), all.end()), all.end());
      auto& [sums, answers] = (*report_)[{layer, t->kind}];
      const at::Tensor m = detached.select(1, t->row - (first - rows))
                               .index_select(1, at::tensor(all, at::kLong))
                               .sum(1)
                               .to(at::kDouble)
                               .contiguous();  // [heads]
      sums.resize(m.size(0));
      for (int64_t h = 0; h < m.size(0); ++h) sums[h] += m.data_ptr<double>()[h];
      ++answers;
    }
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
