#include "engine/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

namespace llava {
namespace {

// Growable [kv_heads, capacity, head_dim] buffers for K and V of one layer.
class LayerBuffer {
 public:
  void Append(const at::Tensor& k, const at::Tensor& v) {
    const int64_t n = k.size(1);
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
  at::Tensor Keys() const { return k_.defined() ? k_.narrow(1, 0, len_) : at::Tensor(); }
  at::Tensor Values() const { return v_.defined() ? v_.narrow(1, 0, len_) : at::Tensor(); }
  int64_t Length() const { return len_; }

 private:
  int64_t Capacity() const { return k_.defined() ? k_.size(1) : 0; }
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

// Elastic, H2O and StreamingLLM. Invariant: after each OnForwardDone every layer holds
// params_.EntryTarget(tokens_seen_) entries in position order (Elastic merges the prompt
// into anchors first; H2O keeps per-layer scores aligned with the entries).
class CompressingKvCache final : public KvCache {
 public:
  CompressingKvCache(const KvLayout& layout, const CacheParams& params)
      : layout_(layout),
        params_(params),
        layers_(layout.num_layers),
        positions_(layout.num_layers),
        scores_(layout.num_layers) {}

  const KvLayout& layout() const override { return layout_; }
  void Append(int layer, const at::Tensor& k, const at::Tensor& v) override {
    layers_[layer].Append(k, v);
    for (int64_t i = 0; i < k.size(1); ++i) positions_[layer].push_back(tokens_seen_ + i);
    if (params_.policy == CachePolicy::kH2O) scores_[layer].resize(layers_[layer].Length(), 0.f);
  }
  at::Tensor Keys(int layer) const override { return layers_[layer].Keys(); }
  at::Tensor Values(int layer) const override { return layers_[layer].Values(); }
  int64_t Length(int layer) const override { return layers_[layer].Length(); }
  const std::vector<int64_t>& Positions(int layer) const override { return positions_[layer]; }

  bool WantsAttentionProbs(int layer) const override {
    return params_.policy == CachePolicy::kH2O ||
           (params_.policy == CachePolicy::kElastic && !prefilled_);
  }
  void ObserveAttention(int layer, const at::Tensor& probs) override {
    // probs [H, n, len] -> attention each entry received, summed over queries, head-averaged.
    at::Tensor col = probs.sum(at::IntArrayRef{0, 1}).div_(probs.size(0)).to(at::kCPU).contiguous();
    const float* p = col.data_ptr<float>();
    std::vector<float>& s = scores_[layer];
    s.resize(col.size(0), 0.f);
    for (int64_t j = 0; j < col.size(0); ++j) s[j] += p[j];
  }

  void OnForwardDone(int64_t n_new) override {
    tokens_seen_ += n_new;
    const int64_t target = params_.EntryTarget(tokens_seen_);
    if (!prefilled_) {
      prefilled_ = true;
      for (int l = 0; l < layout_.num_layers; ++l) CompressPrompt(l, target);
      fixed_point_ = ElasticFixedPoint(layers_[0].Length(), params_);
      return;
    }
    for (int l = 0; l < layout_.num_layers; ++l) {
      while (layers_[l].Length() > target) Evict(l, Victim(l, target));
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
  // After the prompt's forward pass: keep EntryTarget(T) entries of layer `l`.
  void CompressPrompt(int l, int64_t target) {
    LayerBuffer& buf = layers_[l];
    const int64_t t = buf.Length();
    if (target >= t) return;
    std::vector<int64_t> keep;
    switch (params_.policy) {
      case CachePolicy::kElastic: {
        if (params_.elastic_mean_importance) {
          for (int64_t n = 0; n < t; ++n) scores_[l][n] /= static_cast<float>(t - n);
        }
        const MergePlan plan = PlanElasticMerge(scores_[l], params_);
        buf.Assign(MergeRows(buf.Keys(), plan), MergeRows(buf.Values(), plan));
        positions_[l] = plan.kept;
        merged_ += plan.merged;
        evicted_ += plan.dropped;
        scores_[l].clear();  // Elastic's importance is not used after the merge
        return;
      }
      case CachePolicy::kH2O:
        keep = H2OKeep(scores_[l], target);
        break;
      default:
        keep = StreamingKeep(t, target, params_.sinks());
        break;
    }
    at::Tensor idx = at::tensor(keep, at::kLong).to(buf.Keys().device());
    buf.Assign(buf.Keys().index_select(1, idx), buf.Values().index_select(1, idx));
    std::vector<int64_t> pos;
    std::vector<float> sc;
    for (int64_t i : keep) {
      pos.push_back(positions_[l][i]);
      if (!scores_[l].empty()) sc.push_back(scores_[l][i]);
    }
    positions_[l] = std::move(pos);
    scores_[l] = std::move(sc);
    evicted_ += t - static_cast<int64_t>(keep.size());
  }

  int64_t Victim(int l, int64_t target) const {
    switch (params_.policy) {
      case CachePolicy::kElastic:
        return fixed_point_;
      case CachePolicy::kH2O:
        return H2OVictim(scores_[l], target);
      default:
        return std::min<int64_t>(params_.sinks(), layers_[l].Length() - 1);
    }
  }

  void Evict(int l, int64_t i) {
    layers_[l].Erase(i);
    positions_[l].erase(positions_[l].begin() + i);
    if (!scores_[l].empty()) scores_[l].erase(scores_[l].begin() + i);
    ++evicted_;
  }

  KvLayout layout_;
  CacheParams params_;
  std::vector<LayerBuffer> layers_;
  std::vector<std::vector<int64_t>> positions_;  // per layer, aligned with the entries
  std::vector<std::vector<float>> scores_;       // per layer: Elastic importance (prefill only)
                                                 // or H2O accumulated attention
  int64_t tokens_seen_ = 0;
  bool prefilled_ = false;
  int64_t fixed_point_ = 0;  // Elastic N_tl
  int64_t merged_ = 0;       // summed over layers
  int64_t evicted_ = 0;      // summed over layers
};

}  // namespace

std::unique_ptr<KvCache> NewFullKvCache(const KvLayout& layout) {
  return std::make_unique<FullKvCache>(layout);
}

std::unique_ptr<KvCache> NewKvCache(const KvLayout& layout, const CacheParams& params) {
  if (params.budget >= 1.0) return NewFullKvCache(layout);
  return NewPolicyKvCache(layout, params);
}

std::unique_ptr<KvCache> NewPolicyKvCache(const KvLayout& layout, const CacheParams& params) {
  if (params.policy == CachePolicy::kFull) return NewFullKvCache(layout);
  return std::make_unique<CompressingKvCache>(layout, params);
}

at::Tensor MergeRows(const at::Tensor& rows, const MergePlan& plan) {
  // rows [Hkv, T, hd]; bucket[i] = kept index of row i or -1 (dropped).
  std::vector<int64_t> src, dst;
  for (int64_t i = 0; i < static_cast<int64_t>(plan.bucket.size()); ++i) {
    if (plan.bucket[i] >= 0) {
      src.push_back(i);
      dst.push_back(plan.bucket[i]);
    }
  }
  const int64_t k = static_cast<int64_t>(plan.kept.size());
  const at::Device dev = rows.device();
  at::Tensor dst_idx = at::tensor(dst, at::kLong).to(dev);
  at::Tensor sum = at::zeros({rows.size(0), k, rows.size(2)}, rows.options().dtype(at::kFloat));
  sum.index_add_(1, dst_idx,
                 rows.index_select(1, at::tensor(src, at::kLong).to(dev)).to(at::kFloat));
  at::Tensor count = at::bincount(dst_idx, {}, k).to(at::kFloat).view({1, k, 1});
  return sum.div_(count).to(rows.scalar_type());
}

}  // namespace llava
