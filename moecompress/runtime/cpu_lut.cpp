#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

namespace {

inline uint32_t load32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

inline __m256i lanes(int step, int first) {  // first, first + step, ..., first + 7 step
  return _mm256_setr_epi32(first, first + step, first + 2 * step, first + 3 * step, first + 4 * step,
                           first + 5 * step, first + 6 * step, first + 7 * step);
}

// Code j of a little-endian bit stream (the scalar path).
inline uint32_t code_at(const uint8_t* p, int64_t j, int bits) {
  const int64_t bit = j * bits, b = bit >> 3;
  const int sh = int(bit & 7);
  uint32_t v = p[b];
  if (sh + bits > 8) v |= uint32_t(p[b + 1]) << 8;
  return (v >> sh) & ((1u << bits) - 1);
}

// One group's table in registers; decode() turns the 2*B bytes of 16 codes into 16 float32 weights.
template <int B> struct Lut;

// vpermps reads only bits 0..2 of each lane, so the codes need no mask: at 2 bits the 4-entry table is
// repeated in lanes 4..7 (bit 2 belongs to the next code), at 4 bits bit 3 picks the upper half.
template <> struct Lut<2> {
  __m256 t; __m256i s0 = lanes(2, 0), s1 = lanes(2, 16);
  explicit Lut(const float* tab) : t(_mm256_broadcast_ps((const __m128*)tab)) {}
  void decode(const uint8_t* p, __m256& w0, __m256& w1) const {
    const __m256i v = _mm256_set1_epi32(int(load32(p)));
    w0 = _mm256_permutevar8x32_ps(t, _mm256_srlv_epi32(v, s0));
    w1 = _mm256_permutevar8x32_ps(t, _mm256_srlv_epi32(v, s1));
  }
};

template <> struct Lut<3> {
  __m256 t; __m256i s0 = lanes(3, 0), s1 = lanes(3, 8);
  explicit Lut(const float* tab) : t(_mm256_loadu_ps(tab)) {}
  void decode(const uint8_t* p, __m256& w0, __m256& w1) const {  // codes 8..15 start at bit 8 of p + 2
    const __m256i a = _mm256_set1_epi32(int(load32(p))), b = _mm256_set1_epi32(int(load32(p + 2)));
    w0 = _mm256_permutevar8x32_ps(t, _mm256_srlv_epi32(a, s0));
    w1 = _mm256_permutevar8x32_ps(t, _mm256_srlv_epi32(b, s1));
  }
};

template <> struct Lut<4> {
  __m256 lo, hi; __m256i s = lanes(4, 0), top = lanes(-4, 28);
  explicit Lut(const float* tab) : lo(_mm256_loadu_ps(tab)), hi(_mm256_loadu_ps(tab + 8)) {}
  __m256 look(const uint8_t* p) const {  // sllv moves each code's bit 3 to the sign bit blendv reads
    const __m256i v = _mm256_set1_epi32(int(load32(p))), i = _mm256_srlv_epi32(v, s);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i),
                            _mm256_castsi256_ps(_mm256_sllv_epi32(v, top)));
  }
  void decode(const uint8_t* p, __m256& w0, __m256& w1) const { w0 = look(p); w1 = look(p + 4); }
};

