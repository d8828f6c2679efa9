// The layer kernels of notebook 04a: RMSNorm with a residual add, SiLU-and-multiply, rotary embeddings, argmax,
// the uniforms of seeded draws (Philox4x32-10), and logits masked by a constraint's bits (notebook 05b).
#include "vector_helpers.h"
// rows of `width` floats in parallel, a grain of at least ~16K floats per task (small batches stay on one thread)
template <typename F>
static void for_rows(int64_t rows, int64_t width, const F& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i);
  });
}

// float32, or bfloat16 computed in float32 and rounded where torch's bfloat16 operations round
static void check_float_cpu(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have x's dtype");
}

template <typename T>
static void add_rms_norm_rows(const T* xp, const T* rp, const T* wp, T* op, T* sp, int64_t rows, int64_t H, float eps) {
  const int64_t full = H / 16 * 16;
  for_rows(rows, H, [&](int64_t i) {
    const T* s = xp + i * H;
    if (rp) {  // s = x + residual (rounded to T), kept: it is the next residual
      for (int64_t j = 0; j < full; j += 16) store(sp + i * H + j, load(xp + i * H + j) + load(rp + i * H + j));
      for (int64_t j = full; j < H; ++j) sp[i * H + j] = fromf<T>(tof(xp[i * H + j]) + tof(rp[i * H + j]));
      s = sp + i * H;
    }
    v16 squares = {};
    for (int64_t j = 0; j < full; j += 16) { v16 v = load(s + j); squares += v * v; }
    float ss = hsum(squares);
    for (int64_t j = full; j < H; ++j) ss += tof(s[j]) * tof(s[j]);
    const float inv = 1.f / std::sqrt(ss / H + eps);
    // the normalised value rounded to T before the weight multiplies it, as transformers' RMSNorm does
    for (int64_t j = 0; j < full; j += 16) store(op + i * H + j, load(wp + j) * rnd<T>(load(s + j) * inv));
    for (int64_t j = full; j < H; ++j) op[i * H + j] = fromf<T>(tof(wp[j]) * rnd1<T>(tof(s[j]) * inv));
  });
}

// out = weight * (s / sqrt(mean(s^2) + eps)) for s = x (+ residual), over the last dim; returns (out, s) with a residual
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x_, const c10::optional<at::Tensor>& residual_,
                                     const at::Tensor& weight_, double eps) {
  const auto dtype = x_.scalar_type();
  check_float_cpu(x_, "x", dtype); check_float_cpu(weight_, "weight", dtype);
  TORCH_CHECK(x_.dim() >= 1 && weight_.dim() == 1 && x_.size(-1) == weight_.size(0), "x [..., H] and weight [H]");
  const bool has_residual = residual_.has_value();
  if (has_residual) { check_float_cpu(*residual_, "residual", dtype); TORCH_CHECK(residual_->sizes() == x_.sizes(), "residual as x"); }
  auto x = x_.contiguous(), w = weight_.contiguous();
  auto r = has_residual ? residual_->contiguous() : at::Tensor();
  auto out = at::empty_like(x), sum = has_residual ? at::empty_like(x) : at::Tensor();
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  if (dtype == at::kBFloat16)
    add_rms_norm_rows(x.data_ptr<at::BFloat16>(), has_residual ? r.data_ptr<at::BFloat16>() : nullptr,
                      w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                      has_residual ? sum.data_ptr<at::BFloat16>() : nullptr, rows, H, static_cast<float>(eps));
  else
    add_rms_norm_rows(x.data_ptr<float>(), has_residual ? r.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                      out.data_ptr<float>(), has_residual ? sum.data_ptr<float>() : nullptr, rows, H, static_cast<float>(eps));
  if (has_residual) return {out, sum};
  return {out};
}

