#include "engine/kv/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "engine/kv/kv_policy.h"

namespace llava {
namespace {

bool KeepRowsInPlace(const at::Tensor& rows, const std::vector<int64_t>& kept);

// Growable [kv_heads, capacity, head_dim] buffers for K and V of one layer.
class LayerBuffer {
 public:
  void Append(const at::Tensor& k, const at::Tensor& v) {
    const int64_t n = k.size(1);
    if (k.requires_grad() || v.requires_grad()) {
      // Under autograd (the trainer) the buffer is exactly the entries, concatenated: Keys() is
      // then that tensor, not a narrow of a larger buffer, whose backward would make a zero
      // tensor of the whole buffer for every read (and the copy into it another).
      k_ = len_ == 0 ? k.contiguous() : at::cat({Keys(), k}, 1);
      v_ = len_ == 0 ? v.contiguous() : at::cat({Values(), v}, 1);
      len_ += n;
      return;
    }
    if (!k_.defined() || len_ + n > k_.size(1))
      Grow(k, std::max<int64_t>(len_ + n, 2 * Capacity()));
    if (!CopyRows(k, k_) || !CopyRows(v, v_)) {
      k_.narrow(1, len_, n).copy_(k);
      v_.narrow(1, len_, n).copy_(v);
    }
    len_ += n;
  }
  // Replaces the contents with `k`, `v` [Hkv, len, hd].
  void Assign(const at::Tensor& k, const at::Tensor& v) {
    len_ = 0;
    Append(k, v);
  }
  // Deletes entry `i`, shifting the later ones down (the source is copied first: the ranges
  // overlap). Only the entries after `i` move.
  void Erase(int64_t i) {
    const int64_t tail = len_ - i - 1;
    if (tail > 0 && k_.device().is_cpu()) {
      // Decoding evicts an entry per layer and step: a memmove per head, not four ATen ops.
      const int64_t row = k_.size(2) * k_.element_size(), head = k_.size(1) * row;
      auto* kp = static_cast<char*>(k_.data_ptr());
      auto* vp = static_cast<char*>(v_.data_ptr());
      for (int64_t h = 0; h < k_.size(0); ++h) {
        std::memmove(kp + h * head + i * row, kp + h * head + (i + 1) * row, tail * row);
        std::memmove(vp + h * head + i * row, vp + h * head + (i + 1) * row, tail * row);
      }
    } else if (tail > 0) {
      k_.narrow(1, i, tail).copy_(k_.narrow(1, i + 1, tail).clone());
      v_.narrow(1, i, tail).copy_(v_.narrow(1, i + 1, tail).clone());
    }
    --len_;
  }
  // Decoding appends one row per layer and step: on the CPU, without autograd, a memcpy per
  // head instead of two ATen copies. False when the fast path does not apply.
  bool CopyRows(const at::Tensor& src, at::Tensor& dst) const {
    if (!src.device().is_cpu() || !dst.device().is_cpu() ||
        src.scalar_type() != dst.scalar_type() || src.stride(2) != 1 || src.requires_grad() ||
        dst.requires_grad()) {
      return false;
    }
    const int64_t es = src.element_size(), row = src.size(2) * es;
    const auto* from = static_cast<const char*>(src.data_ptr());
    auto* to = static_cast<char*>(dst.data_ptr());
    for (int64_t h = 0; h < src.size(0); ++h) {
      for (int64_t i = 0; i < src.size(1); ++i) {
        std::memcpy(to + (h * dst.size(1) + len_ + i) * row,
                    from + (h * src.stride(0) + i * src.stride(1)) * es, row);
      }
    }
    return true;
  }
  // Applies a prompt plan where the entries are, without allocating (CPU, outside autograd):
  // the kept or merged rows are written to the first plan.kept.size() slots. False (and nothing
  // changed) when that does not apply.
  bool CompressInPlace(const MergePlan& plan) {
    const at::Tensor k = Keys(), v = Values();
    auto fits = [](const at::Tensor& t) {
      return t.device().is_cpu() && !t.requires_grad() && t.stride(2) == 1 &&
             (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
    };
    if (!fits(k) || !fits(v)) return false;
    const bool merge = plan.merged > 0;
    if (merge && plan.merge_keys) {
      MergeRowsInPlace(k, plan);
    } else {
      KeepRowsInPlace(k, plan.kept);
    }
    if (merge) {
      MergeRowsInPlace(v, plan);
    } else {
      KeepRowsInPlace(v, plan.kept);
    }
    len_ = static_cast<int64_t>(plan.kept.size());
    return true;
  }
  at::Tensor Keys() const { return Entries(k_); }
  at::Tensor Values() const { return Entries(v_); }
  int64_t Length() const { return len_; }

 private:
  int64_t Capacity() const { return k_.defined() ? k_.size(1) : 0; }
  // The first len_ entries of a buffer: the buffer itself when it is full.
  at::Tensor Entries(const at::Tensor& buffer) const {
    if (!buffer.defined()) return at::Tensor();
    return buffer.size(1) == len_ ? buffer : buffer.narrow(1, 0, len_);
  }
  void Grow(const at::Tensor& like, int64_t capacity) {
    capacity = std::max<int64_t>(capacity, 16);
    at::Tensor k = at::empty({like.size(0), capacity, like.size(2)}, like.options());
    at::Tensor v = at::empty({like.size(0), capacity, like.size(2)}, like.options());
    if (len_ > 0) {
      k.narrow(1, 0, len_).copy_(Keys());
      v.narrow(1, 0, len_).copy_(Values());
    }
    k_ = std::move(k);
    v_ = std::move(v);
  }

  at::Tensor k_, v_;  // [kv_heads, capacity, head_dim]
  int64_t len_ = 0;
};

// Entries and bytes of every layer, and what Full would hold after `tokens_seen` tokens.
KvStats LayerStats(const std::vector<LayerBuffer>& layers, const KvLayout& layout,
                   int64_t tokens_seen) {
  KvStats s;
  s.tokens_seen = tokens_seen;
  for (const auto& l : layers) {
    s.entries_per_layer.push_back(l.Length());
    s.bytes_kept += l.Length() * layout.bytes_per_entry();
  }
  s.full_equivalent_bytes = tokens_seen * layout.num_layers * layout.bytes_per_entry();
  return s;
}

class FullKvCache final : public KvCache {
 public:
  explicit FullKvCache(const KvLayout& layout) : layout_(layout), layers_(layout.num_layers) {}

