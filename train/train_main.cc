// llava-train: trains the default model (a small LLaVA) from scratch on the shapes world
// (train/shapes_world.h), with the engine's own model code: LlavaModel::Forward runs under
// autograd (Full caches, every row's logits), AdamW updates its weights in place.
//
//   1. generate a text corpus from the train seed and train tokenizer.model with spm_train;
//   2. initialise the weights (seeded), build the model in f32;
//   3. train: each step samples `batch` fresh scenes and multi-turn conversations, loss on
//      answer tokens (and each answer's </s>) only; warm-up then cosine learning rate;
//   4. save the llava-hf folder (bf16 safetensors, config, preprocessor config, tokenizer),
//      also every --save-every steps, so an interrupted run leaves a usable model.
// Reproducible from --seed for a fixed --steps and thread count.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include "engine/io/chat_template.h"
#include "engine/io/image_io.h"
#include "engine/io/model_config.h"
#include "engine/io/tokenizer.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "tools/checkpoint_writer.h"
#include "train/attention_supervision.h"
#include "train/shapes_world.h"

namespace {

using llava::shapes::QA;
using llava::shapes::Rng;

constexpr uint64_t kSceneStream = 0x5CE9E5ull;
constexpr int kIgnore = -100;

uint64_t Mix(uint64_t seed, uint64_t a, uint64_t b = 0) {
  Rng r(seed ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full));
  return r.Next();
}

struct Example {
  std::vector<int> ids;     // prompt ids with image rows, answers and </s>
  std::vector<int> labels;  // labels[t] = id predicted from position t (kIgnore if none)
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
  bool patch_labels = false;   // --patch-weight: label every image patch (Example::patch_*)
  // --paper-layout: this share of conversations in the Elastic Cache paper's layout (llava_v1
  // system prompt, the first question before the image); the others image-first.
  double paper_layout = 0;
  double paraphrase = 0;  // --paraphrase: each question reworded with this probability
};

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
  ex->labels.assign(all->ids.size(), kIgnore);
  size_t end = 0;
  for (size_t start : answer_starts) {
    size_t t = start;
    while (t < all->ids.size() && all->ids[t] != tok.eos_id()) ++t;
    if (t == all->ids.size()) return false;
    for (size_t u = start; u <= t; ++u) ex->labels[u - 1] = all->ids[u];
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
    if (!target.parts.empty()) ex->attn_targets.push_back(std::move(target));
  }
  return true;
}

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

// bf16 autocast on the CPU for the forward pass: matmuls in bf16 through oneDNN, reductions
// and the loss in fp32, master weights fp32. ~3x faster than fp32 here (docs/TRAINING.md).
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

 private:
  bool on_;
};

// 2-D sin-cos patch positions (as in MAE) for the learned CLIP position embedding, scaled to
// `rms` per element; the class token's row is zero. The checkpoint writer's N(0, 0.2) positions
// are ~2.5x weaker than the patch contents (RMS ~0.5 with N(0, 0.02) patch weights), and the
// first model never learnt where objects are (docs/TRAINING.md).
at::Tensor SinCosPositions(const llava::VisionConfig& v, double rms) {
  const int64_t grid = v.image_size / v.patch_size, d = v.hidden_size, quarter = d / 4;
  at::Tensor out = at::zeros({grid * grid + 1, d});
  auto a = out.accessor<float, 2>();
  for (int64_t r = 0; r < grid; ++r) {
    for (int64_t c = 0; c < grid; ++c) {
      for (int64_t k = 0; k < quarter; ++k) {
        // wavelengths from 2 pi to 2 pi * 100 patches: the grid is only `grid` wide
        const double omega = std::pow(100.0, -double(k) / quarter);
        float* row = &a[1 + r * grid + c][0];
        row[k] = static_cast<float>(std::sin(r * omega));
        row[quarter + k] = static_cast<float>(std::cos(r * omega));
        row[2 * quarter + k] = static_cast<float>(std::sin(c * omega));
        row[3 * quarter + k] = static_cast<float>(std::cos(c * omega));
      }
    }
  }
  return out * (rms / std::sqrt(0.5));
}

