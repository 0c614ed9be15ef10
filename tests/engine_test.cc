// The continuous-batching engine on the tiny checkpoint: concurrent requests get the answers
// they get alone, admission follows the KV byte budget, cancellation/deadlines free caches,
// shutdown drains.
#include "engine/serving/engine.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include "engine/kernels/runtime.h"
#include "engine/kv/kv_policy.h"
#include "engine/kv/kv_pool.h"
#include "engine/model/llava_model.h"
#include "engine/serving/generator.h"
#include "engine/serving/warmup.h"
#include "tests/engine_observer.h"
#include "tests/test_util.h"
#include "tests/tiny_model.h"

namespace llava {
namespace {

using Kind = ContentPart::Kind;
using namespace std::chrono_literals;
using ::llava::testing::Collector;

std::string Png() {
  cv::Mat img(40, 40, CV_8UC3, cv::Scalar(250, 250, 250));
  cv::circle(img, cv::Point(15, 15), 9, cv::Scalar(0, 0, 230), -1);
  std::vector<uint8_t> buf;
  cv::imencode(".png", img, buf);
  return std::string(buf.begin(), buf.end());
}

GenerationRequest Request(const std::string& question, int max_tokens, bool image) {
  GenerationRequest r;
  ChatMessage m{"user", {}};
  if (image) {
    r.images = {Png()};
    m.content.push_back({Kind::kImage, "", 0});
  }
  m.content.push_back({Kind::kText, question, 0});
  r.messages = {m};
  r.sampling.max_tokens = max_tokens;
  return r;
}

class EngineTest : public ::llava::testing::TinyModelTest {};

// Submits `reqs` as ids 1..n; stops at the first refusal (fewer collectors than requests).
std::vector<std::shared_ptr<Collector>> SubmitAll(Engine* engine,
                                                  const std::vector<GenerationRequest>& reqs) {
  std::vector<std::shared_ptr<Collector>> out;
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto c = std::make_shared<Collector>();
    const Status s = engine->Submit(i + 1, reqs[i], c);
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (!s.ok()) break;
    out.push_back(std::move(c));
  }
  return out;
}

// Every engine answer equals the same request run alone (Generator: the engine at batch 1,
// nothing else running): tokens, text, kept
// bytes and merges.
void ExpectSameAsAlone(const LoadedModel& model, const std::vector<GenerationRequest>& reqs,
                       const std::vector<std::shared_ptr<Collector>>& out) {
  ASSERT_EQ(out.size(), reqs.size());
  Generator alone(model, EngineLimits{});
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(out[i]->Wait());
    ASSERT_TRUE(out[i]->result_.has_value()) << out[i]->status_.ToString();
    auto ref = alone.Generate(reqs[i], nullptr);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(out[i]->result_->tokens, ref->tokens) << "request " << i;
    EXPECT_EQ(out[i]->text_, ref->text) << "request " << i;
    EXPECT_EQ(out[i]->result_->text, ref->text) << "request " << i;
    EXPECT_EQ(out[i]->result_->kv.bytes_kept, ref->kv.bytes_kept) << "request " << i;
    EXPECT_EQ(out[i]->result_->kv.tokens_merged, ref->kv.tokens_merged) << "request " << i;
  }
}

TEST_F(EngineTest, ConcurrentRequestsMatchRunningAlone) {
  std::vector<GenerationRequest> reqs = {
      Request("What is in the image?", 12, true), Request("describe the picture", 9, false),
      Request("how many objects are there", 14, true), Request("hello", 6, false)};
  reqs[1].kv_cache.policy = CachePolicy::kElastic;
  reqs[1].kv_cache.budget = 0.5;
  reqs[2].kv_cache.policy = CachePolicy::kStreamingLLM;
  reqs[2].kv_cache.budget = 0.5;
  reqs[3].sampling.temperature = 0.8f;
  reqs[3].sampling.seed = 11;
  Engine engine(*loaded_, EngineOptions{});
  const std::vector<std::shared_ptr<Collector>> out = SubmitAll(&engine, reqs);
  ExpectSameAsAlone(*loaded_, reqs, out);
  EXPECT_GE(engine.Snapshot().last_batch_size, 1);
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
}

