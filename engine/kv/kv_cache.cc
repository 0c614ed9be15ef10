#include "engine/kv/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>

#include "engine/io/aten_dtype.h"
#include "engine/kv/kv_policy.h"
#include "engine/kv/kv_pool.h"

namespace llava {
namespace {

// The mean over heads of the column sums of probs[:, begin:begin + rows, :] ([H, *, len]), in
// fp32. On the CPU a loop over the rows: a prompt's policy reads every row's sums, and on short
// prompts ATen's reduction and copies cost more than the sums themselves.
std::vector<float> ColumnMeans(const at::Tensor& probs, int64_t begin, int64_t rows) {
  const int64_t heads = probs.size(0), len = probs.size(2);
  std::vector<float> out(len, 0.f);
  if (probs.is_cpu() && probs.scalar_type() == at::kFloat && probs.stride(2) == 1) {
    const float* p = probs.data_ptr<float>();
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r = begin; r < begin + rows; ++r) {
        const float* row = p + h * probs.stride(0) + r * probs.stride(1);
        for (int64_t j = 0; j < len; ++j) out[j] += row[j];
      }
    }
    for (float& x : out) x /= static_cast<float>(heads);
    return out;
  }
  const at::Tensor sums = probs.narrow(1, begin, rows)
                              .sum(at::IntArrayRef{0, 1})
                              .div_(heads)
                              .to(at::kCPU, at::kFloat)
                              .contiguous();
  std::copy(sums.data_ptr<float>(), sums.data_ptr<float>() + len, out.begin());
  return out;
}

// Growable [kv_heads, capacity, head_dim] buffers for K and V of one layer: the unpooled Full
// cache's (the trainer's).
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
  KvStorage Storage() const {
    static const int32_t kOnePage = 0;
    KvStorage st;
    if (len_ == 0) return st;
    st.keys = k_.data_ptr();
    st.values = v_.data_ptr();
    st.pages = &kOnePage;
    st.page_rows = len_;
    st.key_head_stride = k_.stride(0);
    st.value_head_stride = v_.stride(0);
    st.row_stride = k_.stride(1);
    st.len = len_;
    return st;
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
KvStats LayerStats(const std::vector<int64_t>& lengths, const KvLayout& layout,
                   int64_t tokens_seen) {
  KvStats s;
  s.tokens_seen = tokens_seen;
  for (int64_t len : lengths) {
    s.entries_per_layer.push_back(len);
    s.bytes_kept += len * layout.bytes_per_entry();
  }
  s.full_equivalent_bytes = tokens_seen * layout.num_layers * layout.model_bytes_per_entry();
  return s;
}

// The trainer's Full cache: every entry, in per-layer buffers outside any pool.
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
  KvStorage Storage(int layer) const override { return layers_[layer].Storage(); }
  int64_t Length(int layer) const override { return layers_[layer].Length(); }
  const std::vector<int64_t>& Positions(int layer) const override { return positions_; }
  void OnForwardDone(int64_t n_new) override { tokens_seen_ += n_new; }
  void OnPromptChunkDone(int64_t n_new) override { tokens_seen_ += n_new; }
  int64_t NextPosition() const override { return tokens_seen_; }

  KvStats Stats() const override {
    std::vector<int64_t> lengths;
    for (const LayerBuffer& l : layers_) lengths.push_back(l.Length());
    return LayerStats(lengths, layout_, tokens_seen_);
  }

 private:
  KvLayout layout_;
  std::vector<LayerBuffer> layers_;
  std::vector<int64_t> positions_;  // shared by all layers: Full never drops anything
  int64_t tokens_seen_ = 0;
};

// One sequence's pages in the pool: slot s of every layer lives in page pages_[s / P], row
// s % P. Returns its pages when destroyed.
class PageTable {
 public:
  explicit PageTable(KvPool* pool) : pool_(pool) {}
  ~PageTable() { Shrink(0); }
  PageTable(const PageTable&) = delete;
  PageTable& operator=(const PageTable&) = delete;

