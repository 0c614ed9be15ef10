#include "train/train_step.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>

#include "engine/kv/kv_cache.h"
#include "engine/model/llava_model.h"

namespace llava::train {
namespace {

// bf16 autocast on the CPU for the forward pass: matmuls in bf16 through oneDNN, reductions
// and the loss in fp32, master weights fp32. ~3x faster than fp32 here (docs/TRAINING.md).
// Autocast's state and its cache of cast weights are per thread.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool on) : on_(on) {
    if (!on_) return;
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_cpu_enabled(false);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool on_;
};

// One shard's loss terms as sums over its rows with their counts, so that the shards' terms add
// up to the batch's means once every shard's counts are known.
struct ShardSums {
  at::Tensor lm, attn, patch, count;  // undefined where the shard has none
  int64_t lm_n = 0, attn_n = 0, patch_n = 0, count_n = 0;
  int64_t tokens = 0, rows_saved = 0;
  AttentionReport report;
};

// Shorter common prefixes are not worth a pass of their own (every conversation begins with
// "<s> USER:").
constexpr int64_t kMinSharedPrefix = 16;

// The rows that the shard's conversations with the most text before their image have in
// common, and which conversations those are (`shares`): 0 when fewer than two of them agree on
// kMinSharedPrefix rows. The prefix ends before any image row and any labelled row.
int64_t SharedPrefix(const std::vector<const Example*>& shard, std::vector<bool>* shares) {
  shares->assign(shard.size(), false);
  const Example* first = nullptr;
  int64_t prefix = 0;
  int count = 0;
  for (size_t b = 0; b < shard.size(); ++b) {
    const Example& e = *shard[b];
    int64_t limit = e.image_offsets.empty() ? static_cast<int64_t>(e.ids.size())
                                            : static_cast<int64_t>(e.image_offsets[0]);
    for (int64_t t = 0; t < limit; ++t) {
      if (e.labels[t] != kIgnoreLabel) {
        limit = t;
        break;
      }
    }
    if (limit < kMinSharedPrefix) continue;
    if (first == nullptr) {
      first = &e;
      prefix = limit;
    } else {
      int64_t common = 0;
      while (common < std::min(prefix, limit) && e.ids[common] == first->ids[common]) ++common;
      if (common < kMinSharedPrefix) continue;
      prefix = common;
    }
    (*shares)[b] = true;
    ++count;
  }
  if (count < 2) {
    shares->assign(shard.size(), false);
    return 0;
  }
  return prefix;
}

ShardSums ForwardShard(LlavaModel& model, const LlavaConfig& config,
                       const std::vector<const Example*>& shard, const Probes& probes,
                       const LossOptions& o) {
  ShardSums sums;
  const int64_t batch = static_cast<int64_t>(shard.size());
  std::vector<float> pixels;
  std::vector<int64_t> labels, patch_labels[3];
  for (const Example* e : shard) {
    patch_labels[0].insert(patch_labels[0].end(), e->patch_shape.begin(), e->patch_shape.end());
    patch_labels[1].insert(patch_labels[1].end(), e->patch_colour.begin(), e->patch_colour.end());
    patch_labels[2].insert(patch_labels[2].end(), e->patch_size.begin(), e->patch_size.end());
    pixels.insert(pixels.end(), e->pixels.begin(), e->pixels.end());
    for (int l : e->labels) sums.lm_n += l != kIgnoreLabel;
    sums.tokens += static_cast<int64_t>(e->labels.size());  // shared rows included
  }

  CpuAutocast autocast(o.bf16);
  const int64_t s = config.vision.image_size;
  // A copy: the backward pass, after this function, reads the pixels (the patch embedding's
  // gradient).
  at::Tensor pv = at::from_blob(pixels.data(), {batch, 3, s, s}, at::kFloat).clone();
  at::Tensor features = model.EncodeImages(pv);  // [B, N, D]
  std::vector<bool> shares(shard.size(), false);
  const int64_t prefix = o.share_prefix ? SharedPrefix(shard, &shares) : 0;
  std::unique_ptr<KvCache> prefix_cache;
  if (prefix > 0) {
    // The shared rows' keys and values, one pass (its one logit row is not used).
    const Example& e = *shard[std::find(shares.begin(), shares.end(), true) - shares.begin()];
    prefix_cache = model.NewFullCache();
    std::vector<int64_t> ids(e.ids.begin(), e.ids.begin() + prefix);
    SequenceChunk c;
    c.embeds = model.Embed(at::tensor(ids, at::kLong));
    c.kv = prefix_cache.get();
    model.Forward({c});
    prefix_cache->OnForwardDone(prefix);
    sums.rows_saved = prefix * (std::count(shares.begin(), shares.end(), true) - 1);
  }
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<SequenceChunk> chunks;
  std::vector<at::Tensor> attn_terms;          // per layer and query block: its targets' terms
  std::vector<int64_t> count_rows, inventory;  // rows of the shard, their scenes' counts
  int64_t shard_row = 0;
  // Each conversation's image features (a split: one concatenation in the backward pass, where a
  // narrow per conversation would add up a zero tensor of the whole batch for each).
  const std::vector<at::Tensor> images = features.split(1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const Example& e = *shard[b];
    const int64_t skip = shares[b] ? prefix : 0;  // rows already in the cache
    caches.push_back(model.NewFullCache());
    if (skip > 0) {
      for (int l = 0; l < config.text.num_hidden_layers; ++l) {
        caches.back()->Append(l, prefix_cache->Keys(l), prefix_cache->Values(l));
      }
      caches.back()->OnForwardDone(skip);
    }
    if (o.attn_weight > 0 || o.attn_report) {
      caches.back() =
          NewSupervisedAttentionCache(std::move(caches.back()), o.attn_layers, e.attn_targets,
                                      &attn_terms, o.attn_report ? &sums.report : nullptr, skip);
    }
    SequenceChunk c;
    c.embeds = model.EmbedPrompt(e.ids, e.image_offsets, images[b]);
    if (skip > 0) c.embeds = c.embeds.narrow(0, skip, c.embeds.size(0) - skip);
    // Logits only for the rows the loss reads (the answers' ~1/4 of the rows): the output head,
    // final norm and cross-entropy skip the image and prompt rows. None is in a shared prefix.
    for (int64_t r = skip; r < static_cast<int64_t>(e.labels.size()); ++r) {
      if (e.labels[r] == kIgnoreLabel) continue;
      c.logit_rows.push_back(r - skip);
      labels.push_back(e.labels[r]);
    }
    if (c.logit_rows.empty()) labels.push_back(kIgnoreLabel);  // the last row's logits, unread
    c.start_position = skip;
    c.kv = caches.back().get();
    for (int64_t r : e.answer_rows) {
      count_rows.push_back(shard_row + r - skip);
      inventory.insert(inventory.end(), e.inventory.begin(), e.inventory.end());
    }
    shard_row += c.embeds.size(0);
    chunks.push_back(c);
  }
  std::vector<at::Tensor> layer_outputs;
  at::Tensor logits = model.Forward(chunks, o.count_weight > 0 ? &layer_outputs : nullptr);
  sums.lm = at::cross_entropy_loss(logits, at::tensor(labels, at::kLong), {}, at::Reduction::Sum,
                                   kIgnoreLabel);
  if (o.attn_weight > 0 && !attn_terms.empty()) {
    const at::Tensor all = at::cat(attn_terms);
    sums.attn = all.sum();
    sums.attn_n = all.numel();
  }
  if (o.patch_weight > 0) {
    // [B * N, classes]: each image row's shape, colour and size logits.
    at::Tensor rows = features.to(at::kFloat).reshape({-1, features.size(-1)});
    at::Tensor all = at::addmm(probes.patch_b, rows, probes.patch_w.t());
    int64_t from = 0;
    for (int k = 0; k < 3; ++k) {
      at::Tensor p =
          at::cross_entropy_loss(all.narrow(1, from, kPatchClasses[k]),
                                 at::tensor(patch_labels[k], at::kLong), {}, at::Reduction::Sum);
      sums.patch = sums.patch.defined() ? sums.patch + p : p;
      from += kPatchClasses[k];
    }
    sums.patch_n = rows.size(0);
  }
  if (o.count_weight > 0 && !count_rows.empty()) {
    // The answer rows' residual stream, RMS-normalised, -> [rows, kInventory, 7] logits.
    at::Tensor h = layer_outputs[o.count_layer]
                       .index_select(0, at::tensor(count_rows, at::kLong))
                       .to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-5);
    at::Tensor all = at::addmm(probes.count_b, h, probes.count_w.t()).to(at::kFloat);
    sums.count = at::cross_entropy_loss(all.reshape({-1, kCountClasses}),
                                        at::tensor(inventory, at::kLong), {}, at::Reduction::Sum);
    sums.count_n = static_cast<int64_t>(inventory.size());
  }
  return sums;
}

