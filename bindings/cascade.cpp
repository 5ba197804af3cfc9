#include "cascade.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "output_row.h"
#include "sparse_v.h"
#include "split_merge.h"
#include "thread_pool.h"

namespace kvmetal {
namespace {

constexpr int kItemsPerThread = 8;  // as in attention.cpp: enough items to balance uneven ones

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One token list and the query rows that attend all of it.
struct RowGroup {
  const int32_t* table = nullptr;  // block ids of the list
  int len = 0;                     // tokens (clamped to the table)
  std::vector<int> seqs;           // query sequences; row j = member (j / G), head g = j % G of the kv head
};

// One (group, kv head, split) item and where its partials go.
struct Item {
  int group = 0, kvh = 0, lo = 0, hi = 0;
  int64_t offset = 0;  // floats into the partials: m[R], l[R], acc[R * D]
};

struct Scratch {
  std::vector<float> q, k_tile, v_tile, scores, corr, ones;
  void fit(int R, int D, int block_size) {
    ones.assign(R, 1.f);
    q.resize(static_cast<size_t>(R) * D);
    k_tile.resize(static_cast<size_t>(block_size) * D);
    v_tile.resize(static_cast<size_t>(block_size) * D);
    scores.resize(static_cast<size_t>(R) * kMaxTileRows);
    corr.resize(R);
  }
};

Scratch& scratch() {
  thread_local Scratch sc;
  return sc;
}

int clamp_len(int32_t len, int64_t width, int block_size) {
  return static_cast<int>(std::clamp<int64_t>(len, 0, width * block_size));
}

// The prefix groups (members of one valid, non-empty prefix) and one own group per
// sequence with tokens. prefix_slot[s] / own_group[s]: where sequence s's states are.
struct Groups {
  std::vector<RowGroup> list;
  std::vector<int> prefix_group, prefix_member, own_group;  // -1: none
};

Groups build_groups(const CascadeParams& p) {
  Groups g;
  g.prefix_group.assign(p.num_seqs, -1);
  g.prefix_member.assign(p.num_seqs, -1);
  g.own_group.assign(p.num_seqs, -1);
  std::vector<int> group_of_prefix(p.num_prefixes, -1);
  for (int s = 0; s < p.num_seqs; ++s) {
    const int owner = p.prefix_of[s];
    if (owner < 0 || owner >= p.num_prefixes) continue;
    const int len = clamp_len(p.prefix_lens[owner], p.prefix_width, p.block_size);
    if (len == 0) continue;
    if (group_of_prefix[owner] < 0) {
      group_of_prefix[owner] = static_cast<int>(g.list.size());
      g.list.push_back(RowGroup{p.prefix_tables + static_cast<int64_t>(owner) * p.prefix_width, len, {}});
    }
    RowGroup& group = g.list[group_of_prefix[owner]];
    g.prefix_group[s] = group_of_prefix[owner];
    g.prefix_member[s] = static_cast<int>(group.seqs.size());
    group.seqs.push_back(s);
  }
  for (int s = 0; s < p.num_seqs; ++s) {
    const int len = clamp_len(p.seq_lens[s], p.width, p.block_size);
    if (len == 0) continue;
    g.own_group[s] = static_cast<int>(g.list.size());
    g.list.push_back(RowGroup{p.block_tables + static_cast<int64_t>(s) * p.width, len, {s}});
  }
  return g;
}

// Splits cut a group's tokens in whole blocks; enough items for the threads, but no
// split under min_tokens_per_split tokens.
std::vector<Item> plan_items(const CascadeParams& p, const Groups& g) {
  const int G = p.num_heads / p.num_kv_heads;
  const int64_t target = static_cast<int64_t>(kItemsPerThread) * ThreadPool::instance().num_threads();
  const int64_t base = std::max<int64_t>(1, static_cast<int64_t>(g.list.size()) * p.num_kv_heads);
  std::vector<Item> items;
  int64_t offset = 0;
  for (int gi = 0; gi < static_cast<int>(g.list.size()); ++gi) {
    const RowGroup& group = g.list[gi];
    const int64_t R = static_cast<int64_t>(group.seqs.size()) * G;
    const int64_t blocks = ceil_div(group.len, p.block_size);
    const int64_t cap = std::max<int64_t>(1, group.len / std::max(1, p.min_tokens_per_split));
    const int64_t splits = std::clamp<int64_t>(ceil_div(target, base), 1, std::min(blocks, cap));
    const int64_t per = ceil_div(blocks, splits) * p.block_size;
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh)
      for (int64_t lo = 0; lo < group.len; lo += per) {
        items.push_back(Item{gi, kvh, static_cast<int>(lo), static_cast<int>(std::min<int64_t>(group.len, lo + per)),
                             offset});
        offset += R * (p.head_dim + 2);
      }
  }
  return items;
}

// Sparse V (sparse_v.h, seed_running_max): every row of a group sees all of its
// tokens, so the seeds are its first token and its kSparseVRecentSeeds last ones.
void seed(const CascadeParams& p, const KVView& k, const TileKernels& tk, const RowGroup& group, const Item& item,
          int R, Scratch& sc, float* m) {
  const int D = p.head_dim;
  const int recent = std::max(0, group.len - kSparseVRecentSeeds);
  int at[kMaxTileRows], n = 0;
  if (recent > 0) at[n++] = 0;
  for (int t = recent; t < group.len; ++t) at[n++] = t;
  float* scores = sc.scores.data();
  bool valid[kMaxTileRows];
  for (int i = 0; i < n;) {  // one call per run of seeds inside a block
    int b = i + 1;
    while (b < n && at[b] == at[b - 1] + 1 && at[b] % p.block_size) ++b;
    const int32_t block = group.table[at[i] / p.block_size];
    std::fill(valid + i, valid + b, block >= 0 && block < p.num_blocks);
    if (valid[i]) {
      int64_t ks = D;
      const float* rows = k.tile(block, item.kvh, at[i] % p.block_size, b - i, sc.k_tile.data(), &ks, tk);
      tk.scores(sc.q.data(), R, rows, ks, b - i, D, scores + i);
    }
    i = b;
  }
  p.cap_scores(scores, R, n, kMaxTileRows);
  for (int i = 0; i < n; ++i)  // padding is never a seed (masked after the softcap, as in the walk)
    if (!valid[i])
      for (int j = 0; j < R; ++j) scores[j * kMaxTileRows + i] = kNegInf;
  seed_running_max(scores, R, n, m);
}

// The online-softmax state of one item's R rows over its token range.
void run_item(const CascadeParams& p, const KVView& k, const KVView& v, const TileKernels& tk, const RowGroup& group,
              const Item& item, float* part) {
  const int G = p.num_heads / p.num_kv_heads;
  const int D = p.head_dim;
  const int R = static_cast<int>(group.seqs.size()) * G;
  float* m = part;
  float* l = part + R;
  float* acc = part + 2 * R;
  std::fill(m, m + R, kNegInf);
  std::fill(l, l + R + static_cast<int64_t>(R) * D, 0.f);
  Scratch& sc = scratch();
  sc.fit(R, D, p.block_size);
  // Query rows, pre-scaled: member (j / G), head kvh * G + j % G.
  for (int j = 0; j < R; ++j) {
    const int64_t src = (static_cast<int64_t>(group.seqs[j / G]) * p.num_heads + item.kvh * G + j % G) * D;
    float* dst = sc.q.data() + static_cast<int64_t>(j) * D;
    for (int d = 0; d < D; ++d) dst[d] = load_as_f32(p.query, src + d, p.q_kind) * p.scale;
  }
  if (p.sparse_v > 0.f) seed(p, k, tk, group, item, R, sc, m);
  // One block's rows at a time: converted once, scored and accumulated for all R rows.
  for (int t = item.lo; t < item.hi;) {
    const int32_t block = group.table[t / p.block_size];
    const int row0 = t % p.block_size;
    const int n = std::min(p.block_size - row0, item.hi - t);
    t += n;
    if (block < 0 || block >= p.num_blocks) continue;  // padding: never read, attends nothing
    int64_t ks = D, vs = D;
    const float* k_rows = k.tile(block, item.kvh, row0, n, sc.k_tile.data(), &ks, tk);
    float* scores = sc.scores.data();
    tk.scores(sc.q.data(), R, k_rows, ks, n, D, scores);
    p.cap_scores(scores, R, n, kMaxTileRows);
    tk.softmax_update(scores, R, n, m, l, sc.corr.data());
    if (p.sparse_v > 0.f) {  // only the V rows some member row still needs (sparse_v.h)
      accumulate_sparse_v(
          p.sparse_v, scores, R, D, n, 1, [n](int) { return SparseVSegment{n, true}; }, sc.corr.data(),
          sc.ones.data(), acc, [&](int, int r0, int rn, const float* w, const float* c) {
            const float* rows = v.tile(block, item.kvh, row0 + r0, rn, sc.v_tile.data(), &vs, tk);
            tk.accumulate(w, c, R, rows, vs, rn, D, acc);
          });
      continue;
    }
    const float* v_rows = v.tile(block, item.kvh, row0, n, sc.v_tile.data(), &vs, tk);
    tk.accumulate(scores, sc.corr.data(), R, v_rows, vs, n, D, acc);
  }
}

// Fold the states of query row (s, h) (prefix items, own items, sink) into the output.
void merge_row(const CascadeParams& p, const TileKernels& tk, const Groups& g, const std::vector<Item>& items,
               const std::vector<int64_t>& first_item, const std::vector<float>& partials, int s, int h, float* tmp) {
  const int G = p.num_heads / p.num_kv_heads;
  const int D = p.head_dim;
  const int kvh = h / G;
  // Sequence s's two states: its prefix group's member rows and its own group's rows.
  struct State {
    int group, R, j;  // row j of the group's R rows
  };
  State states[2];
  int count = 0;
  if (g.prefix_group[s] >= 0) {
    const int gi = g.prefix_group[s];
    states[count++] = State{gi, static_cast<int>(g.list[gi].seqs.size()) * G, g.prefix_member[s] * G + h % G};
  }
  if (g.own_group[s] >= 0) states[count++] = State{g.own_group[s], G, h % G};
  auto for_each_item = [&](const State& st, auto fn) {
    for (int64_t i = first_item[st.group]; i < first_item[st.group + 1]; ++i)
      if (items[i].kvh == kvh) fn(partials.data() + items[i].offset, st.R, st.j);
  };
  merge_partials(
      [&](auto f) {
        for (int c = 0; c < count; ++c)
          for_each_item(states[c], [&](const float* part, int R, int j) {
            f(part[j], part[R + j], part + 2 * R + static_cast<int64_t>(j) * D);
          });
      },
      D, p.sinks ? p.sinks + h : nullptr, tmp);
  const int64_t row = (static_cast<int64_t>(s) * p.num_heads + h) * D;
  store_output_row(tk, p.q_kind, tmp, D, p.out, row);
}

}  // namespace

