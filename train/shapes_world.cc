// The shapes world in one file (~590 lines) on purpose: scenes, rendering, questions,
// paraphrases and descriptions share its word tables and placement rules (where a cell is, how
// large a size draws), so one world's rules are read and changed in one place.
#include "train/shapes_world.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#include <set>

namespace llava::shapes {

uint64_t Rng::Next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
int Rng::Uniform(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }
double Rng::Real() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

const char* const kShapeNames[kNumShapes] = {"circle", "square", "triangle", "diamond", "star"};
const char* const kShapePlurals[kNumShapes] = {"circles", "squares", "triangles", "diamonds",
                                               "stars"};
const char* const kColourNames[kNumColours] = {"red",  "orange", "yellow", "green",
                                               "blue", "purple", "pink",   "black"};
const char* const kSizeNames[kNumSizes] = {"small", "medium", "large"};
const char* const kCellNames[kNumCells] = {"top left",    "top",    "top right",
                                           "left",        "center", "right",
                                           "bottom left", "bottom", "bottom right"};
const char* const kCellPhrases[kNumCells] = {
    "at the top left",    "at the top",    "at the top right",
    "on the left",        "in the center", "on the right",
    "at the bottom left", "at the bottom", "at the bottom right"};
const char* const kBackgroundNames[3] = {"white", "gray", "beige"};

namespace {

const uint8_t kColourRgb[kNumColours][3] = {{220, 40, 40},   {245, 145, 30}, {235, 210, 30},
                                            {40, 160, 70},   {40, 90, 220},  {135, 65, 185},
                                            {240, 120, 185}, {25, 25, 25}};
const uint8_t kBackgroundRgb[3][3] = {{250, 250, 250}, {200, 200, 200}, {238, 226, 196}};
const double kRadius[kNumSizes] = {6, 10, 15};  // at 96 px

struct Circle {
  double x, y, r;
};
// Where object `o` is drawn, in pixels of an image `k` times the design size of 96 px: its
// centre (the cell's centre plus jitter) and radius.
Circle Placement(const Object& o, double k) {
  return {k * (16 + 32 * (o.cell % 3) + o.dx), k * (16 + 32 * (o.cell / 3) + o.dy),
          k * kRadius[o.size]};
}
const int kJitter[kNumSizes] = {5, 4, 3};

std::string Article(const std::string& word) {
  return (word[0] == 'a' || word[0] == 'e' || word[0] == 'i' || word[0] == 'o' || word[0] == 'u')
             ? "an "
             : "a ";
}

std::string ObjectPhrase(const Object& o) {  // "a small red circle"
  return "a " + std::string(kSizeNames[o.size]) + " " + kColourNames[o.colour] + " " +
         kShapeNames[o.shape];
}

int CountIf(const Scene& s, int shape, int colour) {
  int n = 0;
  for (const Object& o : s.objects) {
    n += (shape < 0 || o.shape == shape) && (colour < 0 || o.colour == colour);
  }
  return n;
}

// Objects that a "<colour> <shape>" phrase identifies uniquely.
std::vector<const Object*> UniquelyNamed(const Scene& s) {
  std::vector<const Object*> out;
  for (const Object& o : s.objects) {
    if (CountIf(s, o.shape, o.colour) == 1) out.push_back(&o);
  }
  return out;
}

std::vector<cv::Point2d> Polygon(int shape, double r, double angle_deg) {
  std::vector<cv::Point2d> p;
  const double a0 = angle_deg * M_PI / 180.0;
  auto ring = [&](int n, double start, const std::vector<double>& radii) {
    for (int i = 0; i < n; ++i) {
      const double a = a0 + start + 2 * M_PI * i / n;
      const double rr = radii[i % radii.size()];
      p.emplace_back(rr * std::cos(a), rr * std::sin(a));
    }
  };
  switch (shape) {
    case 1:
      ring(4, M_PI / 4, {r * 1.1});
      break;  // square
    case 2:
      ring(3, -M_PI / 2, {r * 1.15});
      break;  // triangle
    case 3:
      p = {{0, -r * 1.15}, {r * 0.75, 0}, {0, r * 1.15}, {-r * 0.75, 0}};
      break;  // diamond
    case 4:
      ring(10, -M_PI / 2, {r * 1.2, r * 0.5});
      break;  // star
    default:
      break;
  }
  return p;
}

}  // namespace

Scene SampleScene(Rng& rng) {
  Scene s;
  s.background = rng.Uniform(3);
  s.textured = rng.Chance(0.5);
  const int n = 1 + rng.Uniform(kMaxObjects);
  std::vector<int> cells(kNumCells);
  for (int i = 0; i < kNumCells; ++i) cells[i] = i;
  for (int i = kNumCells - 1; i > 0; --i) std::swap(cells[i], cells[rng.Uniform(i + 1)]);
  for (int i = 0; i < n; ++i) {
    Object o;
    o.shape = rng.Uniform(kNumShapes);
    o.colour = rng.Uniform(kNumColours);
    o.size = rng.Uniform(kNumSizes);
    o.cell = cells[i];
    const int j = kJitter[o.size];
    o.dx = rng.Uniform(2 * j + 1) - j;
    o.dy = rng.Uniform(2 * j + 1) - j;
    o.angle = rng.Uniform(41) - 20;
    s.objects.push_back(o);
  }
  std::sort(s.objects.begin(), s.objects.end(),
            [](const Object& a, const Object& b) { return a.cell < b.cell; });
  return s;
}

std::vector<uint8_t> RenderScene(const Scene& scene, int size, uint64_t texture_seed) {
  const double k = size / 96.0;
  const uint8_t* bg = kBackgroundRgb[scene.background];
  cv::Mat img(size, size, CV_8UC3, cv::Scalar(bg[0], bg[1], bg[2]));
  if (scene.textured) {
    Rng rng(texture_seed);
    const int period = 6 + rng.Uniform(6);
    for (int y = 0; y < size; ++y) {
      uint8_t* row = img.ptr<uint8_t>(y);
      for (int x = 0; x < size; ++x) {
        const int stripe = ((x + y) / period) % 2 == 0 ? -10 : 0;
        const int noise = rng.Uniform(13) - 6;
        for (int c = 0; c < 3; ++c) {
          row[3 * x + c] =
              static_cast<uint8_t>(std::clamp(row[3 * x + c] + stripe + noise, 0, 255));
        }
      }
    }
  }
  constexpr int kShift = 4;  // sub-pixel bits for OpenCV's drawing
  for (const Object& o : scene.objects) {
    const auto [cx, cy, r] = Placement(o, k);
    const uint8_t* c = kColourRgb[o.colour];
    const cv::Scalar colour(c[0], c[1], c[2]);
    if (o.shape == 0) {
      cv::circle(img, cv::Point(std::lround(cx * 16), std::lround(cy * 16)),
                 static_cast<int>(std::lround(r * 16)), colour, cv::FILLED, cv::LINE_AA, kShift);
      continue;
    }
    std::vector<cv::Point> pts;
    for (const auto& p : Polygon(o.shape, r, o.shape == 3 ? 0 : o.angle)) {
      pts.emplace_back(std::lround((cx + p.x) * 16), std::lround((cy + p.y) * 16));
    }
    cv::fillPoly(img, std::vector<std::vector<cv::Point>>{pts}, colour, cv::LINE_AA, kShift);
  }
  return std::vector<uint8_t>(img.data, img.data + img.total() * 3);
}

std::string RenderPng(const Scene& scene, int size, uint64_t texture_seed) {
  std::vector<uint8_t> rgb = RenderScene(scene, size, texture_seed);
  cv::Mat img(size, size, CV_8UC3, rgb.data()), bgr;
  cv::cvtColor(img, bgr, cv::COLOR_RGB2BGR);
  std::vector<uint8_t> png;
  cv::imencode(".png", bgr, png, {cv::IMWRITE_PNG_COMPRESSION, 9});
  return std::string(png.begin(), png.end());
}

std::optional<QA> AskQuestionOfKind(const Scene& s, Rng& rng, QuestionKind kind) {
  switch (kind) {
    case QuestionKind::kColour: {  // colour of a shape present exactly once
      std::vector<int> shapes;
      for (int sh = 0; sh < kNumShapes; ++sh) {
        if (CountIf(s, sh, -1) == 1) shapes.push_back(sh);
      }
      if (shapes.empty()) return std::nullopt;
      const int sh = shapes[rng.Uniform(static_cast<int>(shapes.size()))];
      for (const Object& o : s.objects) {
        if (o.shape == sh) {
          return QA{"colour", std::string("What color is the ") + kShapeNames[sh] + "?",
                    kColourNames[o.colour]};
        }
      }
      return std::nullopt;
    }
    case QuestionKind::kShape: {  // shape of a colour present exactly once
      std::vector<int> colours;
      for (int c = 0; c < kNumColours; ++c) {
        if (CountIf(s, -1, c) == 1) colours.push_back(c);
      }
      if (colours.empty()) return std::nullopt;
      const int c = colours[rng.Uniform(static_cast<int>(colours.size()))];
      for (const Object& o : s.objects) {
        if (o.colour == c) {
          return QA{"shape", std::string("What shape is the ") + kColourNames[c] + " object?",
                    kShapeNames[o.shape]};
        }
      }
      return std::nullopt;
    }
    case QuestionKind::kCountAll:
      return QA{"count", "How many objects are there?", std::to_string(s.objects.size())};
    case QuestionKind::kCountShape: {
      const int sh = rng.Chance(0.7) ? s.objects[rng.Uniform(int(s.objects.size()))].shape
                                     : rng.Uniform(kNumShapes);
      return QA{"count", std::string("How many ") + kShapePlurals[sh] + " are there?",
                std::to_string(CountIf(s, sh, -1))};
    }
    case QuestionKind::kCountColour: {
      const int c = rng.Chance(0.7) ? s.objects[rng.Uniform(int(s.objects.size()))].colour
                                    : rng.Uniform(kNumColours);
      return QA{"count", std::string("How many ") + kColourNames[c] + " objects are there?",
                std::to_string(CountIf(s, -1, c))};
    }
    case QuestionKind::kPosition: {  // what is at a position
      const int cell = rng.Chance(0.75) ? s.objects[rng.Uniform(int(s.objects.size()))].cell
                                        : rng.Uniform(kNumCells);
      std::string answer = "nothing";
      for (const Object& o : s.objects) {
        if (o.cell == cell) answer = ObjectPhrase(o);
      }
      std::string phrase = kCellPhrases[cell];
      return QA{"position", "What is " + phrase + "?", answer};
    }
    case QuestionKind::kExists: {  // existence, balanced
      int sh, c;
      if (rng.Chance(0.5)) {
        const Object& o = s.objects[rng.Uniform(int(s.objects.size()))];
        sh = o.shape;
        c = o.colour;
      } else {
        do {
          sh = rng.Uniform(kNumShapes);
          c = rng.Uniform(kNumColours);
        } while (CountIf(s, sh, c) > 0);
      }
      const std::string colour = kColourNames[c];
      return QA{"exists", "Is there " + Article(colour) + colour + " " + kShapeNames[sh] + "?",
                CountIf(s, sh, c) > 0 ? "yes" : "no"};
    }
    case QuestionKind::kLarger: {  // which is larger
      std::vector<const Object*> named = UniquelyNamed(s);
      std::vector<std::pair<const Object*, const Object*>> pairs;
      for (const Object* a : named) {
        for (const Object* b : named) {
          if (a != b && a->size != b->size) pairs.emplace_back(a, b);
        }
      }
      if (pairs.empty()) return std::nullopt;
      const auto [a, b] = pairs[rng.Uniform(static_cast<int>(pairs.size()))];
      auto name = [](const Object* o) {
        return std::string("the ") + kColourNames[o->colour] + " " + kShapeNames[o->shape];
      };
      return QA{"larger", "Which is larger, " + name(a) + " or " + name(b) + "?",
                name(a->size > b->size ? a : b)};
    }
    case QuestionKind::kWhere: {  // where is an object
      std::vector<const Object*> named = UniquelyNamed(s);
      if (named.empty()) return std::nullopt;
      const Object* o = named[rng.Uniform(static_cast<int>(named.size()))];
      return QA{"where",
                std::string("Where is the ") + kColourNames[o->colour] + " " +
                    kShapeNames[o->shape] + "?",
                kCellNames[o->cell]};
    }
  }
  return std::nullopt;
}

QA AskShortQuestion(const Scene& s, Rng& rng) {
  // Eight equally likely cases, the three count variants sharing two of them. The order of the
  // draws is the held-out split's bytes: keep it.
  static constexpr QuestionKind kCases[8] = {QuestionKind::kColour,   QuestionKind::kShape,
                                             QuestionKind::kCountAll, QuestionKind::kCountAll,
                                             QuestionKind::kPosition, QuestionKind::kExists,
                                             QuestionKind::kLarger,   QuestionKind::kWhere};
  for (;;) {
    QuestionKind kind = kCases[rng.Uniform(8)];
    if (kind == QuestionKind::kCountAll) {
      kind = static_cast<QuestionKind>(static_cast<int>(QuestionKind::kCountAll) + rng.Uniform(3));
    }
    if (std::optional<QA> qa = AskQuestionOfKind(s, rng, kind)) return *std::move(qa);
  }
}

QA AskShortQuestion(const Scene& s, Rng& rng, const QuestionWeights& weights) {
  double total = 0;
  for (double w : weights) total += w;
  for (;;) {
    double r = rng.Real() * total;
    int k = 0;
    while (k + 1 < kNumQuestionKinds && r >= weights[k]) r -= weights[k++];
    if (weights[k] == 0) continue;  // rounding ran past the last weighted kind
    if (std::optional<QA> qa = AskQuestionOfKind(s, rng, static_cast<QuestionKind>(k))) {
      return *std::move(qa);
    }
  }
}

const char* QuestionKindName(QuestionKind kind) {
  static constexpr const char* kNames[kNumQuestionKinds] = {
      "colour",   "shape",  "count_all", "count_shape", "count_colour",
      "position", "exists", "larger",    "where"};
  return kNames[static_cast<int>(kind)];
}

std::optional<QuestionWeights> ParseQuestionWeights(const std::string& text, std::string* error) {
  QuestionWeights weights = UniformQuestionWeights();
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t comma = text.find(',', begin);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(begin, comma - begin);
    begin = comma + 1;
    const size_t eq = item.find('=');
    int kind = 0;
    while (kind < kNumQuestionKinds &&
           item.substr(0, eq) != QuestionKindName(static_cast<QuestionKind>(kind))) {
      ++kind;
    }
    if (eq == std::string::npos || kind == kNumQuestionKinds) {
      *error = "\"" + item + "\" is not TEMPLATE=WEIGHT with TEMPLATE one of";
      for (int k = 0; k < kNumQuestionKinds; ++k) {
        *error += std::string(k ? ", " : " ") + QuestionKindName(static_cast<QuestionKind>(k));
      }
      return std::nullopt;
    }
    const std::string number = item.substr(eq + 1);
    char* end = nullptr;
    const double w = std::strtod(number.c_str(), &end);
    if (number.empty() || *end != '\0' || !(w >= 0) || w > 1e6) {
      *error = "\"" + item + "\": the weight must be a number from 0 to 1e6";
      return std::nullopt;
    }
    weights[kind] = w;
  }
  double total = 0;
  for (double w : weights) total += w;
  if (total <= 0) {
    *error = "every weight is 0";
    return std::nullopt;
  }
  return weights;
}