// fn(0) .. fn(n - 1), each on its own thread with `intra_op` ATen threads (the calling thread
// when n == 1); the results in order, after every thread has finished.
template <typename Fn>
auto OnShardThreads(int n, int intra_op, Fn fn) -> std::vector<decltype(fn(0))> {
  std::vector<decltype(fn(0))> out;
  if (n == 1) {
    out.push_back(fn(0));
    return out;
  }
  std::vector<std::future<decltype(fn(0))>> running;
  for (int i = 0; i < n; ++i) {
    running.push_back(std::async(std::launch::async, [&fn, i, intra_op] {
      at::set_num_threads(intra_op);  // this thread's OpenMP team (and oneDNN's) only
      return fn(i);
    }));
  }
  for (auto& r : running) r.wait();  // every thread done before any error is rethrown
  for (auto& r : running) out.push_back(r.get());
  return out;
}

// The examples of each of `n` shards: longest first onto the shard with the fewest tokens, so
// that the threads finish together; deterministic, and in batch order within a shard.
std::vector<std::vector<const Example*>> Balance(const std::vector<Example>& examples, int n) {
  std::vector<size_t> order(examples.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return examples[a].ids.size() > examples[b].ids.size();
  });
  std::vector<std::vector<size_t>> picked(n);
  std::vector<size_t> load(n, 0);
  for (size_t i : order) {
    const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    picked[s].push_back(i);
    load[s] += examples[i].ids.size();
  }
  std::vector<std::vector<const Example*>> shards(n);
  for (int s = 0; s < n; ++s) {
    std::sort(picked[s].begin(), picked[s].end());
    for (size_t i : picked[s]) shards[s].push_back(&examples[i]);
  }
  return shards;
}

