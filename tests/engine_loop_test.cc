// The serving loop (engine.h) driven by a scripted model runner, without weights: what each
// forward pass receives (chunked prefill, batching across requests, positions, the sampled
// token fed back), which answer reaches which observer, and that a failing pass ends only its
// own requests while the engine keeps serving.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "engine/model/llava_model.h"
#include "engine/serving/engine.h"
#include "tests/engine_observer.h"
#include "tests/test_util.h"

namespace llava {
namespace {

using Kind = ContentPart::Kind;
using ::llava::testing::Collector;

// Every request answers with its own prompt's text ids (BOS left out) in order, then EOS. K/V
// rows of zeros go to the caches as a real pass would append them; every pass is recorded.
class EchoRunner final : public ModelRunner {
 public:
  struct ChunkSeen {
    const SequenceKv* cache;
    int64_t start, rows;
    bool prompt;  // rows of the prompt (else a decode row)
    bool prompt_continues;
  };

  explicit EchoRunner(const Tokenizer& tok)
      : tok_(tok),
        config_(PresetConfig(ModelPreset::kTiny, tok.vocab_size(), tok.PieceToId("<image>"))) {}

  const LlavaConfig& config() const override { return config_; }
  const Tokenizer& tokenizer() const override { return tok_; }
  KvLayout kv_layout() const override { return {kLayers, 1, kHeadDim, DType::kF32}; }
  // Input rows carry their token id in column 0.
  at::Tensor EmbedPrompt(const PreparedRequest& p, double*) const override {
    std::vector<float> ids(p.prompt.ids.begin(), p.prompt.ids.end());
    return at::tensor(ids).view({-1, 1});
  }
  at::Tensor EmbedTokens(const std::vector<int64_t>& ids) const override {
    return at::tensor(ids, at::kLong).to(at::kFloat).view({-1, 1});
  }

  at::Tensor Forward(const std::vector<SequenceChunk>& chunks) const override {
    std::unique_lock<std::mutex> lock(mu_);
    ++entered_;
    gate_.notify_all();
    gate_.wait(lock, [&] { return open_; });
    passes_.emplace_back();
    TORCH_CHECK(static_cast<int>(passes_.size()) != fail_pass_, "scripted failure");
    at::Tensor logits = at::zeros({static_cast<int64_t>(chunks.size()), config_.text.vocab_size});
    for (size_t i = 0; i < chunks.size(); ++i) {
      const SequenceChunk& c = chunks[i];
      const int64_t n = c.embeds.size(0);
      if (c.start_position == 0) seqs_[c.kv] = Echo();  // a new request (caches are reused)
      Echo& e = seqs_[c.kv];
      EXPECT_EQ(c.start_position, e.fed);  // the position after the rows committed so far
      e.fed += n;
      passes_.back().push_back({c.kv, c.start_position, n, !e.answering, c.prompt_continues});
      at::Tensor ids = c.embeds.select(1, 0).to(at::kLong);
      if (e.answering) {  // a decode row: the token sampled from this runner's last logits
        EXPECT_EQ(n, 1);
        EXPECT_EQ(ids[0].item<int64_t>(), e.prompt[e.emitted - 1]);
      } else {
        for (int64_t r = 0; r < n; ++r) {
          const int id = static_cast<int>(ids[r].item<int64_t>());
          if (id != tok_.bos_id()) e.prompt.push_back(id);
        }
      }
      const at::Tensor kv = at::zeros({1, n, kHeadDim});
      for (int l = 0; l < kLayers; ++l) c.kv->Append(l, kv, kv);
      if (c.prompt_continues) continue;  // (the engine commits the pass)
      e.answering = true;
      const size_t k = e.emitted++;
      logits[static_cast<int64_t>(i)][k < e.prompt.size() ? e.prompt[k] : tok_.eos_id()] = 100.f;
    }
    return logits;
  }

  void Close() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = false;
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    gate_.notify_all();
  }
  // Waits until a pass has reached the model (and, if closed, is held there).
  void WaitForPass() {
    std::unique_lock<std::mutex> l(mu_);
    gate_.wait(l, [&] { return entered_ > 0; });
  }
  void FailPass(int pass) {  // 1-based
    std::lock_guard<std::mutex> l(mu_);
    fail_pass_ = pass;
  }
  std::vector<std::vector<ChunkSeen>> passes() const {
    std::lock_guard<std::mutex> l(mu_);
    return passes_;
  }

