// The tiny checkpoint of the ctest fixture `tiny` (tiny-new, fp32), loaded once per test suite
// that derives from TinyModelTest, with two intra-op threads.
#pragma once

#include <gtest/gtest.h>

#include "engine/kernels/runtime.h"
#include "engine/serving/generator.h"
#include "tests/test_util.h"

namespace llava {
namespace testing {

class TinyModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    InitTorchThreads(2);
    ModelOptions o;
    o.dtype = DType::kF32;
    auto m = LoadModel(TestData() + "/tiny-new", o);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    loaded_ = std::move(m).value().release();
  }
  static void TearDownTestSuite() {
    delete loaded_;
    loaded_ = nullptr;
  }
  inline static LoadedModel* loaded_ = nullptr;
};

}  // namespace testing
}  // namespace llava