  const KvLayout& layout() const override { return layout_; }
  void Append(int layer, const at::Tensor& k, const at::Tensor& v) override {
    layers_[layer].Append(k, v);
    if (layer == 0) {
      for (int64_t i = 0; i < k.size(1); ++i) positions_.push_back(tokens_seen_ + i);
    }
  }
  at::Tensor Keys(int layer) const override { return layers_[layer].Keys(); }
  at::Tensor Values(int layer) const override { return layers_[layer].Values(); }
  int64_t Length(int layer) const override { return layers_[layer].Length(); }
  const std::vector<int64_t>& Positions(int layer) const override { return positions_; }
  void OnForwardDone(int64_t n_new) override { tokens_seen_ += n_new; }
  void OnPromptChunkDone(int64_t n_new) override { tokens_seen_ += n_new; }
  int64_t NextPosition() const override { return tokens_seen_; }

  KvStats Stats() const override { return LayerStats(layers_, layout_, tokens_seen_); }

 private:
  KvLayout layout_;
  std::vector<LayerBuffer> layers_;
  std::vector<int64_t> positions_;  // shared by all layers: Full never drops anything
  int64_t tokens_seen_ = 0;
};

// A cache that compresses as its policy (kv_policy.h) decides. Invariant: after each
// OnForwardDone every layer holds policy_->Target(tokens_seen_) entries in position order, and
// positions_ is aligned with the entries.
class CompressingKvCache final : public KvCache {
 public:
  CompressingKvCache(const KvLayout& layout, const CacheParams& params,
                     std::unique_ptr<KvPolicy> policy)
      : layout_(layout),
        params_(params),
        policy_(std::move(policy)),
        layers_(layout.num_layers),
        positions_(layout.num_layers),
        rows_seen_(layout.num_layers, 0),
        pending_scores_(layout.num_layers) {}