void paged_attention_cascade(const CascadeParams& p, const KVView& k, const KVView& v) {
  if (p.num_seqs == 0 || p.num_heads == 0 || p.head_dim == 0) return;  // empty output
  const TileKernels& tk = tile_kernels(p.head_dim);
  const Groups groups = build_groups(p);
  const std::vector<Item> items = plan_items(p, groups);
  // Items are listed group by group: first_item[g] .. first_item[g + 1].
  std::vector<int64_t> first_item(groups.list.size() + 1, static_cast<int64_t>(items.size()));
  for (int64_t i = static_cast<int64_t>(items.size()) - 1; i >= 0; --i) first_item[items[i].group] = i;
  for (int64_t gi = static_cast<int64_t>(groups.list.size()) - 1; gi >= 0; --gi)
    first_item[gi] = std::min(first_item[gi], first_item[gi + 1]);
  const int G = p.num_heads / p.num_kv_heads;
  int64_t floats = 0;
  for (const Item& it : items)
    floats = std::max(floats, it.offset + static_cast<int64_t>(groups.list[it.group].seqs.size()) * G * (p.head_dim + 2));
  std::vector<float> partials(static_cast<size_t>(floats));

  ThreadPool& pool = ThreadPool::instance();
  pool.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    run_item(p, k, v, tk, groups.list[items[i].group], items[i], partials.data() + items[i].offset);
  });
  pool.parallel_for(p.num_seqs, [&](int64_t s) {
    std::vector<float> tmp(p.head_dim);
    for (int h = 0; h < p.num_heads; ++h)
      merge_row(p, tk, groups, items, first_item, partials, static_cast<int>(s), h, tmp.data());
  });
}

}  // namespace kvmetal