QuestionWeights UniformQuestionWeights() {
  QuestionWeights w;
  w.fill(1.0);
  for (QuestionKind k :
       {QuestionKind::kCountAll, QuestionKind::kCountShape, QuestionKind::kCountColour}) {
    w[static_cast<int>(k)] = 2.0 / 3.0;
  }
  return w;
}

std::string DescribeText(const Scene& s) {
  const size_t n = s.objects.size();
  std::string text =
      n == 1 ? "There is 1 object on a " : "There are " + std::to_string(n) + " objects on a ";
  text += std::string(s.textured ? "textured " : "plain ") + kBackgroundNames[s.background] +
          " background: ";
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) text += i + 1 == n ? " and " : ", ";
    text += ObjectPhrase(s.objects[i]) + " " + kCellPhrases[s.objects[i].cell];
  }
  return text + ".";
}

QA Describe(const Scene& s) {
  return {"describe", "Describe the image in detail.", DescribeText(s)};
}

QA DescribeSubset(const Scene& s, int shape, int colour) {
  const bool by_colour = colour >= 0;
  std::vector<const Object*> hits;
  for (const Object& o : s.objects) {
    if (by_colour ? o.colour == colour : o.shape == shape) hits.push_back(&o);
  }
  const std::string singular =
      by_colour ? std::string(kColourNames[colour]) + " object" : kShapeNames[shape];
  const std::string plural =
      by_colour ? std::string(kColourNames[colour]) + " objects" : kShapePlurals[shape];
  const size_t n = hits.size();
  std::string text =
      n == 1 ? "There is 1 " + singular : "There are " + std::to_string(n) + " " + plural;
  if (n > 0) text += ": ";
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) text += i + 1 == n ? " and " : ", ";
    text += ObjectPhrase(*hits[i]) + " " + kCellPhrases[hits[i]->cell];
  }
  return {"describe-subset", "Describe the " + plural + ".", text + "."};
}

