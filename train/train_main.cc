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
// Reproducible from --seed for a fixed --steps, thread count and --shards. The data is
// training_data.h, the initial weights initial_weights.h, the attention targets
// attention_supervision.h; this file keeps the flags, the probes and the loop.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/profiler.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "engine/io/chat_template.h"
#include "engine/io/image_io.h"
#include "engine/io/model_config.h"
#include "engine/io/tokenizer.h"
#include "engine/kernels/cpu_features.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "engine/model/weights.h"
#include "train/attention_supervision.h"
#include "train/checkpoint_writer.h"
#include "train/initial_weights.h"
#include "train/lr_schedule.h"
#include "train/shapes_world.h"
#include "train/train_step.h"
#include "train/training_data.h"

namespace {

using llava::train::DataMix;
using llava::train::Example;
using llava::train::kCountClasses;
using llava::train::kInventory;
using llava::train::kPatchClasses;
using llava::train::Probes;

// Every flag of llava-train (AddFlags documents them).
struct TrainFlags {
  std::string out_dir = "models/shapes-llava", init_dir;
  uint64_t seed = 0;
  int64_t steps = 3000, warmup = 150, save_every = 250;
  int batch = 8, threads = 2, shards = 0, vocab = 512, corpus_scenes = 20000;
  std::string bf16_flag = "auto";  // --bf16 as given: "auto", "true" or "false"
  bool bf16 = true;                // what main() made of it
  bool tie_embeddings = false;
  double embed_std = 0.02, patch_std = 0.02, pos_rms = 0.5, attn_weight = 0, patch_weight = 0,
         count_weight = 0;
  int count_layer = 2;
  DataMix mix;
  std::string question_weights;
  bool attn_report = false;
  bool share_prefix = true;
  std::vector<int> attn_layers = {1, 2};
  double lr = 3e-4, min_lr_ratio = 0.1, weight_decay = 0.05, minutes = 0;
  bool decay_by_time = false;
  std::string trace;  // chrome trace of steps kTraceFirst..kTraceLast (ATen's profiler)
};

// The steps --trace records: past the first steps' one-time costs (oneDNN primitives, the
// allocator's first growth), few enough that the file stays small.
constexpr int64_t kTraceFirst = 10, kTraceLast = 14;

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
  app.add_option("--threads", f.threads, "threads (cores) to train on")->capture_default_str();
  app.add_option("--shards", f.shards,
                 "the batch is cut into this many shards, each with its forward and backward "
                 "pass on its own thread with --threads / --shards intra-op threads (0 = "
                 "--threads: one single-threaded shard per core, ~1.3x faster on 2 cores)")
      ->capture_default_str();
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
  app.add_option("--attn-every-row", f.mix.every_answer_row,
                 "a short answer's every token row gets the attention target, not only the row "
                 "that predicts its first token")
      ->capture_default_str();
  app.add_option("--attn-report", f.attn_report,
                 "print, at the end, every head's attention mass on the named objects in "
                 "--attn-layers per question kind (with --lr 0: a probe of any checkpoint)")
      ->capture_default_str();
  app.add_option("--share-prefix", f.share_prefix,
                 "conversations of a shard that begin alike (the paper layout's system prompt) "
                 "run those rows once and start their caches from them (exact; ~1.1x faster "
                 "steps with --paper-layout 0.5)")
      ->capture_default_str();
  app.add_option("--init", f.init_dir,
                 "continue from this checkpoint of llava-train (its config, weights and "
                 "tokenizer) instead of random weights");
  app.add_option("--tie-embeddings", f.tie_embeddings,
                 "one matrix for the token embeddings and the output head")
      ->capture_default_str();
  app.add_option("--bf16", f.bf16_flag,
                 "bf16 autocast for the forward pass: true, false, or auto (true on CPUs with "
                 "AVX512-BF16, where libtorch's bf16 products are native; false elsewhere, where "
                 "they run ~17x slower than fp32)")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  app.add_option("--max-minutes", f.minutes, "stop (and save) after this long; 0 = no limit");
  app.add_option("--decay-by-time", f.decay_by_time,
                 "with --max-minutes: the cosine ends at the time limit if that comes before "
                 "--steps (the run uses its minutes on any machine and ends at the floor rate)")
      ->capture_default_str();
  app.add_option("--trace", f.trace,
                 "write a chrome trace of steps 11-15 (every ATen op, forward and backward) to "
                 "this file; scripts/trace_summary.py sums it by op. Records the calling thread "
                 "only: use with --shards 1");
}

// What CLI11 cannot check; fills the mix's derived fields. An error names the flag.
std::string CheckFlags(TrainFlags& f) {
  f.mix.patch_labels = f.patch_weight > 0;
  if (f.shards < 0) return "--shards: must be 0 (one per thread) or more";
  if (!f.trace.empty() && f.shards != 1) return "--trace: needs --shards 1";
  if (f.decay_by_time && f.minutes <= 0) return "--decay-by-time: needs --max-minutes";
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
  llava::train::WriteCorpus(corpus, f.seed, f.corpus_scenes, f.mix);
  return llava::TrainTokenizer(corpus, f.out_dir, f.vocab);
}

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

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