  const KvLayout& layout() const override { return layout_; }
  void Append(int layer, const at::Tensor& k, const at::Tensor& v) override {
    layers_[layer].Append(k, v);
    for (int64_t i = 0; i < k.size(1); ++i) positions_[layer].push_back(tokens_seen_ + i);
    if (prefilled_) policy_->OnAppend(layer, k.size(1));
  }
  at::Tensor Keys(int layer) const override { return layers_[layer].Keys(); }
  at::Tensor Values(int layer) const override { return layers_[layer].Values(); }
  int64_t Length(int layer) const override { return layers_[layer].Length(); }
  const std::vector<int64_t>& Positions(int layer) const override { return positions_[layer]; }

  bool WantsAttentionProbs(int layer) const override { return policy_->WantsScores(prefilled_); }
  void ObserveAttention(int layer, const at::Tensor& probs) override {
    // probs [H, rows, len]: while the prompt is fed its blocks arrive in row order, so the
    // block's first row is the prompt position rows_seen_; a block that straddles the policy's
    // split row is handed over as two. Decode rows have no prompt position (-1).
    auto columns = [&](int64_t begin, int64_t rows) {
      return probs.narrow(1, begin, rows).sum(at::IntArrayRef{0, 1}).div_(probs.size(0));
    };
    auto add = [&](int64_t first_row, int64_t begin, int64_t rows) {
      at::Tensor col = columns(begin, rows).to(at::kCPU, at::kFloat).contiguous();
      policy_->AddScores(layer, first_row, col.data_ptr<float>(), col.size(0));
    };
    const int64_t rows = probs.size(1);
    if (prefilled_) {
      // A decode step's sums stay where they were computed until the step's last layer is done
      // (OnForwardDone): one copy to the host per step instead of one per layer, which on a GPU
      // would wait for each layer's kernels before the next layer's could be queued.
      pending_scores_[layer] = columns(0, rows);
      return;
    }
    const int64_t first = rows_seen_[layer];
    rows_seen_[layer] += rows;
    const int64_t split = std::clamp<int64_t>(policy_->ScoreSplitRow() - first, 0, rows);
    if (split > 0 && policy_->ScoresBeforeSplit()) add(first, 0, split);
    if (split < rows) add(first + split, split, rows - split);
  }

  void OnForwardDone(int64_t n_new) override {
    tokens_seen_ += n_new;
    if (!prefilled_) {
      for (int l = 0; l < layout_.num_layers; ++l) CompressPrompt(l);
      prefilled_ = true;
      return;
    }
    AddPendingScores();
    const int64_t target = policy_->Target(tokens_seen_);
    for (int l = 0; l < layout_.num_layers; ++l) {
      while (layers_[l].Length() > target) {
        const int64_t victim = policy_->Victim(l, layers_[l].Length(), target);
        if (victim < 0) break;  // everything left is protected
        Evict(l, victim);
      }
    }
  }

  void OnPromptChunkDone(int64_t n_new) override { tokens_seen_ += n_new; }

  int64_t NextPosition() const override {
    return params_.position_mode == PositionMode::kCompressed ? layers_[0].Length() : tokens_seen_;
  }

  KvStats Stats() const override {
    KvStats s = LayerStats(layers_, layout_, tokens_seen_);
    s.tokens_merged = merged_ / layout_.num_layers;  // per-layer mean
    s.tokens_evicted = evicted_ / layout_.num_layers;
    return s;
  }

