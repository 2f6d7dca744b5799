// The CUDA ops and topology functions of the core against the CPU reference; skipped without a GPU.
#include <cuda_runtime.h>

#include <memory>

#include "test_util.h"

namespace snack::test {
namespace {

bool has_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device"

// A device copy of a host vector; poisoned (all bytes 0xff = NaN for floats) when empty of data.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceArray(const std::vector<T>& host) : count(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(1, count) * sizeof(T)), cudaSuccess);
    if (count) EXPECT_EQ(cudaMemcpy(ptr, host.data(), count * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit DeviceArray(size_t n) : count(n) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(1, count) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr, 0xff, std::max<size_t>(1, count) * sizeof(T)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(ptr); }
  std::vector<T> host() const {
    std::vector<T> out(count);
    if (count) EXPECT_EQ(cudaMemcpy(out.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

template <typename Index>
struct DevicePattern {
  DeviceArray<Index> row_idx, col_idx;
  DeviceArray<int32_t> row_ptr, col_ptr, csc_perm;
  SlotPattern<Index> w;
  explicit DevicePattern(const HostPattern<Index>& p)
      : row_idx(p.row_idx), col_idx(p.col_idx), row_ptr(p.row_ptr), col_ptr(p.col_ptr), csc_perm(p.csc_perm) {
    w = p.view();
    w.row_idx = row_idx.ptr;
    w.col_idx = col_idx.ptr;
    w.row_ptr = row_ptr.ptr;
    w.col_ptr = col_ptr.ptr;
    w.csc_perm = csc_perm.ptr;
  }
};

template <typename Pair>
class CudaOps : public ::testing::Test {};
using Configs = ::testing::Types<std::pair<float, uint16_t>, std::pair<float, int32_t>, std::pair<double, uint16_t>,
                                 std::pair<double, int32_t>>;
TYPED_TEST_SUITE(CudaOps, Configs);

TYPED_TEST(CudaOps, AllOpsMatchDenseReference) {
  SKIP_WITHOUT_GPU();
  using T = typename TypeParam::first_type;
  using Index = typename TypeParam::second_type;
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  uint32_t seed = 100;
  for (const Shape& sh : odd_shapes()) {
    SCOPED_TRACE(::testing::Message() << sh.m << "x" << sh.k << " n=" << sh.n << " nnz=" << sh.nnz);
    auto p = random_pattern<Index>(sh.m, sh.k, sh.nnz, seed++, sh.empty_rows);
    DevicePattern<Index> d(p);
    const auto x64 = random_dense(sh.n * sh.k, seed++), dy64 = random_dense(sh.n * sh.m, seed++);
    const auto bias64 = random_dense(sh.m, seed++);
    DeviceArray<T> values(cast<T>(p.values)), x(cast<T>(x64)), dy(cast<T>(dy64)), bias(cast<T>(bias64));

    DeviceArray<T> y(sh.n * sh.m);
    ASSERT_TRUE((cuda::spmm_forward<T, Index>(d.w, values.ptr, x.ptr, sh.n, bias.ptr, y.ptr, nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_error(y.host(), ref_forward(p.dense, sh.m, sh.k, x64, sh.n, &bias64)), tol);

    DeviceArray<T> dx(sh.n * sh.k);
    ASSERT_TRUE((cuda::spmm_transposed<T, Index>(d.w, values.ptr, dy.ptr, sh.n, dx.ptr, nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_error(dx.host(), ref_transposed(p.dense, sh.m, sh.k, dy64, sh.n)), tol);

    DeviceArray<T> dv(p.row_idx.size());
    ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv.ptr, nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_error(dv.host(), ref_sddmm(p, dy64, x64, sh.n)), tol);

    // The SDDMM kernels that run every batch here (up to 33), forced, each with its own workspace.
    for (SddmmVariant v : {SddmmVariant::kSlot, SddmmVariant::kVector, SddmmVariant::kRows}) {
      SCOPED_TRACE(sddmm_variant_name(v));
      DeviceArray<unsigned char> ws(cuda::sddmm_workspace_bytes(sh.m, sh.k, sh.n, sizeof(T), v));
      DeviceArray<T> dv_forced(p.row_idx.size());
      ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_forced.ptr, ws.ptr, nullptr, v).ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(rel_error(dv_forced.host(), ref_sddmm(p, dy64, x64, sh.n)), tol);

      // The same kernel with AdamW's step fused: equal to the CPU's sddmm, then its update.
      const size_t nnz = p.row_idx.size();
      const AdamWConfig config{1e-2, 0.9, 0.99, 1e-6, 0.05, v == SddmmVariant::kVector};
      const auto m64 = random_dense(int64_t(nnz), seed + 1), s64 = random_dense(int64_t(nnz), seed + 2);
      std::vector<T> exp_avg_h = cast<T>(m64), exp_avg_sq_h(nnz), values_h = cast<T>(p.values);
      for (size_t i = 0; i < nnz; ++i) exp_avg_sq_h[i] = T(s64[i] * s64[i]);
      DeviceArray<T> dvalues(values_h), exp_avg(exp_avg_h), exp_avg_sq(exp_avg_sq_h);
      DeviceArray<float> step(std::vector<float>{3.0f});
      ASSERT_TRUE((cuda::sddmm_adamw<T, Index>(d.w, dy.ptr, x.ptr, sh.n, step.ptr, config, dvalues.ptr, exp_avg.ptr,
                                               exp_avg_sq.ptr, ws.ptr, nullptr, v).ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto w_cpu = p.view(), x_t = cast<T>(x64), dy_t = cast<T>(dy64);
      std::vector<T> dv_cpu(nnz);
      ASSERT_TRUE((cpu::sddmm<T, Index>(w_cpu, dy_t.data(), x_t.data(), sh.n, dv_cpu.data()).ok()));
      EXPECT_EQ(step.host()[0], 4.0f);  // the call advances the count, then updates with it
      ASSERT_TRUE(cpu::adamw_update<T>(dv_cpu.data(), int64_t(nnz), 4.0, config, values_h.data(), exp_avg_h.data(),
                                       exp_avg_sq_h.data())
                      .ok());
      const auto wide = [](const std::vector<T>& v) { return std::vector<double>(v.begin(), v.end()); };
      EXPECT_LT(rel_error(dvalues.host(), wide(values_h)), tol);
      EXPECT_LT(rel_error(exp_avg.host(), wide(exp_avg_h)), tol);
      EXPECT_LT(rel_error(exp_avg_sq.host(), wide(exp_avg_sq_h)), tol);

      // Once more with the bias updated in the same call (its own settings and count): the values
      // as above, the bias as the CPU's bias_grad, then its update.
      std::vector<T> sq_h(nnz);
      for (size_t i = 0; i < nnz; ++i) sq_h[i] = T(s64[i] * s64[i]);
      DeviceArray<T> values2(cast<T>(p.values)), exp_avg2(cast<T>(m64)), exp_avg_sq2(sq_h);
      const AdamWConfig bias_config{3e-2, 0.8, 0.95, 1e-5, 0.1, v != SddmmVariant::kVector};
      std::vector<T> bias_h = cast<T>(bias64), bias_m_h = cast<T>(random_dense(sh.m, seed + 3)), bias_v_h(sh.m);
      for (int64_t r = 0; r < sh.m; ++r) bias_v_h[r] = T(0.5);
      DeviceArray<T> bias_d(bias_h), bias_m(bias_m_h), bias_v(bias_v_h);
      DeviceArray<float> step2(std::vector<float>{3.0f}), bias_step(std::vector<float>{6.0f});
      const cuda::AdamWParameter<T> bias_param{bias_d.ptr, bias_m.ptr, bias_v.ptr, bias_step.ptr, bias_config};
      ASSERT_TRUE((cuda::sddmm_adamw<T, Index>(d.w, dy.ptr, x.ptr, sh.n, step2.ptr, config, values2.ptr,
                                               exp_avg2.ptr, exp_avg_sq2.ptr, ws.ptr, nullptr, v, &bias_param)
                       .ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(rel_error(values2.host(), wide(values_h)), tol);
      EXPECT_LT(rel_error(exp_avg2.host(), wide(exp_avg_h)), tol);
      EXPECT_LT(rel_error(exp_avg_sq2.host(), wide(exp_avg_sq_h)), tol);
      std::vector<T> db_cpu(sh.m);
      ASSERT_TRUE(cpu::bias_grad<T>(dy_t.data(), sh.n, sh.m, db_cpu.data()).ok());
      EXPECT_EQ(step2.host()[0], 4.0f);
      EXPECT_EQ(bias_step.host()[0], 7.0f);
      ASSERT_TRUE(cpu::adamw_update<T>(db_cpu.data(), sh.m, 7.0, bias_config, bias_h.data(), bias_m_h.data(),
                                       bias_v_h.data())
                      .ok());
      EXPECT_LT(rel_error(bias_d.host(), wide(bias_h)), tol);
      EXPECT_LT(rel_error(bias_m.host(), wide(bias_m_h)), tol);
      EXPECT_LT(rel_error(bias_v.host(), wide(bias_v_h)), tol);
    }
  }
}

// X^T handed to the SDDMM (the forward's copy: cuda::TransposedInput) instead of transposed by it:
// the rows kernel's results are bitwise those of its own transpose, with no workspace; the layout
// is the one spmm_forward leaves in a global_xt workspace that holds the whole batch.
TEST(CudaSddmm, ReadsAGivenTransposedInputBitwise) {
  SKIP_WITHOUT_GPU();
  using T = float;
  using Index = uint16_t;
  uint32_t seed = 900;
  for (const Shape& base : odd_shapes()) {
    for (int64_t n : {4, 5, 16, 33}) {
      Shape sh = base;
      sh.n = n;
      SCOPED_TRACE(::testing::Message() << sh.m << "x" << sh.k << " n=" << sh.n << " nnz=" << sh.nnz);
      auto p = random_pattern<Index>(sh.m, sh.k, sh.nnz, seed++, sh.empty_rows);
      DevicePattern<Index> d(p);
      const auto x64 = random_dense(sh.n * sh.k, seed++), dy64 = random_dense(sh.n * sh.m, seed++);
      DeviceArray<T> values(cast<T>(p.values)), x(cast<T>(x64)), dy(cast<T>(dy64));
      // X^T as TransposedInput describes it: k + 1 rows of a power-of-two stride, zero past n.
      int64_t stride = 4;
      while (stride < sh.n) stride *= 2;
      std::vector<T> xt_h(size_t((sh.k + 1) * stride), T(0));
      for (int64_t c = 0; c < sh.k; ++c)
        for (int64_t i = 0; i < sh.n; ++i) xt_h[size_t(c * stride + i)] = T(x64[size_t(i * sh.k + c)]);
      DeviceArray<T> xt_dev(xt_h);
      const cuda::TransposedInput<T> x_t{xt_dev.ptr, stride};
      ASSERT_EQ(cuda::sddmm_workspace_bytes(sh.m, sh.k, sh.n, sizeof(T), SddmmVariant::kRows, true), 0u);
      // It is what a forward whose global_xt plan holds the whole batch leaves in its workspace.
      const SpmmPlan plan = cuda::plan_spmm(sh.m, sh.k, int64_t(p.row_idx.size()), sh.n, sizeof(T),
                                            SpmmVariant::kGlobalXT);
      if (cuda::plan_transposes_whole_input(plan, sh.n)) {
        DeviceArray<unsigned char> fwd_ws(plan.workspace_bytes);
        DeviceArray<T> y(sh.n * sh.m);
        ASSERT_TRUE((cuda::spmm_forward<T, Index>(d.w, values.ptr, x.ptr, sh.n, nullptr, y.ptr, plan, fwd_ws.ptr,
                                                  nullptr)
                         .ok()));
        std::vector<T> copy(plan.workspace_bytes / sizeof(T));
        ASSERT_EQ(cudaMemcpy(copy.data(), fwd_ws.ptr, plan.workspace_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        for (int64_t c = 0; c <= sh.k; ++c)
          for (int64_t i = 0; i < plan.batch_tile; ++i)
            ASSERT_EQ(copy[size_t(c * plan.batch_tile + i)], c < sh.k && i < sh.n ? xt_h[size_t(c * stride + i)] : T(0));
      }

      const size_t nnz = p.row_idx.size();
      DeviceArray<unsigned char> ws(cuda::sddmm_workspace_bytes(sh.m, sh.k, sh.n, sizeof(T), SddmmVariant::kRows));
      DeviceArray<T> dv_own(nnz), dv_given(nnz);
      ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_own.ptr, ws.ptr, nullptr, SddmmVariant::kRows)
                       .ok()));
      ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_given.ptr, nullptr, nullptr,
                                         SddmmVariant::kRows, x_t)
                       .ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dv_given.host(), dv_own.host());
      EXPECT_LT(rel_error(dv_given.host(), ref_sddmm(p, dy64, x64, sh.n)), 1e-5);

      // With AdamW and the bias: values, moments and bias bitwise equal, each count advanced once.
      const AdamWConfig config{1e-2, 0.9, 0.99, 1e-6, 0.05, false};
      const std::vector<T> m_h = cast<T>(random_dense(int64_t(nnz), seed++)), b_h = cast<T>(random_dense(sh.m, seed++));
      struct State {
        DeviceArray<T> values, exp_avg, exp_avg_sq, bias, bias_m, bias_v;
        DeviceArray<float> step, bias_step;
      };
      const auto fresh = [&] {
        return new State{DeviceArray<T>(cast<T>(p.values)), DeviceArray<T>(m_h), DeviceArray<T>(std::vector<T>(nnz, T(0.25))),
                         DeviceArray<T>(b_h), DeviceArray<T>(b_h), DeviceArray<T>(std::vector<T>(sh.m, T(0.5))),
                         DeviceArray<float>(std::vector<float>{2.0f}), DeviceArray<float>(std::vector<float>{5.0f})};
      };
      std::unique_ptr<State> own(fresh()), given(fresh());
      for (State* st : {own.get(), given.get()}) {
        const cuda::AdamWParameter<T> bias_param{st->bias.ptr, st->bias_m.ptr, st->bias_v.ptr, st->bias_step.ptr,
                                                 config};
        const bool with_x_t = st == given.get();
        ASSERT_TRUE((cuda::sddmm_adamw<T, Index>(d.w, dy.ptr, x.ptr, sh.n, st->step.ptr, config, st->values.ptr,
                                                 st->exp_avg.ptr, st->exp_avg_sq.ptr, with_x_t ? nullptr : ws.ptr,
                                                 nullptr, SddmmVariant::kRows, &bias_param,
                                                 with_x_t ? x_t : cuda::TransposedInput<T>{})
                         .ok()));
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(given->values.host(), own->values.host());
      EXPECT_EQ(given->exp_avg.host(), own->exp_avg.host());
      EXPECT_EQ(given->exp_avg_sq.host(), own->exp_avg_sq.host());
      EXPECT_EQ(given->bias.host(), own->bias.host());
      EXPECT_EQ(given->step.host()[0], 3.0f);
      EXPECT_EQ(given->bias_step.host()[0], 6.0f);

      // A copy narrower than the padded batch is refused (where there is a product to compute).
      const cuda::TransposedInput<T> narrow{x_t.data, (sh.n + 3) / 4 * 4 - 4};
      const Status refused = cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_given.ptr, nullptr, nullptr,
                                                   SddmmVariant::kRows, narrow);
      EXPECT_EQ(refused.ok(), nnz == 0) << refused.message();
    }
  }
}

TEST(CudaBiasGrad, PlainAndWithAdamWMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 5, m = 37;
  const auto dy64 = random_dense(n * m, 11), b64 = random_dense(m, 12), m64 = random_dense(m, 13);
  const std::vector<float> dy_h = cast<float>(dy64);
  std::vector<float> bias_h = cast<float>(b64), exp_avg_h = cast<float>(m64), exp_avg_sq_h(m, 0.25f), db_h(m);
  DeviceArray<float> dy(dy_h), db(m), bias(bias_h), exp_avg(exp_avg_h), exp_avg_sq(exp_avg_sq_h);
  DeviceArray<float> step(std::vector<float>{2.0f});
  const AdamWConfig config{1e-2, 0.9, 0.99, 1e-6, 0.05, false};
  ASSERT_TRUE(cuda::bias_grad<float>(dy.ptr, n, m, db.ptr, nullptr).ok());
  ASSERT_TRUE(cuda::bias_grad_adamw<float>(dy.ptr, n, m, step.ptr, config, bias.ptr, exp_avg.ptr, exp_avg_sq.ptr,
                                           nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(cpu::bias_grad<float>(dy_h.data(), n, m, db_h.data()).ok());
  EXPECT_EQ(step.host()[0], 3.0f);  // advanced by the call
  ASSERT_TRUE(cpu::adamw_update<float>(db_h.data(), m, 3.0, config, bias_h.data(), exp_avg_h.data(),
                                       exp_avg_sq_h.data())
                  .ok());
  const auto wide = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  EXPECT_LT(rel_error(db.host(), wide(db_h)), 1e-6);
  EXPECT_LT(rel_error(bias.host(), wide(bias_h)), 1e-6);
  EXPECT_LT(rel_error(exp_avg.host(), wide(exp_avg_h)), 1e-6);
  EXPECT_LT(rel_error(exp_avg_sq.host(), wide(exp_avg_sq_h)), 1e-6);
}

TEST(CudaOpsLongRows, BlockSplitRowsMatchReference) {
  SKIP_WITHOUT_GPU();
  for (int64_t n : {1, 5, 16}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto p = skewed_pattern<int32_t>(96, 3000, 4, 2000, uint32_t(n));
    DevicePattern<int32_t> d(p);
    const auto x64 = random_dense(n * p.k, 7), dy64 = random_dense(n * p.m, 8);
    DeviceArray<float> values(cast<float>(p.values)), x(cast<float>(x64)), dy(cast<float>(dy64));
    DeviceArray<float> y(n * p.m), dx(n * p.k);
    ASSERT_TRUE((cuda::spmm_forward<float, int32_t>(d.w, values.ptr, x.ptr, n, nullptr, y.ptr, nullptr).ok()));
    ASSERT_TRUE((cuda::spmm_transposed<float, int32_t>(d.w, values.ptr, dy.ptr, n, dx.ptr, nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_error(y.host(), ref_forward(p.dense, p.m, p.k, x64, n, nullptr)), 1e-5);
    EXPECT_LT(rel_error(dx.host(), ref_transposed(p.dense, p.m, p.k, dy64, n)), 1e-5);
  }
}

TEST(CudaTopology, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  auto p = random_pattern<uint16_t>(300, 211, 4000, 5, {0, 17, 299});
  // Shuffle the positions so that the device has to sort them.
  std::vector<int64_t> rows, cols;
  for (size_t s = 0; s < p.row_idx.size(); ++s) {
    rows.push_back(p.row_idx[s]);
    cols.push_back(p.col_idx[s]);
  }
  std::mt19937 rng(1);
  std::vector<size_t> perm(rows.size());
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> srows, scols;
  for (size_t i : perm) {
    srows.push_back(rows[i]);
    scols.push_back(cols[i]);
  }
  const int64_t nnz = rows.size();
  DeviceArray<int64_t> drows(srows), dcols(scols), order(nnz);
  DeviceArray<uint16_t> ri(nnz), ci(nnz);
  Status s = cuda::slots_from_coo<uint16_t>(300, 211, nnz, drows.ptr, dcols.ptr, ri.ptr, ci.ptr, order.ptr,
                                            cuda::default_device_allocator(), nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(ri.host(), p.row_idx);
  EXPECT_EQ(ci.host(), p.col_idx);
  const auto ord = order.host();
  for (int64_t i = 0; i < nnz; ++i) EXPECT_EQ(perm[ord[i]], size_t(i));

  DeviceArray<int32_t> rp(301), cp(212), cperm(nnz);
  s = cuda::build_views<uint16_t>(300, 211, nnz, ri.ptr, ci.ptr, rp.ptr, cp.ptr, cperm.ptr,
                                  cuda::default_device_allocator(), nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(rp.host(), p.row_ptr);
  EXPECT_EQ(cp.host(), p.col_ptr);
  EXPECT_EQ(cperm.host(), p.csc_perm);

  srows[7] = srows[3];
  scols[7] = scols[3];
  DeviceArray<int64_t> dup_rows(srows), dup_cols(scols);
  s = cuda::slots_from_coo<uint16_t>(300, 211, nnz, dup_rows.ptr, dup_cols.ptr, ri.ptr, ci.ptr, order.ptr,
                                     cuda::default_device_allocator(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kDuplicateEntry) << s.message();
  srows[5] = 300;
  DeviceArray<int64_t> bad_rows(srows);
  s = cuda::slots_from_coo<uint16_t>(300, 211, nnz, bad_rows.ptr, dup_cols.ptr, ri.ptr, ci.ptr, order.ptr,
                                     cuda::default_device_allocator(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("rows[5]=300"), std::string::npos) << s.message();
}

TEST(CudaTopology, DenseTopkMatchesCpu) {
  SKIP_WITHOUT_GPU();
  auto w64 = random_dense(77 * 59, 9);
  for (int i = 0; i < 40; ++i) w64[i * 13] = 0.5;  // ties
  const auto w = cast<float>(w64);
  std::vector<int64_t> ref(900);
  ASSERT_TRUE(cpu::dense_topk_positions<float>(77, 59, w.data(), 900, ref.data()).ok());
  DeviceArray<float> dw(w);
  DeviceArray<int64_t> pos(900);
  Status s = cuda::dense_topk_positions<float>(77, 59, dw.ptr, 900, pos.ptr, cuda::default_device_allocator(), nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(pos.host(), ref);
}

TEST(CudaPlanner, VariantTileWorkspaceAndLanes) {
  SKIP_WITHOUT_GPU();
  using cuda::describe;
  using cuda::plan_spmm;
  // One batch row: X read in place, no workspace.
  SpmmPlan p = plan_spmm(4096, 4096, 1677722, 1, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(p.batch_tile, 1);
  EXPECT_EQ(p.workspace_bytes, 0u);
  // A small input (8 rows x 1024 = 32 KiB, stays in L1): in place too, operands prefetched into L2.
  p = plan_spmm(768, 1024, 78643, 8, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(p.workspace_bytes, 0u);
  EXPECT_TRUE(p.prefetch_l2);
  // 16 rows of it: 1.3 M multiply-adds, transposed.
  EXPECT_EQ(plan_spmm(768, 1024, 78643, 16, sizeof(float)).variant, SpmmVariant::kGlobalXT);
  // A tiny product (16.8 k entries x 16 rows) reads even a 256 KiB X in place.
  p = plan_spmm(4096, 4096, 16777, 16, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalX);
  EXPECT_LE(p.batch_tile, 32);
  // A large product: X transposed into a workspace of (in_dim + the zero slot) x the batch padded
  // to the tile.
  p = plan_spmm(16384, 4096, 6710886, 20, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalXT);
  const int64_t padded = (20 + p.batch_tile - 1) / p.batch_tile * p.batch_tile;
  EXPECT_EQ(p.workspace_bytes, size_t(4097 * padded * sizeof(float)));
  EXPECT_FALSE(p.prefetch_l2);  // 40 MB of slot arrays: bandwidth-bound, no prefetch
  // A batch too large for global_x's 32-row tiles in grid.y, even with nothing to multiply.
  p = plan_spmm(8, 8, 0, 65535LL * 32 + 1, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalXT);
  // Lanes per row on a GPU of 132 SMs (H100 SXM, H200), where session 12 measured the rules
  // (16384x4096, 90%): the forward at N = 16 goes from one wave of warps to two (4 lanes, not 2);
  // at N = 1 each lane would keep too few entries for that, and stays at 8; the transposed product
  // (4096 rows of 1638 entries) takes 8 lanes at N = 1 (not 32) and keeps 8 at N = 16.
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  if (sms == 132) {
    EXPECT_EQ(plan_spmm(16384, 4096, 6710886, 16, sizeof(float)).lanes_per_row, 4);
    EXPECT_EQ(plan_spmm(16384, 4096, 6710886, 1, sizeof(float), SpmmVariant::kGlobalX).lanes_per_row, 8);
    EXPECT_EQ(plan_spmm(4096, 16384, 6710886, 1, sizeof(float), SpmmVariant::kAuto, true).lanes_per_row, 8);
    EXPECT_EQ(plan_spmm(4096, 16384, 6710886, 1, sizeof(float)).lanes_per_row, 32);  // the same product as a forward
    EXPECT_EQ(plan_spmm(4096, 16384, 6710886, 16, sizeof(float), SpmmVariant::kAuto, true).lanes_per_row, 8);
  }
  // One batch row of a large layer: wide_rows with groups of 16384 / (132 SMs x 32 warps) -> 4 rows
  // per warp; 99% sparse (41 slots per row), 8192 rows (2-row groups) or 16384 inputs (X too large
  // for 4 blocks per SM): global_x.
  p = plan_spmm(16384, 4096, 6710886, 1, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kWideRows);
  EXPECT_EQ(p.workspace_bytes, 0u);
  if (sms == 132) EXPECT_EQ(p.rows_per_warp, 4);
  EXPECT_EQ(plan_spmm(16384, 4096, 6710886, 1, sizeof(float), SpmmVariant::kAuto, true).variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(plan_spmm(16384, 4096, 671089, 1, sizeof(float)).variant, SpmmVariant::kGlobalX);
  if (sms == 132) {
    EXPECT_EQ(plan_spmm(8192, 8192, 6710886, 1, sizeof(float)).variant, SpmmVariant::kGlobalX);
    EXPECT_EQ(plan_spmm(16384, 16384, 26843546, 1, sizeof(float)).variant, SpmmVariant::kGlobalX);
  }
  // A batch of 2-4 rows of the same product: wide_rows, the whole batch in one tile; 8 rows (fp32: 32-byte
  // gathers per slot) and the transposed product: not (its X of 128 KiB is transposed once; smem_x is
  // never chosen).
  p = plan_spmm(16384, 4096, 6710886, 4, sizeof(float));
  EXPECT_EQ(p.variant, SpmmVariant::kWideRows);
  EXPECT_EQ(p.batch_tile, 4);
  EXPECT_EQ(plan_spmm(16384, 4096, 6710886, 3, sizeof(float)).batch_tile, 4);
  EXPECT_EQ(plan_spmm(16384, 4096, 6710886, 8, sizeof(float)).variant, SpmmVariant::kGlobalXT);
  EXPECT_EQ(plan_spmm(4096, 16384, 6710886, 2, sizeof(float), SpmmVariant::kAuto, true).variant, SpmmVariant::kGlobalXT);
  // wide_rows forced on a batch: the widest tile that fits (a power of two up to 8; 1 for fp64), with
  // as many rows per group as shared memory holds beside it (16384x4096 fp32, tile of 8: X takes 128
  // KiB, the partial sums of 2 rows per group 68 KiB more on a GPU with 227 KiB per block).
  for (const int64_t n : {2, 3, 8, 20}) {
    p = plan_spmm(16384, 4096, 6710886, n, sizeof(float), SpmmVariant::kWideRows);
    EXPECT_EQ(p.batch_tile, std::min<int64_t>(8, n == 3 ? 4 : n)) << describe(p);
    EXPECT_NE(describe(p).find("batch tile " + std::to_string(p.batch_tile) + ", "), std::string::npos) << describe(p);
  }
  int smem_per_block = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  p = plan_spmm(16384, 4096, 6710886, 8, sizeof(float), SpmmVariant::kWideRows);
  if (smem_per_block == 227 * 1024) EXPECT_EQ(p.rows_per_warp, 2) << describe(p);
  EXPECT_EQ(plan_spmm(16384, 4096, 6710886, 8, sizeof(double), SpmmVariant::kWideRows).batch_tile, 1);
  EXPECT_EQ(plan_spmm(100, 40000, 100000, 8, sizeof(float), SpmmVariant::kWideRows).batch_tile, 1);  // 160 KB a row
  // Every plan of the row kernels: a power-of-two tile and lanes per row within its free lanes.
  for (const bool transposed : {false, true}) {
    for (SpmmVariant v : {SpmmVariant::kAuto, SpmmVariant::kGlobalX, SpmmVariant::kGlobalXT}) {
      for (int64_t n : {1, 2, 3, 8, 16, 33, 100, 128, 1000}) {
        for (int64_t nnz : {0, 1000, 1000000}) {
          p = plan_spmm(5000, 3000, nnz, n, sizeof(float), v, transposed);
          const int free_lanes = 32 / (p.batch_tile / std::min(p.batch_tile, 4));
          EXPECT_EQ(p.batch_tile & (p.batch_tile - 1), 0) << describe(p);
          EXPECT_LE(p.batch_tile, p.variant == SpmmVariant::kGlobalXT ? 128 : 32) << describe(p);
          EXPECT_GE(p.lanes_per_row, 1) << describe(p);
          EXPECT_LE(p.lanes_per_row, free_lanes) << describe(p);
          EXPECT_EQ(p.lanes_per_row & (p.lanes_per_row - 1), 0) << describe(p);
        }
      }
    }
  }
}

}  // namespace
}  // namespace snack::test
