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

#include "suffix_index.hpp"

namespace nb = nanobind;
using namespace dasrl;

using AnyArray = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>;  // any dtype, checked below
using I64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
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
