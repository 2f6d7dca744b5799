// The CUDA ops and topology functions of the core against the CPU reference; skipped without a GPU.
#include <cuda_runtime.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "snack/attention.h"
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

// A plan of the SDDMM for the current device (the binding plans the same way).
template <typename T, typename Index>
SddmmPlan sddmm_plan(const SlotPattern<Index>& w, int64_t n, SddmmVariant variant,
                     SddmmEpilogue epilogue = SddmmEpilogue::kStore, int64_t x_t_stride = 0, Status* status = nullptr) {
  DeviceLimits limits;
  EXPECT_TRUE(cuda::current_device_limits(&limits).ok());
  SddmmProblem p;
  p.rows = w.rows;
  p.cols = w.cols;
  p.nnz = w.nnz;
  p.n = n;
  p.value_bytes = int(sizeof(T));
  p.epilogue = epilogue;
  p.requested = variant;
  p.x_t_stride = x_t_stride;
  SddmmPlan plan;
  const Status s = plan_sddmm(p, limits, &plan);
  if (status) *status = s;
  else EXPECT_TRUE(s.ok()) << s.message();
  return plan;
}

template <typename T>
SpmmPlan spmm_plan(int64_t out_dim, int64_t in_dim, int64_t nnz, int64_t n, SpmmVariant variant, bool transposed) {
  DeviceLimits limits;
  EXPECT_TRUE(cuda::current_device_limits(&limits).ok());
  SpmmPlan plan;
  const Status s = plan_spmm({out_dim, in_dim, nnz, n, int(sizeof(T)), transposed, variant}, limits, &plan);
  EXPECT_TRUE(s.ok()) << s.message();
  return plan;
}

template <typename Pair>
class CudaOps : public ::testing::Test {};
using Configs = ::testing::Types<std::pair<float, uint16_t>, std::pair<float, int32_t>, std::pair<double, uint16_t>,
                                 std::pair<double, int32_t>>;
TYPED_TEST_SUITE(CudaOps, Configs);