namespace {

// The (colour or -1, shape or -1) pairs a question names and, when it names none, its cell.
void ParseNames(const std::string& question, std::vector<std::pair<int, int>>* named, int* cell) {
  std::vector<std::string> words(1);
  for (char ch : question) {
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      words.back() += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    } else if (!words.back().empty()) {
      words.emplace_back();
    }
  }
  auto find = [](const char* const* names, int n, const std::string& w) {
    for (int i = 0; i < n; ++i) {
      if (w == names[i]) return i;
    }
    return -1;
  };
  auto shape_of = [&](const std::string& w) {
    const int sh = find(kShapeNames, kNumShapes, w);
    return sh >= 0 ? sh : find(kShapePlurals, kNumShapes, w);
  };
  for (size_t i = 0; i < words.size(); ++i) {
    const int c = find(kColourNames, kNumColours, words[i]);
    const int sh = shape_of(words[i]);
    if (c >= 0) {
      const int next = i + 1 < words.size() ? shape_of(words[i + 1]) : -1;
      named->emplace_back(c, next);
      if (next >= 0) ++i;
    } else if (sh >= 0) {
      named->emplace_back(-1, sh);
    }
  }
  *cell = -1;
  size_t longest = 0;
  for (int k = 0; k < kNumCells && named->empty(); ++k) {
    const std::string phrase = kCellPhrases[k];
    if (phrase.size() > longest && question.find(phrase) != std::string::npos) {
      *cell = k;
      longest = phrase.size();
    }
  }
}

}  // namespace

