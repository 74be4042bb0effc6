// Implementation of the suffix index; the header explains the structure and the semantics.
#include "suffix_index.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

namespace dasrl {
namespace {

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t gram_key(const Token* last_k) {  // key of the kOrder tokens ending at last_k[kOrder-1]
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i < kOrder; ++i) h = mix64(h ^ uint32_t(last_k[i]));
  return h == ~uint64_t(0) ? h ^ 1 : h;
}

inline Ref make_ref(uint32_t slot, uint32_t off) { return (Ref(slot) << 32) | off; }

std::string id_str(int64_t id) { return std::to_string(id); }

}  // namespace

// ---------------------------------------------------------------------------------------- HeadTable

Ref HeadTable::get(uint64_t key) const {
  if (slots_.empty()) return kNil;
  size_t mask = slots_.size() - 1;
  for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    if (slots_[i].key == key) return slots_[i].ref;
    if (slots_[i].key == kEmpty) return kNil;
  }
}

Ref HeadTable::exchange(uint64_t key, Ref ref) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  size_t mask = slots_.size() - 1;
  for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    if (slots_[i].key == key) return std::exchange(slots_[i].ref, ref);
    if (slots_[i].key == kEmpty) {
      slots_[i] = {key, ref};
      ++size_;
      return kNil;
    }
  }
}

void HeadTable::prefetch(uint64_t key) const {
  if (!slots_.empty()) __builtin_prefetch(&slots_[mix64(key) & (slots_.size() - 1)]);
}

void HeadTable::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(std::max<size_t>(16, old.size() * 2), Slot{kEmpty, kNil});
  size_ = 0;
  for (const Slot& e : old)
    if (e.key != kEmpty) exchange(e.key, e.ref);
}

void HeadTable::clear() {
  slots_.clear();
  slots_.shrink_to_fit();
  size_ = 0;
}

// -------------------------------------------------------------------------------------- mutations

Sequence& SuffixIndex::live(int64_t seq_id) {
  auto it = slot_of_.find(seq_id);
  if (it == slot_of_.end()) throw std::out_of_range("unknown sequence id " + id_str(seq_id));
  return slots_[it->second];
}

const Sequence& SuffixIndex::live(int64_t seq_id) const {
  return const_cast<SuffixIndex*>(this)->live(seq_id);
}

void SuffixIndex::thread_position(uint32_t slot, uint32_t off) {
  Sequence& s = slots_[slot];
  Ref r = make_ref(slot, off);
  s.prev1[off] = heads1_.exchange(uint32_t(s.tokens[off]), r);
  s.prevk[off] = off + 1 >= uint32_t(kOrder) ? headsk_.exchange(gram_key(&s.tokens[off + 1 - kOrder]), r) : kNil;
}

static void check_tokens(const Token* toks, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (toks[i] < 0) throw std::invalid_argument("negative token id " + std::to_string(toks[i]) +
                                                 " at position " + std::to_string(i));
}

void SuffixIndex::add(int64_t seq_id, const Token* toks, size_t n, double weight) {
  if (seq_id < 0) throw std::invalid_argument("sequence id must be >= 0, got " + id_str(seq_id));
  if (slot_of_.count(seq_id)) throw std::invalid_argument("sequence id " + id_str(seq_id) + " already indexed");
  if (!(weight > 0.0) || weight > 1e300) throw std::invalid_argument("weight must be positive and finite");
  if (slots_.size() >= (1ULL << 31)) throw std::length_error("too many sequences in one index");
  check_tokens(toks, n);
  uint32_t slot = uint32_t(slots_.size());
  slots_.emplace_back();
  Sequence& s = slots_.back();
  s.id = seq_id;
  s.weight = weight;
  slot_of_[seq_id] = slot;
  append(seq_id, toks, n);
}