template <> struct Lut<8> {
  const float* t;
  explicit Lut(const float* tab) : t(tab) {}
  void decode(const uint8_t* p, __m256& w0, __m256& w1) const {
    w0 = _mm256_i32gather_ps(t, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), 4);
    w1 = _mm256_i32gather_ps(t, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))), 4);
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[t * ldy] += sum_{k0 <= j < k1} tab[j / gs][q_j] x[t * in + j] for NT tokens of one row. Steps of 32
// weights feed A = min(4, 8 / NT) accumulators per token: 8 independent FMA chains hide the FMA latency.
template <int B, int NT>
void row(const float* x, int64_t in, const uint8_t* q, const float* tab, int64_t gs, int64_t k0, int64_t k1,
         float* y, int64_t ldy) {
  constexpr int K = 1 << B, A = NT >= 8 ? 1 : NT >= 4 ? 2 : 4;
  __m256 acc[NT][A];
  float rest[NT];
  for (int t = 0; t < NT; ++t) {
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
    rest[t] = 0.f;
  }
  for (int64_t g = k0 / gs; g * gs < k1; ++g) {
    const float* tg = tab + g * K;
    const Lut<B> lut(tg);
    int64_t j = std::max(g * gs, k0);
    const int64_t end = std::min((g + 1) * gs, k1);
    auto one = [&](int64_t k) {
      const float w = tg[code_at(q, k, B)];
      for (int t = 0; t < NT; ++t) rest[t] += w * x[t * in + k];
    };
    auto fma = [&](const __m256* w, int n, int64_t k) {  // n vectors of 8 weights from input k
      for (int t = 0; t < NT; ++t)
        for (int i = 0; i < n; ++i)
          acc[t][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + t * in + k + 8 * i), acc[t][i % A]);
    };
    for (; j < end && (j & 7); ++j) one(j);
    for (; j + 32 <= end; j += 32) {
      __m256 w[4];
      lut.decode(q + (j >> 3) * B, w[0], w[1]);
      lut.decode(q + (j >> 3) * B + 2 * B, w[2], w[3]);
      fma(w, 4, j);
    }
    if (j + 16 <= end) {
      __m256 w[2];
      lut.decode(q + (j >> 3) * B, w[0], w[1]);
      fma(w, 2, j);
      j += 16;
    }
    for (; j < end; ++j) one(j);
  }
  for (int t = 0; t < NT; ++t) {
    __m256 s = acc[t][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[t][a]);
    y[t * ldy] += hsum(s) + rest[t];
  }
}

constexpr int64_t kTile = 16;     // rows whose tables are built together and share each x block in L1
constexpr int64_t kBlock = 4096;  // floats of x per block (16 KiB): NT tokens x (kBlock / NT) inputs

// One tile of rows [r0, r1) for NT tokens: input blocks outside, rows inside, so x stays in L1.
template <int B, int NT>
void tile(const float* x, int64_t in, const uint8_t* codes, int64_t nb, const float* tab, int64_t groups,
          int64_t r0, int64_t r1, float* y, int64_t rows) {
  const int64_t gs = in / groups, kc = kBlock / NT;
  for (int64_t k0 = 0; k0 < in; k0 += kc)
    for (int64_t r = r0; r < r1; ++r)
      row<B, NT>(x, in, codes + r * nb, tab + (r - r0) * groups * (1 << B), gs, k0, std::min(k0 + kc, in),
                 y + r, rows);
}

// ---- T >= kGemmMin tokens: decode an [R x kb] weight tile into L1 once, then a register-blocked GEMM.
// x is packed per input tile, L tokens a vector (zero past T), so one L-lane load is L tokens of input k;
// acc[r][v] += w[r][k] (broadcast) * x[v][k] keeps R x NV vectors in registers. AVX-512 (L = 16, 12 rows,
// 24 accumulators) where the CPU has it, else AVX2 (L = 8, 6 rows, 12 accumulators): NV = 2 vectors of
// tokens, NV = 1 for an odd last one.
constexpr int64_t kGemmMin = 8;  // from this many tokens (AVX-512; 9 on AVX2) the tiles beat the row kernel

// out[j - k0] = tab[j / gs - k0 / gs][q_j] for k0 <= j < k1 (16 codes per vpermps pair where a group
// allows); tab holds the tables of the groups from k0 / gs on.
template <int B>
void decode_range(const uint8_t* q, const float* tab, int64_t gs, int64_t k0, int64_t k1, float* out) {
  constexpr int K = 1 << B;
  for (int64_t g = k0 / gs; g * gs < k1; ++g) {
    const float* tg = tab + (g - k0 / gs) * K;
    const Lut<B> lut(tg);
    int64_t j = std::max(g * gs, k0);
    const int64_t end = std::min((g + 1) * gs, k1);
    for (; j < end && (j & 7); ++j) out[j - k0] = tg[code_at(q, j, B)];
    for (; j + 16 <= end; j += 16) {
      __m256 w0, w1;
      lut.decode(q + (j >> 3) * B, w0, w1);
      _mm256_storeu_ps(out + j - k0, w0);
      _mm256_storeu_ps(out + j - k0 + 8, w1);
    }
    for (; j < end; ++j) out[j - k0] = tg[code_at(q, j, B)];
  }
}

