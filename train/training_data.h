// The trainer's data: each step's fresh scenes rendered, their multi-turn conversations
// tokenized with the chat template, the answer tokens labelled, and the targets of the
// attention, patch and count supervision; the tokenizer's text corpus. Deterministic in the
// seed, the step and the row of the batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/io/model_config.h"
#include "engine/io/tokenizer.h"
#include "train/attention_supervision.h"
#include "train/shapes_world.h"

namespace llava::train {

constexpr int kIgnoreLabel = -100;  // a position whose prediction the loss ignores

struct Example {
  std::vector<int> ids;     // prompt ids with image rows, answers and </s>
  std::vector<int> labels;  // labels[t] = id predicted from position t (kIgnoreLabel if none)
  std::vector<int> image_offsets;
  std::vector<float> pixels;  // [3, S, S]
  // Attention supervision: each short answer's objects (train/attention_supervision.h).
  std::vector<llava::AttentionTarget> attn_targets;
  // Patch supervision (--patch-weight): per image patch, the shape, colour and size class of
  // the object it shows (kNumShapes / kNumColours / kNumSizes = background).
  std::vector<int64_t> patch_shape, patch_colour, patch_size;
  // Count supervision (--count-weight): the rows that predict each answer's first token, and
  // the scene's inventory, how many objects of each shape then of each colour (kNumShapes +
  // kNumColours entries).
  std::vector<int64_t> answer_rows;
  std::vector<int64_t> inventory;
};

// What the training conversations are made of (train/shapes_world.h SampleConversation) and
// the shape of the attention targets (train/attention_supervision.h).
struct DataMix {
  llava::shapes::ConversationMix conversation;
  bool absent_to_bos = false;  // --attn-absent: nothing named is there -> all on <s>
  bool per_object = false;     // --attn-count: <s> and each named object an equal share
  // --attn-every-row: a short answer's every token row gets the target, not only the row that
  // predicts its first token (the rows that write "small red circle" look the object up too)
  bool every_answer_row = false;
  bool patch_labels = false;  // --patch-weight: label every image patch (Example::patch_*)
  // --paper-layout: this share of conversations in the Elastic Cache paper's layout (llava_v1
  // system prompt, the first question before the image); the others image-first.
  double paper_layout = 0;
  double paraphrase = 0;  // --paraphrase: each question reworded with this probability
};

// Row `b` of step `step`'s batch: a fresh scene and conversation from `seed`, rendered and
// tokenized for `config`.
Example MakeExample(const Tokenizer& tok, const LlavaConfig& config, uint64_t seed, int64_t step,
                    int b, const DataMix& mix);

// The tokenizer's training text: `scenes` conversations as "USER: ... ASSISTANT: ..." lines.
void WriteCorpus(const std::string& path, uint64_t seed, int scenes, const DataMix& mix);

}  // namespace llava::train