  int64_t capacity() const { return static_cast<int64_t>(pages_.size()) * pool_->page_rows(); }
  int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }

  // Holds pages for `slots` slots at least; false (nothing allocated) when the pool is short.
  bool Reserve(int64_t slots) {
    const int64_t need = pool_->PagesFor(slots) - num_pages();
    return need <= 0 || pool_->pages().Allocate(need, &pages_);
  }
  // Returns the pages past the first `slots` slots to the pool.
  void Shrink(int64_t slots) {
    const int64_t keep = pool_->PagesFor(slots);
    if (keep >= num_pages()) return;
    pool_->pages().Free(pages_.data() + keep, num_pages() - keep);
    pages_.resize(keep);
  }

  // Writes rows [Hkv, n, hd] to slots [first, first + n) of `layer`'s keys or values
  // (quantized, for int8 entries).
  void Write(int layer, bool values, int64_t first, const at::Tensor& rows) {
    const int64_t n = rows.size(1), p = pool_->page_rows();
    TORCH_CHECK(first + n <= capacity(), "KV cache: ", first + n, " slots written, ", capacity(),
                " reserved");
    TORCH_CHECK(!rows.requires_grad(), "KV cache: the pool does not take autograd tensors");
    if (pool_->layout().int8()) return WriteInt8(layer, values, first, rows);
    const KvLayout& layout = pool_->layout();
    const at::Tensor pages = pool_->Pages(layer, values);  // [pages, Hkv, P, hd]
    const bool fast = rows.device().is_cpu() && pages.device().is_cpu() &&
                      rows.scalar_type() == pages.scalar_type() && rows.stride(2) == 1;
    const int64_t es = pages.element_size(), row = layout.head_dim * es;
    for (int64_t s = first; s < first + n;) {
      const int64_t page = pages_[s / p], r0 = s % p, run = std::min(p - r0, first + n - s);
      const int64_t i = s - first;  // source row
      if (fast) {
        char* dst = static_cast<char*>(pool_->Base(layer, values)) +
                    (page * pool_->page_stride() + r0 * layout.head_dim) * es;
        const char* src = static_cast<const char*>(rows.data_ptr());
        for (int64_t h = 0; h < layout.kv_heads; ++h) {
          char* d = dst + h * pool_->head_stride() * es;
          const char* sh = src + (h * rows.stride(0) + i * rows.stride(1)) * es;
          if (rows.stride(1) == layout.head_dim) {
            std::memcpy(d, sh, run * row);
          } else {
            for (int64_t r = 0; r < run; ++r)
              std::memcpy(d + r * row, sh + r * rows.stride(1) * es, row);
          }
        }
      } else {
        pages[page].narrow(1, r0, run).copy_(rows.narrow(1, i, run));
      }
      s += run;
    }
  }

  // Slots [0, len) of `layer`'s keys or values, copied out: [Hkv, len, hd] in the model's
  // dtype, or in `type` (int8 entries: dequantized; fp32 is exact).
  at::Tensor Gather(int layer, bool values, int64_t len,
                    std::optional<at::ScalarType> type = std::nullopt) const {
    const KvLayout& layout = pool_->layout();
    if (layout.int8()) {
      const at::Tensor out = GatherInt8(layer, values, len);
      return out.to(type.value_or(ScalarTypeOf(layout.dtype)));
    }
    const at::Tensor pages = pool_->Pages(layer, values);
    const int64_t p = pool_->page_rows(), used = pool_->PagesFor(len);
    if (!pages.device().is_cpu()) {
      const at::Tensor ids =
          at::tensor(std::vector<int64_t>(pages_.begin(), pages_.begin() + used), at::kLong)
              .to(pages.device());
      return pages.index_select(0, ids)
          .permute({1, 0, 2, 3})
          .reshape({layout.kv_heads, used * p, layout.head_dim})
          .narrow(1, 0, len);
    }
    at::Tensor out = at::empty({layout.kv_heads, len, layout.head_dim}, pages.options());
    const int64_t es = pages.element_size(), row = layout.head_dim * es;
    const char* base = static_cast<const char*>(pool_->Base(layer, values));
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t h = 0; h < layout.kv_heads; ++h) {
      for (int64_t s = 0; s < len; s += p) {
        const int64_t run = std::min(p, len - s);
        std::memcpy(dst + (h * len + s) * row,
                    base + (pages_[s / p] * pool_->page_stride() + h * pool_->head_stride()) * es,
                    run * row);
      }
    }
    return out;
  }

  // Copies slot `from` to slot `to` in `layer`, keys and values.
  void CopySlot(int layer, int64_t from, int64_t to) {
    const KvLayout& layout = pool_->layout();
    const int64_t p = pool_->page_rows();
    for (bool values : {false, true}) {
      const at::Tensor pages = pool_->Pages(layer, values);
      if (pages.device().is_cpu()) {
        const int64_t es = pages.element_size(), row = layout.head_dim * es;
        char* base = static_cast<char*>(pool_->Base(layer, values));
        char* src =
            base + (pages_[from / p] * pool_->page_stride() + (from % p) * layout.head_dim) * es;
        char* dst =
            base + (pages_[to / p] * pool_->page_stride() + (to % p) * layout.head_dim) * es;
        for (int64_t h = 0; h < layout.kv_heads; ++h) {
          std::memcpy(dst + h * pool_->head_stride() * es, src + h * pool_->head_stride() * es,
                      row);
        }
        if (float* scales = pool_->ScaleBase(layer, values)) {
          for (int64_t h = 0; h < layout.kv_heads; ++h) {
            *ScaleOf(scales, to, h) = *ScaleOf(scales, from, h);
          }
        }
      } else {
        pages[pages_[to / p]]
            .narrow(1, to % p, 1)
            .copy_(pages[pages_[from / p]].narrow(1, from % p, 1));
      }
    }
  }

  // The value of slot `to` becomes (1 - share) x itself + share x slot `from`'s.
  void BlendValue(int layer, int64_t from, int64_t to, float share) {
    const int64_t p = pool_->page_rows();
    if (pool_->layout().int8()) {
      const KvLayout& layout = pool_->layout();
      std::vector<float> a(layout.head_dim);
      for (int64_t h = 0; h < layout.kv_heads; ++h) {
        int8_t* dst = RowInt8(layer, true, to, h);
        float* dst_scale = ScaleOf(pool_->ScaleBase(layer, true), to, h);
        const int8_t* src = RowInt8(layer, true, from, h);
        const float src_scale = *ScaleOf(pool_->ScaleBase(layer, true), from, h);
        for (int64_t d = 0; d < layout.head_dim; ++d) {
          a[d] = (1 - share) * (*dst_scale * dst[d]) + share * (src_scale * src[d]);
        }
        *dst_scale = QuantizeKvRow(a.data(), layout.head_dim, dst);
      }
      return;
    }
    const at::Tensor pages = pool_->Pages(layer, /*values=*/true);
    at::Tensor dst = pages[pages_[to / p]].narrow(1, to % p, 1);
    const at::Tensor src = pages[pages_[from / p]].narrow(1, from % p, 1);
    dst.copy_(dst.to(at::kFloat) * (1 - share) + src.to(at::kFloat) * share);
  }

  KvStorage View(int layer, int64_t len) const {
    KvStorage st;
    st.keys = pool_->Base(layer, false);
    st.values = pool_->Base(layer, true);
    st.pages = pages_.data();
    st.page_rows = pool_->page_rows();
    st.page_stride = pool_->page_stride();
    st.key_head_stride = st.value_head_stride = pool_->head_stride();
    st.row_stride = pool_->layout().head_dim;
    st.len = len;
    st.key_scales = pool_->ScaleBase(layer, false);
    st.value_scales = pool_->ScaleBase(layer, true);
    st.scale_page_stride = pool_->scale_page_stride();
    st.scale_head_stride = pool_->page_rows();
    return st;
  }

 private:
  // int8 entries: slot `s`'s row of KV head h, and its scale in a layer's scales (ScaleBase).
  int8_t* RowInt8(int layer, bool values, int64_t s, int64_t h) const {
    const int64_t p = pool_->page_rows();
    return static_cast<int8_t*>(pool_->Base(layer, values)) + pages_[s / p] * pool_->page_stride() +
           h * pool_->head_stride() + (s % p) * pool_->layout().head_dim;
  }
  float* ScaleOf(float* scales, int64_t s, int64_t h) const {
    const int64_t p = pool_->page_rows();
    return scales + pages_[s / p] * pool_->scale_page_stride() + h * p + s % p;
  }

  void WriteInt8(int layer, bool values, int64_t first, const at::Tensor& rows) {
    const KvLayout& layout = pool_->layout();
    const at::Tensor x = rows.to(at::kFloat).contiguous();  // [Hkv, n, hd]
    const float* src = x.data_ptr<float>();
    float* scales = pool_->ScaleBase(layer, values);
    const int64_t n = rows.size(1), hd = layout.head_dim;
    for (int64_t h = 0; h < layout.kv_heads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        *ScaleOf(scales, first + i, h) =
            QuantizeKvRow(src + (h * n + i) * hd, hd, RowInt8(layer, values, first + i, h));
      }
    }
  }

  at::Tensor GatherInt8(int layer, bool values, int64_t len) const {
    const KvLayout& layout = pool_->layout();
    const int64_t hd = layout.head_dim;
    at::Tensor out = at::empty({layout.kv_heads, len, hd}, at::kFloat);
    float* dst = out.data_ptr<float>();
    float* scales = pool_->ScaleBase(layer, values);
    for (int64_t h = 0; h < layout.kv_heads; ++h) {
      for (int64_t s = 0; s < len; ++s) {
        const int8_t* q = RowInt8(layer, values, s, h);
        const float d = *ScaleOf(scales, s, h);
        float* o = dst + (h * len + s) * hd;
        for (int64_t e = 0; e < hd; ++e) o[e] = d * static_cast<float>(q[e]);
      }
    }
    return out;
  }

  KvPool* pool_;
  std::vector<int32_t> pages_;
};