// silu(x[..., :d]) * x[..., d:] for x [..., 2d]; silu(g) = g / (1 + e^-g)
template <typename T>
static void silu_and_mul_rows(const T* xp, T* op, int64_t rows, int64_t d) {
  const int64_t full = d / 16 * 16;
  for_rows(rows, 2 * d, [&](int64_t i) {  // silu(g) rounded to T, then the product: torch's two T operations
    const T* g = xp + i * 2 * d; const T* u = g + d; T* o = op + i * d;
    for (int64_t j = 0; j < full; j += 16) { v16 gv = load(g + j); store(o + j, rnd<T>(gv / (1.f + exp16(-gv))) * load(u + j)); }
    if (full < d) { v16 gv = load_part(g + full, d - full); store_part(o + full, rnd<T>(gv / (1.f + exp16(-gv))) * load_part(u + full, d - full), d - full); }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_) {
  check_float_cpu(x_, "x", x_.scalar_type());
  TORCH_CHECK(x_.dim() >= 1 && x_.size(-1) % 2 == 0, "x [..., 2d]: gate and up side by side");
  auto x = x_.contiguous();
  const int64_t d = x.size(-1) / 2, rows = d ? x.numel() / (2 * d) : 0;
  auto sizes = x.sizes().vec(); sizes.back() = d;
  auto out = at::empty(sizes, x.options());
  if (x.scalar_type() == at::kBFloat16) silu_and_mul_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, d);
  else silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, d);
  return out;
}

// one tensor's heads rotated; in bfloat16 as transformers' `q * cos + rotate_half(q) * sin`: cos and sin rounded to
// bfloat16, each product rounded, then their sum (the products of two bfloat16 numbers are exact in float32)
template <typename T>
static void rotate_rows(const int64_t* pos, const T* xp, T* op, const float* cs, int64_t T_, int64_t stride,
                        int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for_rows(T_, heads * D, [&](int64_t t) {
    const float* cos = cs + pos[t] * D; const float* sin = cos + half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x1 = xp + t * stride + h * D; const T* x2 = x1 + half;
      T* o1 = op + (t * heads + h) * D; T* o2 = o1 + half;
      for (int64_t j = 0; j < half; j += 16) {
        const int64_t n = std::min<int64_t>(16, half - j);
        v16 c = rnd<T>(load_part(cos + j, n)), s = rnd<T>(load_part(sin + j, n));
        v16 a = load_part(x1 + j, n), b = load_part(x2 + j, n);
        store_part(o1 + j, rnd<T>(a * c) - rnd<T>(b * s), n);
        store_part(o2 + j, rnd<T>(b * c) + rnd<T>(a * s), n);
      }
    }
  });
}

// neox-style rotation of every head of q and k ([T, heads * D] or [T, heads, D]; rows may be strided) by the cos|sin
// table [max_position, D] at each token's position: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin on the two halves
std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions_, const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& cos_sin_, int64_t head_dim) {
  check_float_cpu(q, "q", q.scalar_type()); check_float_cpu(k, "k", q.scalar_type());
  check_float_cpu(cos_sin_, "cos_sin_cache", at::kFloat);
  TORCH_CHECK(positions_.scalar_type() == at::kLong && positions_.dim() == 1, "positions: int64 [T]");
  const int64_t T = positions_.size(0), D = head_dim;
  TORCH_CHECK(D > 0 && D % 2 == 0 && cos_sin_.dim() == 2 && cos_sin_.size(1) == D, "the cos|sin table is [max_position, head_dim]");
  for (const auto* x : {&q, &k}) {
    const bool flat = x->dim() == 2 && x->size(1) % D == 0 && x->stride(1) == 1;
    const bool per_head = x->dim() == 3 && x->size(2) == D && x->stride(2) == 1 && x->stride(1) == D;
    TORCH_CHECK((flat || per_head) && x->size(0) == T, "q and k are [T, heads * head_dim] or [T, heads, head_dim], "
                "each token's heads side by side");
  }
  auto positions = positions_.contiguous(), cos_sin = cos_sin_.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>(); const int64_t max_position = cos_sin.size(0);
  for (int64_t t = 0; t < T; ++t)  // before any read: a position outside the table is an error, never a stray read
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the table's ", max_position);
  auto q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  const float* cs = cos_sin.data_ptr<float>();
  for (auto [x, out] : {std::pair<const at::Tensor*, at::Tensor*>{&q, &q_out}, {&k, &k_out}}) {
    const int64_t stride = x->stride(0), heads = x->numel() / std::max<int64_t>(T * D, 1);
    if (x->scalar_type() == at::kBFloat16)
      rotate_rows(pos, x->data_ptr<at::BFloat16>(), out->data_ptr<at::BFloat16>(), cs, T, stride, heads, D);
    else
      rotate_rows(pos, x->data_ptr<float>(), out->data_ptr<float>(), cs, T, stride, heads, D);
  }
  return {q_out, k_out};
}

