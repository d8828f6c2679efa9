// The bfloat16 product of notebook 04a for decode's few rows (AVX512_BF16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>

constexpr int64_t PANEL = 64;  // output columns per panel
#if defined(__AVX512BF16__)
#include <immintrin.h>
constexpr bool HAS_AVX512_BF16 = true;
constexpr int64_t TILE_ROWS = 6;  // rows per tile: 6 x 4 registers of sums, 4 of weights, 1 of inputs

// R rows of x (each a row of bfloat16 pairs, read as 32-bit words, `ldx` a row) times one panel [pairs, 64, 2], plus
// the panel's bias (float32, or null): the first `ncols` of its 64 columns into y, rounded to bfloat16 once; with
// `next`, its pairs [ahead, ahead + count) are fetched from memory meanwhile, evenly over the tile's work
template <int R>
static void tile(const uint32_t* x, int64_t ldx, const uint16_t* panel, const uint16_t* next, int64_t ahead,
                 int64_t count, int64_t pairs, const float* bias, uint16_t* y, int64_t ldy, int64_t ncols) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
  int64_t due = 0;  // count / pairs next-panel pairs are due at each step: fetch one each time `due` reaches `pairs`
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = panel + p * 2 * PANEL;  // 64 columns x 2 inputs: 256 bytes, 4 registers
    for (due += count; next != nullptr && due >= pairs; due -= pairs, ++ahead)
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + ahead * 2 * PANEL) + 64 * line, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + p]));  // row i's pair, every lane
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0); acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, w2); acc[i][3] = _mm512_dpbf16_ps(acc[i][3], a, w3);
    }
  }
  for (int i = 0; i < R; ++i) {  // rounded to nearest even, as torch rounds float32 to bfloat16
    uint16_t out[PANEL];
    for (int j = 0; j < 4; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    std::memcpy(y + i * ldy, out, ncols * sizeof(uint16_t));  // the last panel's padding columns stay behind
  }
}

// the rows of one panel in tiles of equal size (at most TILE_ROWS), each fetching an equal share of the next panel
static void panel_times_rows(const uint32_t* x, int64_t M, int64_t pairs, const uint16_t* panel, const uint16_t* next,
                             const float* bias, uint16_t* y, int64_t N, int64_t ncols) {
  const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    // subtle: equal tiles take equal time, so the memory traffic is spread evenly over the panel's work (a short
    // last tile that fetched its share of the next panel would wait for memory)
    const int64_t rows = M / tiles + (t < M % tiles), ahead = t * pairs / tiles, count = (t + 1) * pairs / tiles - ahead;
    const uint32_t* xt = x + m * pairs;
    uint16_t* yt = y + m * N;
    switch (rows) {
      case 1: tile<1>(xt, pairs, panel, next, ahead, count, pairs, bias, yt, N, ncols); break;
      case 2: tile<2>(xt, pairs, panel, next, ahead, count, pairs, bias, yt, N, ncols); break;
      case 3: tile<3>(xt, pairs, panel, next, ahead, count, pairs, bias, yt, N, ncols); break;
      case 4: tile<4>(xt, pairs, panel, next, ahead, count, pairs, bias, yt, N, ncols); break;
      case 5: tile<5>(xt, pairs, panel, next, ahead, count, pairs, bias, yt, N, ncols); break;
      default: tile<TILE_ROWS>(xt, pairs, panel, next, ahead, count, pairs, bias, yt, N, ncols); break;
    }
    m += rows;
  }
}
#else
constexpr bool HAS_AVX512_BF16 = false;
#endif

bool available() { return HAS_AVX512_BF16; }

// y [rows, out] = x [rows, in] times the weight in panels [ceil(out / 64), ceil(in / 2), 64, 2] (+ bias), bfloat16
at::Tensor linear(const at::Tensor& x_, const at::Tensor& panels, int64_t out_features, const c10::optional<at::Tensor>& bias_) {
  TORCH_CHECK(HAS_AVX512_BF16, "this CPU has no AVX512_BF16: multiply with oneDNN's product or F.linear");
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kBFloat16, "expected x [rows, in] in bfloat16");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 && panels.size(2) == PANEL &&
              panels.size(3) == 2 && panels.is_contiguous(), "expected panels [out / 64, in / 2, 64, 2] in bfloat16");
  const int64_t M = x_.size(0), pairs = panels.size(1), num_panels = panels.size(0), N = out_features;
  TORCH_CHECK((x_.size(1) + 1) / 2 == pairs, "x has ", x_.size(1), " inputs, the panels ", 2 * pairs, " (or one less)");
  TORCH_CHECK(N >= 0 && (N + PANEL - 1) / PANEL == num_panels, "out_features ", N, " does not fill ", num_panels, " panels");
  TORCH_CHECK(!bias_.has_value() || (bias_->dim() == 1 && bias_->size(0) == N), "expected a bias of out_features numbers");
  auto y = at::empty({M, N}, x_.options());
#if defined(__AVX512BF16__)
  if (M == 0 || N == 0) return y;
  // an odd count of inputs: a zero pairs with the panels' zero padding
  const at::Tensor x = x_.size(1) % 2 ? at::constant_pad_nd(x_, {0, 1}) : x_.contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // the bias in float32, padded to whole panels: the sums start from it
  const at::Tensor bias = bias_.has_value() ? at::constant_pad_nd(bias_->to(at::kFloat), {0, num_panels * PANEL - N}) : at::Tensor();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t panel_size = pairs * 2 * PANEL;
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t end) {
    for (int64_t p = first; p < end; ++p)
      panel_times_rows(xp, M, pairs, wp + p * panel_size, p + 1 < end ? wp + (p + 1) * panel_size : nullptr,
                       bp ? bp + p * PANEL : nullptr, yp + p * PANEL, N, std::min(PANEL, N - p * PANEL));
  });
#endif
  return y;
}

TORCH_LIBRARY(minivllm_cpu_gemm, m) {
  m.def("available() -> bool");
  m.impl("available", TORCH_FN(available));
  m.def("linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
