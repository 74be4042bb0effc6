// nanobind bindings: dasrl._core. Validation with friendly messages lives in dasrl/drafter/suffix.py;
// these entry points still refuse bad input (negative ids, unknown sequences) with an exception.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <shared_mutex>

#include "suffix_index.hpp"

namespace nb = nanobind;
using namespace dasrl;

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BudgetArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <class T>
static nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

static nb::tuple draft_tuple(DraftOut&& d) {
  int32_t m = d.match_len;
  return nb::make_tuple(to_numpy(std::move(d.tokens)), to_numpy(std::move(d.parents)), to_numpy(std::move(d.probs)), m);
}

static DraftParams params(int max_match, double min_prob, int branching) {
  if (max_match < 1) throw std::invalid_argument("max_match must be >= 1");
  if (branching < 1) throw std::invalid_argument("branching must be >= 1");
  return DraftParams{max_match, min_prob, branching};
}

NB_MODULE(_core, m) {
  m.doc() = "dasrl native core: the suffix index behind the history drafter";
  m.attr("ORDER") = kOrder;

  nb::class_<SuffixIndex>(m, "SuffixIndex")
      .def(nb::init<>())
      .def("add", [](SuffixIndex& s, int64_t id, TokenArray t, double w) {
            std::unique_lock lock(s.mutex);
            s.add(id, t.data(), t.shape(0), w);
          }, nb::arg("seq_id"), nb::arg("tokens"), nb::arg("weight") = 1.0)
      .def("append", [](SuffixIndex& s, int64_t id, TokenArray t) {
            std::unique_lock lock(s.mutex);
            s.append(id, t.data(), t.shape(0));
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
      .def_prop_ro("version", &SuffixIndex::version)
      .def("bytes_used", [](const SuffixIndex& s) { std::shared_lock lock(s.mutex); return s.bytes_used(); })
      .def("check_integrity", [](const SuffixIndex& s) { std::shared_lock lock(s.mutex); s.check_integrity(); })
      .def("propose", [](const SuffixIndex& s, TokenArray ctx, int budget, int max_match, double min_prob, int branching) {
            DraftParams p = params(max_match, min_prob, branching);
            DraftOut out;
            {
              nb::gil_scoped_release release;
              std::shared_lock lock(s.mutex);
              Match mt = s.match(ctx.data(), ctx.shape(0), p.max_match);
              s.draft(mt, budget, p, out);
            }
            return draft_tuple(std::move(out));
          }, nb::arg("context"), nb::arg("budget"), nb::arg("max_match") = 64, nb::arg("min_prob") = 0.0,
          nb::arg("branching") = 1);

  nb::class_<Cursor>(m, "Cursor")
      .def(nb::init<std::shared_ptr<SuffixIndex>, int>(), nb::arg("index"), nb::arg("max_match") = 64)
      .def("extend", [](Cursor& c, TokenArray t) { c.extend(t.data(), t.shape(0)); }, nb::arg("tokens"))
      .def("reset", &Cursor::reset)
      .def_prop_ro("context_len", &Cursor::context_len)
      .def_prop_ro("index", &Cursor::index)
      .def_prop_ro("max_match", &Cursor::max_match)
      .def_ro("cache_hits", &Cursor::cache_hits)
      .def_ro("cache_misses", &Cursor::cache_misses);

  // One call for a whole batch: drafts for cursors[i] capped at budgets[i], flattened with offsets.
  m.def("propose_batch", [](std::vector<Cursor*> cursors, BudgetArray budgets, double min_prob, int branching) {
        if (budgets.shape(0) != cursors.size()) throw std::invalid_argument("one budget per cursor needed");
        for (Cursor* c : cursors)
          if (!c) throw std::invalid_argument("cursor is None");
        std::vector<Token> toks;
        std::vector<int32_t> parents, match_lens(cursors.size());
        std::vector<double> probs;
        std::vector<int64_t> offsets(cursors.size() + 1, 0);
        {
          nb::gil_scoped_release release;
          DraftOut out;
          for (size_t i = 0; i < cursors.size(); ++i) {
            Cursor& c = *cursors[i];
            DraftParams p{c.max_match(), min_prob, std::max(branching, 1)};
            {
              std::shared_lock lock(c.index()->mutex);
              c.propose(budgets.data()[i], p, out);
            }
            toks.insert(toks.end(), out.tokens.begin(), out.tokens.end());
            parents.insert(parents.end(), out.parents.begin(), out.parents.end());
            probs.insert(probs.end(), out.probs.begin(), out.probs.end());
            match_lens[i] = out.match_len;
            offsets[i + 1] = int64_t(toks.size());
          }
        }
        return nb::make_tuple(to_numpy(std::move(toks)), to_numpy(std::move(parents)), to_numpy(std::move(probs)),
                              to_numpy(std::move(offsets)), to_numpy(std::move(match_lens)));
      }, nb::arg("cursors"), nb::arg("budgets"), nb::arg("min_prob") = 0.0, nb::arg("branching") = 1);
}
