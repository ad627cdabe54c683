// Paged decode attention on CPU: one query token per sequence, keys and values read in
// place from the paged KV cache (no gathered copy), two passes per (sequence, KV head):
// scores, then the softmax-weighted sum of values. Both passes go a block at a time and,
// within a block, one query head at a time over the block's rows (in L1 after the first
// head): its query (scores) or output (values) stays in registers, four rows' scores are
// independent chains. Accumulation is in at::opmath_type (float for 16-bit inputs, double
// for double). A work item is a sequence's every KV head where the batch has sequences
// enough for every thread (a block's rows are then one contiguous run, asked of the memory
// a block ahead in slices between the query heads), else one (sequence, KV head). Past
// 16384 key values (256 keys of a 64-wide head, 64 of a 256-wide one) it is split into
// near-equal chunks that run in parallel (one long sequence would otherwise keep one
// thread busy), each with its own softmax maximum and sum, merged by rescaling to the
// overall maximum. A (sequence, KV head)'s arithmetic, and so its bits,
// never depend on the batch, the work items or the threads.

#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "entry_points.h"
#include "vec_lanes.h"

namespace {

// exp(x - shift) of n contiguous scores, in place; returns their sum. A plain loop that
// the compiler vectorizes (with -ffast-math, through glibc's vector exp).
template <typename acc_t>
acc_t exp_shifted(acc_t* x, int64_t n, acc_t shift) {
  acc_t total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}

template <typename scalar_t, typename acc_t>
acc_t dot(const acc_t* q, const scalar_t* k, int64_t n) {
  acc_t total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < n; ++d) total += q[d] * static_cast<acc_t>(k[d]);
  return total;
}

using vec_lanes::load_lanes;
using vec_lanes::VecF;
// Key values (keys x head_dim) per work item past which a (sequence, KV head) is split into
// chunks of near-equal keys: 256 keys of 64-wide heads, 64 of 256-wide ones. The chunks are
// a function of the sequence's length and the head width only, so a row's result never
// depends on its batch or the threads.
constexpr int64_t kChunkValues = 256 * 64;

// The chunks of `count` keys: chunk c is keys [count * c / chunks, count * (c + 1) / chunks).
inline int64_t num_chunks(int64_t count, int64_t head_dim) {
  const int64_t most = std::max<int64_t>(16, kChunkValues / head_dim);
  return (count + most - 1) / most;
}

struct Item {
  int64_t seq, kv_head;             // KV heads kv_head .. kv_head + heads_per_item - 1
  int64_t lo, hi;                   // keys lo .. hi - 1
  int64_t part;                     // its first head's slot in the partial results (its other
                                    // heads' follow); -1: the whole sequence
};

struct Split {   // a (sequence, KV head) in chunks: its parts first_part + c * part_step
  int64_t seq, kv_head, first_part, part_step, num_parts;
};
// Work items per thread that one-KV-head items must make before they are taken (see below).
constexpr int64_t kItemsPerThread = 2;

constexpr int64_t kLanes = vec_lanes::kVecLanes;   // the vector path's lanes (vec_lanes.h)

inline float lane_sum(VecF v) {   // -ffast-math: a tree of shuffles and adds
  float total = 0;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// Rows whose scores one pass computes at once: independent chains of fmas.
constexpr int64_t kScoreRows = 4;

// The lane sums of kScoreRows vectors into out[0..kScoreRows-1]: what lane_sum gives for each.
inline void store_sums(const VecF* sums, float* out) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // lane_sum's tree (GCC, -ffast-math, 8 lanes): (v0+v4, v1+v5, v2+v6, v3+v7), then
  // (w0+w2, w1+w3), then x0+x1: the same pairs, four vectors at a time
  const __m256 v0 = sums[0], v1 = sums[1], v2 = sums[2], v3 = sums[3];
  const __m256 a01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
  const __m256 a23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
  // per 128-bit lane: [w0, w1, w0', w1'] + [w2, w3, w2', w3'] (w of rows 0 | 1, w' of rows 2 | 3)
  const __m256 b = _mm256_add_ps(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xEE));
  // per 128-bit lane: [x0, x0', .., ..] + [x1, x1', .., ..]
  const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b, b, 0x08), _mm256_shuffle_ps(b, b, 0x0D));
  out[0] = c[0];
  out[2] = c[1];
  out[1] = c[4];
  out[3] = c[5];
#else
  for (int64_t u = 0; u < kScoreRows; ++u) out[u] = lane_sum(sums[u]);