// The same for the L = 16 path at 2/3/4 bits with AVX-512: vpermps on a zmm reads 4 index bits, so the
// 16-entry table (4 bits; 8 entries twice at 3, 4 entries four times at 2) turns 16 codes, shifted into
// their lanes from two 32-bit loads, into 16 weights with one lookup and no blend.
template <int B>
__attribute__((target("avx512f")))
void decode_range16(const uint8_t* q, const float* tab, int64_t gs, int64_t k0, int64_t k1, float* out) {
  if constexpr (B == 8) {
    decode_range<B>(q, tab, gs, k0, k1, out);
  } else {
    constexpr int K = 1 << B;
    // codes j+8.. start at bit 8B of p: read them from byte (8B - h) / 8 of p, shifted by h, so that no
    // load passes the 2B bytes of the 16 codes (h = 16, 8, 0 at 2, 3, 4 bits)
    constexpr int h = B == 2 ? 16 : B == 3 ? 8 : 0, hi = (8 * B - h) / 8;
    const __m512i sh = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, h, h + B, h + 2 * B,
                                         h + 3 * B, h + 4 * B, h + 5 * B, h + 6 * B, h + 7 * B);
    for (int64_t g = k0 / gs; g * gs < k1; ++g) {
      const float* tg = tab + (g - k0 / gs) * K;
      __m512 t;
      if constexpr (B == 4) t = _mm512_loadu_ps(tg);
      else if constexpr (B == 3) {
        const __m512 h = _mm512_castps256_ps512(_mm256_loadu_ps(tg));
        t = _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(1, 0, 1, 0));
      } else t = _mm512_broadcast_f32x4(_mm_loadu_ps(tg));
      int64_t j = std::max(g * gs, k0);
      const int64_t end = std::min((g + 1) * gs, k1);
      for (; j < end && (j & 7); ++j) out[j - k0] = tg[code_at(q, j, B)];
      for (; j + 16 <= end; j += 16) {
        const uint8_t* p = q + (j >> 3) * B;
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(int(load32(p)))),
                                             _mm256_set1_epi32(int(load32(p + hi))), 1);
        _mm512_storeu_ps(out + j - k0, _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh), t));
      }
      for (; j < end; ++j) out[j - k0] = tg[code_at(q, j, B)];
    }
  }
}

// part[R][NV*L] += w[R][n] . x[NV][n][L], summed in registers from 0 over the n inputs of one tile, then
// added (shorter float32 chains than one running sum over all inputs). The accumulators are named
// variables: GCC keeps a __m256 array in memory and would store it every step.
#define MC_STEP(r) { const VEC wr = BCAST(w + r * ldw + k);                                  \
                     a##r##0 = FMA(wr, x0v, a##r##0); if (NV == 2) a##r##1 = FMA(wr, x1v, a##r##1); }