llava::LlavaConfig DefaultConfig(const llava::Tokenizer& tok, bool tie_embeddings) {
  llava::LlavaConfig c =
      llava::PresetConfig(llava::ModelPreset::kShapes, tok.vocab_size(), tok.PieceToId("<image>"));
  c.text.tie_word_embeddings = tie_embeddings;
  return c;
}

// Every flag of llava-train (AddFlags documents them).
struct TrainFlags {
  std::string out_dir = "models/shapes-llava", init_dir;
  uint64_t seed = 0;
  int64_t steps = 3000, warmup = 150, save_every = 250;
  int batch = 8, threads = 2, vocab = 512, corpus_scenes = 20000;
  bool bf16 = true, tie_embeddings = false;
  double embed_std = 0.02, patch_std = 0.02, pos_rms = 0.5, attn_weight = 0, patch_weight = 0,
         count_weight = 0;
  int count_layer = 2;
  DataMix mix;
  std::string question_weights;
  bool attn_report = false;
  std::vector<int> attn_layers = {1, 2};
  double lr = 3e-4, min_lr_ratio = 0.1, weight_decay = 0.05, minutes = 0;
};

void AddFlags(CLI::App& app, TrainFlags& f) {
  app.add_option("--out", f.out_dir, "output llava-hf folder")->capture_default_str();
  app.add_option("--seed", f.seed, "seed of data, tokenizer corpus and weights")
      ->capture_default_str();
  app.add_option("--steps", f.steps, "optimizer steps (sets the cosine schedule)")
      ->capture_default_str();
  app.add_option("--batch", f.batch, "conversations per step")->capture_default_str();
  app.add_option("--lr", f.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", f.warmup, "linear warm-up steps")->capture_default_str();
  app.add_option("--weight-decay", f.weight_decay, "AdamW decay of matrices")
      ->capture_default_str();
  app.add_option("--threads", f.threads, "intra-op threads")->capture_default_str();
  app.add_option("--vocab", f.vocab, "tokenizer vocabulary size")->capture_default_str();
  app.add_option("--save-every", f.save_every, "checkpoint interval (steps)")
      ->capture_default_str();
  app.add_option("--embed-std", f.embed_std, "initial token-embedding std")->capture_default_str();
  app.add_option("--patch-std", f.patch_std, "initial patch-embedding std")->capture_default_str();
  app.add_option("--pos-rms", f.pos_rms,
                 "RMS of the 2-D sin-cos initial patch position embedding (0 = N(0, 0.2))")
      ->capture_default_str();
  app.add_option("--describe-prob", f.mix.conversation.describe,
                 "probability that a training conversation is the description alone")
      ->capture_default_str();
  app.add_option("--subset-prob", f.mix.conversation.subset,
                 "probability that a training conversation describes objects of one colour or "
                 "shape (\"Describe the red objects.\")")
      ->capture_default_str();
  app.add_option("--grouped-prob", f.mix.conversation.grouped,
                 "probability that a training conversation lists the objects grouped by colour "
                 "(\"List the objects by color.\")")
      ->capture_default_str();
  app.add_option("--min-questions", f.mix.conversation.min_questions,
                 "fewest short questions in a question conversation")
      ->capture_default_str();
  app.add_option("--max-questions", f.mix.conversation.max_questions,
                 "most short questions in a question conversation")
      ->capture_default_str();
  app.add_option("--question-weights", f.question_weights,
                 "how often each question template is drawn, e.g. \"position=0.5,count_colour=2\" "
                 "(templates not named keep the held-out split's 1, or 2/3 for each of "
                 "count_all, count_shape, count_colour; empty = the held-out draws)");
  app.add_option("--paper-layout", f.mix.paper_layout,
                 "share of conversations in the paper's layout (llava_v1 system prompt, the "
                 "question before the image; llava-eval --layout paper)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--paraphrase", f.mix.paraphrase,
                 "probability that a question is reworded (shapes_world.h Paraphrase)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--attn-weight", f.attn_weight,
                 "weight of the attention supervision: head 0 of --attn-layers attends from each "
                 "short answer to the objects its question names (0 = off)")
      ->capture_default_str();
  app.add_option("--patch-weight", f.patch_weight,
                 "weight of the patch supervision: a linear probe on the projector's output "
                 "(trained alongside, never saved) classifies every image row's shape, colour and "
                 "size (or background), so the image rows carry what the lookups need (0 = off)")
      ->capture_default_str();
  app.add_option("--count-weight", f.count_weight,
                 "weight of the count supervision: a linear probe on the residual stream after "
                 "--count-layer (trained alongside, never saved) reads, from the row that predicts "
                 "every answer, how many objects of each shape and of each colour the image holds "
                 "(0 = off)")
      ->capture_default_str();
  app.add_option("--count-layer", f.count_layer, "decoder layer whose output the count probe reads")
      ->capture_default_str();
  app.add_option("--attn-layers", f.attn_layers, "decoder layers whose head 0 is supervised")
      ->capture_default_str();
  app.add_option("--attn-absent", f.mix.absent_to_bos,
                 "questions that name a colour, shape or cell with no object there are "
                 "supervised to attend to <s>, so that absence becomes a state the model can read")
      ->capture_default_str();
  app.add_option("--attn-count", f.mix.per_object,
                 "head 0 shares its attention equally between <s> and each object the question "
                 "names (every object for \"How many objects are there?\"; all on <s> when none "
                 "is there), so that the share on <s> tells how many there are")
      ->capture_default_str();
  app.add_option("--attn-report", f.attn_report,
                 "print, at the end, every head's attention mass on the named objects in "
                 "--attn-layers per question kind (with --lr 0: a probe of any checkpoint)")
      ->capture_default_str();
  app.add_option("--init", f.init_dir,
                 "continue from this checkpoint of llava-train (its config, weights and "
                 "tokenizer) instead of random weights");
  app.add_option("--tie-embeddings", f.tie_embeddings,
                 "one matrix for the token embeddings and the output head")
      ->capture_default_str();
  app.add_option("--bf16", f.bf16, "bf16 autocast for the forward pass")->capture_default_str();
  app.add_option("--max-minutes", f.minutes, "stop (and save) after this long; 0 = no limit");
}

// What CLI11 cannot check; fills the mix's derived fields. An error names the flag.
std::string CheckFlags(TrainFlags& f) {
  f.mix.patch_labels = f.patch_weight > 0;
  if (f.mix.conversation.min_questions < 1 ||
      f.mix.conversation.max_questions < f.mix.conversation.min_questions) {
    return "--min-questions / --max-questions: need 1 <= min <= max";
  }
  if (!f.question_weights.empty()) {
    std::string error;
    f.mix.conversation.question_weights =
        llava::shapes::ParseQuestionWeights(f.question_weights, &error);
    if (!f.mix.conversation.question_weights) return "--question-weights: " + error;
  }
  return "";
}

// The tokenizer in the output folder: --init's, or one trained on a corpus of the world.
llava::StatusOr<std::unique_ptr<llava::Tokenizer>> PrepareTokenizer(const TrainFlags& f) {
  if (!f.init_dir.empty()) {  // continue training a model of ours: its tokenizer, its weights
    std::error_code ec;
    std::filesystem::copy_file(f.init_dir + "/tokenizer.model", f.out_dir + "/tokenizer.model",
                               std::filesystem::copy_options::overwrite_existing, ec);
    if (ec) return llava::InvalidArgument("--init: tokenizer.model: " + ec.message());
    return llava::Tokenizer::Load(f.out_dir + "/tokenizer.model");
  }
  const std::string corpus = f.out_dir + "/.corpus.txt";
  WriteCorpus(corpus, f.seed, f.corpus_scenes, f.mix);
  return llava::TrainTokenizer(corpus, f.out_dir, f.vocab);
}

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The initial weights in fp32 under their checkpoint names: seeded random ones, or --init's.
llava::StatusOr<NamedTensors> InitialWeights(const llava::LlavaConfig& config,
                                             const TrainFlags& f) {
  NamedTensors init = llava::RandomLlavaWeights(config, f.seed, at::kFloat, 0.02);
  {
    // LLaMA/CLIP-style small initial embeddings (the test checkpoints' N(0, 1) token
    // embeddings dwarf every layer's update, and large patch embeddings make the pre-layernorm
    // erase brightness): see docs/TRAINING.md.
    at::NoGradGuard no_grad;
    at::Generator gen = at::detail::createCPUGenerator(f.seed + 1);
    for (auto& [name, t] : init) {
      if (name == "lm.embed_tokens.weight") t.normal_(0.0, f.embed_std, gen);
      if (name == "vision.embeddings.patch_embedding.weight") t.normal_(0.0, f.patch_std, gen);
      if (name == "vision.embeddings.position_embedding.weight" && f.pos_rms > 0) {
        t.copy_(SinCosPositions(config.vision, f.pos_rms));
      }
    }
  }
  if (f.init_dir.empty()) return init;
  LLAVA_ASSIGN_OR_RETURN(std::unique_ptr<llava::CheckpointReader> reader,
                         llava::CheckpointReader::Open(f.init_dir));
  for (auto& [name, t] : init) {
    LLAVA_RETURN_IF_ERROR(reader->Take(name, t.sizes().vec(), llava::DType::kF32, "cpu", &t));
    t = t.clone();  // the reader's mapping goes away on return
  }
  return init;
}

// The probes trained alongside the model and never saved (--patch-weight, --count-weight).
constexpr int64_t kPatchClasses[3] = {llava::shapes::kNumShapes + 1, llava::shapes::kNumColours + 1,
                                      llava::shapes::kNumSizes + 1};
constexpr int64_t kInventory = llava::shapes::kNumShapes + llava::shapes::kNumColours;
constexpr int64_t kCountClasses = llava::shapes::kMaxObjects + 1;
struct Probes {
  at::Tensor patch_w, patch_b;  // image row -> shape, colour and size logits
  at::Tensor count_w, count_b;  // answer row -> kInventory classifications over 0..kMaxObjects
};

// What AdamW updates: matrices with weight decay; embeddings, norms and biases without.
struct ParamGroups {
  std::vector<at::Tensor> decay, no_decay;
  int64_t model_parameters = 0;
};

ParamGroups TrainableParameters(llava::LlavaModel& model, const llava::LlavaConfig& config,
                                const TrainFlags& f, Probes* probes) {
  ParamGroups g;
  for (auto& [name, t] : model.MutableParameters()) {
    t->requires_grad_(true);
    g.model_parameters += t->numel();
    (t->dim() >= 2 && name.find("embed") == std::string::npos ? g.decay : g.no_decay).push_back(*t);
  }
  if (f.patch_weight > 0) {
    const int64_t n = kPatchClasses[0] + kPatchClasses[1] + kPatchClasses[2];
    probes->patch_w = (torch::randn({n, config.text.hidden_size}) * 0.02).requires_grad_(true);
    probes->patch_b = torch::zeros({n}).requires_grad_(true);
    g.decay.push_back(probes->patch_w);
    g.no_decay.push_back(probes->patch_b);
  }
  if (f.count_weight > 0) {
    probes->count_w = (torch::randn({kInventory * kCountClasses, config.text.hidden_size}) * 0.02)
                          .requires_grad_(true);
    probes->count_b = torch::zeros({kInventory * kCountClasses}).requires_grad_(true);
    g.decay.push_back(probes->count_w);
    g.no_decay.push_back(probes->count_b);
  }
  return g;
}

// Linear warm-up, then cosine decay to min_lr_ratio of the peak.
double LearningRate(const TrainFlags& f, int64_t step) {
  const double warm = std::min(1.0, (step + 1.0) / f.warmup);
  const double progress =
      std::min(1.0, std::max(0.0, double(step - f.warmup) / (f.steps - f.warmup)));
  return f.lr * warm *
         (f.min_lr_ratio + (1 - f.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

struct StepLosses {
  double lm = 0, attn = 0, patch = 0, count = 0;
  int64_t tokens = 0;  // labelled tokens of the batch
};
struct StepTimes {
  double data = 0, forward = 0, backward = 0, update = 0;  // seconds, summed over the steps
};

// One optimizer step on `f.batch` fresh conversations: the language-model loss on the answers
// plus the supervisions that are on, backward, clipped AdamW update.
StepLosses TrainStep(llava::LlavaModel& model, const llava::Tokenizer& tok,
                     const llava::LlavaConfig& config, const TrainFlags& f, int64_t step,
                     const Probes& probes, const ParamGroups& params,
                     torch::optim::AdamW& optimizer, llava::AttentionReport* report,
                     StepTimes* times) {
  StepLosses losses;
  auto tick = std::chrono::steady_clock::now();
  auto lap = [&tick](double* acc) {
    const auto now = std::chrono::steady_clock::now();
    *acc += std::chrono::duration<double>(now - tick).count();
    tick = now;
  };
  std::vector<Example> examples;
  std::vector<float> pixels;
  std::vector<int64_t> labels, patch_labels[3];
  for (int b = 0; b < f.batch; ++b) {
    examples.push_back(MakeExample(tok, config, f.seed, step, b, f.mix));
    const Example& e = examples.back();
    patch_labels[0].insert(patch_labels[0].end(), e.patch_shape.begin(), e.patch_shape.end());
    patch_labels[1].insert(patch_labels[1].end(), e.patch_colour.begin(), e.patch_colour.end());
    patch_labels[2].insert(patch_labels[2].end(), e.patch_size.begin(), e.patch_size.end());
    pixels.insert(pixels.end(), examples.back().pixels.begin(), examples.back().pixels.end());
    labels.insert(labels.end(), examples.back().labels.begin(), examples.back().labels.end());
  }
  const int64_t s = config.vision.image_size;
  lap(&times->data);
  std::optional<CpuAutocast> autocast;
  autocast.emplace(f.bf16);
  at::Tensor pv = at::from_blob(pixels.data(), {f.batch, 3, s, s}, at::kFloat);
  at::Tensor features = model.EncodeImages(pv);  // [B, N, D]
  std::vector<std::unique_ptr<llava::KvCache>> caches;
  std::vector<llava::SequenceChunk> chunks;
  std::vector<at::Tensor> attn_terms;          // one per supervised answer and layer
  std::vector<int64_t> count_rows, inventory;  // rows of the batch, their scenes' counts
  int64_t batch_row = 0;
  for (int b = 0; b < f.batch; ++b) {
    caches.push_back(model.NewFullCache());
    if (f.attn_weight > 0 || f.attn_report) {
      caches.back() = llava::NewSupervisedAttentionCache(std::move(caches.back()), f.attn_layers,
                                                         examples[b].attn_targets, &attn_terms,
                                                         f.attn_report ? report : nullptr);
    }
    llava::SequenceChunk c;
    c.embeds =
        model.EmbedPrompt(examples[b].ids, examples[b].image_offsets, features.narrow(0, b, 1));
    c.cache = caches.back().get();
    c.all_logits = true;
    for (int64_t r : examples[b].answer_rows) {
      count_rows.push_back(batch_row + r);
      inventory.insert(inventory.end(), examples[b].inventory.begin(), examples[b].inventory.end());
    }
    batch_row += c.embeds.size(0);
    chunks.push_back(c);
  }
  std::vector<at::Tensor> layer_outputs;
  at::Tensor logits = model.Forward(chunks, f.count_weight > 0 ? &layer_outputs : nullptr);
  at::Tensor target = at::tensor(labels, at::kLong);
  at::Tensor loss = at::cross_entropy_loss(logits, target, {}, at::Reduction::Mean, kIgnore);
  losses.lm = loss.item<double>();
  if (f.attn_weight > 0 && !attn_terms.empty()) {
    at::Tensor a = at::stack(attn_terms).mean();
    losses.attn = a.item<double>();
    loss = loss + f.attn_weight * a;
  }
  if (f.patch_weight > 0) {
    // [B * N, classes]: each image row's shape, colour and size logits.
    at::Tensor rows = features.to(at::kFloat).reshape({-1, features.size(-1)});
    at::Tensor all = at::addmm(probes.patch_b, rows, probes.patch_w.t());
    at::Tensor p = at::zeros({}, at::kFloat);
    int64_t from = 0;
    for (int k = 0; k < 3; ++k) {
      p = p + at::cross_entropy_loss(all.narrow(1, from, kPatchClasses[k]),
                                     at::tensor(patch_labels[k], at::kLong));
      from += kPatchClasses[k];
    }
    p = p / 3;
    losses.patch = p.item<double>();
    loss = loss + f.patch_weight * p;
  }
  if (f.count_weight > 0) {
    // The answer rows' residual stream, RMS-normalised, -> [rows, kInventory, 7] logits.
    at::Tensor h = layer_outputs[f.count_layer]
                       .index_select(0, at::tensor(count_rows, at::kLong))
                       .to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-5);
    at::Tensor all = at::addmm(probes.count_b, h, probes.count_w.t()).to(at::kFloat);
    at::Tensor c =
        at::cross_entropy_loss(all.reshape({-1, kCountClasses}), at::tensor(inventory, at::kLong));
    losses.count = c.item<double>();
    loss = loss + f.count_weight * c;
  }
  autocast.reset();
  lap(&times->forward);
  optimizer.zero_grad();
  loss.backward();
  lap(&times->backward);
  torch::nn::utils::clip_grad_norm_(params.decay, 1.0);
  torch::nn::utils::clip_grad_norm_(params.no_decay, 1.0);
  optimizer.step();
  lap(&times->update);

  losses.tokens = static_cast<int64_t>(labels.size());
  return losses;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train the default shapes LLaVA from scratch"};
  TrainFlags f;
  AddFlags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (const std::string error = CheckFlags(f); !error.empty()) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 2;
  }
  llava::InitTorchThreads(f.threads);
  torch::manual_seed(f.seed);

  if (std::system(("mkdir -p '" + f.out_dir + "'").c_str()) != 0) return 1;
  auto tok = PrepareTokenizer(f);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  auto config_or = f.init_dir.empty()
                       ? llava::StatusOr<llava::LlavaConfig>(DefaultConfig(**tok, f.tie_embeddings))
                       : llava::LoadLlavaConfig(f.init_dir);
  if (!config_or.ok()) {
    std::fprintf(stderr, "--init %s: %s\n", f.init_dir.c_str(),
                 config_or.status().ToString().c_str());
    return 1;
  }
  const llava::LlavaConfig config = *config_or;
  if (f.count_weight > 0 && (f.count_layer < 0 || f.count_layer >= config.text.num_hidden_layers)) {
    std::fprintf(stderr, "--count-layer: %d is not one of the decoder's %d layers\n", f.count_layer,
                 config.text.num_hidden_layers);
    return 2;
  }
  auto init = InitialWeights(config, f);
  if (!init.ok()) {
    std::fprintf(stderr, "--init %s: %s\n", f.init_dir.c_str(), init.status().ToString().c_str());
    return 1;
  }
  llava::ModelOptions options;
  options.dtype = llava::DType::kF32;
  NamedTensors copies;
  for (const auto& [name, t] : *init) copies.emplace_back(name, t.clone());
  auto model_or =
      llava::LlavaModel::FromWeights(config, llava::NewTensorMapSource(copies), options);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", model_or.status().ToString().c_str());
    return 1;
  }
  llava::LlavaModel& model = **model_or;

  Probes probes;
  const ParamGroups params = TrainableParameters(model, config, f, &probes);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      params.decay,
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(f.lr).betas({0.9, 0.98}).weight_decay(f.weight_decay)));
  groups.emplace_back(params.no_decay,
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(f.lr).betas({0.9, 0.98}).weight_decay(0)));
  torch::optim::AdamW optimizer(groups);
  std::printf("model: %.2f M trained parameters, vocab %d, %d image tokens; %lld steps x %d\n",
              params.model_parameters / 1e6, config.text.vocab_size, config.image_tokens(),
              static_cast<long long>(f.steps), f.batch);

  auto save = [&](const char* why) {
    torch::NoGradGuard no_grad;
    auto tensors = llava::TrainedCheckpointTensors(model, *init, at::kBFloat16);
    llava::Status st = tensors.ok() ? llava::WriteLlavaCheckpoint(f.out_dir, config, *tensors,
                                                                  llava::TensorNaming::kOld, 1)
                                    : tensors.status();
    std::printf("%s: saved %s (%s)\n", why, f.out_dir.c_str(),
                st.ok() ? "ok" : st.ToString().c_str());
    std::fflush(stdout);
    return st.ok();
  };

  const auto t0 = std::chrono::steady_clock::now();
  llava::AttentionReport report;
  StepTimes times;
  double ema_loss = 0, ema_attn = 0, ema_patch = 0, ema_count = 0;
  int64_t tokens_done = 0;
  for (int64_t step = 0; step < f.steps; ++step) {
    const double cur_lr = LearningRate(f, step);
    for (auto& g : optimizer.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(cur_lr);
    }
    const StepLosses losses =
        TrainStep(model, **tok, config, f, step, probes, params, optimizer, &report, &times);

    tokens_done += losses.tokens;
    const double l = losses.lm;
    ema_loss = step == 0 ? l : 0.95 * ema_loss + 0.05 * l;
    ema_attn = step == 0 ? losses.attn : 0.95 * ema_attn + 0.05 * losses.attn;
    ema_patch = step == 0 ? losses.patch : 0.95 * ema_patch + 0.05 * losses.patch;
    ema_count = step == 0 ? losses.count : 0.95 * ema_count + 0.05 * losses.count;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step % 10 == 0 || step + 1 == f.steps) {
      const double eta = elapsed / (step + 1) * (f.steps - step - 1);
      std::printf(
          "step %5lld/%lld  loss %.4f (ema %.4f)  lr %.2e  %.0f tok/s  elapsed %.1f min  ETA %.1f "
          "min%s%s%s\n",
          static_cast<long long>(step + 1), static_cast<long long>(f.steps), l, ema_loss, cur_lr,
          tokens_done / elapsed, elapsed / 60, eta / 60,
          f.attn_weight > 0 ? ("  attention " + std::to_string(ema_attn)).c_str() : "",
          f.patch_weight > 0 ? ("  patches " + std::to_string(ema_patch)).c_str() : "",
          f.count_weight > 0 ? ("  counts " + std::to_string(ema_count)).c_str() : "");
      if (step % 100 == 0) {
        std::printf(
            "  time per step: data %.3f s, forward %.3f s, backward %.3f s, update %.3f s\n",
            times.data / (step + 1), times.forward / (step + 1), times.backward / (step + 1),
            times.update / (step + 1));
      }
      std::fflush(stdout);
    }
    if ((step + 1) % f.save_every == 0 && step + 1 < f.steps && !save("checkpoint")) return 1;
    if (f.minutes > 0 && elapsed > f.minutes * 60) {
      std::printf("time limit reached at step %lld\n", static_cast<long long>(step + 1));
      break;
    }
  }
  if (f.attn_report) llava::PrintAttentionReport(report);
  return save("final") ? 0 : 1;
}