#endif
}

// The scalar types the vector path reads (float16 and double take the generic loop).
template <typename scalar_t>
constexpr bool kVectorType = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
// The widest head the vector path takes, in vectors (head_dim / kLanes per row): 256 values
// (Gemma's heads) with AVX2's 8 lanes. Up to 16 stay in registers; wider rows spill a
// query's or an output's vectors to the stack, which still beats the generic loop (its
// scores are per-row horizontal sums, its query re-read per key).
constexpr int64_t kMaxHeadVectors = 32;

// Blocks ahead whose rows a pass asks the memory for before it reads them: in a decode step
// the cache is cold (the layer's weights streamed through since this layer last ran), and
// blocks lie anywhere (a head's rows are short runs at a stride besides) where the hardware
// prefetcher does not follow. One block: two or more were no faster on a 2-core EPYC.
constexpr int64_t kPrefetchBlocks = 1;

// Asks for the rows lo..hi-1 of one block of one head (`row_bytes` each), into every cache level.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* base, int64_t lo, int64_t hi, int64_t token_stride, int64_t row_bytes) {
  for (int64_t i = lo; i < hi; ++i) {
    const char* row = reinterpret_cast<const char*>(base + i * token_stride);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 3);
  }
}

// a * b + c rounded once, in this order: what the compiler makes of `c += a * b` in a loop
// whose length it does not know, kept when the length is known (an unrolled chain of
// `+=` may be reassociated under -ffast-math, which would change a score's bits).
inline VecF fma_lanes(VecF a, VecF b, VecF c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// fn(std::integral_constant<int64_t, W>) with W = nvec where it is a common head width in
// vectors (64, 128 or 256 values, with AVX2 or AVX-512), else W = 0 (the width at run time): a
// known width unrolls a row's loops and keeps its vectors in registers.
template <typename Fn>
inline void with_head_vectors(int64_t nvec, Fn fn) {
#if defined(__AVX2__) && defined(__FMA__)
  switch (nvec * kLanes) {
    case 64: return fn(std::integral_constant<int64_t, 64 / kLanes>{});
    case 128: return fn(std::integral_constant<int64_t, 128 / kLanes>{});
    case 256: return fn(std::integral_constant<int64_t, 256 / kLanes>{});
    default: return fn(std::integral_constant<int64_t, 0>{});
  }
#else
  (void)nvec;
  return fn(std::integral_constant<int64_t, 0>{});   // no fused multiply-add to keep the order
#endif
}

// The cache lines of one block's rows that a pass asks for a slice at a time, spread over
// its work on the block before (all at once they would fill the miss buffers and stall it).
struct Ahead {
  const char* from = nullptr;   // contiguous rows: first byte; nullptr: nothing to ask for
  int64_t lines = 0;
  void slice(int64_t k, int64_t of) const {
    for (int64_t line = k * lines / of; line < (k + 1) * lines / of; ++line)
      __builtin_prefetch(from + line * 64, 0, 3);
  }
};

// The blocks of one work item's keys first .. len-1, in order: fn(base, lo, hi, t, ahead) with
// base the block's first row of the item's first head, its rows lo .. hi-1 (within the block)
// the item's tokens t .. t + hi - lo - 1, and ahead the block kPrefetchBlocks on when the
// item's rows are contiguous (every head), for fn to ask for in slices. Otherwise (one head's
// rows at a stride) the rows of the block kPrefetchBlocks on are asked for before fn runs.
template <typename scalar_t, typename Fn>
inline void for_each_block(const scalar_t* cache, const int32_t* table, int64_t first, int64_t len,
                           int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_offset,
                           int64_t span, Fn fn) {
  const int64_t first_block = first / block_size, end_block = (len + block_size - 1) / block_size;
  const int64_t span_bytes = span * static_cast<int64_t>(sizeof(scalar_t));
  const bool contiguous = span == token_stride;
  auto rows = [&](int64_t b, int64_t* lo, int64_t* hi) {
    *lo = std::max<int64_t>(first, b * block_size) - b * block_size;
    *hi = std::min<int64_t>(len, (b + 1) * block_size) - b * block_size;
    return cache + table[b] * block_stride + head_offset;
  };
  int64_t lo, hi;
  for (int64_t b = first_block; b < std::min(end_block, first_block + kPrefetchBlocks); ++b) {
    const scalar_t* base = rows(b, &lo, &hi);
    prefetch_rows(base, lo, hi, token_stride, span_bytes);
  }
  int64_t t = 0;
  for (int64_t b = first_block; b < end_block; ++b) {
    Ahead ahead;
    if (b + kPrefetchBlocks < end_block) {
      const scalar_t* next = rows(b + kPrefetchBlocks, &lo, &hi);
      if (contiguous) {
        ahead.from = reinterpret_cast<const char*>(next + lo * token_stride);
        ahead.lines = ((hi - lo) * span_bytes + 63) / 64;
      } else {
        prefetch_rows(next, lo, hi, token_stride, span_bytes);
      }
    }
    const scalar_t* base = rows(b, &lo, &hi);
    fn(base, lo, hi, t, ahead);
    t += hi - lo;
  }
}

// The vector path's visit of one work item's rows: for every block, and within it every
// query head r of the item in turn, fn(w, r, rows, lo, hi, t) with rows the first row of r's
// KV head in the block (see for_each_block for lo, hi and t); the next block is asked for
// in slices between the heads. w is with_head_vectors' width (head_vectors(w, nvec)).
template <typename scalar_t, typename Fn>
inline void for_each_query_head_block(int64_t nvec, int64_t group, int64_t heads, const scalar_t* cache,
                                      const int32_t* table, int64_t first, int64_t len, int64_t block_size,
                                      int64_t block_stride, int64_t token_stride, int64_t head_offset,
                                      int64_t head_dim, Fn fn) {
  with_head_vectors(nvec, [&](auto w) {
    for_each_block(cache, table, first, len, block_size, block_stride, token_stride, head_offset, heads * head_dim,
                   [&](const scalar_t* base, int64_t lo, int64_t hi, int64_t t0, const Ahead& ahead) {
      for (int64_t r = 0; r < heads * group; ++r) {
        ahead.slice(r, heads * group);
        fn(w, r, base + (r / group) * head_dim, lo, hi, t0);
      }
    });
  });
}

// Vectors per head row: with_head_vectors' compile-time width where it has one, else nvec.
template <typename W>
constexpr int64_t head_vectors(W, int64_t nvec) {
  return W::value ? W::value : nvec;
}

template <typename scalar_t>
void decode_rows(const torch::Tensor& query, const torch::Tensor& key_cache,
                 const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                 const torch::Tensor& seq_lens, torch::Tensor& out, int64_t sliding_window,
                 double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k_cache = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_cache = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const acc_t sm_scale = static_cast<acc_t>(scale);
  const int64_t nvec = head_dim / kLanes;
  const bool vector_path = kVectorType<scalar_t> && head_dim % kLanes == 0 && nvec <= kMaxHeadVectors;

  for (int64_t seq = 0; seq < num_seqs; ++seq) {   // block tables checked once, before any work
    const int64_t len = lens[seq];
    TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "sequence ", seq, " has ", len,
                " tokens; its block table holds ", max_blocks * block_size);
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int32_t* table = tables + seq * max_blocks;
    for (int64_t b = first / block_size; b <= (len - 1) / block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "sequence ", seq, " block ", b,
                  " is ", table[b], ", outside the cache's ", num_blocks, " blocks");
    }
  }

  // Work items: a sequence's visible keys, or past kChunkValues one chunk of them (the chunks
  // merged after), over every KV head (a block's rows are then one contiguous run), or over
  // one KV head each (short runs at a stride, which a core reads more slowly) only where the
  // batch has too few sequences to keep each thread busy and a sequence has KV heads
  // enough to. With 2 or 3 KV heads on 2 threads the one-head items either leave a thread
  // a third of the work or gain nothing: every-head items read one or two sequences of
  // 300 to 1,200 keys 5-28% faster (64-wide heads, a 2-core AVX2 EPYC), and no slower below.
  // A (sequence, KV head)'s arithmetic is the same either way.
  const int64_t threads = at::get_num_threads();
  const bool few_sequences = num_seqs < kItemsPerThread * threads;
  const int64_t heads_per_item = few_sequences && num_kv_heads >= kItemsPerThread * threads ? 1 : num_kv_heads;
  std::vector<Item> items;
  std::vector<Split> splits;
  int64_t num_parts = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = lens[seq];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t count = len - first, chunks = num_chunks(count, head_dim);
    if (chunks == 1) {
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item) items.push_back({seq, h, first, len, -1});
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) splits.push_back({seq, h, num_parts + h, num_kv_heads, chunks});
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = first + count * c / chunks, hi = first + count * (c + 1) / chunks;
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back({seq, h, lo, hi, num_parts + c * num_kv_heads + h});
    }
    num_parts += chunks * num_kv_heads;
  }
  // a chunk's softmax maximum and sum, and its unnormalised output, per query head
  std::vector<acc_t> part_max(num_parts * group), part_sum(num_parts * group), part_acc(num_parts * group * head_dim);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // per chunk of work items: the scaled queries of the item's heads, their output
    // accumulators and scores (one row of ``count`` per query head)
    const int64_t width = heads_per_item * group;   // query heads of an item
    std::vector<acc_t> q_rows(width * head_dim), acc(width * head_dim), scores;
    std::vector<VecF> q_vecs(vector_path ? width * nvec : 0), acc_vecs(vector_path ? width * nvec : 0);
    for (int64_t index = begin; index < end; ++index) {
      const Item& item = items[index];
      const int64_t seq = item.seq, h0 = item.kv_head, heads = heads_per_item, first = item.lo, len = item.hi;
      const int64_t count = len - first;
      const int32_t* table = tables + seq * max_blocks;
      const int64_t head_offset = h0 * head_dim;
      for (int64_t r = 0; r < heads * group; ++r) {
        const scalar_t* src = q + (seq * num_heads + h0 * group + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_rows[r * head_dim + d] = static_cast<acc_t>(src[d]) * sm_scale;
      }
      scores.resize(heads * group * count);
      if constexpr (kVectorType<scalar_t>) {
        if (vector_path) {
          for (int64_t i = 0; i < heads * group * nvec; ++i) q_vecs[i] = load_lanes(q_rows.data() + i * kLanes);
          // one query head at a time (its vectors in registers) over the block's rows,
          // kScoreRows rows at once (independent chains); each score is the same chain
          for_each_query_head_block(nvec, group, heads, k_cache, table, first, len, block_size, block_stride,
                                    token_stride, head_offset, head_dim,
                                    [&](auto w, int64_t r, const scalar_t* rows, int64_t lo, int64_t hi, int64_t t0) {
          const int64_t n = head_vectors(w, nvec);
          acc_t* out_scores = scores.data() + r * count + t0;   // row i's: [i - lo]
          VecF qv[kMaxHeadVectors];
          for (int64_t j = 0; j < n; ++j) qv[j] = q_vecs[r * n + j];
          int64_t i = lo;
          for (; i + kScoreRows <= hi; i += kScoreRows) {
            VecF sum[kScoreRows];
            for (int64_t u = 0; u < kScoreRows; ++u) sum[u] = qv[0] * load_lanes(rows + (i + u) * token_stride);
            for (int64_t j = 1; j < n; ++j)
              for (int64_t u = 0; u < kScoreRows; ++u)
                sum[u] = fma_lanes(qv[j], load_lanes(rows + (i + u) * token_stride + j * kLanes), sum[u]);
            store_sums(sum, out_scores + (i - lo));
          }
          for (; i < hi; ++i) {
            const scalar_t* row = rows + i * token_stride;
            VecF sum = qv[0] * load_lanes(row);
            for (int64_t j = 1; j < n; ++j) sum = fma_lanes(qv[j], load_lanes(row + j * kLanes), sum);
            out_scores[i - lo] = lane_sum(sum);
          }
          });
        }
      }
      if (!vector_path) {
        for_each_block(k_cache, table, first, len, block_size, block_stride, token_stride, head_offset,
                       heads * head_dim, [&](const scalar_t* base, int64_t lo, int64_t hi, int64_t t0, const Ahead& ahead) {
          ahead.slice(0, 1);
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = lo; i < hi; ++i)
              for (int64_t g = 0; g < group; ++g)
                scores[(h * group + g) * count + t0 + i - lo] =
                    dot(q_rows.data() + (h * group + g) * head_dim, base + i * token_stride + h * head_dim, head_dim);
        });
      }
      for (int64_t r = 0; r < heads * group; ++r) {   // a chunk keeps its exp(s - max) and their sum unnormalised
        acc_t* s = scores.data() + r * count;
        const acc_t best = *std::max_element(s, s + count);
        const acc_t total = exp_shifted(s, count, best);
        if (item.part >= 0) {
          const int64_t part = item.part + r / group;
          part_max[part * group + r % group] = best;
          part_sum[part * group + r % group] = total;
          continue;
        }
        const acc_t inv_total = acc_t(1) / total;
        for (int64_t t = 0; t < count; ++t) s[t] *= inv_total;
      }
      if constexpr (kVectorType<scalar_t>) {
        if (vector_path) {
          std::fill(acc_vecs.begin(), acc_vecs.end(), VecF{});
          // one query head at a time over the block's rows (in L1 after the first): its
          // n accumulators stay in registers; each is the same chain of fmas in row order
          for_each_query_head_block(nvec, group, heads, v_cache, table, first, len, block_size, block_stride,
                                    token_stride, head_offset, head_dim,
                                    [&](auto w, int64_t r, const scalar_t* rows, int64_t lo, int64_t hi, int64_t t0) {
          const int64_t n = head_vectors(w, nvec);
          const acc_t* p = scores.data() + r * count + t0;   // row i's: [i - lo]
          VecF a[kMaxHeadVectors];
          for (int64_t j = 0; j < n; ++j) a[j] = acc_vecs[r * n + j];
          for (int64_t i = lo; i < hi; ++i) {
            const VecF pi = VecF{} + p[i - lo];
            const scalar_t* row = rows + i * token_stride;
            for (int64_t j = 0; j < n; ++j) a[j] = fma_lanes(pi, load_lanes(row + j * kLanes), a[j]);
          }
          for (int64_t j = 0; j < n; ++j) acc_vecs[r * n + j] = a[j];
          });
          for (int64_t i = 0; i < heads * group * nvec; ++i)
            std::memcpy(acc.data() + i * kLanes, &acc_vecs[i], sizeof(VecF));
        }
      }
      if (!vector_path) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for_each_block(v_cache, table, first, len, block_size, block_stride, token_stride, head_offset,
                       heads * head_dim, [&](const scalar_t* base, int64_t lo, int64_t hi, int64_t t0, const Ahead& ahead) {
          ahead.slice(0, 1);
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = lo; i < hi; ++i) {
              const scalar_t* v = base + i * token_stride + h * head_dim;
              for (int64_t g = 0; g < group; ++g) {
                const acc_t p = scores[(h * group + g) * count + t0 + i - lo];
                acc_t* a = acc.data() + (h * group + g) * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<acc_t>(v[d]);
              }
            }
        });
      }
      if (item.part >= 0) {
        for (int64_t h = 0; h < heads; ++h)
          std::copy(acc.begin() + h * group * head_dim, acc.begin() + (h + 1) * group * head_dim,
                    part_acc.begin() + (item.part + h) * group * head_dim);
        continue;
      }
      for (int64_t r = 0; r < heads * group; ++r) {
        scalar_t* dst = o + (seq * num_heads + h0 * group + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * head_dim + d]);
      }
    }
  });

  // the chunks of a split (sequence, KV head): each rescaled to the overall maximum
  std::vector<acc_t> merged(head_dim);
  for (const Split& split : splits) {
    for (int64_t g = 0; g < group; ++g) {
      acc_t best = -std::numeric_limits<acc_t>::infinity();
      for (int64_t c = 0; c < split.num_parts; ++c)
        best = std::max(best, part_max[(split.first_part + c * split.part_step) * group + g]);
      acc_t total = 0;
      std::fill(merged.begin(), merged.end(), acc_t(0));
      for (int64_t c = 0; c < split.num_parts; ++c) {
        const int64_t part = (split.first_part + c * split.part_step) * group + g;
        const acc_t weight = std::exp(part_max[part] - best);
        total += weight * part_sum[part];
        const acc_t* a = part_acc.data() + part * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * a[d];
      }
      scalar_t* dst = o + (split.seq * num_heads + split.kv_head * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] / total);
    }
  }
}

}  // namespace

// query [num_seqs, num_heads, head_dim]; key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_dim] (contiguous, the query's dtype); block_tables [num_seqs,
// max_blocks] int32; seq_lens [num_seqs] int32 (the query is the last token).
// sliding_window <= 0: none. The caller checks shapes (kvpilot.kernels.paged_decode_cpu).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens,
                           int64_t sliding_window, double scale) {
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(query, key_cache, value_cache, block_tables, seq_lens, out,
                          sliding_window, scale);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention on CPU");
  m.def("entry_points", [] {
    py::dict d;
    d["paged_decode"] = entry_points::wrap<entry_points::PagedDecode>(&paged_decode, entry_points::kPagedDecode);
    return d;
  }, "the kernel as a capsule, for another kernel module's native calls (entry_points.h)");
}