void SuffixIndex::append(int64_t seq_id, const Token* toks, size_t n) {
  auto it = slot_of_.find(seq_id);  // one look-up: the slot and its sequence
  if (it == slot_of_.end()) throw std::out_of_range("unknown sequence id " + id_str(seq_id));
  const uint32_t slot = it->second;
  Sequence& s = slots_[slot];
  check_tokens(toks, n);  // before any change: a bad token leaves the index as it was
  if (s.tokens.size() + n >= (1ULL << 32) - 1) throw std::length_error("sequence too long");
  size_t start = s.tokens.size();
  s.tokens.insert(s.tokens.end(), toks, toks + n);
  s.prev1.resize(s.tokens.size());
  s.prevk.resize(s.tokens.size());
  for (size_t off = start; off < s.tokens.size(); ++off) {  // the chain heads' misses overlap
    heads1_.prefetch(uint32_t(s.tokens[off]));
    if (off + 1 >= size_t(kOrder)) headsk_.prefetch(gram_key(&s.tokens[off + 1 - kOrder]));
  }
  for (size_t off = start; off < s.tokens.size(); ++off) thread_position(slot, uint32_t(off));
  live_tokens_ += n;
}

void SuffixIndex::remove(int64_t seq_id) {
  Sequence& s = live(seq_id);
  s.alive = false;
  live_tokens_ -= s.tokens.size();
  dead_tokens_ += s.tokens.size();
  slot_of_.erase(seq_id);
  maybe_compact();
}

void SuffixIndex::set_weight(int64_t seq_id, double weight) {
  if (!(weight > 0.0) || weight > 1e300) throw std::invalid_argument("weight must be positive and finite");
  live(seq_id).weight = weight;
}

void SuffixIndex::scale_weights(double factor) {
  if (!(factor > 0.0) || factor > 1e300) throw std::invalid_argument("factor must be positive and finite");
  for (auto& s : slots_) s.weight *= factor;
}

void SuffixIndex::maybe_compact() {
  if (live_tokens_ == 0 && slot_of_.empty()) {
    slots_.clear();
    slots_.shrink_to_fit();
    heads1_.clear();
    headsk_.clear();
    dead_tokens_ = 0;
  } else if (dead_tokens_ > std::max<size_t>(live_tokens_, 4096) || slots_.size() > 2 * slot_of_.size() + 64) {
    compact();
  }
}

// Drops the dead sequences and relinks every chain without their positions, keeping the chain order
// (newest first by indexing time): re-threading slot by slot would reorder the chains, and the order
// decides which kMaxOccurrences positions a match considers.
void SuffixIndex::compact() {
  std::vector<uint32_t> new_slot(slots_.size(), UINT32_MAX);
  uint32_t n = 0;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot)
    if (slots_[slot].alive) new_slot[slot] = n++;
  auto relink = [&](HeadTable& table, bool order1) {
    HeadTable fresh;
    table.for_each([&](uint64_t key, Ref head) {
      Ref first = kNil;
      Ref* link = &first;  // the prev ref of the last live position kept (read before it is rewritten)
      for (Ref r = head; r != kNil;) {
        Sequence& s = slots_[r >> 32];
        uint32_t off = uint32_t(r);
        Ref& prev = order1 ? s.prev1[off] : s.prevk[off];
        Ref next = prev;
        if (s.alive) {
          *link = make_ref(new_slot[r >> 32], off);
          link = &prev;
        }
        r = next;
      }
      *link = kNil;
      if (first != kNil) fresh.exchange(key, first);
    });
    table = std::move(fresh);
  };
  relink(heads1_, true);
  relink(headsk_, false);
  std::vector<Sequence> old = std::move(slots_);
  slots_.clear();
  slot_of_.clear();
  for (auto& s : old) {
    if (!s.alive) continue;
    slot_of_[s.id] = uint32_t(slots_.size());
    slots_.push_back(std::move(s));
  }
  dead_tokens_ = 0;
}

// ---------------------------------------------------------------------------------------- queries

