// nanobind bindings: dasrl._core. Validation with friendly messages lives in dasrl/drafter/suffix.py;
// these entry points still refuse what would corrupt the index (negative or out-of-range tokens,
// unknown sequences) with an exception, or report the first bad token's position without changing
// anything (the hot-path calls Cursor.extend and extend_batch).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "rows.hpp"
#include "suffix_index.hpp"

namespace nb = nanobind;
using namespace dasrl;

using AnyArray = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>;  // any dtype, checked below
using I64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F64Array = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F64Table = nb::ndarray<const double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8Array = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using TokTable = nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>;  // int32 or int64, checked below
using DraftTable = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// Calls f with the token table's typed pointer (int32 or int64 rows; anything else: TypeError).
template <class F> static auto with_rows(const TokTable& t, F f) {
  if (t.dtype() == nb::dtype<int32_t>()) return f(static_cast<const int32_t*>(t.data()));
  if (t.dtype() == nb::dtype<int64_t>()) return f(static_cast<const int64_t*>(t.data()));
  throw nb::type_error("token rows must be an int32 or int64 array");
}

// rows[i], start[i], count[i] must name a run inside the [R, W] table.
static void check_runs(const TokTable& t, const I64Array& rows, const I64Array& start, const I64Array& count, size_t n) {
  if (rows.shape(0) != n || start.shape(0) != n || count.shape(0) != n)
    throw nb::value_error("rows, start and count need one entry per row");
  const int64_t R = int64_t(t.shape(0)), W = int64_t(t.shape(1));
  for (size_t i = 0; i < n; ++i)
    if (rows.data()[i] < 0 || rows.data()[i] >= R || start.data()[i] < 0 || count.data()[i] < 0 ||
        start.data()[i] + count.data()[i] > W)
      throw nb::value_error(("run " + std::to_string(i) + " lies outside the token rows").c_str());
}
constexpr int64_t kTokenLimit = int64_t(INT32_MAX) + 1;

template <class T>
static nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

// Token ids of an integer array of any width: the array itself when int32, else a copy into buf.
// bad = the first position outside [0, limit) (-1: none); a non-integer dtype throws TypeError.
static const Token* token_view(const AnyArray& a, int64_t limit, std::vector<Token>& buf, int64_t& bad) {
  size_t n = a.shape(0);
  auto as = [&](auto tag) -> const Token* {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(a.data());
    bad = first_out_of_range(p, n, std::min(limit, kTokenLimit));
    if constexpr (std::is_same_v<T, Token>) {
      return p;
    } else {
      if (bad < 0) buf.assign(p, p + n);
      return buf.data();
    }
  };
  nb::dlpack::dtype d = a.dtype();
  if (n == 0) { bad = -1; return nullptr; }
  if (d == nb::dtype<int32_t>()) return as(int32_t{});
  if (d == nb::dtype<int64_t>()) return as(int64_t{});
  if (d == nb::dtype<uint32_t>()) return as(uint32_t{});
  if (d == nb::dtype<uint64_t>()) return as(uint64_t{});
  if (d == nb::dtype<int16_t>()) return as(int16_t{});
  if (d == nb::dtype<uint16_t>()) return as(uint16_t{});
  if (d == nb::dtype<int8_t>()) return as(int8_t{});
  if (d == nb::dtype<uint8_t>()) return as(uint8_t{});
  throw nb::type_error("token ids must be an integer array");
}

// For the entry points that throw: a view of valid tokens, or ValueError naming the first bad one.
static const Token* checked_tokens(const AnyArray& a, std::vector<Token>& buf) {
  int64_t bad;
  const Token* p = token_view(a, kTokenLimit, buf, bad);
  if (bad >= 0) throw nb::value_error(("token id out of range [0, 2^31) at position " + std::to_string(bad)).c_str());
  return p;
}

static nb::tuple batch_tuple(DraftOut&& d) {
  return nb::make_tuple(to_numpy(std::move(d.tokens)), to_numpy(std::move(d.parents)), to_numpy(std::move(d.probs)),
                        to_numpy(std::move(d.offsets)), to_numpy(std::move(d.match_len)));
}

