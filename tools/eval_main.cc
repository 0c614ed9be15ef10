// llava-eval: what cache policies cost in quality and save in memory.
//
// For every sample of a JSONL dataset and every policy x budget:
//   PPL      of the reference answer, teacher-forced through the compressed cache (prefill
//            compressed by the policy, answer tokens fed as decode steps with eviction active);
//   ROUGE-L  F1 of the policy's greedy answer against the Full policy's greedy answer;
//   ref ROUGE-L  F1 against the dataset's reference answer, on samples without a short answer
//            (detailed descriptions);
//   accuracy exact match against the short answer, where the sample has one;
//   KV bytes kept / full-equivalent, prefill time, decode time per token;
//   paired bootstrap intervals of --compare minus every other policy at the same budget.
// Writes a table to stdout, results.csv, results.json and (with gnuplot) two PNG plots.
//
// Dataset lines: {"image": "a.png" | "images": [..], "prompt": "question" |
//                 "conversation": [{"role": "user", "content": "..."}, ...],
//                 "answer": "reference answer", "short_answer": "optional"}
// Image paths are relative to the dataset file. Images attach to the first user turn: before
// its text (--layout image_first, llava-hf's template), or after it with LLaVA-1.5's llava_v1
// system prompt first (--layout paper, the Elastic Cache paper's evaluation).
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "engine/eval/eval_metrics.h"
#include "engine/kernels/runtime.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"

namespace {

using llava::CacheParams;
using llava::CachePolicy;
using llava::ContentPart;

struct Sample {
  llava::GenerationRequest request;
  std::string answer, short_answer;
  std::string kind;    // optional "kind" field: accuracy is also reported per kind
  std::string prompt;  // the last question, for --items
};

enum class Layout { kImageFirst, kPaper };

llava::StatusOr<std::vector<Sample>> LoadDataset(const std::string& path, int limit,
                                                 Layout layout) {
  std::ifstream in(path);
  if (!in) return llava::NotFound(path + ": cannot open dataset");
  const std::string dir =
      path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
  std::vector<Sample> out;
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    if (limit > 0 && static_cast<int>(out.size()) >= limit) break;
    const std::string where = path + ":" + std::to_string(lineno);
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object()) return llava::InvalidArgument(where + ": not a JSON object");
    if (!j.contains("answer") || !j["answer"].is_string()) {
      return llava::InvalidArgument(where + ": \"answer\" (string) is required");
    }
    Sample s;
    s.answer = j["answer"];
    if (j.contains("short_answer") && j["short_answer"].is_string())
      s.short_answer = j["short_answer"];
    if (j.contains("kind") && j["kind"].is_string()) s.kind = j["kind"];
    if (j.contains("prompt") && j["prompt"].is_string()) s.prompt = j["prompt"];
    std::vector<std::string> images;
    if (j.contains("image") && j["image"].is_string()) images.push_back(j["image"]);
    if (j.contains("images") && j["images"].is_array()) {
      for (const auto& i : j["images"]) images.push_back(i.get<std::string>());
    }
    for (const auto& rel : images) {
      std::string bytes;
      const std::string p = rel.rfind('/', 0) == 0 ? rel : dir + "/" + rel;
      if (!llava::ReadFileToString(p, &bytes))
        return llava::NotFound(where + ": image " + p + " not found");
      s.request.images.push_back(std::move(bytes));
    }
    std::vector<std::pair<std::string, std::string>> turns;
    if (j.contains("conversation") && j["conversation"].is_array()) {
      for (const auto& t : j["conversation"]) {
        if (!t.contains("role") || !t.contains("content")) {
          return llava::InvalidArgument(where + ": conversation turns need role and content");
        }
        turns.emplace_back(t["role"].get<std::string>(), t["content"].get<std::string>());
      }
    } else if (j.contains("prompt") && j["prompt"].is_string()) {
      turns.emplace_back("user", j["prompt"].get<std::string>());
    } else {
      return llava::InvalidArgument(where + ": \"prompt\" or \"conversation\" is required");
    }
    if (layout == Layout::kPaper) {
      s.request.messages.push_back(
          {"system", {{ContentPart::Kind::kText, llava::kLlavaV1SystemPrompt, 0}}});
    }
    bool images_attached = false;
    for (const auto& [role, text] : turns) {
      llava::ChatMessage m{role, {}};
      if (layout == Layout::kPaper) m.content.push_back({ContentPart::Kind::kText, text, 0});
      if (role == "user" && !images_attached) {
        for (size_t i = 0; i < images.size(); ++i) {
          m.content.push_back({ContentPart::Kind::kImage, "", static_cast<int>(i)});
        }
        images_attached = true;
      }
      if (layout == Layout::kImageFirst) m.content.push_back({ContentPart::Kind::kText, text, 0});
      s.request.messages.push_back(std::move(m));
    }
    out.push_back(std::move(s));
  }
  if (out.empty()) return llava::InvalidArgument(path + ": no samples");
  return out;
}