 private:
  // After the prompt's last forward pass: apply the policy's plan to layer `l`.
  void CompressPrompt(int l) {
    LayerBuffer& buf = layers_[l];
    const int64_t t = buf.Length();
    const MergePlan plan = policy_->PlanPrompt(l, t);
    merged_ += plan.merged;
    evicted_ += plan.dropped;
    if (static_cast<int64_t>(plan.kept.size()) == t) return;  // nothing to drop or merge
    std::vector<int64_t> pos;
    for (int64_t i : plan.kept) pos.push_back(positions_[l][i]);
    positions_[l] = std::move(pos);
    if (buf.CompressInPlace(plan)) return;
    const at::Tensor index = at::tensor(plan.kept, at::kLong).to(buf.Keys().device());
    auto kept = [&](const at::Tensor& rows) { return rows.index_select(1, index); };
    if (plan.merged > 0) {
      buf.Assign(plan.merge_keys ? MergeRows(buf.Keys(), plan) : kept(buf.Keys()),
                 MergeRows(buf.Values(), plan));
    } else {
      buf.Assign(kept(buf.Keys()), kept(buf.Values()));
    }
  }

  // The decode step's column sums of every layer, copied to the host in one piece.
  void AddPendingScores() {
    std::vector<at::Tensor> sums;
    for (const at::Tensor& t : pending_scores_) {
      if (t.defined()) sums.push_back(t.to(at::kFloat));
    }
    if (sums.empty()) return;
    const at::Tensor host = at::cat(sums).to(at::kCPU).contiguous();
    const float* p = host.data_ptr<float>();
    for (int l = 0; l < layout_.num_layers; ++l) {
      at::Tensor& t = pending_scores_[l];
      if (!t.defined()) continue;
      policy_->AddScores(l, -1, p, t.size(0));
      p += t.size(0);
      t = at::Tensor();
    }
  }

  void Evict(int l, int64_t i) {
    layers_[l].Erase(i);
    positions_[l].erase(positions_[l].begin() + i);
    policy_->OnEvict(l, i);
    ++evicted_;
  }