// each row's index of its first maximum, a NaN above every number (what torch's max(dim).indices and argmax give):
// one pass, each lane keeping its own maximum and the first index that held it, then the lanes compared
template <typename T>
static int64_t argmax_row(const T* x, int64_t n) {
  const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 m = splat(-INFINITY); vi16 first = lane, nan = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = load(x + i);
    const vi16 more = v > m;  // subtle: strictly greater, so each lane keeps its first maximum
    m = more ? v : m; first = more ? lane + static_cast<int32_t>(i) : first; nan |= v != v;
  }
  int64_t best = i ? first[0] : -1;
  float top = i ? m[0] : -INFINITY;
  bool any_nan = false;
  for (int k = 0; k < 16; ++k) {
    any_nan |= nan[k] != 0;
    if (i && (m[k] > top || (m[k] == top && first[k] < best))) { top = m[k]; best = first[k]; }
  }
  for (; i < n; ++i) {
    const float v = tof(x[i]);
    any_nan |= v != v;
    if (best < 0 || v > top) { top = v; best = i; }
  }
  if (any_nan)  // rare: the first NaN wins
    for (int64_t j = 0; j < n; ++j) if (tof(x[j]) != tof(x[j])) return j;
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x_) {
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) > 0 && x_.size(1) < (int64_t(1) << 31),
              "argmax_rows takes [rows, n] with 0 < n < 2^31, got ", x_.sizes());
  TORCH_CHECK(x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kBFloat16, "argmax_rows takes float32 or bfloat16");
  const at::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for_rows(rows, n, [&](int64_t r) {
    o[r] = x.scalar_type() == at::kBFloat16 ? argmax_row(x.data_ptr<at::BFloat16>() + r * n, n)
                                            : argmax_row(x.data_ptr<float>() + r * n, n);
  });
  return out;
}

// Philox4x32-10 (Random123's, as torch's and Triton's) for 16 counters at once, lane by lane (the compiler's vectors):
// each counter's four 32-bit words from the key (k0, k1)
constexpr int PHILOX_LANES = 16;
static inline void philox4x32(uint32_t c0[], uint32_t c1[], uint32_t c2[], uint32_t c3[], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    for (int i = 0; i < PHILOX_LANES; ++i) {
      const uint64_t p0 = uint64_t(c0[i]) * 0xD2511F53u, p2 = uint64_t(c2[i]) * 0xCD9E8D57u;
      const uint32_t n0 = uint32_t(p2 >> 32) ^ c1[i] ^ k0, n2 = uint32_t(p0 >> 32) ^ c3[i] ^ k1;
      c0[i] = n0, c1[i] = uint32_t(p2), c2[i] = n2, c3[i] = uint32_t(p0);
    }
    k0 += 0x9E3779B9u;  // the golden ratio, and sqrt(3) - 1, added to the key after each round
    k1 += 0xBB67AE85u;
  }
}

