// llava-make-data: writes a split of the shapes world (train/shapes_world.h) to disk: PNG
// images and an llava-eval dataset (JSONL), or the training text corpus. Deterministic: the
// same --seed gives the same bytes. The trainer draws its training scenes in-process from its
// own seed; --split picks the seed stream, so train and held-out scenes never share one.
//
//   llava-make-data --split heldout --images 60 --out build/shapes-heldout
//   -> images/00000.png ..., eval.jsonl with per image: two short questions (short_answer),
//      every 2nd image a detailed description, every 4th image a three-turn conversation, and
//      the 4th images that follow those a three-turn conversation whose last question is about
//      other objects than its first (kind multiturn-other).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train/shapes_world.h"

namespace {

using llava::shapes::QA;
using llava::shapes::Rng;

uint64_t SceneSeed(const std::string& split, uint64_t seed, int i) {
  Rng r(seed * 0x9E3779B97F4A7C15ull ^ (split == "heldout" ? 0x4E1D07ull : 0x7A1Aull) ^
        (static_cast<uint64_t>(i) << 20));
  return r.Next();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Generate shapes-world images and questions"};
  std::string out = "build/shapes-heldout", split = "heldout";
  uint64_t seed = 1001;
  int images = 60, size = 96;
  app.add_option("--out", out, "output folder")->capture_default_str();
  app.add_option("--split", split, "train | heldout (different seed streams)")
      ->check(CLI::IsMember({"train", "heldout"}))
      ->capture_default_str();
  app.add_option("--seed", seed, "seed")->capture_default_str();
  app.add_option("--images", images, "number of scenes")->capture_default_str();
  app.add_option("--size", size, "image side in pixels (the default model reads 96)")
      ->capture_default_str();
  bool conversations = false, no_images = false;
  app.add_flag("--no-images", no_images, "write the text only (scenes as JSON in conversations)");
  app.add_flag("--conversations", conversations,
               "write training conversations (conversations.jsonl: image + 3-8 turns) instead "
               "of an eval set");
  CLI11_PARSE(app, argc, argv);
  if (std::system(("mkdir -p '" + out + "/images'").c_str()) != 0) return 1;

  std::ofstream jsonl(out + (conversations ? "/conversations.jsonl" : "/eval.jsonl"));
  int items = 0;
  for (int i = 0; i < images; ++i) {
    Rng rng(SceneSeed(split, seed, i));
    const llava::shapes::Scene scene = llava::shapes::SampleScene(rng);
    char name[32];
    std::snprintf(name, sizeof(name), "images/%05d.png", i);
    const uint64_t texture_seed = rng.Next();
    if (!no_images) {
      std::ofstream(out + "/" + name, std::ios::binary)
          << llava::shapes::RenderPng(scene, size, texture_seed);
    }
    if (conversations) {
      nlohmann::ordered_json j;
      j["image"] = name;
      nlohmann::ordered_json objects = nlohmann::ordered_json::array();
      for (const auto& o : scene.objects) {
        objects.push_back({o.shape, o.colour, o.size, o.cell, o.dx, o.dy, o.angle});
      }
      j["scene"] = {{"background", scene.background},
                    {"textured", scene.textured},
                    {"texture_seed", texture_seed},
                    {"objects", objects}};
      j["turns"] = nlohmann::ordered_json::array();
      for (const QA& qa : llava::shapes::SampleConversation(scene, rng, {})) {
        j["turns"].push_back({qa.question, qa.answer});
      }
      jsonl << j.dump() << "\n";
      ++items;
      continue;
    }
    auto item = [&](const QA& qa) {
      nlohmann::ordered_json j;
      j["image"] = name;
      j["prompt"] = qa.question;
      j["answer"] = qa.answer;
      if (qa.kind != "describe") j["short_answer"] = qa.answer;
      j["kind"] = qa.kind;
      return j;
    };
    // The turns as a chat; the last question is the item's, its answer the reference.
    auto conversation = [&](const std::vector<QA>& turns, const std::string& kind) {
      nlohmann::ordered_json j = item(turns.back());
      j.erase("prompt");
      j["conversation"] = nlohmann::ordered_json::array();
      for (size_t t = 0; t < turns.size(); ++t) {
        j["conversation"].push_back({{"role", "user"}, {"content", turns[t].question}});
        if (t + 1 < turns.size()) {
          j["conversation"].push_back({{"role", "assistant"}, {"content", turns[t].answer}});
        }
      }
      j["kind"] = kind;
      return j;
    };
    QA a = llava::shapes::AskShortQuestion(scene, rng), b;
    do b = llava::shapes::AskShortQuestion(scene, rng);
    while (b.question == a.question);
    jsonl << item(a).dump() << "\n" << item(b).dump() << "\n";
    items += 2;
    if (i % 2 == 0) {
      jsonl << item(llava::shapes::Describe(scene)).dump() << "\n";
      ++items;
    }
    if (i % 4 == 0) {
      std::vector<QA> turns;
      while (turns.size() < 3) {
        QA qa = llava::shapes::AskShortQuestion(scene, rng);
        bool repeated = false;
        for (const QA& t : turns) repeated |= t.question == qa.question;
        if (!repeated) turns.push_back(qa);
      }
      jsonl << conversation(turns, "multiturn-" + turns.back().kind).dump() << "\n";
      ++items;
    }
    // Drawn after everything above, so the earlier items of the split keep their bytes.
    if (i % 4 == 2) {
      if (std::optional<std::vector<QA>> turns = llava::shapes::AskAboutOtherObjects(scene, rng)) {
        jsonl << conversation(*turns, "multiturn-other").dump() << "\n";
        ++items;
      }
    }
  }
  std::printf("wrote %d images and %d eval items to %s\n", images, items, out.c_str());
  return 0;
}