size_t SuffixIndex::seq_len(int64_t seq_id) const { return live(seq_id).tokens.size(); }
std::vector<Token> SuffixIndex::tokens(int64_t seq_id) const { return live(seq_id).tokens; }
double SuffixIndex::weight(int64_t seq_id) const { return live(seq_id).weight; }

std::vector<int64_t> SuffixIndex::ids() const {
  std::vector<int64_t> out;
  for (auto& s : slots_)
    if (s.alive) out.push_back(s.id);
  return out;
}

size_t SuffixIndex::bytes_used() const {
  size_t b = sizeof(*this) + heads1_.bytes() + headsk_.bytes() + slots_.capacity() * sizeof(Sequence);
  b += slot_of_.size() * (sizeof(int64_t) + sizeof(uint32_t) + 2 * sizeof(void*)) + slot_of_.bucket_count() * sizeof(void*);
  for (auto& s : slots_)
    b += s.tokens.capacity() * sizeof(Token) + (s.prev1.capacity() + s.prevk.capacity()) * sizeof(Ref);
  return b;
}

// Common suffix of ctx[0..n) and the tokens ending at off, at most cap long, for the kMaxOccurrences
// newest live positions of the chain; occurrences shorter than best.len (or than the chain's order)
// cannot join the best, so those tokens are tested in one memcmp.
void SuffixIndex::scan_chain(Ref r, bool order1, const Token* ctx, size_t n, int cap, Match& best) const {
  for (int walked = 0; r != kNil && walked < kMaxOccurrences;) {
    const Sequence& s = slots_[r >> 32];
    uint32_t off = uint32_t(r);
    walked += s.alive;
    int lim = int(std::min<int64_t>(cap, int64_t(off) + 1));
    int need = std::max(best.len, order1 ? 1 : kOrder);
    if (s.alive && off + 1 < s.tokens.size() && lim >= need &&
        std::memcmp(ctx + n - need, s.tokens.data() + off + 1 - need, size_t(need) * sizeof(Token)) == 0) {
      int L = need;
      while (L < lim && ctx[n - 1 - L] == s.tokens[off - L]) ++L;
      if (L > best.len) {
        best.len = L;
        best.occ.clear();
      }
      best.occ.push_back(r);
    }
    r = order1 ? s.prev1[off] : s.prevk[off];
  }
}

Match SuffixIndex::match(const Token* ctx, size_t n, int max_match) const {
  Match best;
  int cap = int(std::min<size_t>(size_t(std::max(max_match, 0)), n));
  if (cap >= kOrder) scan_chain(headsk_.get(gram_key(ctx + n - kOrder)), false, ctx, n, cap, best);
  // No occurrence of >= kOrder tokens: every match is shorter, so the token chain finds them all.
  if (best.len == 0 && cap >= 1) scan_chain(heads1_.get(uint32_t(ctx[n - 1])), true, ctx, n, std::min(cap, kOrder - 1), best);
  return best;
}

namespace {

constexpr size_t kLinearGroups = 16;  // up to this many distinct continuations, a linear scan groups them

struct Candidate {
  double prob;
  uint64_t order;  // push order: ties go to the earliest pushed
  int32_t parent;
  Token tok;
  std::vector<Ref> occ;
};

struct WorseCandidate {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.prob != b.prob ? a.prob < b.prob : a.order > b.order;
  }
};

}  // namespace

double SuffixIndex::children(const std::vector<Ref>& occ, size_t k, Scratch& s) const {
  s.cont.clear();
  s.groups.clear();
  s.group_of.clear();
  double total = 0.0;
  for (Ref r : occ) {
    const Sequence& q = slots_[r >> 32];
    if (!q.alive || uint32_t(r) + 1 >= q.tokens.size()) continue;
    Token t = q.tokens[uint32_t(r) + 1];
    total += q.weight;
    s.cont.emplace_back(r + 1, t);
    size_t g = s.groups.size();
    if (s.groups.size() < kLinearGroups) {
      for (size_t i = 0; i < s.groups.size(); ++i)
        if (s.groups[i].tok == t) { g = i; break; }
    } else {
      if (s.group_of.empty())  // the first time past the linear limit: map every group so far
        for (size_t i = 0; i < s.groups.size(); ++i) s.group_of.emplace(s.groups[i].tok, uint32_t(i));
      g = s.group_of.try_emplace(t, uint32_t(g)).first->second;
    }
    if (g == s.groups.size()) s.groups.push_back({t, 0.0});
    s.groups[g].weight += q.weight;
  }
  k = std::min(k, s.groups.size());
  std::partial_sort(s.groups.begin(), s.groups.begin() + k, s.groups.end(), [](const Group& a, const Group& b) {
    return a.weight != b.weight ? a.weight > b.weight : a.tok < b.tok;
  });
  return total;
}

