// The CPU's paged attention (decode, and a few queries a sequence over a cached prefix) and KV store of notebook 06a.
#include "vector_helpers.h"
constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead of the row it reads the kernel asks for the next (measured)

// One sequence's attention, every head, for the queries of its last nq tokens: query j sees the first n - nq + 1 + j
// keys (causal), so nq = 1 is a decode. D = 16 * DC (DCT = DC when known when compiling, 0 when not); the caches hold
// T (float or bfloat16), the math is float32's. q and out are [nq, H, D]; a query row r = j * H + h is a head of its own
template <int DCT, typename T>
static void attend_one(const float* q, const T* kp, const T* vp, const int32_t* table, int64_t n, int64_t nq, int64_t bs,
                       int64_t H, int64_t KVH, int64_t D, float scale, float* out, std::vector<float>& buf) {
  const int64_t DC = DCT ? DCT : (D + 15) / 16, last = D - 16 * (DC - 1);  // chunks per head; lanes of the last
  const int64_t G = H / KVH, R = nq * H, row = KVH * D, np = (n + 15) / 16 * 16, row_bytes = row * sizeof(T);
  buf.resize(R * DC * 16 + R * np);
  float* acc = buf.data();                // [R, DC * 16]: the scaled queries, then the weighted sum of values
  float* sc = buf.data() + R * DC * 16;   // [R, np]: scores, then softmax numerators
  auto lanes = [&](int64_t c) { return c == DC - 1 ? last : 16; };
  auto seen = [&](int64_t j) { return n - nq + 1 + j; };  // how many keys query j attends to
  auto at = [&](const T* cache, int64_t t) {  // token t's row of a cache: its keys (or values) for all KV heads
    return cache + (static_cast<int64_t>(std::max(table[t / bs], 0)) * bs + t % bs) * row;
  };
  // while token t is read, ask for the row PREFETCH_BYTES ahead: the blocks of a sequence lie anywhere in the cache,
  // where the hardware's prefetcher cannot guess them, and a steady few lines per token keep the memory busy
  const int64_t ahead = std::min<int64_t>(64, (PREFETCH_BYTES + row_bytes - 1) / row_bytes);
  auto row_of = [&](const T* cache, int64_t t) {
    if (t + ahead < n) {
      const char* next = reinterpret_cast<const char*>(at(cache, t + ahead));
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
    }
    return at(cache, t);
  };
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < DC; ++c) store(acc + (r * DC + c) * 16, load_part(q + r * D + 16 * c, lanes(c)) * scale);
  // 1. scores: one pass over the keys; a token's keys for all KV heads are one contiguous row, loaded once for every
  // query row that shares its KV head; a key after a query's own token scores -inf for it (the causal mask)
  for (int64_t t = 0; t < n; ++t) {
    const T* krow = row_of(kp, t);
    for (int64_t g = 0; g < KVH; ++g) {
      v16 k[DCT ? DCT : 16];
      for (int64_t c = 0; c < DC; ++c) k[c] = load_part(krow + g * D + 16 * c, lanes(c));
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t h = j * H + g * G; h < j * H + (g + 1) * G; ++h) {  // the query heads that share KV head g
          if (t >= seen(j)) { sc[h * np + t] = -INFINITY; continue; }
          v16 s = {};
          for (int64_t c = 0; c < DC; ++c) s += load(acc + (h * DC + c) * 16) * k[c];
          sc[h * np + t] = hsum(s);
        }
    }
  }
  // 2. softmax numerators per query row (the division waits for the end)
  std::vector<float> inv_sum(R);
  for (int64_t h = 0; h < R; ++h) {
    float* s = sc + h * np;
    for (int64_t t = n; t < np; ++t) s[t] = -INFINITY;
    v16 m = splat(-INFINITY);
    for (int64_t t = 0; t < np; t += 16) { v16 x = load(s + t); m = x > m ? x : m; }
    float mx = m[0];
    for (int i = 1; i < 16; ++i) mx = std::max(mx, m[i]);
    v16 sum = {};
    for (int64_t t = 0; t < np; t += 16) {
      v16 x = load(s + t), e = exp16(x - mx);
      e = x == splat(-INFINITY) ? splat(0.f) : e;  // the padding after the last token (and the masked) weighs nothing
      store(s + t, e); sum += e;
    }
    inv_sum[h] = 1.f / hsum(sum);
  }
  // 3. values: one pass, every query row's weighted sum (a masked key adds nothing: skipped)
  std::fill(acc, acc + R * DC * 16, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* vrow = row_of(vp, t);
    for (int64_t g = 0; g < KVH; ++g) {
      v16 v[DCT ? DCT : 16];
      for (int64_t c = 0; c < DC; ++c) v[c] = load_part(vrow + g * D + 16 * c, lanes(c));
      for (int64_t j = 0; j < nq; ++j) {
        if (t >= seen(j)) continue;
        for (int64_t h = j * H + g * G; h < j * H + (g + 1) * G; ++h) {
          const float p = sc[h * np + t];
          for (int64_t c = 0; c < DC; ++c) store(acc + (h * DC + c) * 16, load(acc + (h * DC + c) * 16) + p * v[c]);
        }
      }
    }
  }
  for (int64_t h = 0; h < R; ++h)
    for (int64_t c = 0; c < DC; ++c) store_part(out + h * D + 16 * c, load(acc + (h * DC + c) * 16) * inv_sum[h], lanes(c));
}