std::vector<int> NamedObjects(const Scene& s, const std::string& question) {
  std::vector<std::pair<int, int>> named;
  int cell;
  ParseNames(question, &named, &cell);
  std::vector<int> out;
  for (size_t i = 0; i < s.objects.size(); ++i) {
    const Object& o = s.objects[i];
    bool hit = o.cell == cell;
    for (const auto& [c, sh] : named) hit |= (c < 0 || o.colour == c) && (sh < 0 || o.shape == sh);
    if (hit) out.push_back(static_cast<int>(i));
  }
  return out;
}

bool NamesAnything(const std::string& question) {
  std::vector<std::pair<int, int>> named;
  int cell;
  ParseNames(question, &named, &cell);
  return !named.empty() || cell >= 0;
}

std::vector<int> ObjectPatches(const Object& o, int size, int grid) {
  const double step = double(size) / grid;
  const auto [cx, cy, radius] = Placement(o, size / 96.0);
  const double r = 0.8 * radius;
  std::vector<int> out;
  for (int row = 0; row < grid; ++row) {
    for (int col = 0; col < grid; ++col) {
      const double px = (col + 0.5) * step - cx, py = (row + 0.5) * step - cy;
      const bool under_centre = std::floor(cx / step) == col && std::floor(cy / step) == row;
      if (under_centre || px * px + py * py <= r * r) out.push_back(row * grid + col);
    }
  }
  return out;
}

