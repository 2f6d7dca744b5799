// Construction of patterns on the CPU: sorting, validation errors, views, top-k.
#include "test_util.h"

namespace snack::test {
namespace {

TEST(SlotsFromCoo, SortsRowMajorAndReturnsOrder) {
  const std::vector<int64_t> rows{2, 0, 1, 0}, cols{1, 3, 0, 0};
  std::vector<uint16_t> ri(4), ci(4);
  std::vector<int64_t> order(4);
  ASSERT_TRUE(cpu::slots_from_coo<uint16_t>(3, 4, 4, rows.data(), cols.data(), ri.data(), ci.data(), order.data()).ok());
  EXPECT_EQ(ri, (std::vector<uint16_t>{0, 0, 1, 2}));
  EXPECT_EQ(ci, (std::vector<uint16_t>{0, 3, 0, 1}));
  EXPECT_EQ(order, (std::vector<int64_t>{3, 1, 2, 0}));
}

TEST(SlotsFromCoo, ReportsOutOfRangeAndDuplicates) {
  std::vector<int32_t> ri(3, -7), ci(3, -7);
  std::vector<int64_t> order(3, -7);
  const std::vector<int64_t> rows{0, 3, 1}, cols{0, 0, 0};
  Status s = cpu::slots_from_coo<int32_t>(3, 4, 3, rows.data(), cols.data(), ri.data(), ci.data(), order.data());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("rows[1]=3"), std::string::npos) << s.message();
  EXPECT_EQ(ri, std::vector<int32_t>(3, -7)) << "outputs untouched on error";

  const std::vector<int64_t> rows2{0, 1, 0}, cols2{2, 2, 2};
  s = cpu::slots_from_coo<int32_t>(3, 4, 3, rows2.data(), cols2.data(), ri.data(), ci.data(), order.data());
  EXPECT_EQ(s.code(), StatusCode::kDuplicateEntry);
  EXPECT_NE(s.message().find("(0, 2)"), std::string::npos) << s.message();

  const std::vector<int64_t> cols3{0, -1, 0};
  s = cpu::slots_from_coo<int32_t>(3, 4, 3, rows.data(), cols3.data(), ri.data(), ci.data(), order.data());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);

  EXPECT_EQ(cpu::slots_from_coo<int32_t>(1, 2, 3, rows.data(), cols.data(), ri.data(), ci.data(), order.data()).code(),
            StatusCode::kInvalidArgument);  // nnz > rows*cols
  EXPECT_EQ(cpu::slots_from_coo<uint16_t>(70000, 2, 0, nullptr, nullptr, nullptr, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);  // does not fit 16-bit indices
}

TEST(BuildViews, MatchesDefinitionWithEmptyRowsAndColumns) {
  auto p = random_pattern<uint16_t>(40, 23, 300, 11, {0, 7, 39});
  const int64_t nnz = p.row_idx.size();
  for (int64_t r = 0; r < p.m; ++r)
    for (int32_t s = p.row_ptr[r]; s < p.row_ptr[r + 1]; ++s) EXPECT_EQ(p.row_idx[s], r);
  EXPECT_EQ(p.row_ptr[0], 0);
  EXPECT_EQ(p.row_ptr[p.m], nnz);
  EXPECT_EQ(p.row_ptr[1], p.row_ptr[0]) << "row 0 is empty";
  std::vector<int> seen(nnz, 0);
  for (int64_t c = 0; c < p.k; ++c)
    for (int32_t j = p.col_ptr[c]; j < p.col_ptr[c + 1]; ++j) {
      const int32_t s = p.csc_perm[j];
      ++seen[s];
      EXPECT_EQ(p.col_idx[s], c);
      if (j > p.col_ptr[c]) EXPECT_LT(p.csc_perm[j - 1], s) << "rows ascend within a column";
    }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), nnz);
}

