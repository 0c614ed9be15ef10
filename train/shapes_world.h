// The synthetic "shapes" world the default model is trained and evaluated on. Torch-free.
//
// A scene is 1-6 objects on a 3 x 3 grid (one per cell; large ones may overlap a neighbour),
// each with a shape (5 kinds), a colour (8) and a size (3), on a plain or lightly textured
// background. Scenes render to RGB images with OpenCV and come with LLaVA-style text: short
// questions with one-phrase answers and a detailed description. Everything is a pure function
// of the seed (our own SplitMix64 generator, no std:: distributions whose output differs
// between standard libraries), so the same seed gives the same bytes everywhere.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace llava::shapes {

// SplitMix64: tiny, fast, and fully specified.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  int Uniform(int n);  // [0, n)
  double Real();       // [0, 1)
  bool Chance(double p) { return Real() < p; }

 private:
  uint64_t state_;
};

inline constexpr int kNumShapes = 5, kNumColours = 8, kNumSizes = 3, kNumCells = 9;
inline constexpr int kMaxObjects = 6;                // objects in a scene: 1 to kMaxObjects
extern const char* const kShapeNames[kNumShapes];    // "circle", ...
extern const char* const kShapePlurals[kNumShapes];  // "circles", ...
extern const char* const kColourNames[kNumColours];  // "red", ...
extern const char* const kSizeNames[kNumSizes];      // "small", "medium", "large"
extern const char* const kCellNames[kNumCells];      // "top left", ..., "bottom right"
extern const char* const kCellPhrases[kNumCells];    // "at the top left", "in the center", ..

struct Object {
  int shape = 0, colour = 0, size = 0, cell = 0;
  int dx = 0, dy = 0;  // jitter of the centre inside the cell, pixels at 96 px
  int angle = 0;       // rotation in degrees (squares, triangles, stars)
};

struct Scene {
  int background = 0;  // 0 white, 1 gray, 2 beige
  bool textured = false;
  std::vector<Object> objects;  // sorted by cell (row-major)
};
extern const char* const kBackgroundNames[3];

Scene SampleScene(Rng& rng);

// RGB pixels [size, size, 3]; geometry scales with `size` (designed at 96).
std::vector<uint8_t> RenderScene(const Scene& scene, int size, uint64_t texture_seed);
// PNG bytes of RenderScene.
std::string RenderPng(const Scene& scene, int size, uint64_t texture_seed);

struct QA {
  std::string kind;      // colour, shape, count, position, exists, larger, where, describe
  std::string question;  // e.g. "What color is the circle?"
  std::string answer;    // e.g. "red"; the full description for kind "describe"
};

// The short-question templates; the three counts are "How many objects", "How many <shapes>"
// and "How many <colour> objects". QA::kind names them coarser ("count" for all three).
enum class QuestionKind {
  kColour,
  kShape,
  kCountAll,
  kCountShape,
  kCountColour,
  kPosition,
  kExists,
  kLarger,
  kWhere
};
inline constexpr int kNumQuestionKinds = 9;
using QuestionWeights = std::array<double, kNumQuestionKinds>;  // indexed by QuestionKind
const char* QuestionKindName(QuestionKind kind);  // "colour", ..., "count_colour", ..., "where"
// The shares AskShortQuestion(scene, rng) draws with: 1 each, the counts 2/3 each.
QuestionWeights UniformQuestionWeights();
// "position=0.5,count_colour=2" (llava-train --question-weights): the named templates' weights,
// the others UniformQuestionWeights'. nullopt, and *error naming the bad item, for an unknown
// template, a weight that is not a number >= 0, or all weights 0.
std::optional<QuestionWeights> ParseQuestionWeights(const std::string& text, std::string* error);

