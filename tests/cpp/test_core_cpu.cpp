// The CPU ops of the core against dense float64 references, on odd sizes and both index widths.
#include <cmath>

#include "test_util.h"

namespace snack::test {
namespace {

template <typename Pair>
class CpuOps : public ::testing::Test {};
using Configs = ::testing::Types<std::pair<float, uint16_t>, std::pair<float, int32_t>, std::pair<double, uint16_t>,
                                 std::pair<double, int32_t>>;
TYPED_TEST_SUITE(CpuOps, Configs);

TYPED_TEST(CpuOps, AllOpsMatchDenseReference) {
  using T = typename TypeParam::first_type;
  using Index = typename TypeParam::second_type;
  uint32_t seed = 1;
  for (const Shape& sh : odd_shapes()) {
    SCOPED_TRACE(::testing::Message() << sh.m << "x" << sh.k << " n=" << sh.n << " nnz=" << sh.nnz);
    auto p = random_pattern<Index>(sh.m, sh.k, sh.nnz, seed++, sh.empty_rows);
    const auto w = p.view();
    const auto values = cast<T>(p.values);
    const auto x64 = random_dense(sh.n * sh.k, seed++), dy64 = random_dense(sh.n * sh.m, seed++);
    const auto bias64 = random_dense(sh.m, seed++);
    const auto x = cast<T>(x64), dy = cast<T>(dy64), bias = cast<T>(bias64);

    std::vector<T> y(sh.n * sh.m, T(NAN));
    ASSERT_TRUE((cpu::spmm_forward<T, Index>(w, values.data(), x.data(), sh.n, bias.data(), y.data()).ok()));
    expect_elementwise(y, ref_forward(p.dense, sh.m, sh.k, x64, sh.n, &bias64), tol<T>());
    std::fill(y.begin(), y.end(), T(NAN));
    ASSERT_TRUE((cpu::spmm_forward<T, Index>(w, values.data(), x.data(), sh.n, nullptr, y.data()).ok()));
    expect_elementwise(y, ref_forward(p.dense, sh.m, sh.k, x64, sh.n, nullptr), tol<T>());

    // Channels first: two images of sh.n pixels each.
    const auto images64 = random_dense(2 * sh.k * sh.n, seed++);
    const auto images = cast<T>(images64);
    std::vector<T> y_cf(2 * sh.m * sh.n, T(NAN));
    ASSERT_TRUE((cpu::spmm_channels_first<T, Index>(w, values.data(), images.data(), 2, sh.n, bias.data(),
                                                     y_cf.data()).ok()));
    expect_elementwise(y_cf, ref_channels_first(p.dense, sh.m, sh.k, images64, 2, sh.n, bias64), tol<T>());

    std::vector<T> dx(sh.n * sh.k, T(NAN));
    ASSERT_TRUE((cpu::spmm_transposed<T, Index>(w, values.data(), dy.data(), sh.n, dx.data()).ok()));
    expect_elementwise(dx, ref_transposed(p.dense, sh.m, sh.k, dy64, sh.n), tol<T>());

    std::vector<T> dv(w.nnz, T(NAN));
    ASSERT_TRUE((cpu::sddmm<T, Index>(w, dy.data(), x.data(), sh.n, dv.data()).ok()));
    expect_elementwise(dv, ref_sddmm(p, dy64, x64, sh.n), tol<T>());

    std::vector<T> db(sh.m, T(NAN));
    ASSERT_TRUE((cpu::bias_grad<T>(dy.data(), sh.n, sh.m, db.data()).ok()));
    expect_elementwise(db, ref_bias_grad(dy64, sh.n, sh.m), tol<T>());
  }
}

// Every bit pattern of the 16-bit types survives the trip through float (NaNs stay NaN), and the
// rounding from float is to nearest with ties to even, with overflow to infinity.
TEST(ValueTypes, SixteenBitConversions) {
  // v -> float -> back, for v of every bit pattern; `back` is to_float16 or to_bfloat16.
  auto round_trip = [](auto v, auto back, uint32_t bits) {
    const float f = to_float(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(back(f)))) << bits;
    } else {
      EXPECT_EQ(back(f).bits, v.bits) << bits;
    }
  };
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    round_trip(float16{uint16_t(bits)}, [](float f) { return to_float16(f); }, bits);
    round_trip(bfloat16{uint16_t(bits)}, [](float f) { return to_bfloat16(f); }, bits);
  }
  EXPECT_EQ(to_float(float16{0x3c00}), 1.0f);
  EXPECT_EQ(to_float(float16{0x0001}), 5.9604644775390625e-8f);  // smallest subnormal
  EXPECT_EQ(to_float16(1.0f + 0.00048828125f).bits, 0x3c00);       // halfway 1 .. 1+2^-10: even, down
  EXPECT_EQ(to_float16(1.0f + 3 * 0.00048828125f).bits, 0x3c02);   // halfway 1+2^-10 .. 1+2^-9: even, up
  EXPECT_EQ(to_float16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(to_float16(65519.0f).bits, 0x7bff);
  EXPECT_EQ(to_float16(65520.0f).bits, 0x7c00);                    // rounds to infinity
  EXPECT_EQ(to_float16(2.9802322387695312e-8f).bits, 0x0000);      // half the smallest subnormal: even, 0
  EXPECT_EQ(to_float16(8.940696716308594e-8f).bits, 0x0002);       // 1.5 x smallest: even, up
  EXPECT_EQ(to_bfloat16(1.0f + 0.00390625f).bits, 0x3f80);         // halfway 1 .. 1+2^-7: even, down
  EXPECT_EQ(to_bfloat16(1.0f + 3 * 0.00390625f).bits, 0x3f82);
  EXPECT_EQ(to_bfloat16(-2.5f).bits, 0xc020);
}