struct Cell {  // one policy x budget, accumulated over samples
  double nll = 0, rouge = 0, rouge_ref = 0, kv_ratio = 0, prefill_s = 0, decode_s = 0;
  int64_t tokens = 0, decode_tokens = 0;
  int samples = 0, with_short = 0, correct = 0, long_answers = 0;
  double Ppl() const { return tokens ? std::exp(nll / tokens) : 0; }
  double Accuracy() const { return with_short ? double(correct) / with_short : NAN; }
  double RougeRef() const { return long_answers ? rouge_ref / long_answers : NAN; }
  // kind -> {score sum, items}: exact matches for short answers, ROUGE-L vs the reference
  // for long ones
  std::map<std::string, std::pair<double, int>> by_kind;
  std::vector<llava::ItemScore> items;  // per sample, in dataset order (the paired intervals)
};

void WritePlots(const std::string& out, const std::map<std::pair<std::string, double>, Cell>& cells,
                const std::vector<std::string>& policies, const std::vector<double>& budgets) {
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) {
    std::fprintf(stderr, "gnuplot not found: skipping the plots\n");
    return;
  }
  for (const auto& p : policies) {
    std::ofstream dat(out + "/" + p + ".dat");
    for (double b : budgets) {
      auto key = std::make_pair(p, p == "full" ? 1.0 : b);
      auto it = cells.find(key);
      if (it == cells.end()) continue;
      const Cell& c = it->second;
      dat << b << " " << c.Ppl() << " " << c.rouge / c.samples << " "
          << (std::isnan(c.Accuracy()) ? 0.0 : c.Accuracy()) << " "
          << (std::isnan(c.RougeRef()) ? 0.0 : c.RougeRef()) << "\n";
    }
  }
  std::ofstream gp(out + "/plot.gp");
  gp << "set terminal png size 800,520 noenhanced\nset grid\nset xlabel 'KV budget (fraction of "
        "the full cache)'\n"
        "set key outside right\nset xrange [0:1.05]\n";
  auto plot = [&](const char* file, const char* ylabel, int col) {
    gp << "set output '" << out << "/" << file << "'\nset ylabel '" << ylabel << "'\nplot ";
    for (size_t i = 0; i < policies.size(); ++i) {
      gp << (i ? ", " : "") << "'" << out << "/" << policies[i] << ".dat' using 1:" << col
         << " with linespoints lw 2 title '" << policies[i] << "'";
    }
    gp << "\n";
  };
  plot("ppl_vs_budget.png", "perplexity of the reference answer", 2);
  plot("rouge_vs_budget.png", "ROUGE-L vs the Full answer", 3);
  plot("accuracy_vs_budget.png", "exact-match accuracy (short answers)", 4);
  plot("rouge_ref_vs_budget.png", "ROUGE-L vs the reference (long answers)", 5);
  gp.close();
  if (std::system(("gnuplot '" + out + "/plot.gp'").c_str()) != 0) {
    std::fprintf(stderr, "gnuplot failed\n");
  }
}

}  // namespace

// Per-kind scores (exact match, or ROUGE-L vs the reference for long answers): a table on
// stdout and kinds.csv (policy, budget, kind, items, score).
void WriteKinds(const std::string& out, const std::map<std::pair<std::string, double>, Cell>& cells,
                const std::vector<std::pair<std::string, double>>& order) {
  std::set<std::string> kinds;
  for (const auto& [key, c] : cells) {
    for (const auto& [kind, v] : c.by_kind) kinds.insert(kind);
  }
  if (kinds.empty()) return;
  std::ofstream csv(out + "/kinds.csv");
  csv << "policy,budget,kind,items,score\n";
  std::printf("\nper kind (exact match; ROUGE-L vs reference for descriptions):\n%-20s", "");
  for (const auto& k : kinds) std::printf(" %*s", std::max<int>(6, k.size()), k.c_str());
  std::printf("\n");
  for (const auto& key : order) {
    const Cell& c = cells.at(key);
    std::printf("%-14s %5.2f", key.first.c_str(), key.second);
    for (const auto& k : kinds) {
      const int w = std::max<int>(6, k.size());
      auto it = c.by_kind.find(k);
      if (it == c.by_kind.end()) {
        std::printf(" %*s", w, "-");
        continue;
      }
      const double score = it->second.first / it->second.second;
      std::printf(" %*.3f", w, score);
      char line[256];
      std::snprintf(line, sizeof(line), "%s,%.2f,%s,%d,%.4f\n", key.first.c_str(), key.second,
                    k.c_str(), it->second.second, score);
      csv << line;
    }
    std::printf("\n");
  }
}