bool SuffixIndex::draft(const Match& m, int budget, const DraftParams& p, DraftOut& out, Scratch& s,
                        double beat) const {
  const size_t base = out.tokens.size();
  double score = 0.0;
  auto taken = [&] { return int(out.tokens.size() - base); };
  auto take = [&](Token tok, int32_t parent, double prob) {
    out.tokens.push_back(tok);
    out.parents.push_back(parent);
    out.probs.push_back(prob);
    score += prob;
  };
  // Every node still to come has a probability <= best_open: the score can reach at most this (kept a
  // hair above, so that rounding never abandons a draft the final comparison would keep).
  auto hopeless = [&](double best_open) {
    return beat >= 0.0 && (score + best_open * (budget - taken())) * (1.0 + 1e-12) < beat;
  };
  auto abandon = [&] {
    out.tokens.resize(base), out.parents.resize(base), out.probs.resize(base);
    return false;
  };
  if (budget > 0 && !m.occ.empty() && p.branching <= 1) {  // a chain: no frontier, no per-node allocation
    std::vector<Ref> cur(m.occ);
    double prob = 1.0;
    while (taken() < budget) {
      if (hopeless(prob)) return abandon();
      double total = children(cur, 1, s);
      if (s.groups.empty()) break;
      double child = prob * (s.groups[0].weight / total);
      if (child < p.min_prob) break;
      prob = child;
      Token best = s.groups[0].tok;
      take(best, taken() - 1, prob);
      cur.clear();
      for (auto& [r, t] : s.cont)
        if (t == best) cur.push_back(r);
    }
  } else if (budget > 0 && !m.occ.empty()) {
    std::priority_queue<Candidate, std::vector<Candidate>, WorseCandidate> frontier;
    uint64_t pushed = 0;
    auto expand = [&](const std::vector<Ref>& occ, int32_t parent, double parent_prob) {
      double total = children(occ, size_t(p.branching), s);
      size_t k = std::min<size_t>(size_t(p.branching), s.groups.size());
      for (size_t i = 0; i < k; ++i) {
        double prob = parent_prob * (s.groups[i].weight / total);
        if (prob < p.min_prob) break;
        Candidate c{prob, pushed++, parent, s.groups[i].tok, {}};
        for (auto& [r, t] : s.cont)
          if (t == c.tok) c.occ.push_back(r);
        frontier.push(std::move(c));
      }
    };
    if (hopeless(1.0)) return abandon();
    expand(m.occ, -1, 1.0);
    while (!frontier.empty() && taken() < budget) {
      if (hopeless(frontier.top().prob)) return abandon();
      Candidate c = std::move(const_cast<Candidate&>(frontier.top()));
      frontier.pop();
      int32_t node = taken();
      take(c.tok, c.parent, c.prob);
      if (taken() < budget) expand(c.occ, node, c.prob);
    }
  }
  if (beat >= 0.0 && score <= beat) return abandon();
  out.offsets.push_back(int64_t(out.tokens.size()));
  out.match_len.push_back(m.len);
  return true;
}

