// Helpers of the core C++ tests: a host-side pattern built through the core, dense float64 references.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "snack/sddmm.h"
#include "snack/spmm.h"
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

// A float64 reference of sums of products: each element's value and the sum of its terms'
// magnitudes, the scale its rounding error is measured against (an element-wise bound that holds
// for cancelling sums too).
struct Reference {
  std::vector<double> value, scale;
};

// Every out[i] finite and within tol * scale[i] of value[i] (tol: the unit roundoff of the type
// the sums ran in, with room for their length); reports the first offenders.
template <typename T>
void expect_elementwise(const std::vector<T>& out, const Reference& ref, double tol) {
  ASSERT_EQ(out.size(), ref.value.size());
  int reported = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = double(out[i]);
    const double bound = tol * ref.scale[i] + 1e-300;
    if (!std::isfinite(o) || std::abs(o - ref.value[i]) > bound) {
      ADD_FAILURE() << "element " << i << ": " << o << " vs " << ref.value[i] << " (bound " << bound << ")";
      if (++reported == 5) return;
    }
  }
}

// A reference whose elements are exact (copies, counts): scale 1, so tol is absolute.
inline Reference exact(std::vector<double> value) {
  Reference r{std::move(value), {}};
  r.scale.assign(r.value.size(), 1.0);
  return r;
}

// A reference of values computed elsewhere in other rounding (an optimizer's update, whose terms
// are of order 1 even where its result is not: floor 0.1): scale |value| + floor.
inline Reference relative(const std::vector<double>& value, double floor) {
  Reference r{value, std::vector<double>(value.size())};
  for (size_t i = 0; i < value.size(); ++i) r.scale[i] = std::abs(value[i]) + floor;
  return r;
}

template <typename T>
std::vector<double> widen(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Unit roundoff with room for the sums' length: fp32 and fp64 kernels.
template <typename T>
double tol() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

// Dense float64 references.
inline Reference ref_forward(const std::vector<double>& dense, int64_t m, int64_t k, const std::vector<double>& x,
                             int64_t n, const std::vector<double>* bias) {
  Reference y{std::vector<double>(n * m), std::vector<double>(n * m)};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < m; ++r) {
      double acc = bias ? (*bias)[r] : 0.0, mag = bias ? std::abs((*bias)[r]) : 0.0;
      for (int64_t c = 0; c < k; ++c) {
        acc += dense[r * k + c] * x[i * k + c];
        mag += std::abs(dense[r * k + c] * x[i * k + c]);
      }
      y.value[i * m + r] = acc;
      y.scale[i * m + r] = mag;
    }
  return y;
}

// y[b, r, p] = sum_c dense[r, c] x[b, c, p] + bias[r]: x [images, k, pixels], y [images, m, pixels];
// each image is ref_forward of its pixels as rows.
inline Reference ref_channels_first(const std::vector<double>& dense, int64_t m, int64_t k, const std::vector<double>& x,
                                    int64_t images, int64_t pixels, const std::vector<double>& bias) {
  Reference y{std::vector<double>(images * m * pixels), std::vector<double>(images * m * pixels)};
  std::vector<double> rows(pixels * k);
  for (int64_t b = 0; b < images; ++b) {
    for (int64_t c = 0; c < k; ++c)
      for (int64_t p = 0; p < pixels; ++p) rows[p * k + c] = x[(b * k + c) * pixels + p];
    const Reference image = ref_forward(dense, m, k, rows, pixels, &bias);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t p = 0; p < pixels; ++p) {
        y.value[(b * m + r) * pixels + p] = image.value[p * m + r];
        y.scale[(b * m + r) * pixels + p] = image.scale[p * m + r];
      }
  }
  return y;
}

inline Reference ref_transposed(const std::vector<double>& dense, int64_t m, int64_t k, const std::vector<double>& dy,
                                int64_t n) {
  Reference dx{std::vector<double>(n * k, 0.0), std::vector<double>(n * k, 0.0)};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k; ++c) {
        dx.value[i * k + c] += dy[i * m + r] * dense[r * k + c];
        dx.scale[i * k + c] += std::abs(dy[i * m + r] * dense[r * k + c]);
      }
  return dx;
}

template <typename Index>
Reference ref_sddmm(const HostPattern<Index>& p, const std::vector<double>& dy, const std::vector<double>& x,
                    int64_t n) {
  Reference dv{std::vector<double>(p.row_idx.size()), std::vector<double>(p.row_idx.size())};
  for (size_t s = 0; s < dv.value.size(); ++s) {
    double acc = 0, mag = 0;
    for (int64_t i = 0; i < n; ++i) {
      acc += dy[i * p.m + p.row_idx[s]] * x[i * p.k + p.col_idx[s]];
      mag += std::abs(dy[i * p.m + p.row_idx[s]] * x[i * p.k + p.col_idx[s]]);
    }
    dv.value[s] = acc;
    dv.scale[s] = mag;
  }
  return dv;
}

inline Reference ref_bias_grad(const std::vector<double>& dy, int64_t n, int64_t m) {
  Reference db{std::vector<double>(m, 0.0), std::vector<double>(m, 0.0)};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < m; ++r) {
      db.value[r] += dy[i * m + r];
      db.scale[r] += std::abs(dy[i * m + r]);
    }
  return db;
}

struct Shape {
  int64_t m, k, n, nnz;
  std::vector<int64_t> empty_rows;
};

inline std::vector<Shape> odd_shapes() {
  return {{1, 1, 1, 1, {}},       {7, 13, 3, 40, {2}},     {33, 65, 1, 200, {0, 5, 32}},
          {64, 37, 17, 500, {3}}, {130, 257, 5, 1700, {}}, {9, 11, 4, 0, {}},
          {300, 50, 33, 1500, {}}, {12, 9, 2, 50, {1}}};
}

}  // namespace snack::test
