#include "train/training_data.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "engine/io/chat_template.h"
#include "engine/io/image_io.h"

namespace llava::train {
namespace {

using llava::shapes::QA;
using llava::shapes::Rng;

constexpr uint64_t kSceneStream = 0x5CE9E5ull;

uint64_t Mix(uint64_t seed, uint64_t a, uint64_t b = 0) {
  Rng r(seed ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full));
  return r.Next();
}

// Builds the token ids of a whole conversation and marks the answer tokens. The template is
// prefix-stable: the prompt up to turn i's "ASSISTANT:" is a prefix of the whole conversation,
// and turn i's answer runs from there to its </s>.
bool BuildExample(const llava::Tokenizer& tok, const llava::LlavaConfig& config,
                  const llava::shapes::Scene& scene, const std::vector<QA>& turns,
                  const DataMix& mix, bool paper_layout, Example* ex) {
  using Kind = llava::ContentPart::Kind;
  std::vector<llava::ChatMessage> messages;
  if (paper_layout) messages.push_back({"system", {{Kind::kText, llava::kLlavaV1SystemPrompt, 0}}});
  std::vector<size_t> answer_starts;
  std::vector<std::vector<int>> prefixes;
  for (size_t i = 0; i < turns.size(); ++i) {
    llava::ChatMessage user{"user", {}};
    if (paper_layout) user.content.push_back({Kind::kText, turns[i].question, 0});
    if (i == 0) user.content.push_back({Kind::kImage, "", 0});
    if (!paper_layout) user.content.push_back({Kind::kText, turns[i].question, 0});
    messages.push_back(user);
    auto prefix =
        llava::BuildPrompt(tok, messages, 1, config.image_token_index, config.image_tokens());
    if (!prefix.ok()) return false;
    answer_starts.push_back(prefix->ids.size());
    prefixes.push_back(std::move(prefix->ids));
    messages.push_back({"assistant", {{llava::ContentPart::Kind::kText, turns[i].answer, 0}}});
  }
  messages.push_back({"user", {{llava::ContentPart::Kind::kText, "-", 0}}});
  auto all = llava::BuildPrompt(tok, messages, 1, config.image_token_index, config.image_tokens());
  if (!all.ok()) return false;
  for (size_t i = 0; i < prefixes.size(); ++i) {  // the labels below rely on it
    if (!std::equal(prefixes[i].begin(), prefixes[i].end(), all->ids.begin())) {
      std::fprintf(stderr, "BuildExample: turn %zu's prompt is not a prefix\n", i);
      std::abort();
    }
  }
  ex->labels.assign(all->ids.size(), kIgnoreLabel);
  size_t end = 0;
  std::vector<size_t> answer_ends;  // each answer's </s>
  for (size_t start : answer_starts) {
    size_t t = start;
    while (t < all->ids.size() && all->ids[t] != tok.eos_id()) ++t;
    if (t == all->ids.size()) return false;
    for (size_t u = start; u <= t; ++u) ex->labels[u - 1] = all->ids[u];
    answer_ends.push_back(t);
    end = t + 1;
  }
  ex->ids.assign(all->ids.begin(), all->ids.begin() + end);
  ex->labels.resize(end);
  ex->image_offsets = all->image_offsets;
  const int size = config.vision.image_size, grid = size / config.vision.patch_size;
  for (size_t start : answer_starts) ex->answer_rows.push_back(static_cast<int64_t>(start) - 1);
  ex->inventory.assign(llava::shapes::kNumShapes + llava::shapes::kNumColours, 0);
  for (const llava::shapes::Object& o : scene.objects) {
    ++ex->inventory[o.shape];
    ++ex->inventory[llava::shapes::kNumShapes + o.colour];
  }
  for (size_t i = 0; i < turns.size(); ++i) {
    std::vector<std::vector<int64_t>> objects;
    std::vector<int> named = llava::shapes::NamedObjects(scene, turns[i].question);
    if (mix.per_object && turns[i].kind == "count" &&
        !llava::shapes::NamesAnything(turns[i].question)) {
      for (size_t o = 0; o < scene.objects.size(); ++o) named.push_back(static_cast<int>(o));
    }
    for (int o : named) {
      objects.emplace_back();
      for (int p : llava::shapes::ObjectPatches(scene.objects[o], size, grid)) {
        objects.back().push_back(ex->image_offsets[0] + p);
      }
    }
    std::string kind = turns[i].kind;
    const bool absent = objects.empty() && llava::shapes::NamesAnything(turns[i].question);
    if (absent && (mix.absent_to_bos || mix.per_object)) kind += "/absent";
    llava::AttentionTarget target{static_cast<int64_t>(answer_starts[i]) - 1, {}, kind};
    if (mix.per_object && (absent || !objects.empty())) {
      target.parts = {{0}};  // <s>, then one part per object
      target.parts.insert(target.parts.end(), objects.begin(), objects.end());
    } else if (absent && mix.absent_to_bos) {
      target.parts = {{0}};
    } else if (!objects.empty()) {
      target.parts.emplace_back();
      for (const auto& o : objects)
        target.parts[0].insert(target.parts[0].end(), o.begin(), o.end());
    }
    if (target.parts.empty()) continue;
    // The rows that predict the answer's later tokens (not its </s>), for short answers.
    const int64_t last_row = turns[i].kind == "describe" || !mix.every_answer_row
                                 ? target.row
                                 : static_cast<int64_t>(answer_ends[i]) - 2;
    for (int64_t row = target.row + 1; row <= last_row; ++row) {
      llava::AttentionTarget more = target;
      more.row = row;
      ex->attn_targets.push_back(std::move(more));
    }
    ex->attn_targets.push_back(std::move(target));
  }
  return true;
}

}  // namespace

