// Attention supervision for llava-train (docs/TRAINING.md, "Attention supervision"): head 0 of
// chosen decoder layers is taught to attend, from the row that predicts a short answer, to the
// image rows of the objects its question names. Our small model, trained from scratch, never
// formed a lookup by colour on its own; this gives that lookup a direct gradient. Training
// only: the checkpoint is a plain LLaVA model.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/kv/kv_cache.h"

namespace llava {

// The loss asks head 0 to share its attention equally among `parts`: one part is all the
// named objects' image rows together (--attn-weight), or each object its own part plus <s>
// (--attn-count), so that the share left on <s> says how many objects there are.
struct AttentionTarget {
  int64_t row = 0;  // query row (sequence index) that predicts an answer's first token
  std::vector<std::vector<int64_t>> parts;  // cache entries (image rows, <s> = 0) per part
  std::string kind;                         // the question's kind, for the report
};

// (layer, question kind) -> per-head sums of the attention mass on the targets, and answers.
using AttentionReport = std::map<std::pair<int, std::string>, std::pair<std::vector<double>, int>>;

// A cache that behaves exactly as `inner` (a Full cache of one sequence fed in one forward pass)
// and, in `layers`, appends to `terms` a 1-D tensor per query block that holds targets (one
// differentiable term per target, in the order of `targets`; at::cat(terms) lists them all): the
// mean over its
// parts of -log(mass + 1e-6), mass being the probability head 0 puts on the part's entries from
// the target's row (a cross-entropy against equal shares). With `report`, it also adds every
// head's mass on all the parts together. `terms` and `report` must outlive the forward pass.
// `first_row`: the sequence's row that the forward pass's first query row is (> 0 when `inner`
// already holds the sequence's first rows, a prefix shared with other sequences).
std::unique_ptr<KvCache> NewSupervisedAttentionCache(
    std::unique_ptr<KvCache> inner, std::vector<int> layers, std::vector<AttentionTarget> targets,
    std::vector<at::Tensor>* terms, AttentionReport* report, int64_t first_row = 0);

void PrintAttentionReport(const AttentionReport& report);

}  // namespace llava