// the head sizes of most models with their chunk count known when compiling (the loops unrolled), any other at run time
template <typename T>
static void attend_dc(const float* q, const T* kp, const T* vp, const int32_t* table, int64_t n, int64_t nq, int64_t bs,
                      int64_t H, int64_t KVH, int64_t D, float scale, float* out, std::vector<float>& buf) {
  if (D == 64) attend_one<4>(q, kp, vp, table, n, nq, bs, H, KVH, D, scale, out, buf);
  else if (D == 128) attend_one<8>(q, kp, vp, table, n, nq, bs, H, KVH, D, scale, out, buf);
  else attend_one<0>(q, kp, vp, table, n, nq, bs, H, KVH, D, scale, out, buf);
}

// the checks every call makes, then each sequence's attention on the threads: sequence b's nq[b] queries, the rows
// from first[b] of q, over its n[b] keys (its last nq[b] tokens' own among them)
static at::Tensor attend_batch(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const std::vector<int64_t>& first,
                               const std::vector<int64_t>& nq, const std::vector<int64_t>& n, double scale) {
  const auto dtype = q_.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "paged attention on the CPU takes float32 or bfloat16, q and caches alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  // bfloat16: the queries widened once (a few numbers per sequence), the output rounded once at the end
  auto q = q_.to(at::kFloat).contiguous();
  const int64_t B = first.size(), H = q.size(1), D = q.size(2), bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {  // memory safety first: every block a sequence reads must exist
    TORCH_CHECK(n[b] >= 0 && n[b] <= max_blocks * bs, "context length ", n[b], " does not fit the block table");
    for (int64_t j = 0; j * bs < n[b]; ++j)  // -1 (padding) reads block 0, as gather_kv does
      TORCH_CHECK(bt[b * max_blocks + j] >= -1 && bt[b * max_blocks + j] < num_blocks, "block id ",
                  bt[b * max_blocks + j], " is not in the cache's ", num_blocks, " blocks");
  }
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>(); float* op = out.data_ptr<float>();
  // the threads' shares: longest work first, each to the thread with the least so far
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return n[a] * nq[a] > n[b] * nq[b]; });
  std::vector<std::vector<int64_t>> share(threads);
  std::vector<int64_t> work(threads, 0);
  for (int64_t b : order) {
    const int64_t i = std::min_element(work.begin(), work.end()) - work.begin();
    share[i].push_back(b); work[i] += (n[b] + 16) * nq[b];  // + 16: a sequence costs something even when short
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b : share[i]) {
        float* o = op + first[b] * H * D;
        if (n[b] == 0) { std::fill(o, o + nq[b] * H * D, 0.f); continue; }  // a padding row (CUDA-graph style): zeros
        const float* qb = qp + first[b] * H * D; const int32_t* table = bt + b * max_blocks;
        if (dtype == at::kBFloat16) attend_dc(qb, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                                              table, n[b], nq[b], bs, H, KVH, D, scale, o, buf);
        else attend_dc(qb, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table, n[b], nq[b], bs, H, KVH, D,
                       scale, o, buf);
      }
  });
  return out.to(dtype);
}

static void check_shapes(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  // every shape the kernel's pointer arithmetic relies on, checked: a mismatch is an error, never a stray read
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "expected q [T, H, D] and k/v caches [blocks, block_size, KVH, D] of one shape");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0,
              "q's heads and head size do not fit the cache's: H must be a multiple of KVH, and D equal");
  TORCH_CHECK(q.size(2) > 0 && q.size(2) <= 256, "head size ", q.size(2), " is not in 1..256");
}