// Chunked prefill (7 prompt rows a turn, so every prompt is spread over several turns and
// shares them with other prompts and decode steps) changes no answer.
TEST_F(EngineTest, ChunkedPrefillMatchesRunningAlone) {
  std::vector<GenerationRequest> reqs = {
      Request("What is in the image?", 10, true), Request("describe the picture", 8, true),
      Request("how many objects are there", 12, true), Request("hello", 6, false)};
  reqs[0].kv_cache.policy = CachePolicy::kElastic;
  reqs[0].kv_cache.budget = 0.4;
  reqs[1].kv_cache.policy = CachePolicy::kH2O;
  reqs[1].kv_cache.budget = 0.5;
  reqs[2].kv_cache.policy = CachePolicy::kStreamingLLM;
  reqs[2].kv_cache.budget = 0.5;
  reqs[3].kv_cache.policy = CachePolicy::kSnapKV;  // its window (4 rows) within one chunk or two
  reqs[3].kv_cache.budget = 0.5;
  reqs[3].kv_cache.snapkv = SnapKvParams{4, 3};
  EngineOptions options;
  options.prefill_chunk = 7;
  Engine engine(*loaded_, options);
  const std::vector<std::shared_ptr<Collector>> out = SubmitAll(&engine, reqs);
  ExpectSameAsAlone(*loaded_, reqs, out);
  for (const auto& c : out) {
    ASSERT_TRUE(c->result_.has_value());
    EXPECT_GT(c->result_->prompt_tokens, 7) << "the prompt must span several turns";
  }
  const EngineSnapshot snap = engine.Snapshot();
  EXPECT_EQ(snap.kv_bytes_used, 0);
  EXPECT_EQ(snap.kv_bytes_reserved, 0) << "every prompt transient and reservation returned";
}

TEST_F(EngineTest, CancelFreesTheCache) {
  Engine engine(*loaded_, EngineOptions{});
  auto c = std::make_shared<Collector>();
  GenerationRequest r = Request("describe", 400, true);
  ASSERT_TRUE(engine.Submit(1, r, c).ok());
  // Wait until the request is running and its cache shows in the snapshot.
  while (engine.Snapshot().kv_bytes_used == 0 && c->finished() == 0)
    std::this_thread::sleep_for(1ms);
  ASSERT_EQ(c->finished(), 0) << "400 tokens take longer than this";
  engine.Cancel(1);
  ASSERT_TRUE(c->Wait());
  ASSERT_TRUE(c->result_.has_value());
  EXPECT_EQ(c->result_->finish, FinishReason::kCancelled);
  EXPECT_LT(c->result_->completion_tokens, 400);
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
  EXPECT_EQ(engine.Snapshot().kv_bytes_reserved, 0);
}