// What a shard's sums are divided by: the whole batch's counts, known before any forward pass
// (ForwardShard's own counts are checked against the same arithmetic).
ShardSums Counts(const LlavaConfig& config, const std::vector<const Example*>& shard,
                 const LossOptions& o) {
  ShardSums c;
  int layers = 0;
  for (int l : o.attn_layers) layers += l >= 0 && l < config.text.num_hidden_layers;
  for (const Example* e : shard) {
    for (int l : e->labels) c.lm_n += l != kIgnoreLabel;
    if (o.attn_weight > 0) c.attn_n += static_cast<int64_t>(e->attn_targets.size()) * layers;
    if (o.patch_weight > 0) c.patch_n += config.image_tokens();
    if (o.count_weight > 0) c.count_n += static_cast<int64_t>(e->answer_rows.size()) * kInventory;
  }
  return c;
}

// One shard's forward and backward pass: its part of the batch's loss and its gradients.
struct ShardResult {
  BatchLosses losses;  // the shard's parts of the batch's means
  std::vector<at::Tensor> grads;
  AttentionReport report;
};

}  // namespace

BatchLosses BatchGradients(LlavaModel& model, const LlavaConfig& config,
                           const std::vector<Example>& examples, const Probes& probes,
                           const LossOptions& options, const std::vector<at::Tensor>& params,
                           int shards, int threads, AttentionReport* report) {
  const int n = std::max(1, std::min(shards, static_cast<int>(examples.size())));
  const std::vector<std::vector<const Example*>> parts = Balance(examples, n);
  std::vector<const Example*> all;
  for (const Example& e : examples) all.push_back(&e);
  const ShardSums total = Counts(config, all, options);

  std::vector<ShardResult> results = OnShardThreads(n, std::max(1, threads / n), [&](int i) {
    ShardResult r;
    const auto t0 = std::chrono::steady_clock::now();
    ShardSums s = ForwardShard(model, config, parts[i], probes, options);
    const ShardSums expected = Counts(config, parts[i], options);
    if (s.lm_n != expected.lm_n || s.attn_n != expected.attn_n || s.patch_n != expected.patch_n ||
        s.count_n != expected.count_n) {
      throw std::logic_error("BatchGradients: a shard's loss terms are not the ones counted");
    }
    // The shard's sums over the batch's counts, weighted: its part of the batch's loss.
    at::Tensor loss = s.lm / static_cast<double>(std::max<int64_t>(1, total.lm_n));
    r.losses.lm = loss.item<double>();
    if (s.attn.defined()) {
      at::Tensor a = s.attn / static_cast<double>(total.attn_n);
      r.losses.attn = a.item<double>();
      loss = loss + options.attn_weight * a;
    }
    if (s.patch.defined()) {
      at::Tensor p = s.patch / (3.0 * total.patch_n);
      r.losses.patch = p.item<double>();
      loss = loss + options.patch_weight * p;
    }
    if (s.count.defined()) {
      at::Tensor c = s.count / static_cast<double>(total.count_n);
      r.losses.count = c.item<double>();
      loss = loss + options.count_weight * c;
    }
    r.losses.tokens = s.tokens;
    r.losses.rows_saved = s.rows_saved;
    r.report = std::move(s.report);
    const auto t1 = std::chrono::steady_clock::now();
    r.grads = torch::autograd::grad({loss}, params, /*grad_outputs=*/{},
                                    /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    r.losses.forward_s = std::chrono::duration<double>(t1 - t0).count();
    r.losses.backward_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    return r;
  });

  BatchLosses losses;
  for (const ShardResult& r : results) {
    losses.lm += r.losses.lm;
    losses.attn += r.losses.attn;
    losses.patch += r.losses.patch;
    losses.count += r.losses.count;
    losses.tokens += r.losses.tokens;
    losses.rows_saved += r.losses.rows_saved;
    losses.forward_s = std::max(losses.forward_s, r.losses.forward_s);
    losses.backward_s = std::max(losses.backward_s, r.losses.backward_s);
    if (report == nullptr) continue;
    for (const auto& [key, masses] : r.report) {
      auto& into = (*report)[key];
      into.first.resize(masses.first.size());
      for (size_t h = 0; h < masses.first.size(); ++h) into.first[h] += masses.first[h];
      into.second += masses.second;
    }
  }
  for (size_t p = 0; p < params.size(); ++p) {  // in shard order: the same sum every run
    at::Tensor sum;
    for (const ShardResult& r : results) {
      if (r.grads[p].defined()) sum = sum.defined() ? sum + r.grads[p] : r.grads[p];
    }
    at::Tensor param = params[p];
    param.mutable_grad() = sum;
  }
  return losses;
}

}  // namespace llava::train