// The serving cache: its entries in the pool, compressed as its policy (kv_policy.h) decides,
// or all kept (no policy: Full). Invariants: every layer's entries fill slots [0, len_[l]) of
// one page table; positions_[l][s] is the token in slot s; with a policy, order_[l][r] is the
// slot of the entry of rank r (position order), and after each OnForwardDone every layer holds
// policy_->Target(tokens_seen_) entries unless all the rest are protected.
class PagedKvCache final : public KvCache {
 public:
  PagedKvCache(KvPool* pool, const CacheParams& params, std::unique_ptr<KvPolicy> policy)
      : pool_(pool),
        params_(params),
        policy_(std::move(policy)),
        table_(pool),
        len_(pool->layout().num_layers, 0),
        positions_(pool->layout().num_layers),
        order_(policy_ ? pool->layout().num_layers : 0),
        rows_seen_(pool->layout().num_layers, 0),
        pending_scores_(pool->layout().num_layers) {}

  const KvLayout& layout() const override { return pool_->layout(); }
  bool Reserve(int64_t n_new) override { return table_.Reserve(MaxLength() + n_new); }
  void Append(int layer, const at::Tensor& k, const at::Tensor& v) override {
    const int64_t n = k.size(1), first = len_[layer];
    table_.Write(layer, false, first, k);
    table_.Write(layer, true, first, v);
    len_[layer] += n;
    for (int64_t i = 0; i < n; ++i) positions_[layer].push_back(tokens_seen_ + i);
    if (!policy_) return;
    for (int64_t i = 0; i < n; ++i) order_[layer].push_back(static_cast<int32_t>(first + i));
  }
  at::Tensor Keys(int layer) const override { return table_.Gather(layer, false, len_[layer]); }
  at::Tensor Values(int layer) const override { return table_.Gather(layer, true, len_[layer]); }
  KvStorage Storage(int layer) const override { return table_.View(layer, len_[layer]); }
  int64_t Length(int layer) const override { return len_[layer]; }
  const std::vector<int64_t>& Positions(int layer) const override { return positions_[layer]; }

