// DecodeAttention (one query row per sequence, all sequences in one call) against the ATen
// attention path (CachedAttention, itself checked against a naive loop in model_test.cc).
#include "engine/kernels/decode_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "engine/model/llava_model.h"

namespace llava {
namespace {

struct Case {
  at::ScalarType dtype;
  double tol;
  int64_t heads, kv_heads, hd;
};

class DecodeAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttentionTest, MatchesPerSequenceAttention) {
  const auto [dtype, tol, heads, kv_heads, hd] = GetParam();
  const std::vector<int64_t> lengths = {1, 7, 300, 33};  // 300 > one query block of the ATen path
  at::manual_seed(7);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  at::Tensor q = at::randn({batch, heads, hd}).to(dtype);
  std::vector<at::Tensor> keys, values;
  for (int64_t len : lengths) {
    // Views into a larger buffer, as the caches hand them out: strided in dims 0 and 1.
    at::Tensor kbuf = at::randn({kv_heads, len + 5, hd}).to(dtype);
    at::Tensor vbuf = at::randn({kv_heads, len + 5, hd}).to(dtype);
    keys.push_back(kbuf.narrow(1, 0, len));
    values.push_back(vbuf.narrow(1, 0, len));
  }
  const std::vector<bool> want = {true, false, true, true};
  std::vector<at::Tensor> probs;
  at::Tensor got = DecodeAttention(q, keys, values, want, &probs);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{batch, heads * hd}));
  EXPECT_EQ(got.scalar_type(), dtype);
  for (int64_t b = 0; b < batch; ++b) {
    // The reference in fp32 on the same (rounded) inputs.
    at::Tensor ref_probs;
    const ProbsObserver keep = [&](int64_t, const at::Tensor& p) { ref_probs = p.clone(); };
    at::Tensor ref = CachedAttention(q[b].unsqueeze(0).to(at::kFloat), keys[b].to(at::kFloat),
                                     values[b].to(at::kFloat), &keep);
    EXPECT_LT((got[b].to(at::kFloat) - ref[0]).abs().max().item<double>(), tol) << "sequence " << b;
    if (want[b]) {
      ASSERT_TRUE(probs[b].defined());
      ASSERT_EQ(probs[b].sizes(), ref_probs.sizes());
      EXPECT_LT((probs[b] - ref_probs).abs().max().item<double>(), 1e-5) << "sequence " << b;
      EXPECT_NEAR(probs[b].sum().item<double>(), heads, 1e-4);
    } else {
      EXPECT_FALSE(probs[b].defined());
    }
  }
}

// fp32: same arithmetic up to summation order; bf16: the output's own rounding (values ~ 1).
// Grouped KV heads (4 query heads on 2), one KV head per query head, LLaVA-7B's head size;
// multiples of 16 take the blocked AVX-512 or AVX2 kernel of the CPU path (tests/CMakeLists.txt
// runs this on each path).
INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionTest,
    ::testing::Values(Case{at::kFloat, 1e-5, 4, 2, 64}, Case{at::kBFloat16, 2e-2, 4, 2, 64},
                      Case{at::kFloat, 1e-5, 3, 3, 128}, Case{at::kBFloat16, 2e-2, 8, 1, 32},
                      // not a multiple of 16: the portable loops
                      Case{at::kBFloat16, 2e-2, 4, 2, 24}, Case{at::kFloat, 1e-5, 2, 1, 40}));