// The 16-bit types through the CPU ops: computed in float, each output rounded once.
TEST(ValueTypes, SixteenBitOpsRoundOnce) {
  auto p = random_pattern<uint16_t>(37, 29, 300, 5);
  const auto w = p.view();
  const int64_t n = 3;
  const auto x64 = random_dense(n * 29, 6);
  std::vector<bfloat16> values(p.values.size()), x(x64.size());
  for (size_t i = 0; i < values.size(); ++i) values[i] = to_bfloat16(float(p.values[i]));
  for (size_t i = 0; i < x.size(); ++i) x[i] = to_bfloat16(float(x64[i]));
  std::vector<bfloat16> y(n * 37, bfloat16{0x7fc0});
  ASSERT_TRUE((cpu::spmm_forward<bfloat16, uint16_t>(w, values.data(), x.data(), n, nullptr, y.data()).ok()));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t r = 0; r < 37; ++r) {
      float acc = 0;  // the same order as the op: the row's slots ascending
      for (int32_t s = w.row_ptr[r]; s < w.row_ptr[r + 1]; ++s) acc += to_float(values[s]) * to_float(x[i * 29 + w.col_idx[s]]);
      EXPECT_EQ(y[i * 37 + r].bits, to_bfloat16(acc).bits) << i << "," << r;
    }
  }
}

TEST(CpuOpsErrors, RejectsBadArguments) {
  auto p = random_pattern<int32_t>(4, 5, 6, 3);
  auto w = p.view();
  std::vector<float> v(6, 1.f), x(10, 1.f), y(8);
  EXPECT_EQ((cpu::spmm_forward<float, int32_t>(w, v.data(), x.data(), -1, nullptr, y.data()).code()),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((cpu::spmm_forward<float, int32_t>(w, v.data(), nullptr, 2, nullptr, y.data()).code()),
            StatusCode::kInvalidArgument);
  auto bad = w;
  bad.nnz = 21;  // > rows * cols
  EXPECT_EQ((cpu::spmm_forward<float, int32_t>(bad, v.data(), x.data(), 2, nullptr, y.data()).code()),
            StatusCode::kInvalidArgument);
  SlotPattern<uint16_t> big;
  big.rows = 70000;
  big.cols = 2;
  std::vector<int32_t> ptr(70001, 0), cptr(3, 0);
  big.row_ptr = ptr.data();
  big.col_ptr = cptr.data();
  Status s = cpu::spmm_forward<float, uint16_t>(big, v.data(), x.data(), 0, nullptr, y.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("index type"), std::string::npos) << s.message();
}

TEST(CpuOps, ForwardOnlyPatternRunsTheForwardAndRefusesTheRest) {
  const auto p = random_pattern<uint16_t>(9, 11, 40, 3, {4});
  auto w = p.view();
  std::vector<float> v(40), x(2 * 11), y(2 * 9, -1.f), y_whole(2 * 9, -2.f), dx(2 * 11), dv(40);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 7) - 3.f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 5) * 0.5f - 1.f;
  ASSERT_TRUE((cpu::spmm_forward<float, uint16_t>(w, v.data(), x.data(), 2, nullptr, y_whole.data()).ok()));
  w.row_idx = nullptr;
  w.csc_perm = nullptr;
  ASSERT_TRUE((cpu::spmm_forward<float, uint16_t>(w, v.data(), x.data(), 2, nullptr, y.data()).ok()));
  EXPECT_EQ(y, y_whole);
  EXPECT_EQ((cpu::spmm_transposed<float, uint16_t>(w, v.data(), y.data(), 2, dx.data()).code()),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((cpu::sddmm<float, uint16_t>(w, y.data(), x.data(), 2, dv.data()).code()), StatusCode::kInvalidArgument);
}

TEST(CpuOptimizer, AdamWUpdateFollowsTorchFormula) {
  const AdamWConfig c{0.01, 0.8, 0.95, 1e-6, 0.1, false};
  std::vector<double> g{0.5, -2.0, 0.0}, v{1.0, -0.25, 3.0}, m{0.1, 0.2, -0.3}, s{0.01, 0.5, 0.0};
  auto value = v, exp_avg = m, exp_avg_sq = s;
  ASSERT_TRUE(cpu::adamw_update<double>(g.data(), 3, 3.0, c, value.data(), exp_avg.data(), exp_avg_sq.data()).ok());
  for (size_t i = 0; i < 3; ++i) {  // torch.optim.AdamW, written out
    const double w = v[i] - c.lr * c.weight_decay * v[i];
    const double m1 = c.beta1 * m[i] + (1 - c.beta1) * g[i], s1 = c.beta2 * s[i] + (1 - c.beta2) * g[i] * g[i];
    const double denom = std::sqrt(s1) / std::sqrt(1 - std::pow(c.beta2, 3.0)) + c.eps;
    EXPECT_NEAR(value[i], w - c.lr / (1 - std::pow(c.beta1, 3.0)) * m1 / denom, 1e-15) << i;
    EXPECT_NEAR(exp_avg[i], m1, 1e-15);
    EXPECT_NEAR(exp_avg_sq[i], s1, 1e-15);
  }
  EXPECT_EQ(cpu::adamw_update<double>(g.data(), 3, 0.0, c, value.data(), exp_avg.data(), exp_avg_sq.data()).code(),
            StatusCode::kInvalidArgument);  // steps count from 1
  EXPECT_EQ(cpu::adamw_update<double>(g.data(), 3, 1.0, c, value.data(), nullptr, exp_avg_sq.data()).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace snack::test