int SuffixIndex::best_continuation(const Match& m, const Token* target, size_t k) const {
  int best = 0;
  for (Ref r : m.occ) {
    const Sequence& q = slots_[r >> 32];
    if (!q.alive) continue;
    size_t off = uint32_t(r) + 1, n = std::min(k, q.tokens.size() - std::min(off, q.tokens.size()));
    size_t j = 0;
    while (j < n && q.tokens[off + j] == target[j]) ++j;
    best = std::max(best, int(j));
  }
  return best;
}

// -------------------------------------------------------------------------------------- integrity

void SuffixIndex::check_integrity() const {
  auto fail = [](const std::string& what) { throw std::logic_error("suffix index integrity: " + what); };
  size_t live = 0, dead = 0, alive_slots = 0, positions1 = 0, positionsk = 0;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    const Sequence& s = slots_[slot];
    if (s.prev1.size() != s.tokens.size() || s.prevk.size() != s.tokens.size()) fail("chain arrays sized wrong in slot " + std::to_string(slot));
    (s.alive ? live : dead) += s.tokens.size();
    if (s.alive) {
      ++alive_slots;
      auto it = slot_of_.find(s.id);
      if (it == slot_of_.end() || it->second != slot) fail("sequence " + id_str(s.id) + " not mapped to its slot");
      if (!(s.weight > 0.0)) fail("non-positive weight for sequence " + id_str(s.id));
    }
    for (Token t : s.tokens)
      if (t < 0) fail("negative token in sequence " + id_str(s.id));
    positions1 += s.tokens.size();
    positionsk += s.tokens.size() >= size_t(kOrder) ? s.tokens.size() - kOrder + 1 : 0;
  }
  if (alive_slots != slot_of_.size()) fail("id map has " + std::to_string(slot_of_.size()) + " entries for " + std::to_string(alive_slots) + " live sequences");
  if (live != live_tokens_ || dead != dead_tokens_) fail("token counts out of date");
  auto walk = [&](const HeadTable& table, bool order1, size_t expected) {
    size_t seen = 0;
    table.for_each([&](uint64_t key, Ref head) {
      for (Ref r = head; r != kNil;) {
        if ((r >> 32) >= slots_.size() || uint32_t(r) >= slots_[r >> 32].tokens.size()) fail("dangling ref in a chain");
        const Sequence& s = slots_[r >> 32];
        uint32_t off = uint32_t(r);
        uint64_t k = order1 ? uint64_t(uint32_t(s.tokens[off])) : (off + 1 >= uint32_t(kOrder) ? gram_key(&s.tokens[off + 1 - kOrder]) : 0);
        if (k != key || (!order1 && off + 1 < uint32_t(kOrder))) fail("position on the wrong chain");
        if (++seen > expected) fail("chains hold more positions than the index (a cycle?)");
        r = order1 ? s.prev1[off] : s.prevk[off];
      }
    });
    if (seen != expected) fail("chains hold " + std::to_string(seen) + " positions, index has " + std::to_string(expected));
  };
  walk(heads1_, true, positions1);
  walk(headsk_, false, positionsk);
}

// ----------------------------------------------------------------------------------------- cursor

Cursor::Cursor(std::shared_ptr<SuffixIndex> index, int max_match, int64_t seq_id)
    : index_(std::move(index)), max_match_(max_match), seq_id_(seq_id) {
  if (!index_) throw std::invalid_argument("cursor needs an index");
  if (max_match < 1) throw std::invalid_argument("max_match must be >= 1, got " + std::to_string(max_match));
  if (seq_id >= 0 && !index_->contains(seq_id)) throw std::out_of_range("unknown sequence id " + id_str(seq_id));
}

void Cursor::extend(const Token* toks, size_t n) {
  check_tokens(toks, n);
  if (seq_id_ >= 0) {
    std::unique_lock lock(index_->mutex);
    index_->append(seq_id_, toks, n);
  }
  for (const Source& src : sources_)
    if (src.seq_id >= 0) {
      std::unique_lock lock(src.index->mutex);
      src.index->append(src.seq_id, toks, n);
    }
  ctx_.insert(ctx_.end(), toks, toks + n);
}

