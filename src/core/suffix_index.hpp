// dasrl suffix index: a weighted multi-sequence index of int32 token streams that proposes drafts.
//
// Structure (see docs/drafter.md): every sequence keeps its tokens; every position is threaded on two
// occurrence chains, one per key order: the token itself (order 1) and the 4-gram ending there
// (order 4). A chain is a singly linked list (newest first: the order positions were indexed in) through
// per-position `prev` refs; chain heads live in open-addressing hash tables. Appends are O(1) per token
// and never touch other sequences, so live sequences can grow interleaved. Removal marks a sequence
// dead; dead positions are skipped and the chains are relinked without them, in the same order, once
// dead tokens outnumber live ones (amortised O(1) per token).
//
// Semantics (the pure-Python reference in dasrl/drafter/reference.py is the oracle):
//  * match: the candidates are the kMaxOccurrences newest live positions (in the order tokens were
//    indexed) that end with ctx's last kOrder tokens (when max_match and ctx allow kOrder); m = the
//    largest L <= max_match such that ctx[-L:] ends a candidate that has a next token; occ = all such
//    candidates. If none has, the same with the newest positions holding ctx's last token and L < kOrder.
//    Bounding the candidates bounds a proposal's work: a looping request (one token repeated a million
//    times) would otherwise make every proposal walk and extend a million occurrences.
//  * draft: best-first expansion from occ. A node's children are the distinct next tokens over its
//    occurrences that have a next token, weighted by their sequences' weights, ranked by (weight desc,
//    token asc) -- one ranking function, children(), serves chains and trees; the top `branching`
//    become candidates with path probability parent * w / W. The candidate with the highest path
//    probability (ties: earliest pushed) is taken next, until `budget` nodes or no candidate with
//    probability >= min_prob remains.
//
// Validation with friendly messages is Python's (dasrl/drafter/suffix.py); the core still refuses what
// would corrupt it (negative ids and tokens, unknown sequences) with an exception.
#pragma once

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace dasrl {

using Token = int32_t;
using Ref = uint64_t;  // (slot << 32) | offset
constexpr Ref kNil = ~Ref(0);
constexpr int kOrder = 4;
constexpr int kMaxOccurrences = 1024;  // candidates of a match, newest first (see the semantics above)
constexpr int kMaxDraft = 1024;        // nodes of one draft, whatever the budget (dasrl.drafter.base.MAX_DRAFT)

// Open-addressing hash map uint64 key -> Ref (chain head). No erase: chains are rebuilt instead.
class HeadTable {
 public:
  Ref get(uint64_t key) const;
  // Replace the head for key with ref; returns the previous head (kNil if none).
  Ref exchange(uint64_t key, Ref ref);
  // Hint that key is about to be looked up (overlaps the cache misses of a run of appends).
  void prefetch(uint64_t key) const;
  void clear();
  size_t size() const { return size_; }
  size_t bytes() const { return slots_.capacity() * sizeof(Slot); }
  template <class F> void for_each(F f) const {
    for (const Slot& e : slots_)
      if (e.key != kEmpty) f(e.key, e.ref);
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  void grow();
  struct Slot {
    uint64_t key;
    Ref ref;
  };
  std::vector<Slot> slots_;  // key and value side by side: one cache miss per lookup
  size_t size_ = 0;
};

struct Sequence {
  int64_t id = -1;
  double weight = 1.0;
  bool alive = true;
  std::vector<Token> tokens;
  std::vector<Ref> prev1;  // previous position with the same token
  std::vector<Ref> prevk;  // previous position with the same 4-gram ending there (kNil if off < 3)
};

struct DraftParams {
  int max_match = 64;
  double min_prob = 0.0;
  int branching = 1;
};

// Drafts laid end to end: one request's (propose) or a whole batch's (propose_batch). Request i owns
// nodes [offsets[i], offsets[i+1]); parents index its own nodes (-1 = child of the context).
struct DraftOut {
  std::vector<Token> tokens;
  std::vector<int32_t> parents;
  std::vector<double> probs;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> match_len;
};

// The matched state of a context: the longest suffix length and its occurrences.
struct Match {
  int32_t len = 0;
  std::vector<Ref> occ;
};

struct Group {
  Token tok;
  double weight;
};

// Reused buffers of children() (no allocation per node once warm).
struct Scratch {
  std::vector<std::pair<Ref, Token>> cont;  // continued occurrences: (next position, its token)
  std::vector<Group> groups;
  std::unordered_map<Token, uint32_t> group_of;  // token -> group, used past kLinearGroups groups
  DraftOut alt;  // a later source's draft, before it is scored against the best so far
};

class SuffixIndex {
 public:
  void add(int64_t seq_id, const Token* toks, size_t n, double weight);
  void append(int64_t seq_id, const Token* toks, size_t n);
  void remove(int64_t seq_id);
  void set_weight(int64_t seq_id, double weight);
  void scale_weights(double factor);
  bool contains(int64_t seq_id) const { return slot_of_.count(seq_id) != 0; }
  size_t seq_len(int64_t seq_id) const;
  std::vector<Token> tokens(int64_t seq_id) const;
  double weight(int64_t seq_id) const;
  std::vector<int64_t> ids() const;
  size_t num_sequences() const { return slot_of_.size(); }
  size_t num_tokens() const { return live_tokens_; }
  size_t bytes_used() const;
  // Throws std::logic_error naming the first broken invariant.
  void check_integrity() const;

  // Longest match of ctx[0..n) (only its last max_match tokens matter).
  Match match(const Token* ctx, size_t n, int max_match) const;
  // Appends the draft from m (at most budget nodes) as one more request of out. With beat >= 0 the
  // draft is abandoned (false, out unchanged) once its score (the sum of its path probabilities) can
  // no longer exceed beat: what it has plus its best open probability times the nodes left.
  bool draft(const Match& m, int budget, const DraftParams& p, DraftOut& out, Scratch& s,
             double beat = -1.0) const;
  // The continuations of occ grouped by next token, weights summed; the top k groups ranked first by
  // (weight desc, token asc). Fills s.cont and s.groups; returns the total weight (0: none continues).
  double children(const std::vector<Ref>& occ, size_t k, Scratch& s) const;
  // The longest common prefix, at most k, of target[0..k) and the tokens after an occurrence of m: the
  // best continuation any draft from this match could hold (the lab's oracle bound, not a drafter).
  int best_continuation(const Match& m, const Token* target, size_t k) const;

  mutable std::shared_mutex mutex;  // proposals hold it shared, mutations exclusive

 private:
  Sequence& live(int64_t seq_id);
  const Sequence& live(int64_t seq_id) const;
  void thread_position(uint32_t slot, uint32_t off);
  void maybe_compact();
  void compact();
  void scan_chain(Ref head, bool order1, const Token* ctx, size_t n, int cap, Match& best) const;

  std::vector<Sequence> slots_;
  std::unordered_map<int64_t, uint32_t> slot_of_;
  HeadTable heads1_, headsk_;
  size_t live_tokens_ = 0, dead_tokens_ = 0;
};

// A request's context and (optionally) its live sequence in the index, which extend() grows with it.
// Further sources (other indexes: cross-problem history) draft from the same context, each optionally
// with a live sequence of its own that extend() grows too; every source drafts and the draft with the
// highest score wins (score = the sum of its nodes' path probabilities, its expected accepted length; a
// later source must beat the best by a relative kScoreTie, so that two sums of the same probabilities
// added in another order do not flip the choice).
class Cursor {
 public:
  struct Source {
    std::shared_ptr<SuffixIndex> index;
    int64_t seq_id;  // its live sequence, -1: none
  };
  Cursor(std::shared_ptr<SuffixIndex> index, int max_match, int64_t seq_id = -1);
  // Appends to the live sequences (if any; exclusive locks), then to the context.
  void extend(const Token* toks, size_t n);
  // One more source, after the index and those added before it (ties go to the earlier); a live
  // sequence of it (seq_id >= 0) must hold the context so far.
  void add_source(std::shared_ptr<SuffixIndex> index, int64_t seq_id = -1);
  const std::vector<Token>& context() const { return ctx_; }
  const std::shared_ptr<SuffixIndex>& index() const { return index_; }
  const std::vector<Source>& sources() const { return sources_; }
  int max_match() const { return max_match_; }
  int64_t seq_id() const { return seq_id_; }
  // Takes each source's shared lock while it drafts.
  void propose(int budget, const DraftParams& p, DraftOut& out, Scratch& s) const;
  // The longest continuation agreeing with target[0..k) over every source's longest match (shared locks).
  int best_continuation(const Token* target, size_t k) const;

 private:
  std::shared_ptr<SuffixIndex> index_;
  std::vector<Source> sources_;
  int max_match_;
  int64_t seq_id_;
  std::vector<Token> ctx_;
};

constexpr double kScoreTie = 1e-9;

// One draft per cursor, cursors[i] capped at budgets[i], each source under its shared lock.
void propose_batch(Cursor* const* cursors, size_t n, const int64_t* budgets, double min_prob, int branching,
                   DraftOut& out);
// out[i] = cursors[i]->best_continuation(targets + offsets[i], offsets[i+1] - offsets[i]).
void best_continuation_batch(Cursor* const* cursors, size_t n, const Token* targets, const int64_t* offsets,
                             int64_t* out);
// cursors[i] takes toks[offsets[i]..offsets[i+1]) (tokens already checked by the caller).
void extend_batch(Cursor* const* cursors, size_t n, const Token* toks, const int64_t* offsets);

// Index of the first token outside [0, limit), or -1 if all are inside.
template <class T> int64_t first_out_of_range(const T* toks, size_t n, int64_t limit) {
  for (size_t i = 0; i < n; ++i) {
    bool bad;
    if constexpr (std::is_signed_v<T>) bad = toks[i] < 0 || int64_t(toks[i]) >= limit;
    else bad = uint64_t(toks[i]) >= uint64_t(limit);
    if (bad) return int64_t(i);
  }
  return -1;
}

}  // namespace dasrl