 private:
  static constexpr int kLayers = 2, kHeadDim = 4;
  struct Echo {
    std::vector<int> prompt;  // text ids, BOS left out
    size_t emitted = 0;
    bool answering = false;
    int64_t fed = 0;  // rows fed in earlier passes
  };
  const Tokenizer& tok_;
  const LlavaConfig config_;
  mutable std::mutex mu_;
  mutable std::condition_variable gate_;
  bool open_ = true;
  int fail_pass_ = 0;
  mutable int entered_ = 0;  // passes that reached Forward
  mutable std::vector<std::vector<ChunkSeen>> passes_;
  mutable std::map<const SequenceKv*, Echo> seqs_;
};

class EngineLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::Load(::llava::testing::TestData() + "/tiny-new/tokenizer.model");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(t).value();
    runner_ = std::make_unique<EchoRunner>(*tok_);
  }
  static GenerationRequest Text(const std::string& question, int max_tokens = 200) {
    GenerationRequest r;
    r.messages = {{"user", {{Kind::kText, question, 0}}}};
    r.sampling.max_tokens = max_tokens;
    return r;
  }
  // What the echo answers: the prompt's text ids without BOS, the first `max_tokens` of them.
  std::string Expected(const GenerationRequest& r) const {
    auto p = PrepareRequest(r, runner_->config(), *tok_, EngineLimits(), r.sampling.max_tokens);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    std::vector<int> ids;
    for (int id : p->prompt.ids) {
      if (id != tok_->bos_id() && static_cast<int>(ids.size()) < r.sampling.max_tokens) {
        ids.push_back(id);
      }
    }
    return tok_->Decode(ids);
  }
  std::unique_ptr<Tokenizer> tok_;
  std::unique_ptr<EchoRunner> runner_;
};

// Submits `reqs` as ids 1..n while the runner's first pass is held, so that they run side by
// side, then lets the passes go.
std::vector<std::shared_ptr<Collector>> SubmitHeld(Engine* engine, EchoRunner* runner,
                                                   const std::vector<GenerationRequest>& reqs) {
  std::vector<std::shared_ptr<Collector>> out;
  for (size_t i = 0; i < reqs.size(); ++i) {
    out.push_back(std::make_shared<Collector>());
    const Status s = engine->Submit(i + 1, reqs[i], out.back());
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  runner->Open();
  return out;
}

TEST_F(EngineLoopTest, EachRequestGetsItsOwnAnswerInSharedPasses) {
  const std::vector<GenerationRequest> reqs = {Text("How many red circles are there?"),
                                               Text("What color is the star?"),
                                               Text("Describe the image.", 5)};
  runner_->Close();
  Engine engine(*runner_, EngineOptions{});
  const auto out = SubmitHeld(&engine, runner_.get(), reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(out[i]->Wait());
    ASSERT_TRUE(out[i]->result_.has_value()) << out[i]->status_.ToString();
    const GenerationResult& r = *out[i]->result_;
    EXPECT_EQ(out[i]->text_, Expected(reqs[i])) << "request " << i;
    EXPECT_EQ(r.text, out[i]->text_);
    const bool cut = i == 2;  // max_tokens 5: the fifth token is not fed back
    EXPECT_EQ(r.finish, cut ? FinishReason::kLength : FinishReason::kStop);
    EXPECT_EQ(r.completion_tokens, cut ? 5 : r.prompt_tokens - 1);
    EXPECT_EQ(r.kv.tokens_seen, r.prompt_tokens + r.completion_tokens - (cut ? 1 : 0));
  }
  // The requests shared passes: some pass held rows of all three.
  size_t widest = 0;
  for (const auto& pass : runner_->passes()) {
    std::set<const SequenceKv*> caches;
    for (const auto& c : pass) caches.insert(c.cache);
    widest = std::max(widest, caches.size());
  }
  EXPECT_EQ(widest, 3u);
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
}

// Without a loop thread the caller's RunUntilIdle runs the turns: observers are called on the
// caller's thread, shared passes and answers are as with the thread, and it returns only when
// every request has ended.
TEST_F(EngineLoopTest, WithoutItsOwnThreadTheCallerRunsTheLoop) {
  const std::vector<GenerationRequest> reqs = {Text("How many red circles are there?"),
                                               Text("Describe the image.", 5)};
  EngineOptions options;
  options.own_thread = false;
  Engine engine(*runner_, options);
  struct OnThread : Collector {
    std::thread::id seen;
    void OnText(const std::string& delta) override {
      seen = std::this_thread::get_id();
      Collector::OnText(delta);
    }
  };
  std::vector<std::shared_ptr<OnThread>> out;
  for (size_t i = 0; i < reqs.size(); ++i) {
    out.push_back(std::make_shared<OnThread>());
    ASSERT_TRUE(engine.Submit(i + 1, reqs[i], out.back()).ok());
  }
  EXPECT_EQ(out[0]->finished(), 0);  // nothing runs until the caller drives the loop
  engine.RunUntilIdle();
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_EQ(out[i]->finished(), 1) << "request " << i;
    ASSERT_TRUE(out[i]->result_.has_value()) << out[i]->status_.ToString();
    EXPECT_EQ(out[i]->text_, Expected(reqs[i])) << "request " << i;
    EXPECT_EQ(out[i]->seen, std::this_thread::get_id());
  }
  size_t widest = 0;
  for (const auto& pass : runner_->passes()) {
    std::set<const SequenceKv*> caches;
    for (const auto& c : pass) caches.insert(c.cache);
    widest = std::max(widest, caches.size());
  }
  EXPECT_EQ(widest, 2u);
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
  // A request submitted and never driven is cancelled by the shutdown, on this thread too.
  auto late = std::make_shared<Collector>();
  ASSERT_TRUE(engine.Submit(9, Text("What color is the star?"), late).ok());
  engine.Shutdown(std::chrono::milliseconds(0));
  ASSERT_EQ(late->finished(), 1);
  ASSERT_TRUE(late->result_.has_value()) << late->status_.ToString();
  EXPECT_EQ(late->result_->finish, FinishReason::kCancelled);
}