TYPED_TEST(CudaOps, AllOpsMatchDenseReference) {
  SKIP_WITHOUT_GPU();
  using T = typename TypeParam::first_type;
  using Index = typename TypeParam::second_type;
  const double tol = snack::test::tol<T>();
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
    expect_elementwise(y.host(), ref_forward(p.dense, sh.m, sh.k, x64, sh.n, &bias64), tol);

    // Channels first: two images of sh.n pixels each (every vector width across the odd sizes).
    const auto images64 = random_dense(2 * sh.k * sh.n, seed++);
    DeviceArray<T> images(cast<T>(images64)), y_cf(2 * sh.m * sh.n);
    ASSERT_TRUE((cuda::spmm_channels_first<T, Index>(d.w, values.ptr, images.ptr, 2, sh.n, bias.ptr, y_cf.ptr,
                                                      nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_elementwise(y_cf.host(), ref_channels_first(p.dense, sh.m, sh.k, images64, 2, sh.n, bias64), tol);

    DeviceArray<T> dx(sh.n * sh.k);
    ASSERT_TRUE((cuda::spmm_transposed<T, Index>(d.w, values.ptr, dy.ptr, sh.n, dx.ptr, nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_elementwise(dx.host(), ref_transposed(p.dense, sh.m, sh.k, dy64, sh.n), tol);

    DeviceArray<T> dv(p.row_idx.size());
    ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv.ptr, nullptr).ok()));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_elementwise(dv.host(), ref_sddmm(p, dy64, x64, sh.n), tol);

    // The SDDMM kernels that run every batch here (up to 33), forced, each with its own workspace;
    // the staged kernel runs float32 operands.
    std::vector<SddmmVariant> forced = {SddmmVariant::kSlot, SddmmVariant::kVector, SddmmVariant::kRows};
    if constexpr (std::is_same_v<T, float>) forced.push_back(SddmmVariant::kStaged);
    for (SddmmVariant v : forced) {
      SCOPED_TRACE(sddmm_variant_name(v));
      const SddmmPlan plan = sddmm_plan<T>(d.w, sh.n, v);
      DeviceArray<unsigned char> ws(plan.workspace_bytes);
      DeviceArray<T> dv_forced(p.row_idx.size());
      ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_forced.ptr, plan, ws.ptr, nullptr).ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      expect_elementwise(dv_forced.host(), ref_sddmm(p, dy64, x64, sh.n), tol);

      // The same kernel with AdamW's step fused: equal to the CPU's sddmm, then its update.
      const size_t nnz = p.row_idx.size();
      const AdamWConfig config{1e-2, 0.9, 0.99, 1e-6, 0.05, v == SddmmVariant::kVector};
      const auto m64 = random_dense(int64_t(nnz), seed + 1), s64 = random_dense(int64_t(nnz), seed + 2);
      std::vector<T> exp_avg_h = cast<T>(m64), exp_avg_sq_h(nnz), values_h = cast<T>(p.values);
      for (size_t i = 0; i < nnz; ++i) exp_avg_sq_h[i] = T(s64[i] * s64[i]);
      DeviceArray<T> dvalues(values_h), exp_avg(exp_avg_h), exp_avg_sq(exp_avg_sq_h);
      DeviceArray<float> step(std::vector<float>{3.0f});
      const SddmmPlan adamw_plan = sddmm_plan<T>(d.w, sh.n, v, SddmmEpilogue::kAdamW);
      DeviceArray<unsigned char> adamw_ws(adamw_plan.workspace_bytes);
      const cuda::AdamWParameter<T> param{dvalues.ptr, exp_avg.ptr, exp_avg_sq.ptr, step.ptr, config};
      ASSERT_TRUE((cuda::sddmm_adamw<T, Index>(d.w, dy.ptr, x.ptr, sh.n, param, nullptr, adamw_plan, adamw_ws.ptr,
                                               nullptr).ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto w_cpu = p.view(), x_t = cast<T>(x64), dy_t = cast<T>(dy64);
      std::vector<T> dv_cpu(nnz);
      ASSERT_TRUE((cpu::sddmm<T, Index>(w_cpu, dy_t.data(), x_t.data(), sh.n, dv_cpu.data()).ok()));
      EXPECT_EQ(step.host()[0], 4.0f);  // the call advances the count, then updates with it
      ASSERT_TRUE(cpu::adamw_update<T>(dv_cpu.data(), int64_t(nnz), 4.0, config, values_h.data(), exp_avg_h.data(),
                                       exp_avg_sq_h.data())
                      .ok());
      // The kernel's gradient and the CPU's round differently; the updates agree to that rounding.
      expect_elementwise(dvalues.host(), relative(widen(values_h), 0.1), tol);
      expect_elementwise(exp_avg.host(), relative(widen(exp_avg_h), 0.1), tol);
      expect_elementwise(exp_avg_sq.host(), relative(widen(exp_avg_sq_h), 0.1), tol);

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
      const cuda::AdamWParameter<T> param2{values2.ptr, exp_avg2.ptr, exp_avg_sq2.ptr, step2.ptr, config};
      ASSERT_TRUE((cuda::sddmm_adamw<T, Index>(d.w, dy.ptr, x.ptr, sh.n, param2, &bias_param, adamw_plan,
                                               adamw_ws.ptr, nullptr)
                       .ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      expect_elementwise(values2.host(), relative(widen(values_h), 0.1), tol);
      expect_elementwise(exp_avg2.host(), relative(widen(exp_avg_h), 0.1), tol);
      expect_elementwise(exp_avg_sq2.host(), relative(widen(exp_avg_sq_h), 0.1), tol);
      std::vector<T> db_cpu(sh.m);
      ASSERT_TRUE(cpu::bias_grad<T>(dy_t.data(), sh.n, sh.m, db_cpu.data()).ok());
      EXPECT_EQ(step2.host()[0], 4.0f);
      EXPECT_EQ(bias_step.host()[0], 7.0f);
      ASSERT_TRUE(cpu::adamw_update<T>(db_cpu.data(), sh.m, 7.0, bias_config, bias_h.data(), bias_m_h.data(),
                                       bias_v_h.data())
                      .ok());
      expect_elementwise(bias_d.host(), relative(widen(bias_h), 0.1), tol);
      expect_elementwise(bias_m.host(), relative(widen(bias_m_h), 0.1), tol);
      expect_elementwise(bias_v.host(), relative(widen(bias_v_h), 0.1), tol);
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
      const SddmmPlan given_plan = sddmm_plan<T>(d.w, sh.n, SddmmVariant::kRows, SddmmEpilogue::kStore, stride);
      EXPECT_EQ(given_plan.workspace_bytes, 0u);
      // It is what a forward whose global_xt plan holds the whole batch leaves in its workspace.
      const SpmmPlan plan = spmm_plan<T>(sh.m, sh.k, int64_t(p.row_idx.size()), sh.n, SpmmVariant::kGlobalXT, false);
      if (plan_transposes_whole_input(plan)) {
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
      const SddmmPlan own_plan = sddmm_plan<T>(d.w, sh.n, SddmmVariant::kRows);
      DeviceArray<unsigned char> ws(own_plan.workspace_bytes);
      DeviceArray<T> dv_own(nnz), dv_given(nnz);
      ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_own.ptr, own_plan, ws.ptr, nullptr).ok()));
      ASSERT_TRUE((cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_given.ptr, given_plan, nullptr, nullptr, x_t)
                       .ok()));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dv_given.host(), dv_own.host());
      expect_elementwise(dv_given.host(), ref_sddmm(p, dy64, x64, sh.n), 1e-5);

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
      const SddmmPlan own_adamw = sddmm_plan<T>(d.w, sh.n, SddmmVariant::kRows, SddmmEpilogue::kAdamW);
      const SddmmPlan given_adamw = sddmm_plan<T>(d.w, sh.n, SddmmVariant::kRows, SddmmEpilogue::kAdamW, stride);
      for (State* st : {own.get(), given.get()}) {
        const cuda::AdamWParameter<T> bias_param{st->bias.ptr, st->bias_m.ptr, st->bias_v.ptr, st->bias_step.ptr,
                                                 config};
        const cuda::AdamWParameter<T> param{st->values.ptr, st->exp_avg.ptr, st->exp_avg_sq.ptr, st->step.ptr,
                                            config};
        const bool with_x_t = st == given.get();
        ASSERT_TRUE((cuda::sddmm_adamw<T, Index>(d.w, dy.ptr, x.ptr, sh.n, param, &bias_param,
                                                 with_x_t ? given_adamw : own_adamw, with_x_t ? nullptr : ws.ptr,
                                                 nullptr, with_x_t ? x_t : cuda::TransposedInput<T>{})
                         .ok()));
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(given->values.host(), own->values.host());
      EXPECT_EQ(given->exp_avg.host(), own->exp_avg.host());
      EXPECT_EQ(given->exp_avg_sq.host(), own->exp_avg_sq.host());
      EXPECT_EQ(given->bias.host(), own->bias.host());
      EXPECT_EQ(given->step.host()[0], 3.0f);
      EXPECT_EQ(given->bias_step.host()[0], 6.0f);

      // A copy of a stride the kernel cannot read (not a multiple of 4) is refused by the planner (where there is a product
      // to compute), and a plan made for another input by the launch.
      Status refused;
      sddmm_plan<T>(d.w, sh.n, SddmmVariant::kRows, SddmmEpilogue::kStore, (sh.n + 3) / 4 * 4 - 2, &refused);
      EXPECT_EQ(refused.ok(), nnz == 0) << refused.message();
      refused = cuda::sddmm<T, Index>(d.w, dy.ptr, x.ptr, sh.n, dv_given.ptr, own_plan, ws.ptr, nullptr, x_t);
      EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.message();
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
  ASSERT_TRUE(cuda::bias_grad_adamw<float>(dy.ptr, n, m, {bias.ptr, exp_avg.ptr, exp_avg_sq.ptr, step.ptr, config},
                                           nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(cpu::bias_grad<float>(dy_h.data(), n, m, db_h.data()).ok());
  EXPECT_EQ(step.host()[0], 3.0f);  // advanced by the call
  ASSERT_TRUE(cpu::adamw_update<float>(db_h.data(), m, 3.0, config, bias_h.data(), exp_avg_h.data(),
                                       exp_avg_sq_h.data())
                  .ok());
  expect_elementwise(db.host(), ref_bias_grad(dy64, n, m), 1e-6);
  expect_elementwise(bias.host(), relative(widen(bias_h), 0.1), 1e-6);
  expect_elementwise(exp_avg.host(), relative(widen(exp_avg_h), 0.1), 1e-6);
  expect_elementwise(exp_avg_sq.host(), relative(widen(exp_avg_sq_h), 0.1), 1e-6);
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
    expect_elementwise(y.host(), ref_forward(p.dense, p.m, p.k, x64, n, nullptr), 1e-5);
    expect_elementwise(dx.host(), ref_transposed(p.dense, p.m, p.k, dy64, n), 1e-5);
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

  // The tile view: a block per band on the device, the same arrays as the host's walk.
  const int64_t ptr_len = tile_view_ptr_length(300, 211), entries_len = tile_view_entries_length(300, 211, nnz);
  DeviceArray<int32_t> tp(ptr_len);
  DeviceArray<uint32_t> te(entries_len);
  s = cuda::build_tile_view<uint16_t>(300, 211, nnz, ri.ptr, ci.ptr, rp.ptr, tp.ptr, te.ptr, nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  std::vector<int32_t> want_ptr(ptr_len);
  std::vector<uint32_t> want_entries(entries_len);
  ASSERT_TRUE(cpu::build_tile_view<uint16_t>(300, 211, nnz, p.row_idx.data(), p.col_idx.data(), p.row_ptr.data(),
                                             want_ptr.data(), want_entries.data())
                  .ok());
  EXPECT_EQ(tp.host(), want_ptr);
  EXPECT_EQ(te.host(), want_entries);

  // The packed tile values: the same words as the host's packing.
  std::vector<uint16_t> bits(static_cast<size_t>(nnz));
  for (int64_t i = 0; i < nnz; ++i) bits[size_t(i)] = uint16_t(0x3c00u + 3u * uint32_t(i));
  DeviceArray<uint16_t> dbits(bits);
  DeviceArray<uint32_t> packed(entries_len);
  s = cuda::pack_tile_values(300, 211, nnz, rp.ptr, te.ptr, dbits.ptr, packed.ptr, nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  std::vector<uint32_t> want_packed(entries_len);
  ASSERT_TRUE(cpu::pack_tile_values(300, 211, nnz, p.row_ptr.data(), want_entries.data(), bits.data(),
                                    want_packed.data())
                  .ok());
  EXPECT_EQ(packed.host(), want_packed);

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

// The attention entry points check their arrays before any launch: a missing or misaligned one is an
// InvalidArgument, not a fault (host pointers suffice: nothing is read).
TEST(CudaAttention, RefusesMissingOrMisalignedArrays) {
  const auto p = random_pattern<uint16_t>(6, 5, 12, 3, {});
  const SlotPattern<uint16_t> w = p.view();
  alignas(16) float rows[2 * 6 * 32 + 4] = {}, per_row[2 * 6] = {};
  const float* q = rows;
  float* out = rows;
  Status s = cuda::sparse_attention_forward<float, uint16_t>(w, q + 1, q, q, 2, 32, 1.f, false, out, per_row, nullptr,
                                                      cuda::AttentionBands::kAuto, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("q must start at a 16-byte boundary"), std::string::npos) << s.message();
  s = cuda::sparse_attention_forward<float, uint16_t>(w, q, nullptr, q, 2, 32, 1.f, false, out, per_row, nullptr,
                                                      cuda::AttentionBands::kAuto, nullptr);
  EXPECT_NE(s.message().find("k is null"), std::string::npos) << s.message();
  s = cuda::sparse_attention_backward<float, uint16_t>(w, q, q, q, per_row, q, 2, 32, 1.f, false, nullptr, out, out,
                                                       out, nullptr, cuda::AttentionBands::kAuto, nullptr);
  EXPECT_NE(s.message().find("row_dot is null"), std::string::npos) << s.message();
  s = cuda::sparse_attention_forward<float, uint16_t>(w, q, q, q, 2, 48, 1.f, false, out, per_row, nullptr,
                                                      cuda::AttentionBands::kAuto, nullptr);
  EXPECT_NE(s.message().find("head_dim 32, 64 or 128"), std::string::npos) << s.message();
  // In 16 bits at head_dim 64 the bands need their scratch.
  alignas(16) bfloat16 half_rows[2 * 6 * 64] = {};
  ASSERT_GT(cuda::sparse_attention_forward_workspace_bytes<bfloat16>(6, 2, 64, cuda::AttentionBands::kAuto), 0);
  EXPECT_EQ(cuda::sparse_attention_forward_workspace_bytes<bfloat16>(6, 2, 64, cuda::AttentionBands::kOff), 0);
  EXPECT_EQ(cuda::sparse_attention_forward_workspace_bytes<float>(6, 2, 64, cuda::AttentionBands::kAuto), 0);
  s = cuda::sparse_attention_forward<bfloat16, uint16_t>(w, half_rows, half_rows, half_rows, 2, 64, 1.f, false,
                                                         half_rows, per_row, nullptr, cuda::AttentionBands::kAuto,
                                                         nullptr);
  EXPECT_NE(s.message().find("workspace is null"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace snack::test
