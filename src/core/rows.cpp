// See rows.hpp. Every expression below mirrors a numpy expression of allowance.py / tracker.py, evaluated in
// the order numpy evaluates it; CMakeLists compiles this file with -ffp-contract=off (no fused multiply-add).
#include "rows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dasrl {

namespace {

// _Prices.best at a scalar share and fixed cost: argmin over d <= most[b] of (share + cost + fixed * [d > 0]) / e
// (numpy's argmin: the first minimum, or the first NaN).
void best_rows(const double* cost, const double* e, int64_t B, int64_t D, const int64_t* most, double share,
               double fixed, int64_t* out) {
  const double fixed0 = fixed * 0.0;  // fixed * False
  for (int64_t b = 0; b < B; ++b) {
    const double* c = cost + b * D;
    const double* ee = e + b * D;
    const int64_t last = most ? std::min<int64_t>(most[b], D - 1) : D - 1;
    int64_t arg = 0;
    double lo = std::numeric_limits<double>::infinity();
    bool first = true;
    for (int64_t d = 0; d < D; ++d) {
      double v;
      if (d <= last) {
        double t = share + c[d];
        t = t + (d > 0 ? fixed : fixed0);
        v = t / ee[d];
      } else {
        v = std::numeric_limits<double>::infinity();
      }
      if (std::isnan(v)) {
        arg = d;
        break;
      }
      if (first || v < lo) {
        lo = v;
        arg = d;
        first = false;
      }
    }
    out[b] = arg;
  }
}

double pairwise(const double* a, int64_t n) {
  if (n < 8) {
    double res = 0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise(a, n2) + pairwise(a + n2, n - n2);
}

}  // namespace

double numpy_sum(const double* a, int64_t n) { return pairwise(a, n); }

Split price_split(const double* row, double c_tok, const double* e, int64_t B, int64_t D, const int64_t* most,
                  const double* remaining, const double* pu, const double* kv, double c_base, double c_draft, int64_t* best,
                  int64_t* need, double* share, double* extra) {
  // _Prices.cost = row + c_tok * d + kv * [d > 0]: [B, D] seconds per forward without the share
  std::vector<double> table(size_t(B * D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t d = 0; d < D; ++d) {
      double t = row[b] + c_tok * double(d);
      table[size_t(b * D + d)] = t + kv[b] * (d > 0 ? 1.0 : 0.0);
    }
  const double* cost = table.data();
  std::vector<int64_t> solo(B), crit(B);
  std::vector<double> at_solo(B);
  std::vector<uint8_t> group(B);
  const double spread = c_base / double(B);
  best_rows(cost, e, B, D, most, spread, c_draft, solo.data());
  for (int64_t b = 0; b < B; ++b) at_solo[b] = remaining[b] / e[b * D + solo[b]];
  int64_t m = 1, size = 0;
  double horizon = 0.0;
  while (true) {
    best_rows(cost, e, B, D, most, c_base / double(m), c_draft / double(m), crit.data());
    horizon = -std::numeric_limits<double>::infinity();
    bool nan = false;
    for (int64_t b = 0; b < B; ++b) {
      double f = remaining[b] / e[b * D + crit[b]];
      if (std::isnan(f)) nan = true;
      horizon = std::max(horizon, f);
    }
    if (nan) horizon = std::numeric_limits<double>::quiet_NaN();  // numpy's max propagates NaN
    const double bar = horizon * (1 + 1e-9);
    size = 0;
    for (int64_t b = 0; b < B; ++b) size += group[b] = at_solo[b] > bar;
    if (std::max<int64_t>(size, 1) <= m) break;
    m = size;
  }
  const double base_m = c_base / double(m), draft_m = c_draft / double(m);
  const double room = std::max(horizon, 1e-9);
  for (int64_t b = 0; b < B; ++b) {
    if (!size || !group[b]) {
      share[b] = spread;
      extra[b] = kv[b] + c_draft;
      best[b] = need[b] = solo[b];
      continue;
    }
    share[b] = base_m;
    extra[b] = kv[b] + draft_m;
    best[b] = crit[b];
    // pace_draft: the shortest draft (at most crit) within the critical path
    const double n = remaining[b] / room, q = pu[b];
    const int64_t cap = crit[b];
    int64_t k = 0;
    if (n > 1.0 && cap > 0) {
      if (q >= 1.0) {
        k = int64_t(std::ceil(n - 1.0));
      } else if (1.0 - (1.0 - q) * n <= 0.0 || q <= 0.0) {
        k = cap;
      } else {
        k = int64_t(std::ceil(std::log(1.0 - (1.0 - q) * n) / std::log(q) - 1.0 - 1e-9));
      }
      k = std::min(std::max<int64_t>(k, 0), cap);
    }
    need[b] = k;
  }
  return Split{size, m, horizon};
}

void cut_chains(const double* probs, const int64_t* offsets, const int64_t* match_len, int64_t n, double factor,
                const uint8_t* priced, const double* share, const double* row, const double* extra, double c_tok,
                double calib, int64_t* keep, double* expected) {
  std::vector<double> q;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t lo = offsets[b], len = offsets[b + 1] - offsets[b];
    int64_t k = len;
    if (factor > 0) k = std::min(len, std::max<int64_t>(int64_t(factor * double(match_len[b])), 0));
    expected[b] = std::numeric_limits<double>::quiet_NaN();
    if (priced && priced[b] && k > 0) {
      q.resize(size_t(k));
      for (int64_t j = 0; j < k; ++j) q[size_t(j)] = std::min(probs[lo + j] * calib, 1.0);
      const double head = share[b] + row[b];
      double cum = 0.0, low = 0.0;
      int64_t arg = 0;
      for (int64_t j = 0; j <= k; ++j) {
        if (j > 0) cum = cum + q[size_t(j - 1)];
        double t = head + c_tok * double(j);
        t = t + extra[b] * (j > 0 ? 1.0 : 0.0);
        const double v = t / (1.0 + cum);
        if (std::isnan(v)) {
          arg = j;
          break;
        }
        if (j == 0 || v < low) {
          low = v;
          arg = j;
        }
      }
      k = arg;
      if (k > 0) expected[b] = pairwise(q.data(), k) / calib;
    }
    keep[b] = k;
  }
}

void scatter_rows(Token* dst, int64_t k, const int64_t* slots, const Token* src, const int64_t* starts, const int64_t* keep,
                  int64_t n) {
  for (int64_t j = 0; j < n; ++j) std::copy(src + starts[j], src + starts[j] + keep[j], dst + slots[j] * k);
}

template <class T>
void accepted_rows(const Token* drafts, int64_t k, const int64_t* dlen, const T* tokens, int64_t width, const int64_t* rows,
                   const int64_t* start, const int64_t* count, int64_t n, int64_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t seen = std::min(count[j] - 1, dlen[j]);
    const T* t = tokens + rows[j] * width + start[j];
    const Token* d = drafts + j * k;
    int64_t a = 0;
    while (a < seen && int64_t(d[a]) == int64_t(t[a])) ++a;
    out[j] = a;
  }
}

