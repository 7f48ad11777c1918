// The per-token loops for x86-64 CPUs with AVX2 and FMA (8 floats per instruction), chosen at run time by
// dispatch.h. The target pragma comes after the system and c10 headers, so their inline functions keep the
// baseline instruction set, and before the kernel headers, whose helpers are always inlined into the loops
// (never emitted out of line, so no AVX2 symbol is shared with the generic build).
#if defined(__x86_64__) && defined(__GNUC__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#pragma GCC target("avx2,fma")
#define VCPO_ISA avx2
#include "token_loops_impl.h"
#endif
