// Per-step kernels of the vLLM proposer's batch (dasrl/integrations/vllm/tracker.py) and of the priced policy
// (dasrl/policy/allowance.py): the same arithmetic as the numpy code they replace, operation for operation and in
// the same order (this file is compiled without floating-point contraction), so their results are the numpy
// results bit for bit. The tables they read (expected tokens per forward, built with numpy's power) come from
// numpy: a transcendental function is never recomputed here but for log, which Python's math.log takes from
// the same C library.
#pragma once

#include <cstdint>

#include "suffix_index.hpp"

namespace dasrl {

// The pricing of ForwardAllowance._priced over one batch of B rows and D draft lengths: row[b] + c_tok * d +
// kv[b] * [d > 0] the row's seconds per forward at draft length d without its share (_Prices.cost), e[b, d] its
// expected tokens per forward (_Prices.e, numpy's), most[b] its
// longest allowed draft (nullptr: every length allowed), pu[b] its acceptance in [0, 1]. Writes each row's
// priced draft (best), what it drafts (need), its share of c_base and its extra cost of drafting (kv[b] plus its
// share of c_draft); returns the critical group's size (0: no group).
struct Split {
  int64_t size;  // rows in the critical group
  int64_t m;     // the group size the shares were priced at
  double horizon;
};
Split price_split(const double* row, double c_tok, const double* e, int64_t B, int64_t D, const int64_t* most,
                  const double* remaining, const double* pu, const double* kv, double c_base, double c_draft, int64_t* best,
                  int64_t* need, double* share, double* extra);

// dst[slots[j], :keep[j]] = src[starts[j] : starts[j] + keep[j]] (dst: rows of width k).
void scatter_rows(Token* dst, int64_t k, const int64_t* slots, const Token* src, const int64_t* starts, const int64_t* keep,
                  int64_t n);

// numpy's float64 sum (add.reduce over a contiguous run: pairwise, blocks of 128, eight accumulators).
double numpy_sum(const double* a, int64_t n);

// match_capped then ForwardAllowance._trim over the flat chain drafts of n rows (probs[offsets[b]..offsets[b+1])):
// keep[b] the nodes row b keeps (factor > 0: at most factor x match_len[b]; then, where priced[b], the prefix with
// the fewest expected seconds per token at its share[b], row[b], extra[b]), expected[b] the calibrated path
// probabilities its kept nodes sum to (NaN where not cut by price or nothing kept).
void cut_chains(const double* probs, const int64_t* offsets, const int64_t* match_len, int64_t n, double factor,
                const uint8_t* priced, const double* share, const double* row, const double* extra, double c_tok,
                double calib, int64_t* keep, double* expected);

// CountingDrafter's pattern test (dasrl/drafter/counting.py): for each tail tokens[offsets[b]..offsets[b+1]), the
// shortest period P <= max_period (with a number item among its last P items) whose last three windows of P items
// are alike, 0 if none. Items: a non-digit token (keyed by its id) or a number (a run of digit tokens, keyed -1);
// the digits after the last non-digit token are the partial number, not an item, and a leading digit run (the
// window may have cut it) is none. digits: the 10 digit token ids.
void count_periods(const int64_t* tokens, const int64_t* offsets, int64_t n, const int64_t* digits, int64_t max_period,
                   int64_t* out);
// The same for the tails tokens[rows[i], start[i] : start[i] + count[i]] of a [R, width] table.
template <class T>
void count_periods_rows(const T* tokens, int64_t width, const int64_t* rows, const int64_t* start, const int64_t* count,
                        int64_t n, const int64_t* digits, int64_t max_period, int64_t* out);

// Leading draft tokens (drafts[j, :dlen[j]], rows of width k) equal to the tokens emitted after them
// (tokens[rows[j], start[j] : start[j] + count[j]], the last compared with nothing).
template <class T>
void accepted_rows(const Token* drafts, int64_t k, const int64_t* dlen, const T* tokens, int64_t width, const int64_t* rows,
                   const int64_t* start, const int64_t* count, int64_t n, int64_t* out);

// The first bad token of tokens[rows[i], start[i] : start[i] + count[i]] over i (a negative one anywhere first,
// else one >= limit), as (i, offset); (-1, -1) when all are good.
template <class T>
std::pair<int64_t, int64_t> first_bad_rows(const T* tokens, int64_t width, const int64_t* rows, const int64_t* start,
                                           const int64_t* count, int64_t n, int64_t limit);

// cursors[i] takes tokens[rows[i], start[i] : start[i] + count[i]] (checked by first_bad_rows).
template <class T>
void extend_rows(Cursor* const* cursors, const T* tokens, int64_t width, const int64_t* rows, const int64_t* start,
                 const int64_t* count, int64_t n);

}  // namespace dasrl
