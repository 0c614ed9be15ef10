// The shapes-world data generator: deterministic, and its text agrees with its pictures.
#include "train/shapes_world.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <set>

#include "engine/io/image_io.h"
#include "tests/test_util.h"

namespace llava::shapes {
namespace {

// A ConversationMix that is only the given kind of description.
ConversationMix OnlyMix(double ConversationMix::*kind) {
  ConversationMix mix;
  mix.describe = 0;
  mix.*kind = 1;
  return mix;
}

TEST(ShapesWorld, SameSeedSameScenesTextAndPixels) {
  for (uint64_t seed : {1ull, 42ull, 1001ull}) {
    Rng a(seed), b(seed);
    const Scene sa = SampleScene(a), sb = SampleScene(b);
    EXPECT_EQ(DescribeText(sa), DescribeText(sb));
    EXPECT_EQ(RenderPng(sa, 96, 5), RenderPng(sb, 96, 5));
    EXPECT_EQ(AskShortQuestion(sa, a).question, AskShortQuestion(sb, b).question);
  }
  Rng c(1), d(2);
  EXPECT_NE(DescribeText(SampleScene(c)), DescribeText(SampleScene(d)));
}

TEST(ShapesWorld, RngIsSplitMix64) {
  // First outputs of SplitMix64 for seed 0 (Vigna's reference implementation).
  Rng r(0);
  EXPECT_EQ(r.Next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(r.Next(), 0x6E789E6AA1B965F4ull);
}

TEST(ShapesWorld, MakeDataToolIsByteForByteReproducible) {
  const std::string tool = std::string(LLAVA_BINARY_DIR) + "/llava-make-data";
  const std::string dir = ::llava::testing::TestData() + "/make-data";
  ASSERT_EQ(
      std::system(("rm -rf " + dir + " && " + tool + " --images 6 --out " + dir +
                   "/a > /dev/null && " + tool + " --images 6 --out " + dir + "/b > /dev/null && " +
                   tool + " --images 6 --seed 7 --out " + dir + "/c > /dev/null && " + tool +
                   " --images 6 --split train --out " + dir + "/d > /dev/null")
                      .c_str()),
      0);
  EXPECT_EQ(::llava::testing::RunCommand("diff -r " + dir + "/a " + dir + "/b && echo same"),
            "same\n");
  const std::string a = ::llava::testing::ReadFile(dir + "/a/eval.jsonl");
  EXPECT_FALSE(a.empty());
  EXPECT_NE(a, ::llava::testing::ReadFile(dir + "/c/eval.jsonl"));  // other seed
  EXPECT_NE(a, ::llava::testing::ReadFile(dir + "/d/eval.jsonl"));  // other split
}

// Every object's centre pixel has the object's colour (each of the five shapes covers its
// centre); the description names every object with its cell; counts add up.
TEST(ShapesWorld, TextMatchesThePicture) {
  const uint8_t kRgb[kNumColours][3] = {{220, 40, 40},   {245, 145, 30}, {235, 210, 30},
                                        {40, 160, 70},   {40, 90, 220},  {135, 65, 185},
                                        {240, 120, 185}, {25, 25, 25}};
  for (uint64_t seed = 0; seed < 200; ++seed) {
    Rng rng(seed);
    const Scene s = SampleScene(rng);
    ASSERT_GE(s.objects.size(), 1u);
    ASSERT_LE(s.objects.size(), 6u);
    const std::vector<uint8_t> px = RenderScene(s, 96, seed);
    std::set<int> cells;
    const std::string text = DescribeText(s);
    for (const Object& o : s.objects) {
      EXPECT_TRUE(cells.insert(o.cell).second) << "two objects in one cell";
      const int x = 16 + 32 * (o.cell % 3) + o.dx, y = 16 + 32 * (o.cell / 3) + o.dy;
      // A later, larger neighbour may cover the centre: only check when none is near.
      bool covered = false;
      for (const Object& p : s.objects) {
        covered |= &p != &o && p.cell > o.cell && p.size == 2 &&
                   std::abs((p.cell % 3) - (o.cell % 3)) + std::abs(p.cell / 3 - o.cell / 3) == 1;
      }
      if (!covered) {
        for (int c = 0; c < 3; ++c) {
          EXPECT_NEAR(px[(y * 96 + x) * 3 + c], kRgb[o.colour][c], 2)
              << "seed " << seed << " " << kShapeNames[o.shape];
        }
      }
      const std::string phrase = std::string(kSizeNames[o.size]) + " " + kColourNames[o.colour] +
                                 " " + kShapeNames[o.shape] + " " + kCellPhrases[o.cell];
      EXPECT_NE(text.find(phrase), std::string::npos) << text;
    }
    EXPECT_EQ(text.find("There are " + std::to_string(s.objects.size()) + " objects") == 0 ||
                  (s.objects.size() == 1 && text.find("There is 1 object") == 0),
              true)
        << text;
  }
}

TEST(ShapesWorld, ShortAnswersAgreeWithTheScene) {
  int yes = 0, no = 0;
  std::set<std::string> kinds;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    Rng rng(seed);
    const Scene s = SampleScene(rng);
    const QA qa = AskShortQuestion(s, rng);
    kinds.insert(qa.kind);
    if (qa.question == "How many objects are there?") {
      EXPECT_EQ(qa.answer, std::to_string(s.objects.size()));
    }
    if (qa.kind == "exists") (qa.answer == "yes" ? yes : no)++;
    if (qa.kind == "position" && qa.answer == "nothing") {
      for (const Object& o : s.objects) {
        EXPECT_NE(qa.question, "What is " + std::string(kCellPhrases[o.cell]) + "?");
      }
    }
  }
  EXPECT_EQ(kinds.size(), 7u);  // colour, shape, count, position, exists, larger, where
  EXPECT_GT(yes, 5);
  EXPECT_GT(no, 5);
}

TEST(ShapesWorld, SubsetDescriptionsListExactlyTheMatchingObjects) {
  Scene s;
  s.objects = {{0, 0, 0, 0}, {4, 0, 2, 4}, {1, 4, 1, 8}};  // red circle, red star, blue square
  EXPECT_EQ(DescribeSubset(s, -1, 0).question, "Describe the red objects.");
  EXPECT_EQ(DescribeSubset(s, -1, 0).answer,
            "There are 2 red objects: a small red circle at the top left and a large red star in "
            "the center.");
  EXPECT_EQ(DescribeSubset(s, 1, -1).answer,
            "There is 1 square: a medium blue square at the bottom right.");
  EXPECT_EQ(DescribeSubset(s, -1, 3).answer, "There are 0 green objects.");
  EXPECT_EQ(DescribeSubset(s, 3, -1).question, "Describe the diamonds.");

  for (uint64_t seed = 0; seed < 200; ++seed) {
    Rng rng(seed);
    const Scene scene = SampleScene(rng);
    const std::vector<QA> turns = SampleConversation(scene, rng, OnlyMix(&ConversationMix::subset));
    ASSERT_GE(turns.size(), 2u);
    ASSERT_LE(turns.size(), 3u);
    std::set<std::string> questions;
    for (const QA& qa : turns) {
      EXPECT_EQ(qa.kind, "describe-subset");
      EXPECT_TRUE(questions.insert(qa.question).second) << qa.question;
      // Every object of the named colour or shape is listed, and only those.
      int listed = 0;
      for (const Object& o : scene.objects) {
        const std::string phrase = std::string(kSizeNames[o.size]) + " " + kColourNames[o.colour] +
                                   " " + kShapeNames[o.shape] + " " + kCellPhrases[o.cell];
        const bool named =
            qa.question.find(std::string(" ") + kColourNames[o.colour] + " ") !=
                std::string::npos ||
            qa.question.find(std::string(" ") + kShapePlurals[o.shape] + ".") != std::string::npos;
        EXPECT_EQ(qa.answer.find(phrase) != std::string::npos, named) << qa.answer;
        listed += named;
      }
      EXPECT_EQ(qa.answer.rfind(
                    listed == 1 ? "There is 1 " : "There are " + std::to_string(listed) + " ", 0),
                0u)
          << qa.answer;
    }
  }
}

TEST(ShapesWorld, ByColourListsGroupEveryObjectUnderItsColour) {
  Scene s;
  // blue square (top left), red star (center), red circle (bottom right), black diamond (top)
  s.objects = {{1, 4, 1, 0}, {3, 7, 0, 1}, {4, 0, 2, 4}, {0, 0, 0, 8}};
  const QA qa = DescribeByColour(s);
  EXPECT_EQ(qa.question, "List the objects by color.");
  // Colours in kColourNames order (red before blue before black), each group row-major.
  EXPECT_EQ(qa.answer,
            "red: a large star in the center and a small circle at the bottom right; blue: a "
            "medium square at the top left; black: a small diamond at the top.");

  for (uint64_t seed = 0; seed < 200; ++seed) {
    Rng rng(seed);
    const Scene scene = SampleScene(rng);
    const std::vector<QA> turns =
        SampleConversation(scene, rng, OnlyMix(&ConversationMix::grouped));
    ASSERT_EQ(turns.size(), 1u);
    EXPECT_EQ(turns[0].kind, "describe-by-colour");
    // Every object appears once, after its own colour's header and before the next header.
    for (const Object& o : scene.objects) {
      const std::string phrase =
          std::string(kSizeNames[o.size]) + " " + kShapeNames[o.shape] + " " + kCellPhrases[o.cell];
      // The whole phrase: "small square at the bottom" is also a prefix of "... bottom left".
      const std::string& text = turns[0].answer;
      size_t at = text.find(phrase);
      auto ends_there = [&](size_t a) {
        const std::string rest = text.substr(a + phrase.size());
        return rest.rfind(",", 0) == 0 || rest.rfind(";", 0) == 0 || rest.rfind(".", 0) == 0 ||
               rest.rfind(" and ", 0) == 0;
      };
      while (at != std::string::npos && !ends_there(at)) at = text.find(phrase, at + 1);
      ASSERT_NE(at, std::string::npos) << text;
      const std::string before = turns[0].answer.substr(0, at);
      const size_t header = before.rfind(':');
      ASSERT_NE(header, std::string::npos);
      const size_t start =
          before.rfind("; ", header) == std::string::npos ? 0 : before.rfind("; ", header) + 2;
      EXPECT_EQ(before.substr(start, header - start), kColourNames[o.colour]) << turns[0].answer;
    }
  }
}

TEST(ShapesWorld, NamedObjectsAreTheOnesTheQuestionRefersTo) {
  Scene s;
  // blue square (top left), black diamond (top), red star (center), red circle (bottom right)
  s.objects = {{1, 4, 1, 0}, {3, 7, 0, 1}, {4, 0, 2, 4}, {0, 0, 0, 8}};
  using V = std::vector<int>;
  EXPECT_EQ(NamedObjects(s, "What shape is the red object?"), (V{2, 3}));
  EXPECT_EQ(NamedObjects(s, "What color is the diamond?"), (V{1}));
  EXPECT_EQ(NamedObjects(s, "How many squares are there?"), (V{0}));
  EXPECT_EQ(NamedObjects(s, "Is there a red circle?"), (V{3}));
  EXPECT_EQ(NamedObjects(s, "Is there a blue circle?"), V{});
  EXPECT_EQ(NamedObjects(s, "Which is larger, the red star or the blue square?"), (V{0, 2}));
  EXPECT_EQ(NamedObjects(s, "What is at the top left?"), (V{0}));  // not "at the top"
  EXPECT_EQ(NamedObjects(s, "What is at the top?"), (V{1}));
  EXPECT_EQ(NamedObjects(s, "What is on the left?"), V{});
  EXPECT_EQ(NamedObjects(s, "How many objects are there?"), V{});
  EXPECT_EQ(NamedObjects(s, "Describe the image in detail."), V{});
  // Absent things are still named (llava-train --attn-absent sends those answers to <s>).
  EXPECT_TRUE(NamesAnything("Is there a blue circle?"));
  EXPECT_TRUE(NamesAnything("What is on the left?"));
  EXPECT_TRUE(NamesAnything("How many green objects are there?"));
  EXPECT_FALSE(NamesAnything("How many objects are there?"));
  EXPECT_FALSE(NamesAnything("Describe the image in detail."));

  // Patches on a 12 x 12 grid of 8 px at 96 px. A large object in the center cell (centre
  // 48, 48; radius 15, 0.8 of it 12): the patch centres 44 and 52 in each axis are sqrt(32)
  // away, the next ring (36 or 60 in one axis) sqrt(160) > 12, so rows and columns 5..6. A small
  // one (radius 6, 4.8) covers only the patch under its centre.
  V center = ObjectPatches(s.objects[2], 96, 12);
  EXPECT_EQ(center, (V{65, 66, 77, 78}));
  EXPECT_EQ(ObjectPatches(s.objects[3], 96, 12), (V{10 * 12 + 10}));  // centre 80, 80
  // The same object at twice the resolution covers the same part of the image.
  EXPECT_EQ(ObjectPatches(s.objects[2], 192, 12), center);

  // Each patch's owner: the objects' patches, the rest background.
  V owners = PatchOwners(s, 96, 12);
  ASSERT_EQ(owners.size(), 144u);
  EXPECT_EQ(owners[65], 2);
  EXPECT_EQ(owners[78], 2);
  EXPECT_EQ(owners[10 * 12 + 10], 3);
  EXPECT_EQ(owners[0 * 12 + 11], -1);  // top right: no object there
  EXPECT_EQ(std::count(owners.begin(), owners.end(), 2), 4);
  // Where two overlap, the later one (drawn on top) owns the patch.
  Scene two;
  two.objects = {{0, 0, 2, 4}, {1, 4, 2, 4}};  // a large red circle under a large blue square
  V top_alone = PatchOwners(Scene{0, false, {two.objects[1]}}, 96, 12);
  for (int& o : top_alone) o = o == 0 ? 1 : -1;  // its index in `two`
  EXPECT_EQ(PatchOwners(two, 96, 12), top_alone);
}

// Paraphrases reword every template (or keep it) without changing what the question names.
TEST(ShapesWorld, ParaphrasesKeepWhatTheQuestionNames) {
  Rng rng(7);
  std::set<std::string> rewordings;
  int reworded = 0, questions = 0;
  for (int i = 0; i < 200; ++i) {
    Scene s = SampleScene(rng);
    for (int k = 0; k < kNumQuestionKinds; ++k) {
      std::optional<QA> qa = AskQuestionOfKind(s, rng, static_cast<QuestionKind>(k));
      if (!qa) continue;
      ++questions;
      const std::string p = Paraphrase(qa->question, rng);
      EXPECT_EQ(NamedObjects(s, p), NamedObjects(s, qa->question)) << qa->question << " / " << p;
      EXPECT_EQ(NamesAnything(p), NamesAnything(qa->question)) << qa->question << " / " << p;
      reworded += p != qa->question;
      rewordings.insert(p.substr(0, p.find(' ', p.find(' ') + 1)));  // the first two words
    }
  }
  EXPECT_EQ(reworded, questions);  // every template has a rewording
  EXPECT_GE(rewordings.size(), 8u) << "too few distinct openings";
  EXPECT_EQ(Paraphrase("How many objects are there?", rng).find("objects are there?"),
            std::string::npos);
  EXPECT_NE(Paraphrase("Describe the image in detail.", rng), "Describe the image in detail.");
}

TEST(ShapesWorld, WeightedQuestionsDrawOnlyTheWeightedTemplates) {
  // One template at a time: every question is of it, and its answer agrees with the scene.
  for (int k = 0; k < kNumQuestionKinds; ++k) {
    const auto kind = static_cast<QuestionKind>(k);
    QuestionWeights weights{};
    weights[k] = 1;
    for (uint64_t seed = 0; seed < 60; ++seed) {
      Rng rng(seed);
      Scene s = SampleScene(rng);
      if (kind == QuestionKind::kColour || kind == QuestionKind::kShape ||
          kind == QuestionKind::kLarger || kind == QuestionKind::kWhere) {
        // Not every scene has one (e.g. no shape there exactly once): give it one that has.
        s.objects = {{0, 0, 0, 0}, {1, 1, 2, 4}};
      }
      const QA qa = AskShortQuestion(s, rng, weights);
      // The index i < n whose question `question_of(i)` is this one, or -1.
      auto asked = [&](int n, auto question_of) {
        for (int i = 0; i < n; ++i) {
          if (qa.question == question_of(i)) return i;
        }
        return -1;
      };
      // How many objects satisfy `pred`, as the answer writes it.
      auto count = [&](auto pred) {
        return std::to_string(std::count_if(s.objects.begin(), s.objects.end(), pred));
      };
      switch (kind) {
        case QuestionKind::kCountAll:
          EXPECT_EQ(qa.question, "How many objects are there?");
          EXPECT_EQ(qa.answer, std::to_string(s.objects.size()));
          break;
        case QuestionKind::kCountShape: {
          const int shape = asked(kNumShapes, [](int sh) {
            return std::string("How many ") + kShapePlurals[sh] + " are there?";
          });
          ASSERT_GE(shape, 0) << qa.question;
          EXPECT_EQ(qa.answer, count([&](const Object& o) { return o.shape == shape; }));
          break;
        }
        case QuestionKind::kCountColour: {
          const int colour = asked(kNumColours, [](int c) {
            return std::string("How many ") + kColourNames[c] + " objects are there?";
          });
          ASSERT_GE(colour, 0) << qa.question;
          EXPECT_EQ(qa.answer, count([&](const Object& o) { return o.colour == colour; }));
          break;
        }
        default: {
          static const char* const kPrefixes[] = {
              "What color is the ", "What shape is the ", "", "", "", "What is ", "Is there ",
              "Which is larger, ",  "Where is the "};
          EXPECT_EQ(qa.question.rfind(kPrefixes[k], 0), 0u) << QuestionKindName(kind);
        }
      }
    }
  }
  // Shares follow the weights: position 3 : count_all 1.
  QuestionWeights weights{};
  weights[static_cast<int>(QuestionKind::kPosition)] = 3;
  weights[static_cast<int>(QuestionKind::kCountAll)] = 1;
  int position = 0;
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    Rng rng(seed);
    const Scene s = SampleScene(rng);
    position += AskShortQuestion(s, rng, weights).kind == "position";
  }
  EXPECT_NEAR(position / 2000.0, 0.75, 0.04);
}

TEST(ShapesWorld, ParsesQuestionWeightsAndNamesTheBadItem) {
  std::string error;
  std::optional<QuestionWeights> w = ParseQuestionWeights("position=0.5,count_colour=2", &error);
  ASSERT_TRUE(w.has_value()) << error;
  QuestionWeights expected = UniformQuestionWeights();
  expected[static_cast<int>(QuestionKind::kPosition)] = 0.5;
  expected[static_cast<int>(QuestionKind::kCountColour)] = 2;
  EXPECT_EQ(*w, expected);
  EXPECT_DOUBLE_EQ(expected[static_cast<int>(QuestionKind::kCountAll)], 2.0 / 3);
  EXPECT_EQ(expected[static_cast<int>(QuestionKind::kWhere)], 1.0);

  for (const char* bad : {"colour", "size=1", "colour=", "colour=x", "colour=-1", "colour=1,"}) {
    EXPECT_FALSE(ParseQuestionWeights(bad, &error).has_value()) << bad;
    EXPECT_NE(error.find('"'), std::string::npos) << bad << ": " << error;
  }
  EXPECT_FALSE(ParseQuestionWeights("colour=0,shape=0,count_all=0,count_shape=0,count_colour=0,"
                                    "position=0,exists=0,larger=0,where=0",
                                    &error)
                   .has_value());
  EXPECT_EQ(error, "every weight is 0");
}

TEST(ShapesWorld, QuestionConversationsHaveTheAskedLength) {
  ConversationMix mix;
  mix.describe = 0;
  mix.min_questions = 9;
  mix.max_questions = 12;
  int longest = 0;
  for (uint64_t seed = 0; seed < 100; ++seed) {
    Rng rng(seed);
    const Scene s = SampleScene(rng);
    const std::vector<QA> turns = SampleConversation(s, rng, mix);
    ASSERT_LE(turns.size(), 12u);
    std::set<std::string> questions;
    for (const QA& qa : turns) EXPECT_TRUE(questions.insert(qa.question).second);
    longest = std::max(longest, static_cast<int>(turns.size()));
  }
  EXPECT_EQ(longest, 12);
}

TEST(ShapesWorld, OtherObjectConversationsAskAboutDisjointObjects) {
  int made = 0, multi = 0;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    Rng rng(seed);
    const Scene s = SampleScene(rng);
    const std::optional<std::vector<QA>> turns = AskAboutOtherObjects(s, rng);
    if (s.objects.size() < 2) {
      EXPECT_FALSE(turns.has_value()) << seed;
      continue;
    }
    ++multi;
    if (!turns) continue;
    ++made;
    ASSERT_EQ(turns->size(), 3u);
    const std::vector<int> first = NamedObjects(s, turns->front().question);
    const std::vector<int> last = NamedObjects(s, turns->back().question);
    ASSERT_FALSE(first.empty()) << turns->front().question;
    ASSERT_FALSE(last.empty()) << turns->back().question;
    for (int o : first) {
      EXPECT_EQ(std::count(last.begin(), last.end(), o), 0)
          << turns->front().question << " / " << turns->back().question;
    }
    std::set<std::string> questions;
    for (const QA& qa : *turns) EXPECT_TRUE(questions.insert(qa.question).second);
  }
  EXPECT_GT(multi, 100);
  EXPECT_GE(made, multi * 9 / 10);  // nearly every scene of two objects or more has such a pair
}

}  // namespace
}  // namespace llava::shapes