Example MakeExample(const llava::Tokenizer& tok, const llava::LlavaConfig& config, uint64_t seed,
                    int64_t step, int b, const DataMix& mix) {
  for (int attempt = 0;; ++attempt) {
    Rng rng(Mix(seed ^ kSceneStream, static_cast<uint64_t>(step) * 64 + b, attempt));
    llava::shapes::Scene scene = llava::shapes::SampleScene(rng);
    std::vector<QA> turns = llava::shapes::SampleConversation(scene, rng, mix.conversation);
    if (mix.paraphrase > 0) {
      for (QA& qa : turns) {
        if (rng.Chance(mix.paraphrase)) qa.question = llava::shapes::Paraphrase(qa.question, rng);
      }
    }
    const bool paper_layout = mix.paper_layout > 0 && rng.Chance(mix.paper_layout);
    Example ex;
    if (!BuildExample(tok, config, scene, turns, mix, paper_layout, &ex)) continue;
    llava::RgbImage img;
    img.width = img.height = config.vision.image_size;
    img.pixels = llava::shapes::RenderScene(scene, img.width, rng.Next());
    ex.pixels = llava::PreprocessImage(img, config.image_processor);
    if (!mix.patch_labels) return ex;
    const int grid = config.vision.image_size / config.vision.patch_size;
    for (int o : llava::shapes::PatchOwners(scene, config.vision.image_size, grid)) {
      const llava::shapes::Object* obj = o < 0 ? nullptr : &scene.objects[o];
      ex.patch_shape.push_back(obj ? obj->shape : llava::shapes::kNumShapes);
      ex.patch_colour.push_back(obj ? obj->colour : llava::shapes::kNumColours);
      ex.patch_size.push_back(obj ? obj->size : llava::shapes::kNumSizes);
    }
    return ex;
  }
}

void WriteCorpus(const std::string& path, uint64_t seed, int scenes, const DataMix& mix) {
  std::ofstream out(path);
  out << "USER: ASSISTANT:\n";
  for (int i = 0; i < scenes; ++i) {
    Rng rng(Mix(seed ^ kSceneStream, 1ull << 40 | i));
    llava::shapes::Scene scene = llava::shapes::SampleScene(rng);
    // The tokenizer's corpus keeps the held-out split's share of descriptions and questions.
    llava::shapes::ConversationMix corpus_mix;
    corpus_mix.subset = mix.conversation.subset;
    corpus_mix.grouped = mix.conversation.grouped;
    for (const QA& qa : llava::shapes::SampleConversation(scene, rng, corpus_mix)) {
      out << "USER: " << qa.question << " ASSISTANT: " << qa.answer << "\n";
    }
  }
}

}  // namespace llava::train