std::vector<int> PatchOwners(const Scene& s, int size, int grid) {
  std::vector<int> owner(static_cast<size_t>(grid) * grid, -1);
  for (size_t o = 0; o < s.objects.size(); ++o) {
    for (int p : ObjectPatches(s.objects[o], size, grid)) owner[p] = static_cast<int>(o);
  }
  return owner;
}

QA DescribeByColour(const Scene& s) {
  std::string text;
  for (int c = 0; c < kNumColours; ++c) {
    std::vector<const Object*> hits;
    for (const Object& o : s.objects) {
      if (o.colour == c) hits.push_back(&o);
    }
    if (hits.empty()) continue;
    text += (text.empty() ? "" : "; ") + std::string(kColourNames[c]) + ": ";
    for (size_t i = 0; i < hits.size(); ++i) {
      if (i > 0) text += i + 1 == hits.size() ? " and " : ", ";
      text += std::string("a ") + kSizeNames[hits[i]->size] + " " + kShapeNames[hits[i]->shape] +
              " " + kCellPhrases[hits[i]->cell];
    }
  }
  return {"describe-by-colour", "List the objects by color.", text + "."};
}

std::string Paraphrase(const std::string& question, Rng& rng) {
  struct Rewording {
    const char* from;
    const char* to;
  };
  static constexpr Rewording kRewordings[] = {
      {"objects are there?", "shapes are there?"},
      {"objects are there?", "objects are in the image?"},
      {" are there?", " can you see?"},
      {"What color is", "What colour is"},
      {"What color is", "Which color is"},
      {"What shape is the ", "Which shape is the "},
      {" object?", " shape?"},
      {"What is ", "What can you see "},
      {"Is there ", "Do you see "},
      {"Which is larger, ", "Which one is bigger, "},
      {"Where is the ", "In which part of the image is the "},
      {"Describe the image in detail.", "Describe this picture in detail."},
      {"Describe the image in detail.", "Give a detailed description of the image."},
  };
  std::vector<const Rewording*> fits;
  for (const Rewording& r : kRewordings) {
    if (question.find(r.from) != std::string::npos) fits.push_back(&r);
  }
  if (fits.empty()) return question;
  const Rewording& r = *fits[rng.Uniform(static_cast<int>(fits.size()))];
  std::string out = question;
  out.replace(out.find(r.from), std::string(r.from).size(), r.to);
  return out;
}