#define MC_DECL(r) VEC a##r##0 = ZERO(), a##r##1 = ZERO();
#define MC_STORE(r) STORE(part + r * ldp, ADD(LOAD(part + r * ldp), a##r##0));                    \
                    if (NV == 2) STORE(part + r * ldp + L, ADD(LOAD(part + r * ldp + L), a##r##1));
#define MC_BODY(ROWS)                                                        \
  ROWS(MC_DECL)                                                              \
  const float* x1 = xb + (NV == 2 ? xstride : 0);                            \
  for (int64_t k = 0; k < n; ++k) {                                          \
    const VEC x0v = LOAD(xb + L * k), x1v = NV == 2 ? LOAD(x1 + L * k) : x0v; \
    ROWS(MC_STEP)                                                            \
  }                                                                          \
  ROWS(MC_STORE)

#define ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define ROWS12(X) ROWS6(X) X(6) X(7) X(8) X(9) X(10) X(11)

template <int NV>
void micro8(const float* w, int64_t ldw, int64_t n, const float* xb, int64_t xstride, float* part, int64_t ldp) {
  constexpr int L = 8;
  using VEC = __m256;
#define BCAST _mm256_broadcast_ss
#define FMA _mm256_fmadd_ps
#define ZERO _mm256_setzero_ps
#define LOAD _mm256_loadu_ps
#define STORE _mm256_storeu_ps
#define ADD _mm256_add_ps
  MC_BODY(ROWS6)
#undef BCAST
#undef FMA
#undef ZERO
#undef LOAD
#undef STORE
#undef ADD
}

template <int NV>
__attribute__((target("avx512f")))
void micro16(const float* w, int64_t ldw, int64_t n, const float* xb, int64_t xstride, float* part, int64_t ldp) {
  constexpr int L = 16;
  using VEC = __m512;
#define BCAST(p) _mm512_set1_ps(*(p))
#define FMA _mm512_fmadd_ps
#define ZERO _mm512_setzero_ps
#define LOAD _mm512_loadu_ps
#define STORE _mm512_storeu_ps
#define ADD _mm512_add_ps
  MC_BODY(ROWS12)
#undef BCAST
#undef FMA
#undef ZERO
#undef LOAD
#undef STORE
#undef ADD
}
#undef ROWS6
#undef ROWS12
#undef MC_BODY
#undef MC_STEP
#undef MC_DECL
#undef MC_STORE

// Inputs per tile for tp (padded) tokens: the x tile, tp x kb float32, stays within 24 KiB of L1 (with
// the R x kb weight tile, <= 24 KiB, in the rest of a 48 KiB L1).
inline int64_t tile_inputs(int64_t tp) {
  return std::max<int64_t>(32, std::min<int64_t>(512, (6144 / tp) & ~int64_t(15)));
}

// x packed per input tile [k0, k1): xb[k0 * tp + (v * (k1 - k0) + k - k0) * L + i] = x[L v + i, k], one
// contiguous block per tile (no 4 KiB-aliased streams).
inline std::vector<float> pack_x(const float* xp, int64_t T, int64_t in, int64_t L, int64_t tp, int64_t kb) {
  std::vector<float> xb(tp * in, 0.f);
  for (int64_t k0 = 0; k0 < in; k0 += kb) {
    const int64_t w = std::min(kb, in - k0);
    for (int64_t t = 0; t < T; ++t) {
      float* dst = xb.data() + k0 * tp + (t / L) * w * L + t % L;
      const float* src = xp + t * in + k0;
      for (int64_t k = 0; k < w; ++k) dst[k * L] = src[k];
    }
  }
  return xb;
}

// Rows [b, e): input tiles outside and row tiles inside, so that the x tile stays in L1 for every row
// tile; each row tile's tables (of the groups the input tile meets) are filled, its codes decoded into
// w, then multiplied; part[r][t] holds the partial sums.
template <int B, int L, int R, class Fill>
void gemm_rows(const float* xb, int64_t T, int64_t in, const uint8_t* cp, int64_t nb, int64_t groups,
               const Fill& fill, int64_t b, int64_t e, float* yp, int64_t rows) {
  const int64_t nv = (T + L - 1) / L, tp = nv * L, gs = in / groups, n = e - b, kb = tile_inputs(tp);
  const int64_t per = (std::min(groups, kb / gs + 2)) << B;  // tables of the groups one tile meets
  std::vector<float> tab(R * per + 8, 0.f), w(R * kb, 0.f), part((n + R) * tp, 0.f);
  for (int64_t k0 = 0; k0 < in; k0 += kb) {
    const int64_t k1 = std::min(k0 + kb, in), c0 = k0 * B / 8, c1 = (k1 * B + 7) / 8;
    const float* xk = xb + k0 * tp;  // this tile's [nv][k1 - k0][L] block
    const int64_t xs = (k1 - k0) * L;
    for (int64_t r0 = b; r0 < e; r0 += R) {
      const int64_t r1 = std::min(r0 + R, e);
      // the next row tile's codes for this input tile: rows are nb bytes apart, too far for the prefetcher
      for (int64_t r = r1; r < std::min(r1 + R, e); ++r)
        for (int64_t c = c0; c < c1; c += 64) _mm_prefetch((const char*)(cp + r * nb + c), _MM_HINT_T0);
      for (int64_t r = r0; r < r1; ++r) {
        fill(r, k0 / gs, (k1 + gs - 1) / gs, tab.data() + (r - r0) * per);
        if constexpr (L == 16)
          decode_range16<B>(cp + r * nb, tab.data() + (r - r0) * per, gs, k0, k1, w.data() + (r - r0) * kb);
        else
          decode_range<B>(cp + r * nb, tab.data() + (r - r0) * per, gs, k0, k1, w.data() + (r - r0) * kb);
      }
      float* pr = part.data() + (r0 - b) * tp;
      int64_t v = 0;
      if constexpr (L == 16) {
        for (; v + 2 <= nv; v += 2) micro16<2>(w.data(), kb, k1 - k0, xk + v * xs, xs, pr + v * L, tp);
        if (v < nv) micro16<1>(w.data(), kb, k1 - k0, xk + v * xs, xs, pr + v * L, tp);
      } else {
        for (; v + 2 <= nv; v += 2) micro8<2>(w.data(), kb, k1 - k0, xk + v * xs, xs, pr + v * L, tp);
        if (v < nv) micro8<1>(w.data(), kb, k1 - k0, xk + v * xs, xs, pr + v * L, tp);
      }
    }
  }
  for (int64_t r0 = b; r0 < e; r0 += 16)  // y is [T, rows]: 16 rows a time, not a 4·rows-byte stride
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = r0; r < std::min(r0 + 16, e); ++r) yp[t * rows + r] = part[(r - b) * tp + t];
}

template <int B, int L, int R, class Fill>
void gemm(const float* xp, int64_t T, int64_t in, const uint8_t* cp, int64_t nb, int64_t groups,
          const Fill& fill, float* yp, int64_t rows) {
  const int64_t tp = (T + L - 1) / L * L;
  const std::vector<float> xb = pack_x(xp, T, in, L, tp, tile_inputs(tp));
  at::parallel_for(0, (rows + R - 1) / R, 1, [&](int64_t b, int64_t e) {
    gemm_rows<B, L, R>(xb.data(), T, in, cp, nb, groups, fill, b * R, std::min(e * R, rows), yp, rows);
  });
}

// Token lanes of the tile GEMM: 16 (AVX-512) where the CPU has it, else 8; gemm_lanes(8) forces the AVX2
// path (the tests run both on one machine), gemm_lanes(0) restores the default.
std::atomic<int64_t> g_lanes{0};

int64_t gemm_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "gemm_lanes: 0 (auto), 8 or 16, got ", lanes);
  TORCH_CHECK(lanes != 16 || __builtin_cpu_supports("avx512f"), "gemm_lanes: 16 lanes need AVX-512");
  return g_lanes.exchange(lanes);
}

