#include "engine/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace llava {
namespace {

// Growable [kv_heads, capacity, head_dim] buffers for K and V of one layer.
class LayerBuffer {
 public:
  void Append(const at::Tensor& k, const at::Tensor& v) {
    const int64_t n = k.size(1);
    if (!k_.defined() || len_ + n > k_.size(1))
      Grow(k, std::max<int64_t>(len_ + n, 2 * Capacity()));
    k_.narrow(1, len_, n).copy_(k);
    v_.narrow(1, len_, n).copy_(v);
    len_ += n;
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

class FullKvCache final : public KvCache {
 public:
  explicit FullKvCache(const KvLayout& layout) : layout_(layout), layers_(layout.num_layers) {}

  const KvLayout& layout() const override { return layout_; }
  void Append(int layer, const at::Tensor& k, const at::Tensor& v) override {
    layers_[layer].Append(k, v);
  }
  at::Tensor Keys(int layer) const override { return layers_[layer].Keys(); }
  at::Tensor Values(int layer) const override { return layers_[layer].Values(); }
  int64_t Length(int layer) const override { return layers_[layer].Length(); }
  void OnForwardDone(int64_t n_new) override { tokens_seen_ += n_new; }
  int64_t NextPosition() const override { return tokens_seen_; }

  KvStats Stats() const override {
    KvStats s;
    s.tokens_seen = tokens_seen_;
    for (const auto& l : layers_) {
      s.entries_per_layer.push_back(l.Length());
      s.bytes_kept += l.Length() * layout_.bytes_per_entry();
    }
    s.full_equivalent_bytes = tokens_seen_ * layout_.num_layers * layout_.bytes_per_entry();
    return s;
  }

 private:
  KvLayout layout_;
  std::vector<LayerBuffer> layers_;
  int64_t tokens_seen_ = 0;
};

}  // namespace

std::unique_ptr<KvCache> NewFullKvCache(const KvLayout& layout) {
  return std::make_unique<FullKvCache>(layout);
}

}  // namespace llava
