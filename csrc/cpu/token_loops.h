// The per-token loops over a range of sequences. They are compiled once per instruction set, in
// loops_generic.cpp and loops_avx2.cpp, each in its own namespace (vcpo::generic, vcpo::avx2) so the two
// builds never share a symbol; dispatch.h declares them and picks one at run time.
#pragma once

#include "logit_rows.h"
#include "sequence_stats.h"
#include "token_pass.h"
#include "trust_region.h"

// Declarations of the loops of one instruction set.
#define VCPO_DECLARE_LOOPS(ISA)                                                                             \
  namespace vcpo {                                                                                          \
  namespace ISA {                                                                                           \
  template <typename lp_t, typename ref_t, typename acc_t>                                                  \
  void sequence_sums(const TokenView& v, int64_t first, int64_t last, const SequenceSums<acc_t>& out);      \
  template <bool WriteGrad, bool TokenLevel, typename lp_t, typename ref_t, typename acc_t>                 \
  void token_pass_range(const TokenView& v, int64_t first, int64_t last, const acc_t* adv,                  \
                        const acc_t* grad_scale, const LossParams<acc_t>& p, const TokenSums<acc_t>& sums, \
                        lp_t* grad);                                                                        \
  template <typename acc_t>                                                                                 \
  void logit_rows_forward(const LogitRows<acc_t>& r, int64_t first, int64_t last, const RowStats<acc_t>& out); \
  template <typename acc_t>                                                                                 \
  void logit_rows_backward(const LogitRows<acc_t>& r, int64_t first, int64_t last, const RowGrads<acc_t>& g); \
  }                                                                                                         \
  }

// Explicit instantiations for every (logp, behavior/old, accumulation) dtype the ops accept.
#define VCPO_INSTANTIATE_LOOPS_FOR(LP, REF, ACC)                                                             \
  template void sequence_sums<LP, REF, ACC>(const TokenView&, int64_t, int64_t, const SequenceSums<ACC>&); \
  VCPO_INSTANTIATE_TOKEN_PASS(false, false, LP, REF, ACC)                                                  \
  VCPO_INSTANTIATE_TOKEN_PASS(false, true, LP, REF, ACC)                                                   \
  VCPO_INSTANTIATE_TOKEN_PASS(true, false, LP, REF, ACC)                                                   \
  VCPO_INSTANTIATE_TOKEN_PASS(true, true, LP, REF, ACC)
#define VCPO_INSTANTIATE_TOKEN_PASS(W, TL, LP, REF, ACC)                                                   \
  template void token_pass_range<W, TL, LP, REF, ACC>(const TokenView&, int64_t, int64_t, const ACC*,      \
                                                      const ACC*, const LossParams<ACC>&,                   \
                                                      const TokenSums<ACC>&, LP*);
#define VCPO_INSTANTIATE_LOGIT_ROWS(ACC)                                                                    \
  template void logit_rows_forward<ACC>(const LogitRows<ACC>&, int64_t, int64_t, const RowStats<ACC>&);  \
  template void logit_rows_backward<ACC>(const LogitRows<ACC>&, int64_t, int64_t, const RowGrads<ACC>&);
#define VCPO_INSTANTIATE_LOOPS()                                  \
  VCPO_INSTANTIATE_LOGIT_ROWS(float)                              \
  VCPO_INSTANTIATE_LOGIT_ROWS(double)                             \
  VCPO_INSTANTIATE_LOOPS_FOR(float, float, float)                 \
  VCPO_INSTANTIATE_LOOPS_FOR(double, double, double)              \
  VCPO_INSTANTIATE_LOOPS_FOR(double, float, double)               \
  VCPO_INSTANTIATE_LOOPS_FOR(c10::BFloat16, c10::BFloat16, float) \
  VCPO_INSTANTIATE_LOOPS_FOR(c10::BFloat16, float, float)         \
  VCPO_INSTANTIATE_LOOPS_FOR(c10::Half, c10::Half, float)         \
  VCPO_INSTANTIATE_LOOPS_FOR(c10::Half, float, float)