NB_MODULE(_core, m) {
  m.doc() = "dasrl native core: the suffix index behind the history drafter";
  m.attr("ORDER") = kOrder;
  m.attr("MAX_OCCURRENCES") = kMaxOccurrences;
  m.attr("MAX_DRAFT") = kMaxDraft;
  m.attr("SCORE_TIE") = kScoreTie;

  nb::class_<SuffixIndex>(m, "SuffixIndex")
      .def(nb::init<>())
      .def("add", [](SuffixIndex& s, int64_t id, AnyArray t, double w) {
            std::vector<Token> buf;
            const Token* p = checked_tokens(t, buf);
            std::unique_lock lock(s.mutex);
            s.add(id, p, t.shape(0), w);
          }, nb::arg("seq_id"), nb::arg("tokens"), nb::arg("weight") = 1.0)
      .def("append", [](SuffixIndex& s, int64_t id, AnyArray t) {
            std::vector<Token> buf;
            const Token* p = checked_tokens(t, buf);
            std::unique_lock lock(s.mutex);
            s.append(id, p, t.shape(0));
          }, nb::arg("seq_id"), nb::arg("tokens"))
      .def("remove", [](SuffixIndex& s, int64_t id) { std::unique_lock lock(s.mutex); s.remove(id); }, nb::arg("seq_id"))
      .def("set_weight", [](SuffixIndex& s, int64_t id, double w) { std::unique_lock lock(s.mutex); s.set_weight(id, w); })
      .def("scale_weights", [](SuffixIndex& s, double f) { std::unique_lock lock(s.mutex); s.scale_weights(f); })
      .def("__contains__", &SuffixIndex::contains)
      .def("seq_len", &SuffixIndex::seq_len)
      .def("tokens", [](const SuffixIndex& s, int64_t id) { return to_numpy(s.tokens(id)); })
      .def("weight", &SuffixIndex::weight)
      .def("ids", &SuffixIndex::ids)
      .def_prop_ro("num_sequences", &SuffixIndex::num_sequences)
      .def_prop_ro("num_tokens", &SuffixIndex::num_tokens)
      .def("bytes_used", [](const SuffixIndex& s) { std::shared_lock lock(s.mutex); return s.bytes_used(); })
      .def("check_integrity", [](const SuffixIndex& s) { std::shared_lock lock(s.mutex); s.check_integrity(); })
      .def("propose", [](const SuffixIndex& s, AnyArray ctx, int budget, int max_match, double min_prob, int branching) {
            if (max_match < 1 || branching < 1) throw nb::value_error("max_match and branching must be >= 1");
            std::vector<Token> buf;
            const Token* c = checked_tokens(ctx, buf);
            DraftOut out;
            {
              nb::gil_scoped_release release;
              std::shared_lock lock(s.mutex);
              Scratch scratch;
              s.draft(s.match(c, ctx.shape(0), max_match), std::clamp(budget, 0, kMaxDraft),
                      DraftParams{max_match, min_prob, branching}, out, scratch);
            }
            int64_t mlen = out.match_len[0];
            return nb::make_tuple(to_numpy(std::move(out.tokens)), to_numpy(std::move(out.parents)),
                                  to_numpy(std::move(out.probs)), mlen);
          }, nb::arg("context"), nb::arg("budget"), nb::arg("max_match") = 64, nb::arg("min_prob") = 0.0,
          nb::arg("branching") = 1);

  nb::class_<Cursor>(m, "Cursor")
      .def(nb::init<std::shared_ptr<SuffixIndex>, int, int64_t>(), nb::arg("index"), nb::arg("max_match") = 64,
           nb::arg("seq_id") = -1)
      // -1 when every token is in [0, limit) and was appended; else the first bad position, nothing changed.
      .def("extend", [](Cursor& c, AnyArray t, int64_t limit) {
            std::vector<Token> buf;
            int64_t bad;
            const Token* p = token_view(t, limit, buf, bad);
            if (bad < 0) c.extend(p, t.shape(0));
            return bad;
          }, nb::arg("tokens"), nb::arg("limit") = kTokenLimit)
      .def("add_source", &Cursor::add_source, nb::arg("index"), nb::arg("seq_id") = -1)
      .def("context", [](const Cursor& c) { return to_numpy(std::vector<Token>(c.context())); })
      .def_prop_ro("context_len", [](const Cursor& c) { return c.context().size(); })
      .def_prop_ro("index", &Cursor::index)
      .def_prop_ro("sources", [](const Cursor& c) {
            std::vector<std::shared_ptr<SuffixIndex>> out;
            for (const auto& src : c.sources()) out.push_back(src.index);
            return out;
          })
      .def_prop_ro("max_match", &Cursor::max_match)
      .def_prop_ro("seq_id", &Cursor::seq_id);

  m.def("first_out_of_range", [](AnyArray t, int64_t limit) {
        std::vector<Token> buf;
        int64_t bad;
        token_view(t, limit, buf, bad);
        return bad;
      }, nb::arg("tokens"), nb::arg("limit") = kTokenLimit);

  // One call for a whole batch: drafts for cursors[i] capped at budgets[i], flat with offsets.
  m.def("propose_batch", [](const std::vector<Cursor*>& cursors, I64Array budgets, double min_prob, int branching) {
        if (budgets.shape(0) != cursors.size()) throw nb::value_error("one budget per cursor needed");
        for (Cursor* c : cursors)
          if (!c) throw nb::value_error("cursor is None");
        DraftOut out;
        {
          nb::gil_scoped_release release;
          size_t cap = 0;
          for (size_t i = 0; i < cursors.size(); ++i) cap += size_t(std::clamp<int64_t>(budgets.data()[i], 0, 64));
          out.tokens.reserve(cap);
          out.parents.reserve(cap);
          out.probs.reserve(cap);
          out.offsets.reserve(cursors.size() + 1);
          out.match_len.reserve(cursors.size());
          propose_batch(cursors.data(), cursors.size(), budgets.data(), min_prob, branching, out);
        }
        return batch_tuple(std::move(out));
      }, nb::arg("cursors"), nb::arg("budgets"), nb::arg("min_prob") = 0.0, nb::arg("branching") = 1);

  // The lab's oracle: out[i] = the longest prefix of targets[offsets[i]:offsets[i+1]] that follows an
  // occurrence of cursors[i]'s longest match in one of its sources (the best continuation any draft from
  // those matches could hold).
  m.def("best_continuation_batch", [](const std::vector<Cursor*>& cursors, AnyArray targets, I64Array offsets) {
        size_t n = cursors.size();
        const int64_t* o = offsets.data();
        if (offsets.shape(0) != n + 1 || o[0] != 0 || o[n] != int64_t(targets.shape(0)))
          throw nb::value_error("offsets must have one entry per cursor plus one, from 0 to len(targets)");
        for (size_t i = 0; i < n; ++i)
          if (!cursors[i] || o[i + 1] < o[i]) throw nb::value_error("offsets must not decrease; cursors not None");
        std::vector<Token> buf;
        const Token* p = checked_tokens(targets, buf);
        std::vector<int64_t> out(n);
        {
          nb::gil_scoped_release release;
          best_continuation_batch(cursors.data(), n, p, o, out.data());
        }
        return to_numpy(std::move(out));
      }, nb::arg("cursors"), nb::arg("targets"), nb::arg("offsets"));

  // cursors[i] takes tokens[rows[i], start[i] : start[i] + count[i]] of a [R, W] int32/int64 table: (-1, -1) when
  // every token is in [0, limit) and all were appended, else (i, offset) of the first bad one (a negative one
  // anywhere first) and nothing changed.
  m.def("extend_rows", [](const std::vector<Cursor*>& cursors, TokTable tokens, I64Array rows, I64Array start,
                          I64Array count, int64_t limit) {
        size_t n = cursors.size();
        check_runs(tokens, rows, start, count, n);
        for (Cursor* c : cursors)
          if (!c) throw nb::value_error("cursor is None");
        const int64_t W = int64_t(tokens.shape(1));
        return with_rows(tokens, [&](auto* t) {
          auto bad = first_bad_rows(t, W, rows.data(), start.data(), count.data(), int64_t(n), std::min(limit, kTokenLimit));
          if (bad.first < 0) {
            nb::gil_scoped_release release;
            extend_rows(cursors.data(), t, W, rows.data(), start.data(), count.data(), int64_t(n));
          }
          return nb::make_tuple(bad.first, bad.second);
        });
      }, nb::arg("cursors"), nb::arg("tokens"), nb::arg("rows"), nb::arg("start"), nb::arg("count"),
      nb::arg("limit") = kTokenLimit);

  // [n] leading tokens of drafts[j, :dlen[j]] equal to tokens[rows[j], start[j] : start[j] + count[j] - 1].
  m.def("accepted_rows", [](DraftTable drafts, I64Array dlen, TokTable tokens, I64Array rows, I64Array start,
                            I64Array count) {
        size_t n = drafts.shape(0);
        check_runs(tokens, rows, start, count, n);
        if (dlen.shape(0) != n) throw nb::value_error("one draft length per draft needed");
        for (size_t j = 0; j < n; ++j)
          if (dlen.data()[j] < 0 || dlen.data()[j] > int64_t(drafts.shape(1))) throw nb::value_error("draft length out of range");
        std::vector<int64_t> out(n);
        with_rows(tokens, [&](auto* t) {
          accepted_rows(drafts.data(), int64_t(drafts.shape(1)), dlen.data(), t, int64_t(tokens.shape(1)), rows.data(),
                        start.data(), count.data(), int64_t(n), out.data());
          return 0;
        });
        return to_numpy(std::move(out));
      }, nb::arg("drafts"), nb::arg("dlen"), nb::arg("tokens"), nb::arg("rows"), nb::arg("start"), nb::arg("count"));

  // ForwardAllowance._priced's split (rows.hpp): (best, need, share, extra, group size, m, horizon).
  m.def("price_split", [](F64Array row, double c_tok, F64Table e, nb::object most, F64Array remaining, F64Array pu,
                          F64Array kv, double c_base, double c_draft) {
        size_t B = e.shape(0), D = e.shape(1);
        if (B == 0 || D == 0 || row.shape(0) != B || remaining.shape(0) != B || pu.shape(0) != B || kv.shape(0) != B)
          throw nb::value_error("price_split: e must be [B, D] (B, D >= 1), row, remaining, pu and kv [B]");
        const int64_t* m_ptr = nullptr;
        I64Array most_arr;
        if (!most.is_none()) {
          most_arr = nb::cast<I64Array>(most);
          if (most_arr.shape(0) != B) throw nb::value_error("price_split: most must be [B]");
          m_ptr = most_arr.data();
        }
        std::vector<int64_t> best(B), need(B);
        std::vector<double> share(B), extra(B);
        Split sp = price_split(row.data(), c_tok, e.data(), int64_t(B), int64_t(D), m_ptr, remaining.data(), pu.data(),
                               kv.data(), c_base, c_draft, best.data(), need.data(), share.data(), extra.data());
        return nb::make_tuple(to_numpy(std::move(best)), to_numpy(std::move(need)), to_numpy(std::move(share)),
                              to_numpy(std::move(extra)), sp.size, sp.m, sp.horizon);
      }, nb::arg("row"), nb::arg("c_tok"), nb::arg("e"), nb::arg("most").none(), nb::arg("remaining"), nb::arg("pu"),
      nb::arg("kv"), nb::arg("c_base"), nb::arg("c_draft"));

  // drafts[slots[j], :keep[j]] = tokens[starts[j] : starts[j] + keep[j]] (the tracker's pending drafts, rows of k).
  m.def("scatter_rows", [](nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> drafts, I64Array slots,
                           nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tokens, I64Array starts,
                           I64Array keep) {
        size_t n = slots.shape(0);
        const int64_t R = int64_t(drafts.shape(0)), k = int64_t(drafts.shape(1)), T = int64_t(tokens.shape(0));
        if (starts.shape(0) != n || keep.shape(0) != n) throw nb::value_error("scatter_rows: one start and keep per slot");
        for (size_t j = 0; j < n; ++j)
          if (slots.data()[j] < 0 || slots.data()[j] >= R || keep.data()[j] < 0 || keep.data()[j] > k ||
              starts.data()[j] < 0 || starts.data()[j] + keep.data()[j] > T)
            throw nb::value_error("scatter_rows: a run lies outside the drafts or the tokens");
        scatter_rows(drafts.data(), k, slots.data(), tokens.data(), starts.data(), keep.data(), int64_t(n));
      }, nb::arg("drafts"), nb::arg("slots"), nb::arg("tokens"), nb::arg("starts"), nb::arg("keep"));

  // match_capped then ForwardAllowance._trim over flat chain drafts (rows.hpp): (keep, expected).
  m.def("cut_chains", [](F64Array probs, I64Array offsets, I64Array match_len, double factor, nb::object priced,
                         F64Array share, F64Array row, F64Array extra, double c_tok, double calib) {
        size_t n = match_len.shape(0);
        const int64_t* o = offsets.data();
        if (offsets.shape(0) != n + 1 || o[0] != 0 || o[n] != int64_t(probs.shape(0)))
          throw nb::value_error("cut_chains: offsets must run from 0 to len(probs), one per draft plus one");
        for (size_t i = 0; i < n; ++i)
          if (o[i + 1] < o[i]) throw nb::value_error("cut_chains: offsets must not decrease");
        const uint8_t* pr = nullptr;
        U8Array pr_arr;
        if (!priced.is_none()) {
          pr_arr = nb::cast<U8Array>(priced);
          if (pr_arr.shape(0) != n || share.shape(0) != n || row.shape(0) != n || extra.shape(0) != n)
            throw nb::value_error("cut_chains: priced, share, row and extra must be [n]");
          pr = pr_arr.data();
        }
        std::vector<int64_t> keep(n);
        std::vector<double> expected(n);
        cut_chains(probs.data(), o, match_len.data(), int64_t(n), factor, pr, pr ? share.data() : nullptr,
                   pr ? row.data() : nullptr, pr ? extra.data() : nullptr, c_tok, calib, keep.data(), expected.data());
        return nb::make_tuple(to_numpy(std::move(keep)), to_numpy(std::move(expected)));
      }, nb::arg("probs"), nb::arg("offsets"), nb::arg("match_len"), nb::arg("factor"), nb::arg("priced").none(),
      nb::arg("share"), nb::arg("row"), nb::arg("extra"), nb::arg("c_tok"), nb::arg("calib"));

  // CountingDrafter's periods of the tails tokens[offsets[b]..offsets[b+1]) (rows.hpp count_periods).
  m.def("count_periods", [](I64Array tokens, I64Array offsets, I64Array digits, int64_t max_period) {
        size_t n = offsets.shape(0) ? offsets.shape(0) - 1 : 0;
        const int64_t* o = offsets.data();
        if (offsets.shape(0) == 0 || o[0] != 0 || o[n] != int64_t(tokens.shape(0)))
          throw nb::value_error("count_periods: offsets must run from 0 to len(tokens), one per tail plus one");
        for (size_t i = 0; i < n; ++i)
          if (o[i + 1] < o[i]) throw nb::value_error("count_periods: offsets must not decrease");
        if (digits.shape(0) != 10 || max_period < 1)
          throw nb::value_error("count_periods: needs the 10 digit token ids and max_period >= 1");
        std::vector<int64_t> out(n);
        count_periods(tokens.data(), o, int64_t(n), digits.data(), max_period, out.data());
        return to_numpy(std::move(out));
      }, nb::arg("tokens"), nb::arg("offsets"), nb::arg("digits"), nb::arg("max_period"));

  // The periods of the tails tokens[rows[i], start[i] : start[i] + count[i]] of an int32/int64 [R, W] table (the
  // vLLM proposer's token rows, read in place).
  m.def("count_periods_rows", [](TokTable tokens, I64Array rows, I64Array start, I64Array count, I64Array digits,
                                 int64_t max_period) {
        size_t n = rows.shape(0);
        check_runs(tokens, rows, start, count, n);
        if (digits.shape(0) != 10 || max_period < 1)
          throw nb::value_error("count_periods_rows: needs the 10 digit token ids and max_period >= 1");
        std::vector<int64_t> out(n);
        const int64_t W = int64_t(tokens.shape(1));
        with_rows(tokens, [&](auto* t) {
          count_periods_rows(t, W, rows.data(), start.data(), count.data(), int64_t(n), digits.data(), max_period,
                             out.data());
          return 0;
        });
        return to_numpy(std::move(out));
      }, nb::arg("tokens"), nb::arg("rows"), nb::arg("start"), nb::arg("count"), nb::arg("digits"),
      nb::arg("max_period"));

  // numpy's float64 sum of a contiguous array, computed here (tests: it must equal a.sum()).
  m.def("numpy_sum", [](F64Array a) { return numpy_sum(a.data(), int64_t(a.shape(0))); }, nb::arg("values"));

  // cursors[i] takes tokens[offsets[i]:offsets[i+1]]. -1 when all tokens are in [0, limit) and were
  // appended; else the first bad position in `tokens`, and nothing changed.
  m.def("extend_batch", [](const std::vector<Cursor*>& cursors, AnyArray tokens, I64Array offsets, int64_t limit) {
        size_t n = cursors.size();
        const int64_t* o = offsets.data();
        if (offsets.shape(0) != n + 1 || o[0] != 0 || o[n] != int64_t(tokens.shape(0)))
          throw nb::value_error("offsets must have one entry per cursor plus one, from 0 to len(tokens)");
        for (size_t i = 0; i < n; ++i)
          if (!cursors[i] || o[i + 1] < o[i]) throw nb::value_error("offsets must not decrease; cursors not None");
        std::vector<Token> buf;
        int64_t bad;
        const Token* p = token_view(tokens, limit, buf, bad);
        if (bad < 0 && n) {
          nb::gil_scoped_release release;
          extend_batch(cursors.data(), n, p, o);
        }
        return bad;
      }, nb::arg("cursors"), nb::arg("tokens"), nb::arg("offsets"), nb::arg("limit") = kTokenLimit);
}