std::vector<QA> SampleConversation(const Scene& scene, Rng& rng, const ConversationMix& mix) {
  const double p_describe = mix.describe, p_subset = mix.subset, p_grouped = mix.grouped;
  const double r = rng.Real();
  if (r < p_describe) return {Describe(scene)};
  if (p_grouped > 0 && r >= p_describe + p_subset && r < p_describe + p_subset + p_grouped) {
    return {DescribeByColour(scene)};
  }
  if (r < p_describe + p_subset) {
    // Two or three subsets of one attribute (by colour, or by shape): disjoint objects, so no
    // answer can be copied from an earlier one. Mostly attributes that are present.
    const bool by_colour = rng.Chance(0.5);
    const int values = by_colour ? kNumColours : kNumShapes;
    const int n = 2 + rng.Uniform(2);
    std::vector<QA> turns;
    std::set<int> used;
    for (int tries = 0; static_cast<int>(turns.size()) < n && tries < 8 * n; ++tries) {
      const Object& o = scene.objects[rng.Uniform(static_cast<int>(scene.objects.size()))];
      const int v = rng.Chance(0.7) ? (by_colour ? o.colour : o.shape) : rng.Uniform(values);
      if (!used.insert(v).second) continue;
      turns.push_back(by_colour ? DescribeSubset(scene, -1, v) : DescribeSubset(scene, v, -1));
    }
    return turns;
  }
  const int n = mix.min_questions + rng.Uniform(mix.max_questions - mix.min_questions + 1);
  std::vector<QA> turns;
  std::set<std::string> asked;
  for (int tries = 0; static_cast<int>(turns.size()) < n && tries < 4 * n; ++tries) {
    QA qa = mix.question_weights ? AskShortQuestion(scene, rng, *mix.question_weights)
                                 : AskShortQuestion(scene, rng);
    if (asked.insert(qa.question).second) turns.push_back(std::move(qa));
  }
  return turns;
}

std::optional<std::vector<QA>> AskAboutOtherObjects(const Scene& scene, Rng& rng) {
  if (scene.objects.size() < 2) return std::nullopt;
  auto disjoint = [](const std::vector<int>& a, const std::vector<int>& b) {
    for (int x : a) {
      if (std::find(b.begin(), b.end(), x) != b.end()) return false;
    }
    return true;
  };
  for (int tries = 0; tries < 64; ++tries) {
    QA first = AskShortQuestion(scene, rng), last = AskShortQuestion(scene, rng);
    const std::vector<int> a = NamedObjects(scene, first.question);
    const std::vector<int> b = NamedObjects(scene, last.question);
    if (a.empty() || b.empty() || !disjoint(a, b)) continue;
    for (int m = 0; m < 16; ++m) {
      QA middle = AskShortQuestion(scene, rng);
      if (middle.question != first.question && middle.question != last.question) {
        return std::vector<QA>{std::move(first), std::move(middle), std::move(last)};
      }
    }
  }
  return std::nullopt;
}

}  // namespace llava::shapes
