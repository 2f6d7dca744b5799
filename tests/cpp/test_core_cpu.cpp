// The CPU ops of the core against dense float64 references, on odd sizes and both index widths.
#include <cmath>
#include <cstring>

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
      // A float sum of the row's terms, in any order, lies within `slack` of the exact sum; rounded
      // once, it is the bfloat16 nearest to some value in that interval.
      double exact = 0, scale = 0;
      for (int32_t s = w.row_ptr[r]; s < w.row_ptr[r + 1]; ++s) {
        const double term = double(to_float(values[s])) * double(to_float(x[i * 29 + w.col_idx[s]]));
        exact += term;
        scale += std::fabs(term);
      }
      const double slack = 64 * scale * 0x1p-24;
      const float got = to_float(y[i * 37 + r]);
      EXPECT_GE(got, to_float(to_bfloat16(float(exact - slack)))) << i << "," << r;
      EXPECT_LE(got, to_float(to_bfloat16(float(exact + slack)))) << i << "," << r;
    }
  }
}

TEST(BatchTiles, LayoutOfTheBatch) {
  for (const auto& [n, width] : std::vector<std::pair<int64_t, int>>{
           {0, 1}, {1, 1}, {2, 2}, {3, 4}, {5, 8}, {16, 16}, {17, 16}, {1000, 16}})
    EXPECT_EQ(cpu::batch_tile_width(n), width) << n;
  const int64_t n = 19, cols = 5;
  EXPECT_EQ(cpu::batch_tiles_numel(n, cols), 2 * cols * 16);
  const auto x = random_dense(n * cols, 3);
  std::vector<double> tiles(size_t(cpu::batch_tiles_numel(n, cols)), NAN);
  const auto layout = cpu::to_batch_tiles<double>(x.data(), n, cols, tiles.data(), 0, 2);
  EXPECT_EQ(layout.width, 16);
  EXPECT_EQ(layout.tiles(), 2);
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t i = t * 16 + j;
        EXPECT_EQ(layout.tile(t)[c * 16 + j], i < n ? x[size_t(i * cols + c)] : 0.0) << t << "," << c << "," << j;
      }
}

// The products over a split of their outputs (or slots) equal the whole product bit for bit: what
// lets the binding run them on any number of threads.
TEST(CpuOps, SplitOutputsMatchTheWholeProduct) {
  const auto p = skewed_pattern<int32_t>(40, 37, 3, 150, 7);
  const auto w = p.view();
  const auto values = cast<float>(p.values);
  for (const int64_t n : {1, 2, 6, 16, 23}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const auto x = cast<float>(random_dense(n * w.cols, 11)), dy = cast<float>(random_dense(n * w.rows, 12));
    std::vector<float> x_tiles(size_t(cpu::batch_tiles_numel(n, w.cols)));
    std::vector<float> dy_tiles(size_t(cpu::batch_tiles_numel(n, w.rows)));
    const int64_t tiles = (n + cpu::batch_tile_width(n) - 1) / cpu::batch_tile_width(n);
    const auto xt = cpu::to_batch_tiles<float>(x.data(), n, w.cols, x_tiles.data(), 0, tiles);
    const auto dyt = cpu::to_batch_tiles<float>(dy.data(), n, w.rows, dy_tiles.data(), 0, tiles);

    std::vector<float> y(size_t(n * w.rows), NAN), y_split(y.size(), NAN);
    ASSERT_TRUE((cpu::spmm_forward<float, int32_t>(w, values.data(), x.data(), n, nullptr, y.data()).ok()));
    for (const auto& [r0, r1] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 2}, {2, 29}, {29, 40}})
      ASSERT_TRUE((cpu::spmm_forward_rows<float, int32_t>(w, values.data(), xt, nullptr, y_split.data(),
                                                          Activation::kNone, r0, r1).ok()));
    EXPECT_EQ(0, std::memcmp(y.data(), y_split.data(), y.size() * sizeof(float)));

    std::vector<float> dx(size_t(n * w.cols), NAN), dx_split(dx.size(), NAN);
    ASSERT_TRUE((cpu::spmm_transposed<float, int32_t>(w, values.data(), dy.data(), n, dx.data()).ok()));
    for (const auto& [c0, c1] : std::vector<std::pair<int64_t, int64_t>>{{0, 13}, {13, 14}, {14, 37}})
      ASSERT_TRUE((cpu::spmm_transposed_columns<float, int32_t>(w, values.data(), dyt, dx_split.data(), c0, c1).ok()));
    EXPECT_EQ(0, std::memcmp(dx.data(), dx_split.data(), dx.size() * sizeof(float)));

    std::vector<float> dv(size_t(w.nnz), NAN), dv_split(dv.size(), NAN);
    ASSERT_TRUE((cpu::sddmm<float, int32_t>(w, dy.data(), x.data(), n, dv.data()).ok()));
    for (const auto& [s0, s1] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 100}, {100, w.nnz}})
      ASSERT_TRUE((cpu::sddmm_slots<float, int32_t>(w, dyt, xt, dv_split.data(), s0, s1).ok()));
    EXPECT_EQ(0, std::memcmp(dv.data(), dv_split.data(), dv.size() * sizeof(float)));
  }
}

TEST(CpuOpsErrors, RejectsTilesAndRangesThatDoNotFit) {
  const auto p = random_pattern<int32_t>(4, 5, 6, 3);
  const auto w = p.view();
  std::vector<float> v(6, 1.f), data(size_t(cpu::batch_tiles_numel(3, 5)), 0.f), y(12), dv(6);
  const cpu::BatchTiles<float> x{data.data(), 3, 5, 4};
  const cpu::BatchTiles<float> dy{data.data(), 3, 4, 4};
  auto forward = [&](const cpu::BatchTiles<float>& in, int64_t r0, int64_t r1) {
    return cpu::spmm_forward_rows<float, int32_t>(w, v.data(), in, nullptr, y.data(), Activation::kNone, r0, r1).code();
  };
  EXPECT_EQ(forward(x, 0, 4), StatusCode::kOk);
  EXPECT_EQ(forward({data.data(), 3, 5, 2}, 0, 4), StatusCode::kInvalidArgument);  // not the width of 3 rows
  EXPECT_EQ(forward({data.data(), 3, 4, 4}, 0, 4), StatusCode::kInvalidArgument);  // not W's columns
  EXPECT_EQ(forward({nullptr, 3, 5, 4}, 0, 4), StatusCode::kInvalidArgument);
  EXPECT_EQ(forward(x, 3, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(forward(x, 0, 5), StatusCode::kInvalidArgument);
  EXPECT_EQ(forward(x, -1, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ((cpu::spmm_transposed_columns<float, int32_t>(w, v.data(), dy, y.data(), 0, 6).code()),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((cpu::spmm_transposed_columns<float, int32_t>(w, v.data(), x, y.data(), 0, 5).code()),
            StatusCode::kInvalidArgument);  // dY's tiles have W's rows as columns
  EXPECT_EQ((cpu::sddmm_slots<float, int32_t>(w, dy, x, dv.data(), 0, 6).code()), StatusCode::kOk);
  EXPECT_EQ((cpu::sddmm_slots<float, int32_t>(w, dy, x, dv.data(), 0, 7).code()), StatusCode::kInvalidArgument);
  const cpu::BatchTiles<float> x_one_row{data.data(), 1, 5, 1};
  EXPECT_EQ((cpu::sddmm_slots<float, int32_t>(w, dy, x_one_row, dv.data(), 0, 6).code()),
            StatusCode::kInvalidArgument);  // dY and X of different batches
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
