// Helpers of the core C++ tests: a host-side pattern built through the core, dense float64 references.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "snack/ops.h"
#include "snack/topology.h"

namespace snack::test {

// A pattern in host memory, owning its arrays, built with snack::cpu::slots_from_coo + build_views.
template <typename Index>
struct HostPattern {
  int64_t m = 0, k = 0;
  std::vector<Index> row_idx, col_idx;
  std::vector<int32_t> row_ptr, col_ptr, csc_perm;
  std::vector<double> values;  // in slot order
  std::vector<double> dense;   // m x k

  SlotPattern<Index> view() const {
    SlotPattern<Index> w;
    w.rows = m;
    w.cols = k;
    w.nnz = static_cast<int64_t>(row_idx.size());
    w.row_idx = row_idx.data();
    w.col_idx = col_idx.data();
    w.row_ptr = row_ptr.data();
    w.col_ptr = col_ptr.data();
    w.csc_perm = csc_perm.data();
    return w;
  }
};

template <typename Index>
HostPattern<Index> pattern_from(int64_t m, int64_t k, const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
                                const std::vector<double>& vals);

template <typename Index>
HostPattern<Index> random_pattern_impl(int64_t m, int64_t k, int64_t nnz, uint32_t seed, std::vector<int64_t> empty_rows) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> allowed;
  for (int64_t r = 0; r < m; ++r) {
    if (std::find(empty_rows.begin(), empty_rows.end(), r) != empty_rows.end()) continue;
    for (int64_t c = 0; c < k; ++c) allowed.push_back(r * k + c);
  }
  std::shuffle(allowed.begin(), allowed.end(), rng);
  nnz = std::min<int64_t>(nnz, static_cast<int64_t>(allowed.size()));
  std::vector<int64_t> rows(nnz), cols(nnz);
  for (int64_t i = 0; i < nnz; ++i) {
    rows[i] = allowed[i] / k;
    cols[i] = allowed[i] % k;
  }
  std::normal_distribution<double> normal;
  std::vector<double> vals(nnz);
  for (auto& v : vals) v = normal(rng);
  return pattern_from<Index>(m, k, rows, cols, vals);
}

// nnz random distinct positions (rows listed in `empty_rows` stay empty), random values.
template <typename Index>
HostPattern<Index> random_pattern(int64_t m, int64_t k, int64_t nnz, uint32_t seed, std::vector<int64_t> empty_rows = {}) {
  return random_pattern_impl<Index>(m, k, nnz, seed, std::move(empty_rows));
}

// The first `full_rows` rows completely filled, plus `extra` random positions below them: row
// lengths far above the average (the kernels split such rows over a whole block).
template <typename Index>
HostPattern<Index> skewed_pattern(int64_t m, int64_t k, int64_t full_rows, int64_t extra, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> rows, cols, rest;
  for (int64_t r = 0; r < full_rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      rows.push_back(r);
      cols.push_back(c);
    }
  for (int64_t p = full_rows * k; p < m * k; ++p) rest.push_back(p);
  std::shuffle(rest.begin(), rest.end(), rng);
  for (int64_t i = 0; i < extra && i < int64_t(rest.size()); ++i) {
    rows.push_back(rest[i] / k);
    cols.push_back(rest[i] % k);
  }
  std::normal_distribution<double> normal;
  std::vector<double> vals(rows.size());
  for (auto& v : vals) v = normal(rng);
  return pattern_from<Index>(m, k, rows, cols, vals);
}

template <typename Index>
HostPattern<Index> pattern_from(int64_t m, int64_t k, const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
                                const std::vector<double>& vals) {
  const int64_t nnz = static_cast<int64_t>(rows.size());
  HostPattern<Index> p;
  p.m = m;
  p.k = k;
  p.row_idx.resize(nnz);
  p.col_idx.resize(nnz);
  std::vector<int64_t> order(nnz);
  Status s = cpu::slots_from_coo<Index>(m, k, nnz, rows.data(), cols.data(), p.row_idx.data(), p.col_idx.data(), order.data());
  EXPECT_TRUE(s.ok()) << s.message();
  p.row_ptr.resize(m + 1);
  p.col_ptr.resize(k + 1);
  p.csc_perm.resize(nnz);
  s = cpu::build_views<Index>(m, k, nnz, p.row_idx.data(), p.col_idx.data(), p.row_ptr.data(), p.col_ptr.data(),
                              p.csc_perm.data());
  EXPECT_TRUE(s.ok()) << s.message();
  p.values.resize(nnz);
  for (int64_t s2 = 0; s2 < nnz; ++s2) p.values[s2] = vals[order[s2]];
  p.dense.assign(m * k, 0.0);
  for (int64_t i = 0; i < nnz; ++i) p.dense[rows[i] * k + cols[i]] = vals[i];
  return p;
}

inline std::vector<double> random_dense(int64_t count, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> v(count);
  for (auto& x : v) x = normal(rng);
  return v;
}

template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// ||out - ref|| / ||ref||; fails on non-finite outputs.
template <typename T>
double rel_error(const std::vector<T>& out, const std::vector<double>& ref) {
  EXPECT_EQ(out.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(std::isfinite(static_cast<double>(out[i]))) << "element " << i << " not finite (unwritten?)";
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Dense float64 references.
inline std::vector<double> ref_forward(const std::vector<double>& dense, int64_t m, int64_t k, const std::vector<double>& x,
                                       int64_t n, const std::vector<double>* bias) {
  std::vector<double> y(n * m);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < m; ++r) {
      double acc = bias ? (*bias)[r] : 0.0;
      for (int64_t c = 0; c < k; ++c) acc += dense[r * k + c] * x[i * k + c];
      y[i * m + r] = acc;
    }
  return y;
}

inline std::vector<double> ref_transposed(const std::vector<double>& dense, int64_t m, int64_t k,
                                          const std::vector<double>& dy, int64_t n) {
  std::vector<double> dx(n * k, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k; ++c) dx[i * k + c] += dy[i * m + r] * dense[r * k + c];
  return dx;
}

template <typename Index>
std::vector<double> ref_sddmm(const HostPattern<Index>& p, const std::vector<double>& dy, const std::vector<double>& x,
                              int64_t n) {
  std::vector<double> dv(p.row_idx.size());
  for (size_t s = 0; s < dv.size(); ++s) {
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += dy[i * p.m + p.row_idx[s]] * x[i * p.k + p.col_idx[s]];
    dv[s] = acc;
  }
  return dv;
}

struct Shape {
  int64_t m, k, n, nnz;
  std::vector<int64_t> empty_rows;
};

inline std::vector<Shape> odd_shapes() {
  return {{1, 1, 1, 1, {}},       {7, 13, 3, 40, {2}},     {33, 65, 1, 200, {0, 5, 32}},
          {64, 37, 17, 500, {3}}, {130, 257, 5, 1700, {}}, {9, 11, 4, 0, {}},
          {300, 50, 33, 1500, {}}};
}

}  // namespace snack::test