template <class T>
std::pair<int64_t, int64_t> first_bad_rows(const T* tokens, int64_t width, const int64_t* rows, const int64_t* start,
                                           const int64_t* count, int64_t n, int64_t limit) {
  std::pair<int64_t, int64_t> over{-1, -1};
  for (int64_t i = 0; i < n; ++i) {
    const T* t = tokens + rows[i] * width + start[i];
    for (int64_t j = 0; j < count[i]; ++j) {
      if (int64_t(t[j]) < 0) return {i, j};
      if (over.first < 0 && int64_t(t[j]) >= limit) over = {i, j};
    }
  }
  return over;
}

template <class T>
void extend_rows(Cursor* const* cursors, const T* tokens, int64_t width, const int64_t* rows, const int64_t* start,
                 const int64_t* count, int64_t n) {
  std::vector<Token> buf;
  for (int64_t i = 0; i < n; ++i) {
    const T* t = tokens + rows[i] * width + start[i];
    if constexpr (std::is_same_v<T, Token>) {
      cursors[i]->extend(t, size_t(count[i]));
    } else {
      buf.assign(t, t + count[i]);
      cursors[i]->extend(buf.data(), buf.size());
    }
  }
}

template void accepted_rows<int32_t>(const Token*, int64_t, const int64_t*, const int32_t*, int64_t, const int64_t*,
                                     const int64_t*, const int64_t*, int64_t, int64_t*);