inline bool use_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  const int64_t lanes = g_lanes.load();
  return lanes == 0 ? has : lanes == 16;
}

// fill(r, g0, g1, tab) writes row r's float32 tables of groups [g0, g1) to tab ([g1 - g0, K]). From
// kGemmMin tokens the tile GEMM, below it the row kernel (tokens 4, 2, 1 at a time).
template <int B, class Fill>
at::Tensor lut_matmul(const at::Tensor& x, const at::Tensor& codes, int64_t groups, Fill fill) {
  const int64_t T = x.size(0), in = x.size(1), rows = codes.size(0), nb = codes.size(1);
  at::Tensor y = at::zeros({T, rows}, x.options());
  if (in == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t per = groups * (1 << B);
  const bool wide = use_avx512();
  if (T >= kGemmMin + (wide ? 0 : 1)) {  // at exactly 8 tokens the AVX2 row kernel beats the AVX2 tiles
    if (wide) gemm<B, 16, 12>(xp, T, in, cp, nb, groups, fill, yp, rows);
    else gemm<B, 8, 6>(xp, T, in, cp, nb, groups, fill, yp, rows);
    return y;
  }
  at::parallel_for(0, rows, kTile, [&](int64_t b, int64_t e) {
    std::vector<float> tab(kTile * per + 8, 0.f);
    for (int64_t r0 = b; r0 < e; r0 += kTile) {
      const int64_t r1 = std::min(r0 + kTile, e);
      for (int64_t r = r0; r < r1; ++r) fill(r, 0, groups, tab.data() + (r - r0) * per);
      for (int64_t t = 0; t < T;) {
        const float* xt = xp + t * in;
        float* yt = yp + t * rows;
        const int64_t left = T - t;
        if (left >= 8) tile<B, 8>(xt, in, cp, nb, tab.data(), groups, r0, r1, yt, rows), t += 8;
        else if (left >= 4) tile<B, 4>(xt, in, cp, nb, tab.data(), groups, r0, r1, yt, rows), t += 4;
        else if (left >= 2) tile<B, 2>(xt, in, cp, nb, tab.data(), groups, r0, r1, yt, rows), t += 2;
        else tile<B, 1>(xt, in, cp, nb, tab.data(), groups, r0, r1, yt, rows), t += 1;
      }
    }
  });
  return y;
}

template <class Fill>
at::Tensor by_bits(int64_t bits, const at::Tensor& x, const at::Tensor& c, int64_t g, Fill f) {
  switch (bits) {
    case 2: return lut_matmul<2>(x, c, g, f);
    case 3: return lut_matmul<3>(x, c, g, f);
    case 4: return lut_matmul<4>(x, c, g, f);
    case 8: return lut_matmul<8>(x, c, g, f);
  }
  TORCH_CHECK(false, "bits must be 2, 3, 4 or 8, got ", bits);
  return at::Tensor();
}

void check(const at::Tensor& x, const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, in]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              codes.size(1) == (x.size(1) * bits + 7) / 8, "codes: contiguous uint8 [rows, ceil(in*bits/8)]");
}