  KvLayout layout_;
  CacheParams params_;
  std::unique_ptr<KvPolicy> policy_;
  std::vector<LayerBuffer> layers_;
  std::vector<std::vector<int64_t>> positions_;  // per layer, aligned with the entries
  std::vector<int64_t> rows_seen_;               // per layer: prompt query rows observed
  std::vector<at::Tensor> pending_scores_;       // per layer: this decode step's column sums
  int64_t tokens_seen_ = 0;
  bool prefilled_ = false;
  int64_t merged_ = 0;   // summed over layers
  int64_t evicted_ = 0;  // summed over layers
};

}  // namespace

std::unique_ptr<KvCache> NewFullKvCache(const KvLayout& layout) {
  return std::make_unique<FullKvCache>(layout);
}

std::unique_ptr<KvCache> NewKvCache(const KvLayout& layout, const CacheParams& params,
                                    const PromptSegments& segments) {
  if (params.KeepsEverything()) return NewFullKvCache(layout);
  return NewPolicyKvCache(layout, params, segments);
}

std::unique_ptr<KvCache> NewPolicyKvCache(const KvLayout& layout, const CacheParams& params,
                                          const PromptSegments& segments) {
  if (params.policy == CachePolicy::kFull) return NewFullKvCache(layout);
  return std::make_unique<CompressingKvCache>(layout, params,
                                              NewKvPolicy(params, segments, layout.num_layers));
}

namespace {

// MergeRows on the CPU: one pass over the rows, fp32 accumulators, no tensor ops (a prompt
// merge is a few hundred rows per layer; ATen's per-op overhead dominated the small model's
// prefill). Writes the k merged rows of each head to `out` ([heads, >= k, hd], rows
// contiguous), which may be `rows` itself: a head's rows are all read before any is written.
template <typename T>
void MergeRowsCpu(const at::Tensor& rows, const MergePlan& plan, const at::Tensor& out) {
  const int64_t heads = rows.size(0), t = rows.size(1), hd = rows.size(2);
  const int64_t k = static_cast<int64_t>(plan.kept.size());
  std::vector<float> acc(k * hd), total(k);
  const T* src = rows.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (int64_t h = 0; h < heads; ++h) {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(total.begin(), total.end(), 0.f);
    for (int64_t i = 0; i < t; ++i) {
      const int64_t b = plan.bucket[i];
      if (b < 0) continue;
      const float w = plan.weight.empty() ? 1.f : plan.weight[i];
      const T* row = src + h * rows.stride(0) + i * rows.stride(1);
      float* a = acc.data() + b * hd;
      for (int64_t d = 0; d < hd; ++d) a[d] += w * static_cast<float>(row[d]);
      total[b] += w;
    }
    for (int64_t b = 0; b < k; ++b) {
      T* row = dst + h * out.stride(0) + b * out.stride(1);
      for (int64_t d = 0; d < hd; ++d) row[d] = static_cast<T>(acc[b * hd + d] / total[b]);
    }
  }
}

}  // namespace

bool MergeRowsInPlace(const at::Tensor& rows, const MergePlan& plan) {
  if (!rows.device().is_cpu() || rows.requires_grad() || rows.stride(2) != 1) return false;
  if (rows.scalar_type() == at::kFloat) {
    MergeRowsCpu<float>(rows, plan, rows);
  } else if (rows.scalar_type() == at::kBFloat16) {
    MergeRowsCpu<at::BFloat16>(rows, plan, rows);
  } else {
    return false;
  }
  return true;
}

namespace {

// Moves rows `kept` (ascending) of every head to the head's first slots, in order.
bool KeepRowsInPlace(const at::Tensor& rows, const std::vector<int64_t>& kept) {
  const int64_t row = rows.size(2) * rows.element_size();
  auto* base = static_cast<char*>(rows.data_ptr());
  for (int64_t h = 0; h < rows.size(0); ++h) {
    char* head = base + h * rows.stride(0) * rows.element_size();
    for (size_t b = 0; b < kept.size(); ++b) {
      const int64_t from = kept[b];
      if (from != static_cast<int64_t>(b)) std::memmove(head + b * row, head + from * row, row);
    }
  }
  return true;
}

}  // namespace

at::Tensor MergeRows(const at::Tensor& rows, const MergePlan& plan) {
  if (rows.device().is_cpu() && rows.stride(2) == 1 && !rows.requires_grad() &&
      (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16)) {
    at::Tensor out = at::empty({rows.size(0), static_cast<int64_t>(plan.kept.size()), rows.size(2)},
                               rows.options());
    if (rows.scalar_type() == at::kFloat) {
      MergeRowsCpu<float>(rows, plan, out);
    } else {
      MergeRowsCpu<at::BFloat16>(rows, plan, out);
    }
    return out;
  }
  return MergeRowsReference(rows, plan);
}

at::Tensor MergeRowsReference(const at::Tensor& rows, const MergePlan& plan) {
  // rows [Hkv, T, hd]; bucket[i] = kept index of row i or -1 (dropped); weight[i] its weight.
  std::vector<int64_t> src, dst;
  std::vector<float> w;
  for (int64_t i = 0; i < static_cast<int64_t>(plan.bucket.size()); ++i) {
    if (plan.bucket[i] >= 0) {
      src.push_back(i);
      dst.push_back(plan.bucket[i]);
      w.push_back(plan.weight.empty() ? 1.f : plan.weight[i]);
    }
  }
  const int64_t k = static_cast<int64_t>(plan.kept.size());
  const at::Device dev = rows.device();
  at::Tensor dst_idx = at::tensor(dst, at::kLong).to(dev);
  at::Tensor selected = rows.index_select(1, at::tensor(src, at::kLong).to(dev)).to(at::kFloat);
  at::Tensor total = at::zeros({k}, rows.options().dtype(at::kFloat));
  if (plan.weight.empty()) {
    total.index_add_(0, dst_idx, at::ones({static_cast<int64_t>(dst.size())}, total.options()));
  } else {
    at::Tensor wt = at::tensor(w, at::kFloat).to(dev);
    selected.mul_(wt.view({1, -1, 1}));
    total.index_add_(0, dst_idx, wt);
  }
  at::Tensor sum = at::zeros({rows.size(0), k, rows.size(2)}, selected.options());
  sum.index_add_(1, dst_idx, selected);
  return sum.div_(total.view({1, k, 1})).to(rows.scalar_type());
}

}  // namespace llava