TEST_F(EngineLoopTest, ChunkedPrefillFeedsEachPromptInOrderWithinTheRowBudget) {
  const std::vector<GenerationRequest> reqs = {Text("Is there a blue square in the picture?"),
                                               Text("Which is larger, the circle or the star?")};
  EngineOptions options;
  options.prefill_chunk = 4;
  runner_->Close();
  Engine engine(*runner_, options);
  const auto out = SubmitHeld(&engine, runner_.get(), reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(out[i]->Wait());
    ASSERT_TRUE(out[i]->result_.has_value()) << out[i]->status_.ToString();
    EXPECT_EQ(out[i]->text_, Expected(reqs[i])) << "request " << i;
  }
  std::map<const SequenceKv*, std::vector<EchoRunner::ChunkSeen>> prompt_chunks;
  std::map<const SequenceKv*, bool> answering;
  for (const auto& pass : runner_->passes()) {
    int64_t prompt_rows = 0;
    for (const auto& c : pass) {
      if (!c.prompt) {
        EXPECT_EQ(c.rows, 1);
        answering[c.cache] = true;
        continue;
      }
      EXPECT_FALSE(answering[c.cache]) << "a prompt row after the answer began";
      prompt_rows += c.rows;
      prompt_chunks[c.cache].push_back(c);
    }
    EXPECT_LE(prompt_rows, 4);
  }
  ASSERT_EQ(prompt_chunks.size(), 2u);
  for (const auto& [cache, chunks] : prompt_chunks) {
    int64_t next = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      EXPECT_EQ(chunks[k].start, next);
      EXPECT_EQ(chunks[k].prompt_continues, k + 1 < chunks.size());
      next += chunks[k].rows;
    }
    EXPECT_GT(chunks.size(), 2u);  // prompts of > 8 rows
  }
}

TEST_F(EngineLoopTest, AFullQueueRefusesBeforeThePreparationWork) {
  runner_->Close();
  EngineOptions options;
  options.max_batch = 1;
  options.max_queue = 1;
  Engine engine(*runner_, options);
  struct OpenAtExit {  // a failed assertion must not leave the engine's pass held
    EchoRunner* runner;
    ~OpenAtExit() { runner->Open(); }
  } open_at_exit{runner_.get()};
  auto first = std::make_shared<Collector>(), second = std::make_shared<Collector>();
  ASSERT_TRUE(engine.Submit(1, Text("What shape is it?"), first).ok());
  runner_->WaitForPass();  // request 1 is running, held in its first pass
  ASSERT_TRUE(engine.Submit(2, Text("How many?"), second).ok());  // the one waiting place
  // A request whose preparation would fail: the full queue answers first, so no image is
  // decoded and no text tokenized for a request that is refused anyway.
  GenerationRequest bad = Text("What is it?");
  bad.messages[0].content.insert(bad.messages[0].content.begin(), {Kind::kImage, "", 0});
  bad.images = {"not an image"};
  const Status s = engine.Submit(3, bad, std::make_shared<Collector>());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  runner_->Open();
  ASSERT_TRUE(first->Wait());
  ASSERT_TRUE(second->Wait());
  // With room in the queue, the same request is refused for what it is.
  EXPECT_EQ(engine.Submit(4, bad, std::make_shared<Collector>()).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(EngineLoopTest, AFailedPassEndsItsRequestsAndTheEngineServesOn) {
  runner_->Close();
  runner_->FailPass(2);
  Engine engine(*runner_, EngineOptions{});
  const auto out =
      SubmitHeld(&engine, runner_.get(), {Text("What shape is it?"), Text("How many?")});
  for (const auto& c : out) {
    ASSERT_TRUE(c->Wait());
    EXPECT_EQ(c->status_.code(), StatusCode::kInternal);
    EXPECT_NE(c->status_.message().find("model failure"), std::string::npos);
    EXPECT_NE(c->status_.message().find("scripted failure"), std::string::npos);
  }
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
  EXPECT_EQ(engine.Snapshot().running, 0);
  const GenerationRequest again = Text("Where is the star?");
  auto c = std::make_shared<Collector>();
  ASSERT_TRUE(engine.Submit(3, again, c).ok());
  ASSERT_TRUE(c->Wait());
  ASSERT_TRUE(c->result_.has_value()) << c->status_.ToString();
  EXPECT_EQ(c->text_, Expected(again));
}

}  // namespace
}  // namespace llava