  bool WantsAttentionProbs(int layer) const override {
    return policy_ && policy_->WantsScores(prefilled_);
  }
  void ObserveAttention(int layer, const at::Tensor& probs) override {
    // probs [H, rows, len] in storage order. While the prompt is fed, storage order is position
    // order and its blocks arrive in row order, so the block's first row is the prompt position
    // rows_seen_; a block that straddles the policy's split row is handed over as two. Decode
    // rows have no prompt position (-1).
    auto columns = [&](int64_t begin, int64_t rows) {
      return probs.narrow(1, begin, rows).sum(at::IntArrayRef{0, 1}).div_(probs.size(0));
    };
    auto add = [&](int64_t first_row, int64_t begin, int64_t rows) {
      prompt_scores_.push_back({layer, first_row, ColumnMeans(probs, begin, rows)});
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
    if (!policy_) return;
    if (!prefilled_) {
      AddPromptScores();
      for (int l = 0; l < layout().num_layers; ++l) CompressPrompt(l);
      table_.Shrink(MaxLength());
      prefilled_ = true;
      return;
    }
    for (int l = 0; l < layout().num_layers; ++l) policy_->OnAppend(l, n_new);
    AddPendingScores();
    const int64_t target = policy_->Target(tokens_seen_);
    for (int l = 0; l < layout().num_layers; ++l) {
      while (len_[l] > target) {
        const int64_t victim = policy_->Victim(l, len_[l], target);
        if (victim < 0) break;  // everything left is protected
        Evict(l, victim);
      }
    }
    // A step that appended into a fresh page and then evicted leaves that page empty: it goes
    // back (the next step takes the same page again: the pool hands out the last one freed).
    table_.Shrink(MaxLength());
  }

  void OnPromptChunkDone(int64_t n_new) override {
    tokens_seen_ += n_new;
    if (policy_) AddPromptScores();
  }

  int64_t NextPosition() const override {
    return params_.position_mode == PositionMode::kCompressed ? len_[0] : tokens_seen_;
  }

  int64_t PagesHeld() const override { return table_.num_pages(); }
  KvStats Stats() const override {
    KvStats s = LayerStats(len_, layout(), tokens_seen_);
    s.bytes_allocated = table_.num_pages() * pool_->page_bytes();
    s.tokens_merged = merged_ / layout().num_layers;  // per-layer mean
    s.tokens_evicted = evicted_ / layout().num_layers;
    return s;
  }

 private:
  int64_t MaxLength() const { return *std::max_element(len_.begin(), len_.end()); }

  // After the prompt's last forward pass: the policy's plan for layer `l`, its kept and merged
  // rows written to the first slots (the prompt's slots are in position order).
  void CompressPrompt(int l) {
    const int64_t t = len_[l];
    MergePlan plan = policy_->PlanPrompt(l, t);
    merged_ += plan.merged;
    evicted_ += plan.dropped;
    const int64_t kept = static_cast<int64_t>(plan.kept.size());
    if (kept == t) return;  // nothing to drop or merge
    // [Hkv, t, hd] copies; int8 entries in fp32, so that a kept row is requantized exactly.
    const std::optional<at::ScalarType> type =
        layout().int8() ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
    const at::Tensor keys = table_.Gather(l, false, t, type);
    const at::Tensor values = table_.Gather(l, true, t, type);
    if (plan.merge_by_key && plan.merged > 0) AssignMergesByKey(keys, &plan);
    const at::Tensor index = at::tensor(plan.kept, at::kLong).to(keys.device());
    const bool merge = plan.merged > 0;
    table_.Write(l, false, 0,
                 merge && plan.merge_keys ? MergeRows(keys, plan) : keys.index_select(1, index));
    table_.Write(l, true, 0, merge ? MergeRows(values, plan) : values.index_select(1, index));
    std::vector<int64_t> pos;
    for (int64_t i : plan.kept) pos.push_back(positions_[l][i]);
    positions_[l] = std::move(pos);
    order_[l].resize(kept);
    std::iota(order_[l].begin(), order_[l].end(), 0);
    len_[l] = kept;
  }

  // The prompt pass's column sums, in the order they were observed.
  void AddPromptScores() {
    for (const PromptScores& p : prompt_scores_) {
      policy_->AddScores(p.layer, p.first_row, p.sums.data(), static_cast<int64_t>(p.sums.size()));
    }
    prompt_scores_.clear();
  }

  // The decode step's column sums of every layer, copied to the host in one piece and handed
  // to the policy in position order.
  void AddPendingScores() {
    std::vector<at::Tensor> sums;
    for (const at::Tensor& t : pending_scores_) {
      if (t.defined()) sums.push_back(t.to(at::kFloat));
    }
    if (sums.empty()) return;
    const at::Tensor host = at::cat(sums).to(at::kCPU).contiguous();
    const float* p = host.data_ptr<float>();
    std::vector<float> ranked;
    for (int l = 0; l < layout().num_layers; ++l) {
      at::Tensor& t = pending_scores_[l];
      if (!t.defined()) continue;
      const int64_t n = t.size(0);
      ranked.resize(n);
      for (int64_t r = 0; r < n; ++r) ranked[r] = p[order_[l][r]];
      policy_->AddScores(l, -1, ranked.data(), n);
      p += n;
      t = at::Tensor();
    }
  }

  // Evicts the entry of rank `rank` from layer `l`: the entry in the last slot moves into the
  // victim's slot, so the slots stay dense and nothing else moves.
  void Evict(int l, int64_t rank) {
    const KvPolicy::DecodeMerge m = policy_->MergeVictim(l, rank);
    if (m.into >= 0 && m.victim_weight + m.into_weight > 0) {
      table_.BlendValue(l, order_[l][rank], order_[l][m.into],
                        m.victim_weight / (m.victim_weight + m.into_weight));
    }
    const int32_t slot = order_[l][rank], last = static_cast<int32_t>(len_[l] - 1);
    if (slot != last) {
      table_.CopySlot(l, last, slot);
      positions_[l][slot] = positions_[l][last];
      *std::find(order_[l].begin(), order_[l].end(), last) = slot;
    }
    order_[l].erase(order_[l].begin() + rank);
    positions_[l].pop_back();
    --len_[l];
    policy_->OnEvict(l, rank);
    ++evicted_;
  }

  KvPool* pool_;
  CacheParams params_;
  std::unique_ptr<KvPolicy> policy_;  // null: Full
  PageTable table_;
  std::vector<int64_t> len_;                     // per layer: entries (= dense slots)
  std::vector<std::vector<int64_t>> positions_;  // per layer, per slot
  std::vector<std::vector<int32_t>> order_;      // per layer, per rank: its slot (policy only)
  std::vector<int64_t> rows_seen_;               // per layer: prompt query rows observed
  // The pass's attention column sums, held until it is committed: a prompt pass's blocks
  // (fp32 on the host), and a decode step's sums per layer (where they were computed).
  struct PromptScores {
    int layer;
    int64_t first_row;
    std::vector<float> sums;
  };
  std::vector<PromptScores> prompt_scores_;
  std::vector<at::Tensor> pending_scores_;
  int64_t tokens_seen_ = 0;
  bool prefilled_ = false;
  int64_t merged_ = 0;   // summed over layers
  int64_t evicted_ = 0;  // summed over layers
};

}  // namespace