TEST(CheckSlots, AcceptsSortedUniqueInRangeAndNamesTheFirstBadSlot) {
  const std::vector<int32_t> rows{0, 0, 2}, cols{1, 3, 0};
  EXPECT_TRUE(cpu::check_slots<int32_t>(3, 4, 3, rows.data(), cols.data()).ok());
  EXPECT_TRUE(cpu::check_slots<int32_t>(3, 4, 0, nullptr, nullptr).ok());
  const auto code = [](std::vector<int32_t> r, std::vector<int32_t> c) {
    return cpu::check_slots<int32_t>(3, 4, int64_t(r.size()), r.data(), c.data());
  };
  EXPECT_EQ(code({0, 3}, {0, 0}).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(code({0, 0}, {0, 4}).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(code({-1, 0}, {0, 0}).code(), StatusCode::kOutOfRange);
  const Status dup = code({1, 1}, {2, 2});
  EXPECT_EQ(dup.code(), StatusCode::kDuplicateEntry);
  EXPECT_NE(dup.message().find("slots 0 and 1"), std::string::npos) << dup.message();
  const Status unsorted = code({0, 1, 0}, {0, 0, 3});
  EXPECT_EQ(unsorted.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unsorted.message().find("slot 2"), std::string::npos) << unsorted.message();
}

TEST(CheckPattern, AcceptsBuiltViewsAndRejectsEveryCorruption) {
  const auto p = random_pattern<uint16_t>(17, 13, 60, 5, {0, 16});
  EXPECT_TRUE(cpu::check_pattern(p.view()).ok());
  const auto corrupted = [&](auto edit) {
    auto q = p;
    edit(q);
    return cpu::check_pattern(q.view());
  };
  EXPECT_FALSE(corrupted([](auto& q) { q.row_ptr.back() += 1; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { q.row_ptr[3] = -4; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { q.col_ptr[1] = 1000; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { q.csc_perm[0] = 100000; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { q.csc_perm[0] = -1; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { q.csc_perm[1] = q.csc_perm[0]; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { q.col_idx[0] = 13; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { std::swap(q.csc_perm[0], q.csc_perm[q.csc_perm.size() - 1]); }).ok());
}

TEST(CheckPattern, ForwardOnlyPatternsReadTheirRowsFromRowPtr) {
  const auto p = random_pattern<uint16_t>(17, 13, 60, 5, {0, 16});
  const auto forward_only = [](SlotPattern<uint16_t> w) {
    w.row_idx = nullptr;
    w.csc_perm = nullptr;
    return w;
  };
  ASSERT_TRUE(forward_only(p.view()).forward_only());
  EXPECT_TRUE(cpu::check_pattern(forward_only(p.view())).ok());
  const auto corrupted = [&](auto edit) {
    auto q = p;
    edit(q);
    return cpu::check_pattern(forward_only(q.view()));
  };
  EXPECT_FALSE(corrupted([](auto& q) { q.row_ptr[5] = 1000; }).ok()) << "a range past nnz";
  EXPECT_FALSE(corrupted([](auto& q) { q.col_ptr[2] += 1; }).ok()) << "a column's count";
  EXPECT_FALSE(corrupted([](auto& q) { q.col_idx[0] = 13; }).ok());
  EXPECT_FALSE(corrupted([](auto& q) { std::swap(q.col_idx[0], q.col_idx[1]); }).ok()) << "unsorted in a row";
  // Only the arrays' absence is forward-only: one of them alone is a broken pattern.
  auto half = p.view();
  half.csc_perm = nullptr;
  EXPECT_FALSE(half.forward_only());
  EXPECT_FALSE(cpu::check_pattern(half).ok());
  // The products that need the dropped arrays say so.
  const Status refused = check_pattern_shape(forward_only(p.view()), PatternNeeds::kAll);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("only the forward's arrays"), std::string::npos) << refused.message();
  EXPECT_TRUE(check_pattern_shape(forward_only(p.view()), PatternNeeds::kForward).ok());
}

TEST(BuildViews, RejectsInvalidSlotsBeforeWriting) {
  const std::vector<int32_t> rows{0, 5}, cols{0, 1};
  std::vector<int32_t> rp(4, -9), cp(3, -9), perm(2, -9);
  const Status s = cpu::build_views<int32_t>(3, 2, 2, rows.data(), cols.data(), rp.data(), cp.data(), perm.data());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(rp, std::vector<int32_t>(4, -9)) << "nothing written for invalid slots";
}

TEST(BuildTileView, ListsEveryTileRowMajorAndChecksWithThePattern) {
  // 130 x 150: three bands (the last of 2 rows), three chunks (the last of 22 columns), empty rows.
  const int64_t m = 130, k = 150;
  const auto p = random_pattern<uint16_t>(m, k, 6000, 7, {0, 64, 129});
  const int64_t chunks = 3, nnz = int64_t(p.row_idx.size());
  std::vector<int32_t> tile_ptr(size_t(tile_view_ptr_length(m, k)), -1);
  std::vector<uint32_t> entries(size_t(tile_view_entries_length(m, k, nnz)), 77u);
  ASSERT_EQ(tile_ptr.size(), size_t(3 * chunks + 1));
  ASSERT_TRUE(cpu::build_tile_view<uint16_t>(m, k, nnz, p.row_idx.data(), p.col_idx.data(), p.row_ptr.data(),
                                             tile_ptr.data(), entries.data())
                  .ok());
  // Walking the tiles in order meets every slot once, each in its band, tile and row-major place.
  std::vector<int> seen(size_t(nnz), 0);
  EXPECT_EQ(tile_ptr.back(), nnz);
  for (int64_t b = 0; b < 3; ++b) {
    const int32_t first = p.row_ptr[b * 64];
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t previous = -1;
      for (int32_t e = tile_ptr[b * chunks + c]; e < tile_ptr[b * chunks + c + 1]; ++e) {
        const int64_t slot = first + int64_t(entries[e] >> kTileViewSlotShift), pos = entries[e] & 4095u;
        ASSERT_LT(slot, nnz);
        ++seen[slot];
        EXPECT_EQ(int64_t(p.row_idx[slot]), b * 64 + pos / 64);
        EXPECT_EQ(int64_t(p.col_idx[slot]), c * 64 + pos % 64);
        EXPECT_GT(pos, previous) << "row-major inside a tile";
        previous = pos;
      }
    }
  }
  EXPECT_EQ(seen, std::vector<int>(size_t(nnz), 1));
  for (size_t e = size_t(nnz); e < entries.size(); ++e) EXPECT_EQ(entries[e], 0u) << "padding";
  // check_pattern compares a given tile view with the one it derives.
  auto w = p.view();
  w.tile_ptr = tile_ptr.data();
  w.tile_entries = entries.data();
  EXPECT_TRUE(cpu::check_pattern(w).ok());
  std::swap(entries[0], entries[1]);
  EXPECT_FALSE(cpu::check_pattern(w).ok());
  // No view past kTileViewMaxCols inputs: nothing to write, nothing required.
  EXPECT_EQ(tile_view_ptr_length(4, kTileViewMaxCols + 1), 0);
  EXPECT_TRUE(cpu::build_tile_view<int32_t>(4, kTileViewMaxCols + 1, 0, nullptr, nullptr, nullptr, nullptr, nullptr).ok());
}

TEST(PackTileValues, EachEntryCarriesItsSlotsValueAndKeepsItsPosition) {
  const int64_t m = 130, k = 150;
  const auto p = random_pattern<uint16_t>(m, k, 6000, 11, {3, 64});
  const int64_t nnz = int64_t(p.row_idx.size());
  std::vector<int32_t> tile_ptr(size_t(tile_view_ptr_length(m, k)));
  std::vector<uint32_t> entries(size_t(tile_view_entries_length(m, k, nnz)));
  ASSERT_TRUE(cpu::build_tile_view<uint16_t>(m, k, nnz, p.row_idx.data(), p.col_idx.data(), p.row_ptr.data(),
                                             tile_ptr.data(), entries.data())
                  .ok());
  std::vector<uint16_t> bits(static_cast<size_t>(nnz));
  for (int64_t s = 0; s < nnz; ++s) bits[size_t(s)] = uint16_t(0x8001u + 7u * uint32_t(s));  // every value told apart
  std::vector<uint32_t> packed(entries.size(), 0xdeadbeefu);
  ASSERT_TRUE(cpu::pack_tile_values(m, k, nnz, p.row_ptr.data(), entries.data(), bits.data(), packed.data()).ok());
  for (int64_t b = 0; b < tile_view_bands(m); ++b) {
    const int32_t first = p.row_ptr[b * kTileViewRows], last = p.row_ptr[std::min(m, (b + 1) * kTileViewRows)];
    for (int32_t e = first; e < last; ++e) {
      const uint32_t slot = uint32_t(first) + (entries[size_t(e)] >> kTileViewSlotShift);
      EXPECT_EQ(packed[size_t(e)] >> kTilePackedValueShift, bits[slot]) << "entry " << e;
      EXPECT_EQ(packed[size_t(e)] & 0xffffu, entries[size_t(e)] & 4095u) << "entry " << e;
    }
  }
  for (size_t e = size_t(nnz); e < packed.size(); ++e) EXPECT_EQ(packed[e], 0u) << "padding";
  // A pattern without the view (wider than kTileViewMaxCols, or empty) has nothing to pack into.
  const Status wide = cpu::pack_tile_values(4, kTileViewMaxCols + 1, 0, p.row_ptr.data(), nullptr, nullptr, nullptr);
  EXPECT_EQ(wide.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wide.message().find("no tile view"), std::string::npos) << wide.message();
  EXPECT_FALSE(cpu::pack_tile_values(m, k, nnz, p.row_ptr.data(), entries.data(), nullptr, packed.data()).ok());
}

TEST(BuildViews, EmptyPattern) {
  std::vector<int32_t> rp(4, -1), cp(3, -1);
  ASSERT_TRUE(cpu::build_views<int32_t>(3, 2, 0, nullptr, nullptr, rp.data(), cp.data(), nullptr).ok());
  EXPECT_EQ(rp, std::vector<int32_t>(4, 0));
  EXPECT_EQ(cp, std::vector<int32_t>(3, 0));
}

TEST(DenseTopk, LargestMagnitudesTiesToSmallerPosition) {
  const std::vector<float> w{0.5f, -3.f, 0.f, 1.f, 1.f, 2.f, -1.f, 0.25f};
  std::vector<int64_t> pos(4);
  ASSERT_TRUE(cpu::dense_topk_positions<float>(2, 4, w.data(), 4, pos.data()).ok());
  EXPECT_EQ(pos, (std::vector<int64_t>{1, 3, 4, 5}));
  std::vector<float> bad = w;
  bad[6] = INFINITY;
  Status s = cpu::dense_topk_positions<float>(2, 4, bad.data(), 4, pos.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("(1, 2)"), std::string::npos) << s.message();
  EXPECT_EQ(cpu::dense_topk_positions<float>(2, 4, w.data(), 9, pos.data()).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace snack::test