void Cursor::add_source(std::shared_ptr<SuffixIndex> index, int64_t seq_id) {
  if (!index) throw std::invalid_argument("a source needs an index");
  if (index == index_) throw std::invalid_argument("the cursor's own index cannot be a source of it");
  for (const Source& src : sources_)
    if (src.index == index) throw std::invalid_argument("this index is already a source of the cursor");
  if (seq_id >= 0) {
    std::shared_lock lock(index->mutex);
    if (!index->contains(seq_id)) throw std::out_of_range("unknown sequence id " + id_str(seq_id));
    if (index->seq_len(seq_id) != ctx_.size())
      throw std::invalid_argument("a source's live sequence must hold the cursor's context so far");
  }
  sources_.push_back({std::move(index), seq_id});
}

static double score_of(const DraftOut& d, size_t from) {
  double s = 0.0;
  for (size_t i = from; i < d.probs.size(); ++i) s += d.probs[i];
  return s;
}

void Cursor::propose(int budget, const DraftParams& p, DraftOut& out, Scratch& s) const {
  const size_t base = out.tokens.size();
  {
    std::shared_lock lock(index_->mutex);
    index_->draft(index_->match(ctx_.data(), ctx_.size(), max_match_), budget, p, out, s);
  }
  double best = score_of(out, base);
  for (const Source& src : sources_) {
    // A later source wins only with a score above this; no draft scores more than its budget.
    double beat = best * (1.0 + kScoreTie);
    if (beat >= double(budget)) break;
    DraftOut& alt = s.alt;
    alt.tokens.clear(), alt.parents.clear(), alt.probs.clear(), alt.match_len.clear();
    alt.offsets.assign(1, 0);
    bool won;
    {
      std::shared_lock lock(src.index->mutex);
      won = src.index->draft(src.index->match(ctx_.data(), ctx_.size(), max_match_), budget, p, alt, s, beat);
    }
    if (won) {  // replace the best so far (this request's tail of out)
      best = score_of(alt, 0);
      out.tokens.resize(base), out.parents.resize(base), out.probs.resize(base);
      out.tokens.insert(out.tokens.end(), alt.tokens.begin(), alt.tokens.end());
      out.parents.insert(out.parents.end(), alt.parents.begin(), alt.parents.end());
      out.probs.insert(out.probs.end(), alt.probs.begin(), alt.probs.end());
      out.offsets.back() = int64_t(out.tokens.size());
      out.match_len.back() = alt.match_len[0];
    }
  }
}

int Cursor::best_continuation(const Token* target, size_t k) const {
  int best = 0;
  auto one = [&](const SuffixIndex& idx) {
    std::shared_lock lock(idx.mutex);
    best = std::max(best, idx.best_continuation(idx.match(ctx_.data(), ctx_.size(), max_match_), target, k));
  };
  one(*index_);
  for (const Source& src : sources_) one(*src.index);
  return best;
}

void propose_batch(Cursor* const* cursors, size_t n, const int64_t* budgets, double min_prob, int branching,
                   DraftOut& out) {
  Scratch s;
  for (size_t i = 0; i < n; ++i) {
    const Cursor& c = *cursors[i];
    DraftParams p{c.max_match(), min_prob, std::max(branching, 1)};
    int budget = int(std::clamp<int64_t>(budgets[i], 0, kMaxDraft));
    c.propose(budget, p, out, s);
  }
}

void best_continuation_batch(Cursor* const* cursors, size_t n, const Token* targets, const int64_t* offsets,
                             int64_t* out) {
  for (size_t i = 0; i < n; ++i)
    out[i] = cursors[i]->best_continuation(targets + offsets[i], size_t(offsets[i + 1] - offsets[i]));
}

void extend_batch(Cursor* const* cursors, size_t n, const Token* toks, const int64_t* offsets) {
  for (size_t i = 0; i < n; ++i) cursors[i]->extend(toks + offsets[i], size_t(offsets[i + 1] - offsets[i]));
}

}  // namespace dasrl
