// The CPU products' loops (loops.inc) in two builds: for the baseline ISA, and with GCC on x86-64
// for AVX2 with FMA (twice the vector width, a multiply-add in one instruction). Each build lives in
// its own namespace of internal linkage, so the linker never swaps one for the other, and
// with_loops(f) calls f with the Loops of the widest build this CPU runs. FMA rounds each
// multiply-add once, so the two builds' results differ in the last bits; on one machine they are
// always the same, whatever the threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "snack/activation.h"
#include "snack/batch_tiles.h"
#include "snack/pattern.h"
#include "snack/value_types.h"
#include "tiled.h"

namespace snack::cpu {
namespace {

namespace baseline {
constexpr int kVectorBytes = 16;
#include "loops.inc"
}  // namespace baseline

#if SNACK_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
constexpr int kVectorBytes = 32;
#include "loops.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

template <typename F>
void with_loops(F&& f) {
#if SNACK_CPU_AVX2
  if (tiled::has_avx2_fma()) return f(avx2::Loops{});
#endif
  f(baseline::Loops{});
}

}  // namespace
}  // namespace snack::cpu