// A question of `kind` about the scene, or nullopt when the scene has none (no shape that is
// there exactly once, no two named objects of different sizes, ...).
std::optional<QA> AskQuestionOfKind(const Scene& scene, Rng& rng, QuestionKind kind);
// One question of a random applicable kind (never "describe"): the held-out split's questions.
QA AskShortQuestion(const Scene& scene, Rng& rng);
// The same with kinds drawn in proportion to `weights` (llava-train --question-weights).
QA AskShortQuestion(const Scene& scene, Rng& rng, const QuestionWeights& weights);
// "Describe the image in detail." and the description (every object, row-major).
QA Describe(const Scene& scene);
std::string DescribeText(const Scene& scene);

// "Describe the red objects." (colour >= 0) or "Describe the squares." (shape >= 0): how many
// there are, then each one as in the description ("There are 0 red objects." when none). A
// training task: it gives the lookup by colour or shape that short questions need the dense
// supervision that the description gives the lookup by cell (docs/TRAINING.md).
QA DescribeSubset(const Scene& scene, int shape, int colour);

// "List the objects by color." and every object grouped by colour (in kColourNames order, each
// group row-major), the colour first: "red: a large circle at the top left and a small star in
// the center; blue: a medium square at the bottom right." A training task: the model writes
// the colour word itself (read from the image), and the next object's size, shape and cell must
// then be looked up by that colour, with dense supervision (docs/TRAINING.md).
QA DescribeByColour(const Scene& scene);

// The objects a question names, as indices into scene.objects: every "<colour> <shape>" pair,
// else a colour or a shape alone, else a cell phrase ("at the top left"). Empty for questions
// about the whole image and when nothing matches. For llava-train's attention supervision.
std::vector<int> NamedObjects(const Scene& scene, const std::string& question);
// Whether the question names a colour, a shape or a cell at all (present or not).
bool NamesAnything(const std::string& question);
// The patches (row-major indices on a grid x grid patch grid of a size x size image) whose
// centre lies inside 0.8 of object `o`'s radius; at least the patch under its centre.
std::vector<int> ObjectPatches(const Object& o, int size, int grid);
// What each patch shows: for every patch (row-major, grid x grid), the index into s.objects of
// the object whose ObjectPatches hold it (the later one where two overlap: objects are drawn in
// order, so it is on top), or -1 for the background.
std::vector<int> PatchOwners(const Scene& s, int size, int grid);

// Another wording of a question of this world (training only; the held-out split keeps the
// templates): "How many shapes are there?" for "How many objects are there?", "Do you see a red
// circle?" for "Is there a red circle?", ... Every colour, shape and cell word is kept, so the
// answer and NamedObjects stay the same. The question itself when no rewording applies.
std::string Paraphrase(const std::string& question, Rng& rng);

// What a training conversation is made of (the defaults are the held-out split's).
struct ConversationMix {
  double describe = 0.5;                     // the description alone
  double subset = 0;                         // two or three DescribeSubset turns of one attribute
  double grouped = 0;                        // DescribeByColour alone
  int min_questions = 3, max_questions = 8;  // otherwise this many distinct short questions
  std::optional<QuestionWeights> question_weights;  // nullopt: AskShortQuestion(scene, rng)
};

// A training conversation: with probability `describe` the description alone, with probability
// `subset` two or three DescribeSubset turns of one attribute (disjoint objects), with
// probability `grouped` DescribeByColour alone, otherwise min_questions to max_questions
// distinct short questions. Never descriptions and short questions together: a short answer
// that follows a description in the same conversation can be copied from its text instead of
// being read from the image.
std::vector<QA> SampleConversation(const Scene& scene, Rng& rng, const ConversationMix& mix);

// A held-out conversation whose last question is about other objects than its first: three
// distinct short questions, the first and the last each naming at least one object
// (NamedObjects) and no object named by both; the middle one is any other question. nullopt for
// scenes of fewer than two objects or when no such pair turns up in a bounded number of draws.
// It checks that a cache compressed for the last question has not lost what the first one
// asked about, nor the reverse.
std::optional<std::vector<QA>> AskAboutOtherObjects(const Scene& scene, Rng& rng);

}  // namespace llava::shapes
