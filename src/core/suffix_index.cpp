// Implementation of the suffix index; the header explains the structure and the semantics.
#include "suffix_index.hpp"

#include <algorithm>
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
  if (keys_.empty()) return kNil;
  size_t mask = keys_.size() - 1;
  for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    if (keys_[i] == key) return vals_[i];
    if (keys_[i] == kEmpty) return kNil;
  }
}

Ref HeadTable::exchange(uint64_t key, Ref ref) {
  if ((size_ + 1) * 2 > keys_.size()) grow();
  size_t mask = keys_.size() - 1;
  for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    if (keys_[i] == key) return std::exchange(vals_[i], ref);
    if (keys_[i] == kEmpty) {
      keys_[i] = key;
      vals_[i] = ref;
      ++size_;
      return kNil;
    }
  }
}

void HeadTable::grow() {
  std::vector<uint64_t> old_keys = std::move(keys_);
  std::vector<Ref> old_vals = std::move(vals_);
  size_t cap = std::max<size_t>(16, old_keys.size() * 2);
  keys_.assign(cap, kEmpty);
  vals_.assign(cap, kNil);
  size_ = 0;
  for (size_t i = 0; i < old_keys.size(); ++i)
    if (old_keys[i] != kEmpty) exchange(old_keys[i], old_vals[i]);
}

void HeadTable::clear() {
  keys_.clear();
  vals_.clear();
  keys_.shrink_to_fit();
  vals_.shrink_to_fit();
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
  Sequence& s = live(seq_id);
  check_tokens(toks, n);  // before any change: a bad token leaves the index as it was
  if (s.tokens.size() + n >= (1ULL << 32) - 1) throw std::length_error("sequence too long");
  uint32_t slot = slot_of_[seq_id];
  size_t start = s.tokens.size();
  s.tokens.insert(s.tokens.end(), toks, toks + n);
  s.prev1.resize(s.tokens.size());
  s.prevk.resize(s.tokens.size());
  for (size_t off = start; off < s.tokens.size(); ++off) thread_position(slot, uint32_t(off));
  live_tokens_ += n;
  ++version_;
}