TEST_F(EngineTest, QueueBoundAndBudgetRefusals) {
  EngineOptions o;
  o.max_batch = 1;
  o.max_queue = 1;
  Engine engine(*loaded_, o);
  auto a = std::make_shared<Collector>(), b = std::make_shared<Collector>();
  ASSERT_TRUE(engine.Submit(1, Request("long", 300, false), a).ok());
  while (engine.Snapshot().running == 0 && a->finished() == 0) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(engine.Submit(2, Request("next", 4, false), b).ok());  // waits
  Status full = engine.Submit(3, Request("third", 4, false), std::make_shared<Collector>());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full.ToString();
  Status dup = engine.Submit(2, Request("again", 4, false), std::make_shared<Collector>());
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  Status bad = engine.Submit(9, Request("x", 0, false), std::make_shared<Collector>());
  EXPECT_NE(bad.message().find("sampling.max_tokens"), std::string::npos);
  engine.Cancel(1);
  ASSERT_TRUE(b->Wait());
  EXPECT_TRUE(b->result_.has_value());

  EngineOptions tiny;
  tiny.kv_cache_bytes = 1000;  // not even one prompt
  Engine small(*loaded_, tiny);
  Status never = small.Submit(1, Request("hi", 4, false), std::make_shared<Collector>());
  EXPECT_EQ(never.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(never.message().find("KV cache"), std::string::npos);
}

TEST_F(EngineTest, BudgetLimitsConcurrency) {
  // Room for one Full request of this size at a time: the rest wait, all complete.
  const KvLayout layout = loaded_->model().kv_layout();
  EngineOptions o;
  o.kv_cache_bytes = 80 * layout.num_layers * layout.bytes_per_entry();
  Engine engine(*loaded_, o);
  std::vector<std::shared_ptr<Collector>> out;
  for (uint64_t i = 0; i < 3; ++i) {
    out.push_back(std::make_shared<Collector>());
    ASSERT_TRUE(engine.Submit(i, Request("what is in the image", 20, true), out.back()).ok());
  }
  int max_running = 0;
  for (auto& c : out) {
    while (c->finished() == 0) {
      max_running = std::max(max_running, engine.Snapshot().running);
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_TRUE(c->result_.has_value());
  }
  EXPECT_LE(max_running, 1);
}

// A pool too small for two requests' whole answers: both prompts are admitted (admission
// counts the pages they hold, not what they may need), the pool runs short while they grow, and
// the later one gives its pages back and is recomputed from its prompt and answer so far once
// the first is done. Full then resumes with exactly the answer it gets alone; a compressing
// policy compresses the prompt and answer so far as one prompt and carries on from there, so
// its answer may differ after that point, but it keeps its budget and its length.
TEST_F(EngineTest, PreemptedRequestsAreRecomputed) {
  const KvLayout layout = loaded_->model().kv_layout();
  std::vector<GenerationRequest> reqs = {Request("What is in the image?", 48, true),
                                         Request("describe the picture", 48, true)};
  for (auto& r : reqs) r.sampling.ignore_eos = true;
  Generator alone(*loaded_, EngineLimits{});
  auto first = alone.Generate(reqs[0], nullptr);
  ASSERT_TRUE(first.ok());
  const int64_t t = first->prompt_tokens, pages_prompt = (t + kKvPageRows - 1) / kKvPageRows;
  const int64_t pages_peak = (t + 48 + kKvPageRows - 1) / kKvPageRows;
  ASSERT_GT(pages_peak, pages_prompt + 1) << "the answers must outgrow the prompts";
  const int64_t pages = std::max(pages_peak + pages_prompt, 2 * pages_prompt + 1);
  ASSERT_LT(pages, 2 * pages_peak) << "both answers whole would fit: nothing to preempt";
  EngineOptions o;
  o.kv_cache_bytes = pages * kKvPageRows * layout.num_layers * layout.bytes_per_entry();
  o.initial_growth_ratio = o.min_growth_ratio = 0;  // admit by the prompts' pages alone
  {
    Engine engine(*loaded_, o);
    const auto out = SubmitAll(&engine, reqs);
    ExpectSameAsAlone(*loaded_, reqs, out);
    EXPECT_GE(engine.Snapshot().preemptions, 1);
    EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
  }
  for (auto& r : reqs) {
    r.kv_cache.policy = CachePolicy::kStreamingLLM;
    r.kv_cache.budget = 0.9;  // still more than a prompt's pages once the answer has grown
  }
  Engine engine(*loaded_, o);
  const auto out = SubmitAll(&engine, reqs);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(out[i]->Wait());
    ASSERT_TRUE(out[i]->result_.has_value()) << out[i]->status_.ToString();
    const GenerationResult& r = *out[i]->result_;
    EXPECT_EQ(r.completion_tokens, 48);
    EXPECT_EQ(r.kv.tokens_seen, r.prompt_tokens + 47);
    for (int64_t e : r.kv.entries_per_layer) {
      EXPECT_EQ(e, ProjectedEntries(reqs[i].kv_cache, {}, r.kv.tokens_seen)) << "request " << i;
    }
  }
  EXPECT_GE(engine.Snapshot().preemptions, 1);
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
}

TEST_F(EngineTest, DeadlineEndsTheRequest) {
  Engine engine(*loaded_, EngineOptions{});
  auto c = std::make_shared<Collector>();
  ASSERT_TRUE(
      engine.Submit(1, Request("describe", 400, true), c, std::chrono::steady_clock::now() + 30ms)
          .ok());
  ASSERT_TRUE(c->Wait());
  EXPECT_EQ(c->status_.code(), StatusCode::kDeadlineExceeded) << c->status_.ToString();
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(engine.Snapshot().kv_bytes_used, 0);
}

TEST_F(EngineTest, ShutdownDrainsThenRefuses) {
  Engine engine(*loaded_, EngineOptions{});
  auto a = std::make_shared<Collector>(), b = std::make_shared<Collector>();
  ASSERT_TRUE(engine.Submit(1, Request("one", 10, false), a).ok());
  ASSERT_TRUE(engine.Submit(2, Request("two", 10, true), b).ok());
  engine.Shutdown(30s);
  ASSERT_EQ(a->finished_, 1);
  ASSERT_EQ(b->finished_, 1);
  EXPECT_NE(a->result_->finish, FinishReason::kCancelled);
  EXPECT_NE(b->result_->finish, FinishReason::kCancelled);
  EXPECT_EQ(engine.Submit(3, Request("late", 4, false), std::make_shared<Collector>()).code(),
            StatusCode::kUnavailable);
}

// The server's warm-up: one image request (a BMP it writes itself) through the engine with a
// compressing policy, nothing left behind, and the next request answered as if it had not run.
TEST_F(EngineTest, WarmUpRunsOneRequestAndLeavesNothing) {
  Engine engine(*loaded_, EngineOptions{});
  CacheParams kv;
  kv.budget = 0.5;
  double ttft = -1;
  const Status s = WarmUp(&engine, loaded_->config(), kv, 99, 60s, &ttft);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GT(ttft, 0);
  const EngineSnapshot snap = engine.Snapshot();
  EXPECT_EQ(snap.running, 0);
  EXPECT_EQ(snap.waiting, 0);
  EXPECT_EQ(snap.kv_bytes_used, 0);
  EXPECT_EQ(snap.kv_bytes_reserved, 0);
  const std::vector<GenerationRequest> reqs = {Request("What is in the image?", 12, true)};
  ExpectSameAsAlone(*loaded_, reqs, SubmitAll(&engine, reqs));
}

TEST_F(EngineTest, WarmUpReportsARefusal) {
  Engine engine(*loaded_, EngineOptions{});
  engine.Shutdown(0ms);
  EXPECT_EQ(WarmUp(&engine, loaded_->config(), CacheParams{}, 1, 60s, nullptr).code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace llava
