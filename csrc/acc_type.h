// The accumulation type of the kernels: fp64 inputs accumulate in fp64, everything else (fp32, bf16, fp16) in
// fp32 (acc_dtype in entry_points.h is the same rule on torch dtypes).
#pragma once

#include <type_traits>

namespace vcpo {

template <typename T>
using acc_type = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

}  // namespace vcpo