// decode: one query per sequence, over its context_lens[b] keys
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_, const at::Tensor& context_lens_, double scale) {
  check_shapes(q, k_cache, v_cache);
  TORCH_CHECK(block_tables_.dim() == 2 && block_tables_.size(0) == q.size(0) && context_lens_.dim() == 1 &&
              context_lens_.size(0) == q.size(0), "one block table row and one context length per query");
  TORCH_CHECK(block_tables_.scalar_type() == at::kInt && context_lens_.scalar_type() == at::kInt, "int32 tables and lengths");
  const auto block_tables = block_tables_.contiguous(), context_lens = context_lens_.contiguous();
  const int64_t B = q.size(0);
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  std::vector<int64_t> first(B), nq(B, 1), n(cl, cl + B);
  for (int64_t b = 0; b < B; ++b) first[b] = b;
  return attend_batch(q, k_cache, v_cache, block_tables, first, nq, n, scale);
}

// a prefill over a cached prefix: sequence b's queries are rows cu_seqlens_q[b] to cu_seqlens_q[b + 1] of q, its
// last tokens, over its cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (cached and new, all in the cache already)
at::Tensor paged_prefix_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_, const at::Tensor& cu_seqlens_q_,
                                  const at::Tensor& cu_seqlens_k_, double scale) {
  check_shapes(q, k_cache, v_cache);
  TORCH_CHECK(block_tables_.dim() == 2 && cu_seqlens_q_.dim() == 1 && cu_seqlens_k_.dim() == 1 &&
              cu_seqlens_q_.size(0) == block_tables_.size(0) + 1 && cu_seqlens_k_.size(0) == block_tables_.size(0) + 1,
              "one block table row per sequence, and B + 1 starts of its queries and of its keys");
  TORCH_CHECK(block_tables_.scalar_type() == at::kInt && cu_seqlens_q_.scalar_type() == at::kInt &&
              cu_seqlens_k_.scalar_type() == at::kInt, "int32 tables and starts");
  const auto block_tables = block_tables_.contiguous(), cu_q = cu_seqlens_q_.contiguous(), cu_k = cu_seqlens_k_.contiguous();
  const int64_t B = block_tables.size(0);
  const int32_t *sq = cu_q.data_ptr<int32_t>(), *sk = cu_k.data_ptr<int32_t>();
  TORCH_CHECK(sq[0] == 0 && sq[B] == q.size(0), "the query starts must run from 0 to q's ", q.size(0), " rows");
  std::vector<int64_t> first(B), nq(B), n(B);
  for (int64_t b = 0; b < B; ++b) {
    first[b] = sq[b]; nq[b] = sq[b + 1] - sq[b]; n[b] = sk[b + 1] - sk[b];
    TORCH_CHECK(nq[b] >= 0 && nq[b] <= n[b], "sequence ", b, " has ", nq[b], " queries but ", n[b],
                " keys: its queries are its last tokens, so at most as many");
  }
  return attend_batch(q, k_cache, v_cache, block_tables, first, nq, n, scale);
}

// token i's keys and values (one row of KVH * D numbers each) copied into slot slot_mapping[i] of the caches; < 0: none
void store_kvcache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2), "expected keys and values [T, KVH, D] and "
              "caches [blocks, block_size, KVH, D] of one shape");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "keys, values and caches must have one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64 with one slot per token");
  // a token's row must be one run of memory (a view into the qkv projection's output is); anything else is copied
  auto rows = [](const at::Tensor& x) { return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous(); };
  const at::Tensor k = rows(key), v = rows(value), slots = slot_mapping.contiguous();
  const int64_t T = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)  // memory safety first: every slot written must exist
    TORCH_CHECK(s[i] < num_slots, "slot ", s[i], " is not in the cache's ", num_slots, " slots");
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t i = 0; i < T; ++i) {
    if (s[i] < 0) continue;
    std::memcpy(kc + s[i] * bytes, kp + i * k.stride(0) * k.element_size(), bytes);
    std::memcpy(vc + s[i] * bytes, vp + i * v.stride(0) * v.element_size(), bytes);
  }
}

TORCH_LIBRARY(minivllm_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("paged_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale) -> Tensor");
  m.impl("paged_prefix_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefix_attention));
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("store_kvcache", c10::DispatchKey::CPU, TORCH_FN(store_kvcache));
}