void SuffixIndex::remove(int64_t seq_id) {
  Sequence& s = live(seq_id);
  s.alive = false;
  live_tokens_ -= s.tokens.size();
  dead_tokens_ += s.tokens.size();
  slot_of_.erase(seq_id);
  ++version_;
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

void SuffixIndex::compact() {
  std::vector<Sequence> old = std::move(slots_);
  slots_.clear();
  slot_of_.clear();
  heads1_.clear();
  headsk_.clear();
  for (auto& s : old) {
    if (!s.alive) continue;
    slot_of_[s.id] = uint32_t(slots_.size());
    slots_.push_back(std::move(s));
  }
  for (uint32_t slot = 0; slot < slots_.size(); ++slot)
    for (uint32_t off = 0; off < slots_[slot].tokens.size(); ++off) thread_position(slot, off);
  dead_tokens_ = 0;
  ++version_;
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

int SuffixIndex::backward_len(const Token* ctx, size_t n, const Sequence& s, uint32_t off, int cap) const {
  int lim = std::min<int64_t>(cap, int64_t(off) + 1);
  int L = 0;
  while (L < lim && ctx[n - 1 - L] == s.tokens[off - L]) ++L;
  return L;
}

void SuffixIndex::scan_chain(Ref r, bool order1, const Token* ctx, size_t n, int cap, Match& best) const {
  while (r != kNil) {
    const Sequence& s = slots_[r >> 32];
    uint32_t off = uint32_t(r);
    if (s.alive && off + 1 < s.tokens.size()) {
      int L = backward_len(ctx, n, s, off, cap);
      if (L >= (order1 ? 1 : kOrder)) {
        if (L > best.len) {
          best.len = L;
          best.occ.clear();
        }
        if (L == best.len) best.occ.push_back(r);
      }
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

bool SuffixIndex::keep_continued(Match& m) const {
  size_t w = 0;
  for (Ref r : m.occ)
    if (has_next(r)) m.occ[w++] = r;
  m.occ.resize(w);
  return w > 0;
}

bool SuffixIndex::advance(Match& m, Token tok) const {
  size_t w = 0;
  for (Ref r : m.occ)
    if (has_next(r) && at(r + 1) == tok) m.occ[w++] = r + 1;
  m.occ.resize(w);
  m.len += 1;
  return w > 0;
}

namespace {

struct Group {
  Token tok;
  double weight;
};

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

void SuffixIndex::draft(const Match& m, int budget, const DraftParams& p, DraftOut& out) const {
  out.tokens.clear();
  out.parents.clear();
  out.probs.clear();
  out.match_len = m.len;
  if (budget <= 0 || m.occ.empty()) return;
  if (p.branching == 1) return draft_chain(m, budget, p, out);
  std::vector<Group> groups;
  std::unordered_map<Token, size_t> group_of;  // only for nodes with many distinct continuations
  std::priority_queue<Candidate, std::vector<Candidate>, WorseCandidate> frontier;
  uint64_t pushed = 0;

  // Rank the continuations of occ and push the top `branching` as candidates under `parent`.
  auto expand = [&](const std::vector<Ref>& occ, int32_t parent, double parent_prob) {
    groups.clear();
    group_of.clear();
    double total = 0.0;
    for (Ref r : occ) {
      if (!has_next(r)) continue;
      Token t = at(r + 1);
      double w = slots_[r >> 32].weight;
      total += w;
      size_t g = groups.size();
      if (groups.size() <= 16) {
        for (size_t i = 0; i < groups.size(); ++i)
          if (groups[i].tok == t) { g = i; break; }
        if (g == groups.size() && groups.size() == 16)
          for (size_t i = 0; i < groups.size(); ++i) group_of[groups[i].tok] = i;
      } else {
        auto it = group_of.find(t);
        if (it != group_of.end()) g = it->second;
        else group_of[t] = g;
      }
      if (g == groups.size()) groups.push_back({t, 0.0});
      groups[g].weight += w;
    }
    if (groups.empty()) return;
    size_t k = std::min<size_t>(size_t(p.branching), groups.size());
    std::partial_sort(groups.begin(), groups.begin() + k, groups.end(), [](const Group& a, const Group& b) {
      return a.weight != b.weight ? a.weight > b.weight : a.tok < b.tok;
    });
    for (size_t i = 0; i < k; ++i) {
      double prob = parent_prob * (groups[i].weight / total);
      if (prob < p.min_prob) break;
      Candidate c{prob, pushed++, parent, groups[i].tok, {}};
      for (Ref r : occ)
        if (has_next(r) && at(r + 1) == c.tok) c.occ.push_back(r + 1);
      frontier.push(std::move(c));
    }
  };

  expand(m.occ, -1, 1.0);
  while (!frontier.empty() && int(out.tokens.size()) < budget) {
    Candidate c = std::move(const_cast<Candidate&>(frontier.top()));
    frontier.pop();
    int32_t node = int32_t(out.tokens.size());
    out.tokens.push_back(c.tok);
    out.parents.push_back(c.parent);
    out.probs.push_back(c.prob);
    if (int(out.tokens.size()) < budget) expand(c.occ, node, c.prob);
  }
}

// The branching = 1 case of draft(): the same ranking without a frontier or per-node allocations.
void SuffixIndex::draft_chain(const Match& m, int budget, const DraftParams& p, DraftOut& out) const {
  std::vector<Ref> cur(m.occ);
  std::vector<std::pair<Ref, Token>> cont;  // continued occurrences and their next tokens: memory read once
  std::vector<Group> groups;
  double prob = 1.0;
  while (int(out.tokens.size()) < budget) {
    groups.clear();
    cont.clear();
    double total = 0.0;
    for (Ref r : cur) {
      if (!has_next(r)) continue;
      Token t = at(r + 1);
      double w = slots_[r >> 32].weight;
      total += w;
      cont.emplace_back(r + 1, t);
      auto it = std::find_if(groups.begin(), groups.end(), [t](const Group& g) { return g.tok == t; });
      if (it == groups.end()) groups.push_back({t, w});
      else it->weight += w;
    }
    if (groups.empty()) return;
    auto top = std::min_element(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
      return a.weight != b.weight ? a.weight > b.weight : a.tok < b.tok;
    });
    double child = prob * (top->weight / total);
    if (child < p.min_prob) return;
    prob = child;
    Token best = top->tok;
    out.tokens.push_back(best);
    out.parents.push_back(int32_t(out.tokens.size()) - 2);
    out.probs.push_back(prob);
    cur.clear();
    for (auto& [r, t] : cont)
      if (t == best) cur.push_back(r);
  }
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

Cursor::Cursor(std::shared_ptr<SuffixIndex> index, int max_match) : index_(std::move(index)), max_match_(max_match) {
  if (!index_) throw std::invalid_argument("cursor needs an index");
  if (max_match < 1) throw std::invalid_argument("max_match must be >= 1, got " + std::to_string(max_match));
}

void Cursor::extend(const Token* toks, size_t n) {
  check_tokens(toks, n);
  ctx_.insert(ctx_.end(), toks, toks + n);
  if (ctx_.size() > size_t(2 * max_match_)) ctx_.erase(ctx_.begin(), ctx_.end() - max_match_);
  if (cached_) {
    pending_.insert(pending_.end(), toks, toks + n);
    if (match_.len + pending_.size() > size_t(max_match_)) cached_ = false;
  }
  total_ += n;
}

void Cursor::propose(int budget, const DraftParams& p, DraftOut& out) {
  const SuffixIndex& idx = *index_;
  bool hit = cached_ && cached_version_ == idx.version();
  if (hit) {
    for (Token t : pending_)
      if (!(hit = idx.advance(match_, t))) break;
    // The longest match must have a continuation; if none has, a shorter suffix may: re-match.
    if (hit) hit = idx.keep_continued(match_);
  }
  if (hit) {
    ++cache_hits;
  } else {
    ++cache_misses;
    match_ = idx.match(ctx_.data(), ctx_.size(), max_match_);
  }
  pending_.clear();
  cached_ = true;
  cached_version_ = idx.version();
  idx.draft(match_, budget, p, out);
}

}  // namespace dasrl