struct StepLosses {
  double lm = 0, attn = 0, patch = 0, count = 0;
  int64_t tokens = 0;  // labelled tokens of the batch
};
struct StepTimes {
  double data = 0, forward = 0, backward = 0, update = 0;  // seconds, summed over the steps
  int64_t tokens = 0, rows_saved = 0;  // positions, and those run once for several (shared)
};

// One optimizer step on `f.batch` fresh conversations: the language-model loss on the answers
// plus the supervisions that are on, its gradient over --shards threads, clipped AdamW update.
StepLosses TrainStep(llava::LlavaModel& model, const llava::Tokenizer& tok,
                     const llava::LlavaConfig& config, const TrainFlags& f, int64_t step,
                     const Probes& probes, const ParamGroups& params,
                     torch::optim::AdamW& optimizer, llava::AttentionReport* report,
                     StepTimes* times) {
  auto tick = std::chrono::steady_clock::now();
  std::vector<Example> examples;
  for (int b = 0; b < f.batch; ++b) {
    examples.push_back(MakeExample(tok, config, f.seed, step, b, f.mix));
  }
  times->data += std::chrono::duration<double>(std::chrono::steady_clock::now() - tick).count();

  llava::train::LossOptions o;
  o.bf16 = f.bf16;
  o.attn_weight = f.attn_weight;
  o.patch_weight = f.patch_weight;
  o.count_weight = f.count_weight;
  o.attn_layers = f.attn_layers;
  o.count_layer = f.count_layer;
  o.attn_report = f.attn_report;
  o.share_prefix = f.share_prefix;
  std::vector<at::Tensor> all = params.decay;
  all.insert(all.end(), params.no_decay.begin(), params.no_decay.end());
  const llava::train::BatchLosses b = llava::train::BatchGradients(
      model, config, examples, probes, o, all, f.shards, f.threads, report);
  times->forward += b.forward_s;
  times->backward += b.backward_s;
  times->tokens += b.tokens;
  times->rows_saved += b.rows_saved;

  tick = std::chrono::steady_clock::now();
  torch::nn::utils::clip_grad_norm_(params.decay, 1.0);
  torch::nn::utils::clip_grad_norm_(params.no_decay, 1.0);
  optimizer.step();
  times->update += std::chrono::duration<double>(std::chrono::steady_clock::now() - tick).count();
  return {b.lm, b.attn, b.patch, b.count, b.tokens};
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
  if (f.threads <= 0)
    f.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (f.shards == 0) f.shards = f.threads;
  // The calling thread gets the shards' intra-op thread count too: an OpenMP team of 2 on it
  // (data, the update) left its threads spinning in libgomp while the shards ran, and the step
  // was 5% faster than one pass instead of ~1.3x.
  llava::InitTorchThreads(std::max(1, f.threads / f.shards));
  torch::manual_seed(f.seed);
  if (f.bf16_flag == "auto") {
    // On an AVX2 CPU (AMD EPYC, 2 cores) bf16 autocast trained at 224 tokens/s and fp32 at
    // 3,860: libtorch 1.13 has no fast bf16 product without AVX512-BF16 (docs/TRAINING.md).
    f.bf16 = llava::CpuPathAtLeast(llava::CpuPath::kAvx512Bf16);
    std::printf("--bf16 auto: %s (CPU path %s)\n", f.bf16 ? "bf16 autocast" : "fp32",
                llava::CpuPathName(llava::ActiveCpuPath()));
  } else {
    f.bf16 = f.bf16_flag == "true";
  }

  if (std::system(("mkdir -p '" + f.out_dir + "'").c_str()) != 0) return 1;
  auto tok = PrepareTokenizer(f);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  auto config_or = f.init_dir.empty() ? llava::StatusOr<llava::LlavaConfig>(
                                            llava::train::DefaultConfig(**tok, f.tie_embeddings))
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
  llava::train::InitOptions io;
  io.seed = f.seed;
  io.embed_std = f.embed_std;
  io.patch_std = f.patch_std;
  io.pos_rms = f.pos_rms;
  io.init_dir = f.init_dir;
  auto init = llava::train::InitialWeights(config, io);
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
  llava::train::LrSchedule schedule;
  schedule.peak = f.lr;
  schedule.floor_ratio = f.min_lr_ratio;
  schedule.warmup_steps = f.warmup;
  schedule.steps = f.steps;
  schedule.budget_s = f.decay_by_time ? f.minutes * 60 : 0;
  double warm_s = 0;  // when the warm-up ended
  std::optional<torch::autograd::profiler::RecordProfile> trace;
  for (int64_t step = 0; step < f.steps; ++step) {
    if (!f.trace.empty() && step == kTraceFirst) trace.emplace(f.trace);
    if (step == kTraceLast + 1) trace.reset();  // writes the file
    const double started =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step == f.warmup) warm_s = started;
    const double cur_lr = schedule.Rate(step, started, warm_s);
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
      if (step % 100 == 0 || step + 1 == f.steps) {
        std::printf(
            "  time per step: data %.3f s, forward %.3f s, backward %.3f s, update %.3f s; "
            "%.1f%% of the positions shared, not run\n",
            times.data / (step + 1), times.forward / (step + 1), times.backward / (step + 1),
            times.update / (step + 1),
            100.0 * static_cast<double>(times.rows_saved) /
                static_cast<double>(std::max<int64_t>(1, times.tokens)));
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