std::unique_ptr<KvCache> NewFullKvCache(const KvLayout& layout) {
  return std::make_unique<FullKvCache>(layout);
}

std::unique_ptr<KvCache> NewKvCache(KvPool* pool, const CacheParams& params,
                                    const PromptSegments& segments) {
  if (params.KeepsEverything()) return std::make_unique<PagedKvCache>(pool, params, nullptr);
  return NewPolicyKvCache(pool, params, segments);
}

std::unique_ptr<KvCache> NewPolicyKvCache(KvPool* pool, const CacheParams& params,
                                          const PromptSegments& segments) {
  std::unique_ptr<KvPolicy> policy;
  if (params.policy != CachePolicy::kFull) {
    policy = NewKvPolicy(params, segments, pool->layout().num_layers);
  }
  return std::make_unique<PagedKvCache>(pool, params, std::move(policy));
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
      total[b] += plan.divide_by_count ? 1.f : w;
    }
    for (int64_t b = 0; b < k; ++b) {
      T* row = dst + h * out.stride(0) + b * out.stride(1);
      for (int64_t d = 0; d < hd; ++d) row[d] = static_cast<T>(acc[b * hd + d] / total[b]);
    }
  }
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

void AssignMergesByKey(const at::Tensor& keys, MergePlan* plan) {
  std::vector<int64_t> sources, targets;  // merged entries; kept, unpinned entries
  for (int64_t k = 0; k < static_cast<int64_t>(plan->kept.size()); ++k) {
    if (plan->pinned.empty() || !plan->pinned[k]) targets.push_back(plan->kept[k]);
  }
  for (int64_t i = 0; i < static_cast<int64_t>(plan->bucket.size()); ++i) {
    const int64_t b = plan->bucket[i];
    if (b >= 0 && plan->kept[b] != i) sources.push_back(i);
  }
  if (sources.empty() || targets.empty()) return;
  const at::Device dev = keys.device();
  const at::Tensor unit = keys.to(at::kFloat);  // [Hkv, T, hd]
  const at::Tensor normed = unit / unit.norm(2, {2}, true).clamp_min(1e-12);
  const at::Tensor src = normed.index_select(1, at::tensor(sources, at::kLong).to(dev));
  const at::Tensor dst = normed.index_select(1, at::tensor(targets, at::kLong).to(dev));
  // [S, K]: cosine similarity summed over the heads; the first maximum wins ties.
  const auto [sim, best] = at::matmul(src, dst.transpose(1, 2)).sum(0).max(1);
  const at::Tensor sim_host = sim.to(at::kCPU).div_(static_cast<double>(keys.size(0)));
  const at::Tensor best_host = best.to(at::kCPU);
  const float* s_e = sim_host.data_ptr<float>();
  const int64_t* b = best_host.data_ptr<int64_t>();
  for (size_t s = 0; s < sources.size(); ++s) {
    plan->bucket[sources[s]] = plan->bucket[targets[b[s]]];
  }
  if (plan->key_merge == KeyMerge::kAveraged) return;
  // KeyMerge's weights replace any the plan had. Pivotal: the pivot 1 + n/2, each merged 1/2.
  // Weighted: each merged entry its mean cosine similarity, the pivot 1, divided by n + 1.
  const int64_t len = static_cast<int64_t>(plan->bucket.size());
  plan->weight.assign(len, 1.f);
  if (plan->key_merge == KeyMerge::kWeighted) {
    plan->divide_by_count = true;
    for (size_t s = 0; s < sources.size(); ++s) plan->weight[sources[s]] = s_e[s];
    return;
  }
  for (size_t s = 0; s < sources.size(); ++s) {
    plan->weight[sources[s]] = 0.5f;
    plan->weight[plan->kept[plan->bucket[sources[s]]]] += 0.5f;
  }
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
  if (plan.weight.empty() || plan.divide_by_count) {
    total.index_add_(0, dst_idx, at::ones({static_cast<int64_t>(dst.size())}, total.options()));
  }
  if (!plan.weight.empty()) {
    at::Tensor wt = at::tensor(w, at::kFloat).to(dev);
    selected.mul_(wt.view({1, -1, 1}));
    if (!plan.divide_by_count) total.index_add_(0, dst_idx, wt);
  }
  at::Tensor sum = at::zeros({rows.size(0), k, rows.size(2)}, selected.options());
  sum.index_add_(1, dst_idx, selected);
  return sum.div_(total.view({1, k, 1})).to(rows.scalar_type());
}

}  // namespace llava