// Caches read through page tables (pages of 16 rows, in scrambled order inside one pool, as the
// KV pool hands them out) give exactly what the same rows give as contiguous tensors: the
// kernels' 16- and 8-row blocks fall on page boundaries, so not even the summation order moves.
class PagedDecodeAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedDecodeAttentionTest, EqualsTheContiguousCache) {
  const auto [dtype, tol, heads, kv_heads, hd] = GetParam();
  constexpr int64_t kPage = 16, kPages = 40;
  const std::vector<int64_t> lengths = {1, 16, 17, 150, 33};
  at::manual_seed(9);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  // The pool of one layer: [pages, Hkv, P, hd] for keys and for values.
  const at::Tensor pool_k = at::randn({kPages, kv_heads, kPage, hd}).to(dtype);
  const at::Tensor pool_v = at::randn({kPages, kv_heads, kPage, hd}).to(dtype);
  std::vector<int32_t> order(kPages);
  for (int32_t i = 0; i < kPages; ++i) order[i] = (i * 17 + 5) % kPages;  // a permutation
  std::vector<std::vector<int32_t>> tables;
  std::vector<at::Tensor> keys, values;
  size_t next = 0;
  for (int64_t len : lengths) {
    std::vector<int32_t> table;
    for (int64_t s = 0; s < len; s += kPage) table.push_back(order[next++]);
    const at::Tensor ids = at::tensor(std::vector<int64_t>(table.begin(), table.end()), at::kLong);
    // (The shape comes from the pool, not the structured binding: lambdas may not capture one.)
    auto gather = [&](const at::Tensor& pool) {
      return pool.index_select(0, ids)
          .permute({1, 0, 2, 3})
          .reshape({pool.size(1), -1, pool.size(3)})
          .narrow(1, 0, len)
          .contiguous();
    };
    keys.push_back(gather(pool_k));
    values.push_back(gather(pool_v));
    tables.push_back(std::move(table));
  }
  std::vector<DecodeKv> paged(batch);
  for (int64_t b = 0; b < batch; ++b) {
    DecodeKv& c = paged[b];
    c.keys = pool_k.data_ptr();
    c.values = pool_v.data_ptr();
    c.pages = tables[b].data();
    c.page_rows = kPage;
    c.page_stride = kv_heads * kPage * hd;
    c.key_head_stride = c.value_head_stride = kPage * hd;
    c.key_row_stride = c.value_row_stride = hd;
    c.len = lengths[b];
  }
  const at::Tensor q = at::randn({batch, heads, hd}).to(dtype);
  const std::vector<bool> want = {true, true, false, true, true};
  std::vector<at::Tensor> want_probs, got_probs;
  const at::Tensor ref = DecodeAttention(q, keys, values, want, &want_probs);
  const at::Tensor got = DecodeAttention(q, paged, dtype, kv_heads, want, &got_probs);
  EXPECT_TRUE(at::equal(got, ref));
  for (int64_t b = 0; b < batch; ++b) {
    ASSERT_EQ(got_probs[b].defined(), static_cast<bool>(want[b]));
    if (want[b]) {
      EXPECT_TRUE(at::equal(got_probs[b], want_probs[b])) << "sequence " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PagedDecodeAttentionTest,
                         ::testing::Values(Case{at::kFloat, 0, 4, 2, 64},
                                           Case{at::kBFloat16, 0, 4, 2, 128},
                                           Case{at::kBFloat16, 0, 8, 1, 32},
                                           Case{at::kFloat, 0, 2, 1, 40}));

TEST(DecodeAttention, SequencesDoNotSeeEachOther) {
  // Changing one sequence's cache changes only that sequence's output.
  at::manual_seed(3);
  at::Tensor q = at::randn({3, 2, 16});
  std::vector<at::Tensor> k = {at::randn({1, 5, 16}), at::randn({1, 9, 16}), at::randn({1, 2, 16})};
  std::vector<at::Tensor> v = {at::randn({1, 5, 16}), at::randn({1, 9, 16}), at::randn({1, 2, 16})};
  at::Tensor before = DecodeAttention(q, k, v, {false, false, false}, nullptr);
  v[1] = v[1] + 1.0;
  at::Tensor after = DecodeAttention(q, k, v, {false, false, false}, nullptr);
  EXPECT_TRUE(at::equal(before[0], after[0]));
  EXPECT_TRUE(at::equal(before[2], after[2]));
  EXPECT_FALSE(at::allclose(before[1], after[1]));
}

}  // namespace
}  // namespace llava