// Paired bootstrap intervals of `compare` minus every other policy at the same budget (Full:
// against its budget-1.0 cell), over the same items: a table on stdout and intervals.csv
// (policy, budget, against, measure, diff, lo, hi).
void WriteIntervals(const std::string& out,
                    const std::map<std::pair<std::string, double>, Cell>& cells,
                    const std::vector<std::pair<std::string, double>>& order,
                    const std::string& compare, int resamples) {
  using llava::QualityMeasure;
  const std::pair<QualityMeasure, const char*> measures[] = {
      {QualityMeasure::kAccuracy, "accuracy"},
      {QualityMeasure::kReferencePpl, "ppl"},
      {QualityMeasure::kRougeRef, "rouge_l_ref"}};
  std::ofstream csv(out + "/intervals.csv");
  csv << "policy,budget,against,against_budget,measure,diff,lo,hi\n";
  bool header = false;
  for (const auto& key : order) {
    if (key.first != compare) continue;
    for (const auto& other : order) {
      if (other.first == compare) continue;
      if (other.second != key.second && !(other.first == "full" && other.second == 1.0)) continue;
      const Cell& a = cells.at(key);
      const Cell& b = cells.at(other);
      if (!header) {
        std::printf(
            "\n%s minus each policy, same items, paired bootstrap 95%% (%d draws; * the "
            "interval excludes 0):\n%-14s %6s  %-28s %-28s %-28s\n",
            compare.c_str(), resamples, "against", "budget", "accuracy", "ppl (lower better)",
            "rouge_l_ref");
        header = true;
      }
      std::printf("%-14s %6.2f ", other.first.c_str(), key.second);
      for (const auto& [m, name] : measures) {
        const llava::PairedInterval d = llava::PairedBootstrap(a.items, b.items, m, resamples);
        char cell[64];
        std::snprintf(cell, sizeof(cell), "%+.3f [%+.3f, %+.3f]%s", d.diff, d.lo, d.hi,
                      d.Excludes0() ? "*" : " ");
        std::printf(" %-28s", std::isnan(d.diff) ? "-" : cell);
        char line[256];
        std::snprintf(line, sizeof(line), "%s,%.2f,%s,%.2f,%s,%.4f,%.4f,%.4f\n", compare.c_str(),
                      key.second, other.first.c_str(), other.second, name, d.diff, d.lo, d.hi);
        if (!std::isnan(d.diff)) csv << line;
      }
      std::printf("\n");
    }
  }
}

