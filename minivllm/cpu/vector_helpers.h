// Vector helpers every kernel of notebook 04a shares: 16 floats at a time, and a fast exp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// 16 floats, one AVX-512 register (where the CPU has none, GCC splits it into two AVX2 or four SSE registers)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
static inline v16 splat(float x) { return (v16){} + x; }
static inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
// the first n lanes of a row whose length is not a multiple of 16 (the rest zeros); n = 16 is a whole load
static inline v16 load_part(const float* p, int64_t n) {
  if (n == 16) return load(p);
  v16 v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
static inline void store_part(float* p, v16 v, int64_t n) {
  if (n == 16) return store(p, v);
  for (int64_t i = 0; i < n; ++i) p[i] = v[i];
}
// bfloat16 is the upper half of a float32: widening is a shift by 16 bits; narrowing rounds to nearest even, as torch
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
static inline v16 load(const at::BFloat16* p) {
  vu16 h; std::memcpy(&h, p, sizeof h);
  vu32 bits = __builtin_convertvector(h, vu32) << 16;
  v16 v; std::memcpy(&v, &bits, sizeof v); return v;
}
static inline v16 load_part(const at::BFloat16* p, int64_t n) {
  if (n == 16) return load(p);
  v16 v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
static inline void store(at::BFloat16* p, v16 v) {
  vu32 bits; std::memcpy(&bits, &v, sizeof bits);
  vu32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  rounded = (bits & 0x7fffffffu) > 0x7f800000u ? (vu32){} + 0x7fc0u : rounded;  // NaN stays NaN
  vu16 h = __builtin_convertvector(rounded, vu16); std::memcpy(p, &h, sizeof h);
}
static inline void store_part(at::BFloat16* p, v16 v, int64_t n) {
  if (n == 16) return store(p, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<at::BFloat16>(v[i]);
}
// a kernel on T computes in float32 and rounds where torch's T operations round: rnd<T> is that rounding (none for
// float), tof and fromf are the scalar widening and narrowing of the tails
template <typename T> static inline v16 rnd(v16 v) { return v; }
template <> inline v16 rnd<at::BFloat16>(v16 v) {
  vu32 bits; std::memcpy(&bits, &v, sizeof bits);
  vu32 r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  r = (bits & 0x7fffffffu) > 0x7f800000u ? bits : r;
  std::memcpy(&v, &r, sizeof v); return v;
}
static inline float tof(float x) { return x; }
static inline float tof(at::BFloat16 x) { return static_cast<float>(x); }
template <typename T> static inline T fromf(float x) { return static_cast<T>(x); }  // to bfloat16: nearest even
template <typename T> static inline float rnd1(float x) { return tof(fromf<T>(x)); }
static inline float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
// e^x in 16 lanes, as Cephes' expf: x = n ln2 + r, e^x = 2^n (1 + r + r^2 P(r)); within 2 ulp of std::exp
static inline v16 exp16(v16 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;  // e^-87 is the smallest normal float's order: below, 0 is as good
  x = x > splat(88.f) ? splat(88.f) : x;
  v16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2): 1.5 * 2^23 drops the fraction
  v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;               // x - n ln 2, ln 2 in two parts
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;  // 2^n, built in the exponent field
  v16 two_n; std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}