template void accepted_rows<int64_t>(const Token*, int64_t, const int64_t*, const int64_t*, int64_t, const int64_t*,
                                     const int64_t*, const int64_t*, int64_t, int64_t*);
template std::pair<int64_t, int64_t> first_bad_rows<int32_t>(const int32_t*, int64_t, const int64_t*, const int64_t*,
                                                             const int64_t*, int64_t, int64_t);
template std::pair<int64_t, int64_t> first_bad_rows<int64_t>(const int64_t*, int64_t, const int64_t*, const int64_t*,
                                                             const int64_t*, int64_t, int64_t);
template void extend_rows<int32_t>(Cursor* const*, const int32_t*, int64_t, const int64_t*, const int64_t*,
                                   const int64_t*, int64_t);
template void extend_rows<int64_t>(Cursor* const*, const int64_t*, int64_t, const int64_t*, const int64_t*,
                                   const int64_t*, int64_t);

namespace {
// The period of one tail t[0..len) (rows.hpp count_periods); `items` is scratch.
template <class T>
int64_t period_of(const T* t, int64_t len, const int64_t* digits, int64_t max_period, std::vector<int64_t>& items) {
  constexpr int64_t kNum = -1;
  const auto [lo, hi] = std::minmax_element(digits, digits + 10);  // most tokens are outside: one test
  auto is_digit = [&](int64_t x) { return x >= *lo && x <= *hi && std::find(digits, digits + 10, x) != digits + 10; };
  int64_t end = len;
  while (end > 0 && is_digit(t[end - 1])) --end;  // the partial number is not an item
  items.clear();  // the newest item first, at most 3 max_period
  for (int64_t c = end - 1; c >= 0 && int64_t(items.size()) < 3 * max_period; --c) {
    if (!is_digit(t[c])) {
      items.push_back(int64_t(t[c]));
      continue;
    }
    while (c > 0 && is_digit(t[c - 1])) --c;  // back to the run's first digit
    if (c == 0) break;                        // a leading number: the window may have cut it
    items.push_back(kNum);
  }
  const int64_t k = int64_t(items.size());
  int64_t first_num = 0;  // the newest number item
  while (first_num < k && items[first_num] != kNum) ++first_num;
  for (int64_t p = first_num + 1; p <= max_period && 3 * p <= k; ++p) {
    bool ok = true;
    for (int64_t j = 0; j < 2 * p && ok; ++j) ok = items[j] == items[j + p];
    if (ok) return p;
  }
  return 0;
}
}  // namespace

void count_periods(const int64_t* tokens, const int64_t* offsets, int64_t n, const int64_t* digits, int64_t max_period,
                   int64_t* out) {
  std::vector<int64_t> items;
  for (int64_t b = 0; b < n; ++b)
    out[b] = period_of(tokens + offsets[b], offsets[b + 1] - offsets[b], digits, max_period, items);
}

template <class T>
void count_periods_rows(const T* tokens, int64_t width, const int64_t* rows, const int64_t* start, const int64_t* count,
                        int64_t n, const int64_t* digits, int64_t max_period, int64_t* out) {
  std::vector<int64_t> items;
  for (int64_t i = 0; i < n; ++i)
    out[i] = period_of(tokens + rows[i] * width + start[i], count[i], digits, max_period, items);
}

template void count_periods_rows<int32_t>(const int32_t*, int64_t, const int64_t*, const int64_t*, const int64_t*,
                                          int64_t, const int64_t*, int64_t, int64_t*);
template void count_periods_rows<int64_t>(const int64_t*, int64_t, const int64_t*, const int64_t*, const int64_t*,
                                          int64_t, const int64_t*, int64_t, int64_t*);

}  // namespace dasrl