at::Tensor codebook_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& cents, int64_t bits) {
  check(x, codes, bits);
  const int64_t rows = codes.size(0), groups = cents.size(1), K = int64_t(1) << bits;
  TORCH_CHECK(cents.dim() == 3 && cents.scalar_type() == at::kHalf && cents.is_contiguous() &&
              cents.size(0) == rows && cents.size(2) == K && groups > 0 && x.size(1) % groups == 0,
              "centroids: contiguous float16 [rows, G, 2^bits], G dividing in");
  const at::Half* cp = cents.data_ptr<at::Half>();
  return by_bits(bits, x, codes, groups, [=](int64_t r, int64_t g0, int64_t g1, float* tab) {
    const uint16_t* c = reinterpret_cast<const uint16_t*>(cp + (r * groups + g0) * K);
    const int64_t n = (g1 - g0) * K;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)  // F16C: 8 halves -> 8 floats, exact
      _mm256_storeu_ps(tab + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + i))));
    for (; i < n; ++i) tab[i] = _cvtsh_ss(c[i]);
  });
}

at::Tensor rtn_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, int64_t bits) {
  check(x, codes, bits);
  const int64_t rows = codes.size(0), groups = scales.size(1), K = int64_t(1) << bits;
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.size(0) == rows && groups > 0 && x.size(1) % groups == 0,
              "scales: contiguous float16 [rows, G], G dividing in");
  const uint8_t* zp = nullptr;
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales.sizes(),
                "zeros: contiguous uint8 [rows, G]");
    zp = zeros->data_ptr<uint8_t>();
  }
  const at::Half* sp = scales.data_ptr<at::Half>();
  const int zsym = int(1) << (bits - 1);
  return by_bits(bits, x, codes, groups, [=](int64_t r, int64_t g0, int64_t g1, float* tab) {
    for (int64_t g = g0; g < g1; ++g) {
      const float s = float(sp[r * groups + g]);
      const int z = zp ? int(zp[r * groups + g]) : zsym;
      float* tg = tab + (g - g0) * K;
      if (K >= 8) {  // (k - z) is an exact small integer in float32, so the product is the reference's
        const __m256 vs = _mm256_set1_ps(s), vk = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        for (int64_t k = 0; k < K; k += 8)
          _mm256_storeu_ps(tg + k, _mm256_mul_ps(_mm256_add_ps(vk, _mm256_set1_ps(float(k - z))), vs));
      } else {
        for (int64_t k = 0; k < K; ++k) tg[k] = float(int(k) - z) * s;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(moecompress_lut, m) {
  m.def("codebook_matmul(Tensor x, Tensor codes, Tensor centroids, int bits) -> Tensor");
  m.def("rtn_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits) -> Tensor");
  m.def("gemm_lanes(int lanes) -> int", &gemm_lanes);
}

TORCH_LIBRARY_IMPL(moecompress_lut, CPU, m) {
  m.impl("codebook_matmul", &codebook_matmul);
  m.impl("rtn_matmul", &rtn_matmul);
}