// uniforms [rows, vocab] in [2^-24, 1 - 2^-24]: token j of row r is word j % 4 of Philox with key seeds[r] (its two
// halves) and counter (j / 4, steps[r], 0, 0), its top 23 bits plus a half, times 2^-23 (exact in float32)
at::Tensor philox_uniform(const at::Tensor& seeds_, const at::Tensor& steps_, int64_t vocab) {
  TORCH_CHECK(seeds_.dim() == 1 && steps_.sizes() == seeds_.sizes(), "philox_uniform takes seeds and steps [rows]");
  TORCH_CHECK(seeds_.scalar_type() == at::kLong && steps_.scalar_type() == at::kLong, "philox_uniform takes int64 seeds and steps");
  TORCH_CHECK(vocab > 0 && vocab <= (int64_t(1) << 34), "philox_uniform takes 0 < vocab <= 2^34, got ", vocab);
  const at::Tensor seeds = seeds_.contiguous(), steps = steps_.contiguous();
  const int64_t rows = seeds.size(0);
  auto out = at::empty({rows, vocab}, seeds.options().dtype(at::kFloat));
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* tp = steps.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for_rows(rows, vocab, [&](int64_t r) {
    const uint64_t key = uint64_t(sp[r]);
    float* row = op + r * vocab;
    for (int64_t first = 0; 4 * first < vocab; first += PHILOX_LANES) {
      uint32_t c[4][PHILOX_LANES];
      for (int i = 0; i < PHILOX_LANES; ++i)
        c[0][i] = uint32_t(first + i), c[1][i] = uint32_t(uint64_t(tp[r])), c[2][i] = 0, c[3][i] = 0;
      philox4x32(c[0], c[1], c[2], c[3], uint32_t(key), uint32_t(key >> 32));
      for (int i = 0; i < PHILOX_LANES; ++i)
        for (int w = 0; w < 4; ++w) {
          const int64_t j = 4 * (first + i) + w;
          if (j < vocab) row[j] = (float(c[w][i] >> 9) + 0.5f) * 0x1p-23f;
        }
    }
  });
  return out;
}

// logits [rows, vocab] with token j of row r at -inf where bit j % 32 of word j / 32 of bits[r] is clear: a word of all
// ones copies its 32 logits, a word of none fills them, any other goes bit by bit (most of a constraint's words are
// all or none)
template <typename T>
static void mask_row(const T* in, const uint32_t* words, T* out, int64_t vocab) {
  const T minus_inf = T(-INFINITY);
  for (int64_t first = 0; first < vocab; first += 32) {
    const uint32_t word = words[first / 32];
    const int64_t n = std::min<int64_t>(32, vocab - first);
    if (word == ~0u) {
      std::memcpy(out + first, in + first, n * sizeof(T));
    } else if (word == 0) {
      std::fill(out + first, out + first + n, minus_inf);
    } else {
      for (int64_t b = 0; b < n; ++b) out[first + b] = (word >> b) & 1u ? in[first + b] : minus_inf;
    }
  }
}

at::Tensor apply_bitmask(const at::Tensor& logits_, const at::Tensor& bits_) {
  TORCH_CHECK(logits_.dim() == 2 && bits_.dim() == 2 && bits_.size(0) == logits_.size(0),
              "apply_bitmask takes logits [rows, vocab] and bits [rows, words]");
  TORCH_CHECK(bits_.scalar_type() == at::kInt && bits_.size(1) * 32 >= logits_.size(1),
              "apply_bitmask takes int32 bits, 32 tokens a word, enough for the vocabulary");
  TORCH_CHECK(logits_.scalar_type() == at::kFloat || logits_.scalar_type() == at::kBFloat16,
              "apply_bitmask takes float32 or bfloat16 logits");
  const at::Tensor logits = logits_.contiguous(), bits = bits_.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bits.size(1);
  auto out = at::empty_like(logits);
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  for_rows(rows, vocab, [&](int64_t r) {
    if (logits.scalar_type() == at::kBFloat16)
      mask_row(logits.data_ptr<at::BFloat16>() + r * vocab, wp + r * words, out.data_ptr<at::BFloat16>() + r * vocab, vocab);
    else
      mask_row(logits.data_ptr<float>() + r * vocab, wp + r * words, out.data_ptr<float>() + r * vocab, vocab);
  });
  return out;
}

TORCH_LIBRARY(minivllm_cpu_layers, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, int head_dim) -> Tensor[]");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, TORCH_FN(rotary_embedding));
  m.def("philox_uniform(Tensor seeds, Tensor steps, int vocab) -> Tensor");
  m.impl("philox_uniform", c10::DispatchKey::CPU, TORCH_FN(philox_uniform));
  m.def("apply_bitmask(Tensor logits, Tensor bits) -> Tensor");
  m.impl("apply_bitmask", c10::DispatchKey::CPU, TORCH_FN(apply_bitmask));
}
