// Paged decode attention on CPU: one query token per sequence, keys and values read in
// place from the paged KV cache (no gathered copy), two passes per (sequence, KV head):
// scores, then the softmax-weighted sum of values. The query heads that share a KV head
// are computed together, so each key and value row is loaded once for all of them.
// Accumulation is in at::opmath_type (float for 16-bit inputs, double for double). Past
// kChunk keys a (sequence, KV head) is split into chunks that run in parallel (one long
// sequence would otherwise keep one thread per KV head busy), each with its own softmax
// maximum and sum, merged by rescaling to the overall maximum.

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
// Keys per work item past which a (sequence, KV head) is split into chunks: a function of
// the sequence's length only, so a row's result never depends on its batch or the threads.
constexpr int64_t kChunk = 256;

struct Item {
  int64_t seq, kv_head, lo, hi;   // keys lo .. hi - 1
  int64_t part;                   // its chunk's slot in the partial results; -1: the whole sequence
};

struct Split {
  int64_t seq, kv_head, first_part, num_parts;
};

constexpr int64_t kLanes = vec_lanes::kVecLanes;   // the vector path's lanes (vec_lanes.h)

inline float lane_sum(VecF v) {   // -ffast-math: a tree of shuffles and adds
  float total = 0;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// The scalar types the vector path reads (float16 and double take the generic loop).
template <typename scalar_t>
constexpr bool kVectorType = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
// The widest head the vector path holds in registers (head_dim / kLanes vectors per row).
constexpr int64_t kMaxHeadVectors = 16;

// Blocks ahead whose rows a pass asks the memory for before it reads them: in a decode step
// the cache is cold (the layer's weights streamed through since this layer last ran), and
// a head's rows are short runs at a stride that the hardware prefetcher does not follow.
constexpr int64_t kPrefetchBlocks = 2;

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
// vectors (64 or 128 values, with AVX2 or AVX-512), else W = 0 (the width at run time): a
// known width unrolls a row's loops and keeps its vectors in registers.
template <typename Fn>
inline void with_head_vectors(int64_t nvec, Fn fn) {
#if defined(__AVX2__) && defined(__FMA__)
  switch (nvec * kLanes) {
    case 64: return fn(std::integral_constant<int64_t, 64 / kLanes>{});
    case 128: return fn(std::integral_constant<int64_t, 128 / kLanes>{});
    default: return fn(std::integral_constant<int64_t, 0>{});
  }
#else
  (void)nvec;
  return fn(std::integral_constant<int64_t, 0>{});   // no fused multiply-add to keep the order
#endif
}

// The keys and values of one (sequence, KV head) visited a block at a time: fn(row, t)
// for t = 0..count-1, row the cache row of token first + t (no division per token). The rows
// of the next kPrefetchBlocks blocks are requested before a block's are read.
template <typename scalar_t, typename Fn>
inline void for_each_row(const scalar_t* cache, const int32_t* table, int64_t first, int64_t len,
                         int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_offset,
                         int64_t head_dim, Fn fn) {
  const int64_t first_block = first / block_size, end_block = (len + block_size - 1) / block_size;
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  auto rows = [&](int64_t b, int64_t* lo, int64_t* hi) {
    *lo = std::max<int64_t>(first, b * block_size) - b * block_size;
    *hi = std::min<int64_t>(len, (b + 1) * block_size) - b * block_size;
    return cache + table[b] * block_stride + head_offset;
  };
  int64_t lo, hi;
  for (int64_t b = first_block; b < std::min(end_block, first_block + kPrefetchBlocks); ++b) {
    const scalar_t* base = rows(b, &lo, &hi);
    prefetch_rows(base, lo, hi, token_stride, row_bytes);
  }
  int64_t t = 0;
  for (int64_t b = first_block; b < end_block; ++b) {
    if (b + kPrefetchBlocks < end_block) {
      const scalar_t* ahead = rows(b + kPrefetchBlocks, &lo, &hi);
      prefetch_rows(ahead, lo, hi, token_stride, row_bytes);
    }
    const scalar_t* base = rows(b, &lo, &hi);
    for (int64_t i = lo; i < hi; ++i, ++t) fn(base + i * token_stride, t);
  }
}

// The vector path's visit of those rows: fn(vecs, t, n), vecs row t's n = nvec vectors as
// float lanes, n a compile-time constant where with_head_vectors knows the width (the
// callers' loops over n unroll once fn is inlined).
template <typename scalar_t, typename Fn>
inline void for_each_row_vectors(int64_t nvec, const scalar_t* cache, const int32_t* table, int64_t first, int64_t len,
                                 int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_offset,
                                 Fn fn) {
  with_head_vectors(nvec, [&](auto width) {
    constexpr int64_t kWidth = decltype(width)::value;
    const int64_t n = kWidth ? kWidth : nvec;
    for_each_row(cache, table, first, len, block_size, block_stride, token_stride, head_offset, n * kLanes,
                 [&](const scalar_t* row, int64_t t) {
      VecF vecs[kMaxHeadVectors];
      for (int64_t j = 0; j < n; ++j) vecs[j] = load_lanes(row + j * kLanes);
      fn(vecs, t, n);
    });
  });
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

  // Work items: one (sequence, KV head) over its visible keys, or, past kChunk keys, over one
  // chunk of them (both threads busy on one long sequence), the chunks merged after.
  std::vector<Item> items;
  std::vector<Split> splits;
  int64_t num_parts = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = lens[seq];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      if (len - first <= kChunk) {
        items.push_back({seq, kv_head, first, len, -1});
        continue;
      }
      splits.push_back({seq, kv_head, num_parts, 0});
      for (int64_t lo = first; lo < len; lo += kChunk, ++splits.back().num_parts)
        items.push_back({seq, kv_head, lo, std::min(len, lo + kChunk), num_parts++});
    }
  }
  // a chunk's softmax maximum and sum, and its unnormalised output, per query head
  std::vector<acc_t> part_max(num_parts * group), part_sum(num_parts * group), part_acc(num_parts * group * head_dim);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // per chunk of work items: the scaled queries of one KV head's group, their output
    // accumulators and scores (one row of ``count`` per query head)
    std::vector<acc_t> q_rows(group * head_dim), acc(group * head_dim), scores;
    std::vector<VecF> q_vecs(vector_path ? group * nvec : 0), acc_vecs(vector_path ? group * nvec : 0);
    for (int64_t index = begin; index < end; ++index) {
      const Item& item = items[index];
      const int64_t seq = item.seq, kv_head = item.kv_head, first = item.lo, len = item.hi;
      const int64_t count = len - first;
      const int32_t* table = tables + seq * max_blocks;
      const int64_t head_offset = kv_head * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_rows[g * head_dim + d] = static_cast<acc_t>(src[d]) * sm_scale;
      }
      scores.resize(group * count);
      if constexpr (kVectorType<scalar_t>) {
        if (vector_path) {
          for (int64_t i = 0; i < group * nvec; ++i) q_vecs[i] = load_lanes(q_rows.data() + i * kLanes);
          for_each_row_vectors(nvec, k_cache, table, first, len, block_size, block_stride, token_stride, head_offset,
                               [&](const VecF* kv, int64_t t, int64_t n) {
            for (int64_t g = 0; g < group; ++g) {
              const VecF* qg = q_vecs.data() + g * n;
              VecF sum = qg[0] * kv[0];
              for (int64_t j = 1; j < n; ++j) sum = fma_lanes(qg[j], kv[j], sum);
              scores[g * count + t] = lane_sum(sum);
            }
          });
        }
      }
      if (!vector_path) {
        for_each_row(k_cache, table, first, len, block_size, block_stride, token_stride, head_offset, head_dim,
                     [&](const scalar_t* k, int64_t t) {
          for (int64_t g = 0; g < group; ++g) scores[g * count + t] = dot(q_rows.data() + g * head_dim, k, head_dim);
        });
      }
      for (int64_t g = 0; g < group; ++g) {   // a chunk keeps its exp(s - max) and their sum unnormalised
        acc_t* s = scores.data() + g * count;
        const acc_t best = *std::max_element(s, s + count);
        const acc_t total = exp_shifted(s, count, best);
        if (item.part >= 0) {
          part_max[item.part * group + g] = best;
          part_sum[item.part * group + g] = total;
          continue;
        }
        const acc_t inv_total = acc_t(1) / total;
        for (int64_t t = 0; t < count; ++t) s[t] *= inv_total;
      }
      if constexpr (kVectorType<scalar_t>) {
        if (vector_path) {
          std::fill(acc_vecs.begin(), acc_vecs.end(), VecF{});
          for_each_row_vectors(nvec, v_cache, table, first, len, block_size, block_stride, token_stride, head_offset,
                               [&](const VecF* vv, int64_t t, int64_t n) {
            for (int64_t g = 0; g < group; ++g) {
              const float p = scores[g * count + t];
              VecF* a = acc_vecs.data() + g * n;
              for (int64_t j = 0; j < n; ++j) a[j] += p * vv[j];
            }
          });
          for (int64_t i = 0; i < group * nvec; ++i) std::memcpy(acc.data() + i * kLanes, &acc_vecs[i], sizeof(VecF));
        }
      }
      if (!vector_path) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for_each_row(v_cache, table, first, len, block_size, block_stride, token_stride, head_offset, head_dim,
                     [&](const scalar_t* v, int64_t t) {
          for (int64_t g = 0; g < group; ++g) {
            const acc_t p = scores[g * count + t];
            acc_t* a = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<acc_t>(v[d]);
          }
        });
      }
      if (item.part >= 0) {
        std::copy(acc.begin(), acc.end(), part_acc.begin() + item.part * group * head_dim);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });

  // the chunks of a split (sequence, KV head): each rescaled to the overall maximum
  std::vector<acc_t> merged(head_dim);
  for (const Split& split : splits) {
    for (int64_t g = 0; g < group; ++g) {
      acc_t best = -std::numeric_limits<acc_t>::infinity();
      for (int64_t c = 0; c < split.num_parts; ++c) best = std::max(best, part_max[(split.first_part + c) * group + g]);
      acc_t total = 0;
      std::fill(merged.begin(), merged.end(), acc_t(0));
      for (int64_t c = 0; c < split.num_parts; ++c) {
        const int64_t part = (split.first_part + c) * group + g;
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