int main(int argc, char** argv) {
  CLI::App app{"Quality and memory of KV-cache policies (PPL, ROUGE-L, accuracy, bytes)"};
  std::string model_dir = LLAVA_DEFAULT_MODEL_DIR, dataset, out = "eval-out", dtype = "auto";
  std::vector<std::string> policies = {"full",   "elastic", "elastic+paper", "h2o",
                                       "snapkv", "lookm",   "streaming_llm"};
  std::vector<double> budgets = {1.0, 0.8, 0.5, 0.3, 0.2, 0.1};
  int max_tokens = 64, threads = 0, limit = 0, recent_distance = 0;
  app.add_option("--model", model_dir, "llava-hf model folder")->capture_default_str();
  app.add_option("--dataset", dataset, "JSONL dataset")->required();
  app.add_option("--policies", policies,
                 "policies to sweep, each a name with options (ParseCacheSpec in "
                 "engine/kv/cache_policy.h), e.g. elastic, elastic+paper, "
                 "elastic+paper+importance=mean; elastic_drop and elastic_mean are "
                 "elastic+paper+merge=0 and elastic+paper+importance=mean")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--budgets", budgets, "budgets to sweep")->delimiter(',')->capture_default_str();
  app.add_option("--max-tokens", max_tokens, "greedy answer length limit")->capture_default_str();
  app.add_option("--recent-distance", recent_distance,
                 "Elastic fixed-point distance (0: each policy's own, 25 in both presets)");
  app.add_option("--limit", limit, "use only the first N samples (0 = all)");
  app.add_option("--out", out, "output folder")->capture_default_str();
  std::string compare = "elastic";
  app.add_option("--compare", compare,
                 "the policy every other one is compared with at each budget: paired bootstrap "
                 "95% intervals of the difference (intervals.csv; none if it is not swept)")
      ->capture_default_str();
  int resamples = 1000;
  app.add_option("--resamples", resamples, "bootstrap draws of the intervals")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  std::string items_path;
  app.add_option(
      "--items", items_path,
      "also write every answer as JSON lines (sample, policy, budget, kind, prompt, "
      "reference, answer, score, and the reference answer's nll and tokens) to this file");
  app.add_option("--dtype", dtype, "auto | bf16 | f32 (llava-server --help)")
      ->check(CLI::IsMember({"auto", "bf16", "f32"}))
      ->capture_default_str();
  std::string weights = "bf16";
  app.add_option("--weights", weights, "bf16 | int8 | int4 (llava-server --help)")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  std::string kv_dtype = "auto";
  app.add_option("--kv-cache-dtype", kv_dtype, "auto | int8 (llava-server --help)")
      ->check(CLI::IsMember({"auto", "int8"}))
      ->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads (0 = one per core)");
  std::string device = "cpu";
  app.add_option("--device", device, "cpu | cuda[:i] (a CUDA libtorch)")->capture_default_str();
  std::string layout = "image_first";
  app.add_option("--layout", layout,
                 "prompt layout: image_first (llava-hf: <image>, then the question) or paper "
                 "(llava_v1 system prompt, the question, then <image>)")
      ->check(CLI::IsMember({"image_first", "paper"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  llava::InitTorchThreads(threads);

  llava::ModelOptions options;
  options.device = device;
  options.weights = llava::ParseWeightFormat(weights).value();  // checked by the flag
  options.kv_dtype = llava::ParseKvDtype(kv_dtype).value();     // checked by the flag
  llava::ResolveModelDType(dtype, model_dir, &options, nullptr);
  auto loaded = llava::LoadModel(model_dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "error: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  auto samples =
      LoadDataset(dataset, limit, layout == "paper" ? Layout::kPaper : Layout::kImageFirst);
  if (!samples.ok()) {
    std::fprintf(stderr, "error: %s\n", samples.status().ToString().c_str());
    return 1;
  }
  std::vector<CacheParams> parsed;  // budget set per cell
  for (const auto& p : policies) {
    auto pp = llava::ParseCacheSpec(p);
    if (!pp.ok()) {
      std::fprintf(stderr, "error: --policies: %s\n", pp.status().ToString().c_str());
      return 1;
    }
    if (recent_distance > 0) pp->elastic.recent_distance = recent_distance;
    parsed.push_back(*pp);
  }
  llava::Generator gen(**loaded, llava::EngineLimits{});
  std::map<std::pair<std::string, double>, Cell> cells;
  std::vector<std::pair<std::string, double>> order;
  std::vector<std::string> item_lines;

  for (size_t si = 0; si < samples->size(); ++si) {
    Sample& s = (*samples)[si];
    s.request.sampling.max_tokens = max_tokens;
    s.request.kv_cache.policy = CachePolicy::kFull;
    auto full = gen.Generate(s.request, nullptr);
    if (!full.ok()) {
      std::fprintf(stderr, "sample %zu: %s\n", si, full.status().ToString().c_str());
      return 1;
    }
    for (size_t pi = 0; pi < parsed.size(); ++pi) {
      for (double b : budgets) {
        const bool is_full = parsed[pi].policy == CachePolicy::kFull;
        if (is_full && b != budgets.front()) continue;
        const double budget = is_full ? 1.0 : b;
        CacheParams kv = parsed[pi];
        kv.budget = budget;
        s.request.kv_cache = kv;
        auto score = gen.ScoreAnswer(s.request, s.answer);
        auto answer = gen.Generate(s.request, nullptr);
        if (!score.ok() || !answer.ok()) {
          std::fprintf(stderr, "sample %zu: %s\n", si,
                       (score.ok() ? answer.status() : score.status()).ToString().c_str());
          return 1;
        }
        const auto key = std::make_pair(policies[pi], budget);
        if (!cells.count(key)) order.push_back(key);
        Cell& c = cells[key];
        c.nll += score->nll_sum;
        c.tokens += score->tokens;
        c.rouge += llava::RougeL(answer->text, full->text);
        c.kv_ratio += double(score->kv.bytes_kept) / score->kv.full_equivalent_bytes;
        c.prefill_s += score->prefill_seconds;
        c.decode_s += score->decode_seconds;
        c.decode_tokens += std::max(0, score->tokens - 1);
        ++c.samples;
        const double item = s.short_answer.empty()
                                ? llava::RougeL(answer->text, s.answer)
                                : double(llava::ExactMatch(answer->text, s.short_answer));
        if (!s.short_answer.empty()) {
          ++c.with_short;
          c.correct += static_cast<int>(item);
        } else {
          ++c.long_answers;
          c.rouge_ref += item;
        }
        c.items.push_back({!s.short_answer.empty(), item, score->nll_sum, score->tokens});
        if (!s.kind.empty()) {
          c.by_kind[s.kind].first += item;
          ++c.by_kind[s.kind].second;
        }
        if (!items_path.empty()) {
          item_lines.push_back(nlohmann::ordered_json{
              {"sample", si},
              {"policy", policies[pi]},
              {"budget", budget},
              {"kind", s.kind},
              {"prompt", s.prompt},
              {"reference", s.short_answer.empty() ? s.answer : s.short_answer},
              {"answer", answer->text},
              {"score", item},
              {"nll", score->nll_sum},
              {"tokens",
               score->tokens}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
        }
      }
    }
    std::fprintf(stderr, "\rsample %zu/%zu", si + 1, samples->size());
  }
  std::fprintf(stderr, "\n");

  if (std::system(("mkdir -p '" + out + "'").c_str()) != 0) return 1;
  if (!items_path.empty()) {
    std::ofstream items(items_path);
    for (const auto& line : item_lines) items << line << "\n";
    if (!items) {
      std::fprintf(stderr, "error: cannot write %s\n", items_path.c_str());
      return 1;
    }
  }
  std::ofstream csv(out + "/results.csv");
  csv << "policy,budget,samples,ppl,rouge_l,accuracy,rouge_l_ref,kv_bytes_ratio,prefill_ms,"
         "decode_ms_per_token\n";
  nlohmann::ordered_json json = nlohmann::ordered_json::array();
  std::printf("%-14s %6s %9s %8s %8s %8s %9s %11s %12s\n", "policy", "budget", "ppl", "rouge_l",
              "accuracy", "ref_rl", "kv_ratio", "prefill_ms", "decode_ms/t");
  for (const auto& key : order) {
    const Cell& c = cells[key];
    const double rouge = c.rouge / c.samples, ratio = c.kv_ratio / c.samples;
    const double prefill_ms = 1e3 * c.prefill_s / c.samples;
    const double decode_ms = c.decode_tokens ? 1e3 * c.decode_s / c.decode_tokens : 0;
    std::printf("%-14s %6.2f %9.3f %8.3f %8.3f %8.3f %9.3f %11.1f %12.2f\n", key.first.c_str(),
                key.second, c.Ppl(), rouge, c.Accuracy(), c.RougeRef(), ratio, prefill_ms,
                decode_ms);
    char line[256];
    std::snprintf(line, sizeof(line), "%s,%.2f,%d,%.4f,%.4f,%.4f,%.4f,%.4f,%.2f,%.3f\n",
                  key.first.c_str(), key.second, c.samples, c.Ppl(), rouge, c.Accuracy(),
                  c.RougeRef(), ratio, prefill_ms, decode_ms);
    csv << line;
    json.push_back(
        {{"policy", key.first},
         {"budget", key.second},
         {"samples", c.samples},
         {"ppl", c.Ppl()},
         {"rouge_l", rouge},
         {"accuracy", std::isnan(c.Accuracy()) ? nlohmann::ordered_json()
                                               : nlohmann::ordered_json(c.Accuracy())},
         {"rouge_l_ref", std::isnan(c.RougeRef()) ? nlohmann::ordered_json()
                                                  : nlohmann::ordered_json(c.RougeRef())},
         {"kv_bytes_ratio", ratio},
         {"prefill_ms", prefill_ms},
         {"decode_ms_per_token", decode_ms}});
  }
  std::ofstream(out + "/results.json") << json.dump(2) << "\n";
  WriteKinds(out, cells, order);
  WriteIntervals(out, cells, order, compare, resamples);
  WritePlots(out, cells, policies, budgets);
  std::printf("wrote %s/results.csv, results.json and plots\n", out.c_str());
  return 0;
}
