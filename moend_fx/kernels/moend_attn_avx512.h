// AVX-512 inner loops of moend_attn.cpp (built with -mavx512f -mavx512bw [-mavx512vnni] where the CPU has them):
// the same maths and code order as the AVX2 loops of moend_attn_loops.h, on 16 lanes instead of 8.
//
// Why a second tier: on a CPU with full-width 512-bit units (e.g. AMD Zen 5) one zmm instruction does the work
// of two ymm ones, and once its code rows are prefetched the kernel is bound by instructions (docs/kernels.md).
// Where a layout does not fit the 16-lane unit (a V group narrower than 16 code bytes, an odd number of K units)
// the AVX2 loops run instead.
//
// K side: a pair of 16-position units (the same int16 query values, the same code order) is one zmm; VNNI's
// vpdpwssd does madd + add in one instruction. The integer sums are exact, so logits equal the AVX2 loop's up
// to the order of the final float ops (none here: deq * sum + bias is the same expression).
// V side: one 16-position unit (16 code bytes of one plane) is one zmm of fp32; all units of a row block stay
// in registers for the whole block of tokens (one pass over the codes instead of one per pair of units).

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MOEND_AVX512 1

#include <immintrin.h>

#include "moend_attn_simd.h"

namespace moend {

// 16 fp16 values as fp32.
inline __m512 load16h(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// k_group_prep for Dpk = 32 * NP positions (D a multiple of 16): group g's (q*s) as int16 per row, its deq
// factor and q.z, with the row's products held in registers between the max and the rounding. The same values
// as the AVX2 prep: products, max and rounding (nearest even, saturating) are lane-wise; only the sum of q.z is
// reduced in another order.
// The scales are put in position order by permutes where a unit's channels lie in one or two zmm (8 and 4
// bits with whole 16-byte chunks: unit (k, j) is channels 16k*per + i*per + j), by a gather otherwise.
// kSplit (the VNNI dot, k_dot_vnni): each int16 value is stored as two int8 halves, qi = 256 * qh + ql with
// ql in [-128, 127], instead of as int16 (|qi| <= 32639 = 127 * 256 + 127 keeps qh in int8), 64 * ceil(NP / 2)
// bytes per row in split_offset's order.
template <int KB, int NP, bool kSplit = false>
inline void k_group_prep_avx512(const Args& a, int rows, const at::Half* sp, const at::Half* zp, Scratch& s) {
  constexpr int per = 8 / KB;
  const int D = a.D;
  // Whole chunks and one or two planes: D = 32 * NP and the fp16 scales and zeros go straight into registers.
  const bool direct = per <= 2 && a.Wk % 16 == 0;
  __m512 sv[2 * NP], zv[2 * NP];
  if (direct) {
    for (int u = 0; u < 2 * NP; ++u) {
      const int k = u / per, j = u % per;
      zv[u] = load16h(zp + 16 * u);
      if constexpr (per == 1) {
        sv[u] = load16h(sp + 16 * k);
      } else {
        const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1), _mm512_set1_epi32(j));
        sv[u] = _mm512_permutex2var_ps(load16h(sp + 32 * k), idx, load16h(sp + 32 * k + 16));
      }
    }
  } else {
    to_float(sp, s.sf.data(), D);
    to_float(zp, s.zf.data(), D);
    s.sf[D] = 0.f;
    for (int u = 0; u < 2 * NP; ++u)
      sv[u] = _mm512_i32gather_ps(_mm512_loadu_si512(a.gatherk.data() + 16 * u), s.sf.data(), 4);
  }
  for (int r = 0; r < rows; ++r) {
    const float* qp = s.qperm.data() + r * 32 * NP;
    __m512 x[2 * NP];
    __m512 mx = _mm512_setzero_ps();
    for (int u = 0; u < 2 * NP; ++u) {
      x[u] = _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * u), sv[u]);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(x[u]));
    }
    const float m = _mm512_reduce_max_ps(mx);
    const float* q = s.qsc.data() + r * D;
    __m512 bz = _mm512_setzero_ps();
    if (direct) {
      for (int u = 0; u < 2 * NP; ++u) bz = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * u), zv[u], bz);
    } else {
      for (int d = 0; d < D; d += 16) bz = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(s.zf.data() + d), bz);
    }
    const __m512 mul = _mm512_set1_ps(m > 0.f ? a.qmax / m : 0.f);
    if constexpr (kSplit) {
      // Four units at a time, narrowed by packs (in-lane: 128-bit lane i of the result holds dword i of each of
      // the four units, the order split_offset reads); halves taken on int16, no value saturates.
      constexpr int NQ = (2 * NP + 3) / 4;
      int8_t* qh = s.qh.data() + r * 64 * NQ;
      int8_t* ql = s.ql.data() + r * 64 * NQ;
      const __m512i c128 = _mm512_set1_epi16(128);
      for (int g4 = 0; g4 < NQ; ++g4) {
        __m512i v[4];
        for (int i = 0; i < 4; ++i) {
          const int u = 4 * g4 + i;
          v[i] = u < 2 * NP ? _mm512_cvtps_epi32(_mm512_mul_ps(x[u], mul)) : _mm512_setzero_si512();
        }
        const __m512i w0 = _mm512_packs_epi32(v[0], v[1]), w1 = _mm512_packs_epi32(v[2], v[3]);
        const __m512i h0 = _mm512_srai_epi16(_mm512_add_epi16(w0, c128), 8);
        const __m512i h1 = _mm512_srai_epi16(_mm512_add_epi16(w1, c128), 8);
        const __m512i l0 = _mm512_sub_epi16(w0, _mm512_slli_epi16(h0, 8));
        const __m512i l1 = _mm512_sub_epi16(w1, _mm512_slli_epi16(h1, 8));
        _mm512_storeu_si512(qh + 64 * g4, _mm512_packs_epi16(h0, h1));
        _mm512_storeu_si512(ql + 64 * g4, _mm512_packs_epi16(l0, l1));
      }
    } else {
      int16_t* qi = s.qi.data() + r * 32 * NP;
      for (int u = 0; u < 2 * NP; ++u)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + 16 * u),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[u], mul))));
    }
    s.deq[r] = m / a.qmax;
    s.bias[r] = _mm512_reduce_add_ps(bz);
  }
}

// v_block_prep on 16 lanes (16 % ng == 0: lane l is token t + l / ng, group l % ng): the block's weights
// wt[r][t*ng + g] = p_rt * s_tg and zacc[r][g] += sum_t p_rt z_tg; the same products, the zero sums folded in
// another order.
inline void v_block_prep_avx512(const Args& a, int64_t tok0, int n, int rows, const float* p, int ldl, Scratch& s) {
  const int ng = a.ng, nu = n * ng, step = 16 / ng;
  to_float(a.vs + tok0 * ng, s.sf.data(), nu);
  to_float(a.vz + tok0 * ng, s.zf.data(), nu);
  const __m512i idx = _mm512_srlv_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(__builtin_ctz(static_cast<unsigned>(ng))));
  const __mmask16 pm = static_cast<__mmask16>((1u << step) - 1);
  for (int r = 0; r < rows; ++r) {
    const float* pr = p + r * ldl;
    float* w = s.wt.data() + r * ng * s.BT;
    __m512 zs = _mm512_setzero_ps();
    int u = 0;
    for (int t = 0; u + 16 <= nu; u += 16, t += step) {
      const __m512 pe = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(pm, pr + t));
      _mm512_storeu_ps(w + u, _mm512_mul_ps(pe, _mm512_loadu_ps(s.sf.data() + u)));
      zs = _mm512_fmadd_ps(pe, _mm512_loadu_ps(s.zf.data() + u), zs);
    }
    alignas(64) float z16[16];
    _mm512_store_ps(z16, zs);
    float* zacc = s.zacc.data() + r * ng;
    for (int l = 0; l < 16; ++l) zacc[l % ng] += z16[l];
    v_prep_tail(s, pr, u / ng, n, ng, w, zacc);
  }
}

// Units 2p and 2p+1 of token row `row` (W code bytes) as 32 int16 codes (unit v: chunk v / per, plane v % per).
template <int KB>
inline __m512i k_unit_pair(const uint8_t* row, int W, int p) {
  constexpr int per = 8 / KB;
  const int v0 = 2 * p, v1 = 2 * p + 1;
  const __m128i c0 = code_plane<KB>(load_codes16(row + 16 * (v0 / per), W - 16 * (v0 / per)), v0 % per);
  const __m128i c1 = code_plane<KB>(load_codes16(row + 16 * (v1 / per), W - 16 * (v1 / per)), v1 % per);
  return _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(c0), c1, 1));
}

// acc + c . q over 32 int16 lanes, as 16 int32 partial sums.
inline __m512i dot_i16(__m512i acc, __m512i c, __m512i q) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, c, q);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(c, q));
#endif
}

// The 16 lanes of x folded to 8 (lane i + lane i + 8).
inline __m256i fold16_epi32(__m512i x) {
  return _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
}

// Logits of n tokens of one K group, as k_dot_avx2 (same tmp layout and final hadd tree). NP = Dpk / 32.
template <int KB, int NP>
void k_dot_avx512(const Args& a, const uint8_t* codes, int n, int rows, Scratch& s, float* lg, int ldl) {
  const int W = a.Wk;
  const int16_t* __restrict qbase = s.qi.data();
  int32_t* __restrict tmp = s.tmp.data();  // [rows][4 token pairs][8 lanes]
  for (int t8 = 0; t8 < n; t8 += 8) {
    const int nt = std::min(8, n - t8);
    const uint8_t* base = codes + static_cast<int64_t>(t8) * W;
    prefetch_ahead(base + kPrefetchK * W, 8 * W);
    for (int t = 0; t < 8; t += 2) {
      __m512i c0[NP], c1[NP];
      for (int p = 0; p < NP; ++p) {
        c0[p] = t < nt ? k_unit_pair<KB>(base + static_cast<int64_t>(t) * W, W, p) : _mm512_setzero_si512();
        c1[p] = t + 1 < nt ? k_unit_pair<KB>(base + static_cast<int64_t>(t + 1) * W, W, p) : _mm512_setzero_si512();
      }
      for (int r = 0; r < rows; ++r) {
        const int16_t* q = qbase + r * NP * 32;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const __m512i qv = _mm512_loadu_si512(q + 32 * p);
          a0 = dot_i16(a0, c0[p], qv);
          a1 = dot_i16(a1, c1[p], qv);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + (r * 4 + t / 2) * 8),
                            _mm256_hadd_epi32(fold16_epi32(a0), fold16_epi32(a1)));
      }
    }
    finish_logits8(tmp, rows, s, lg + t8, ldl, nt);
  }
}

#ifdef __AVX512VNNI__
#define MOEND_VNNI 1
// The VNNI K loop: 16 tokens per zmm, lane l = token l, so a logit is a lane's sum and needs no horizontal
// reduction (the pair loop above spends more instructions folding its sums than dotting).
//
// Chunk k (16 code bytes) of 16 token rows becomes 4 zmm by a 4x4 dword transpose inside each 128-bit lane:
// zmm m, lane l = bytes 4m .. 4m+3 of token l's chunk k. Plane j of those bytes (a shift and a mask) is 4 codes
// per lane at positions (k*per + j)*16 + 4m + 0..3 (the position order of moend_attn_loops.h), dotted with
// vpdpbusd (u8 codes x s8 query) against the query's int8 halves at those positions (split_offset), broadcast:
// sum_d c*qi = 256 * sum_d c*qh + sum_d c*ql. The int32 sums are exact (qi as in the int16 loops, whose range
// keeps the total inside int32; a wrapped intermediate 256 * hi cancels), so the logits equal the AVX2 loop's.

// Rows t .. t+15's chunk k as the four zmm of the transpose (rows >= nt read as 0).
template <bool kFull>
inline void transpose_chunk16(const uint8_t* base, int W, int k, int nt, __m512i* o) {
  __m512i z[4];
  for (int p = 0; p < 4; ++p) {
    __m512i x = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const int t = p + 4 * j;
      if (kFull || t < nt) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + static_cast<int64_t>(t) * W + 16 * k));
        x = j == 0 ? _mm512_castsi128_si512(c) : _mm512_inserti32x4(x, c, j);
      }
    }
    z[p] = x;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  o[0] = _mm512_unpacklo_epi64(t0, t2), o[1] = _mm512_unpackhi_epi64(t0, t2);
  o[2] = _mm512_unpacklo_epi64(t1, t3), o[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Byte offset, in a row of k_group_prep_avx512's split query, of the 4 values at positions 16v + 4m .. +3.
constexpr int split_offset(int v, int m) { return (v / 4) * 64 + (4 * m + v % 4) * 4; }

inline __m512i bcast4(const int8_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

// Logits of tokens t .. t+nt-1 (nt <= 16) for NR rows starting at r0.
template <int KB, int NP, int NR, bool kFull>
inline void k_block16_vnni(const Args& a, const uint8_t* base, int nt, int r0, const Scratch& s, float* lg,
                           int ldl) {
  constexpr int per = 8 / KB, NCH = 2 * NP / per, RB = 64 * ((2 * NP + 3) / 4);
  const int W = a.Wk;
  __m512i hi[NR], lo[NR];
  for (int r = 0; r < NR; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << KB) - 1));
  for (int k = 0; k < NCH; ++k) {
    __m512i o[4];
    transpose_chunk16<kFull>(base, W, k, nt, o);
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
#pragma GCC unroll 4
      for (int j = 0; j < per; ++j) {
        __m512i c = j == 0 ? o[m] : _mm512_srli_epi32(o[m], KB * j);
        if constexpr (KB != 8) c = _mm512_and_si512(c, mask);
        const int off = split_offset(k * per + j, m);
        for (int r = 0; r < NR; ++r) {
          hi[r] = _mm512_dpbusd_epi32(hi[r], c, bcast4(s.qh.data() + (r0 + r) * RB + off));
          lo[r] = _mm512_dpbusd_epi32(lo[r], c, bcast4(s.ql.data() + (r0 + r) * RB + off));
        }
      }
    }
  }
  const __mmask16 keep = kFull ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nt) - 1);
  for (int r = 0; r < NR; ++r) {
    const __m512i tot = _mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]);
    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_set1_ps(s.deq[r0 + r]),
                                     _mm512_set1_ps(s.bias[r0 + r]));
    _mm512_mask_storeu_ps(lg + (r0 + r) * ldl, keep, f);
  }
}

// Logits of n tokens of one K group: lg[r*ldl + i] = deq[r] * (qi[r] . c_i) + bias[r]. NP = Dpk / 32; needs
// W % 16 == 0 (whole chunks) and the split query of k_group_prep_avx512<KB, NP, true>.
template <int KB, int NP>
void k_dot_vnni(const Args& a, const uint8_t* codes, int n, int rows, const Scratch& s, float* lg, int ldl) {
  const int W = a.Wk;
  for (int t16 = 0; t16 < n; t16 += 16) {
    const int nt = std::min(16, n - t16);
    const uint8_t* base = codes + static_cast<int64_t>(t16) * W;
    prefetch_ahead(base + kPrefetchK * W, 16 * W);
    for_row_blocks<4>(rows, [&](auto nr, int r0) {
      constexpr int NR = decltype(nr)::value;
      if (nt == 16) k_block16_vnni<KB, NP, NR, true>(a, base, nt, r0, s, lg + t16, ldl);
      else k_block16_vnni<KB, NP, NR, false>(a, base, nt, r0, s, lg + t16, ldl);
    });
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define MOEND_VNNI_V 1
// The VNNI V loop: sum_t w_tg c_td as exact integer dots, 4 tokens per vpdpbusd, instead of one fp32 FMA per
// token after widening each code to fp32 (the float loop below spends 10 conversion uops per token on top of
// its 12 FMAs at k4v4, head_dim 64, 3 query rows).
//
// Weights. Per block and V group g, w_tg = p_t s_tg is rounded to an integer qi = round(w_tg * kVQ / smax_g),
// smax_g = max_t |s_tg| over the block (p_t <= 1, so |qi| <= kVQ): one factor per block and group, shared by the
// rows. qi has 23 bits, so each weight is off by at most smax_g / (2 kVQ) ~ 6e-8 smax_g, an fp32 rounding of the
// largest weight (fp32 accumulation of 128 products rounds about as much); int8 or int16 weights would not be
// (with one peaked token, a 16-bit step of its weight times the other tokens' codes is ~3e-4 of an output,
// over the fp32 tolerance). vpdpbusd multiplies u8 by s8, so qi is split into three int8 parts,
// qi = 65536 h + 256 m + l with l, m in [-128, 127] (|qi| <= 127 * 65793 keeps h in int8 too): the bytes of
// qi + 0x8080, the low two with their top bit flipped. Each part has its own int32 accumulator (exact: at most
// 15 * 128 per token), and a block's three sums are combined in fp32 once: deq * (65536 hi + 256 mid + lo).
//
// Codes. Lane i of a zmm holds byte i of one 16-byte chunk of 4 consecutive tokens (vpermb: byte 4i + j = token
// j's byte i), so a plane of it (shift, mask) is 16 positions x 4 tokens, the position order of the float loop:
// the accumulators (accp) and finish_unit are shared. A chunk lies in one V group (wpg % 16 == 0), so its
// weights for 4 tokens are one broadcast dword per part.
constexpr int kVnniMaxW = 256;  // code bytes per token the loop takes (head_dim 512 at 4 bits)
constexpr float kVQ = 8350000.f;  // < 127 * 65793 = 8355711, margin for p_t up to 1 + 6e-4 (the exp is <= 1 + 2e-7)

// The block's V scales and zeros as fp32 in group-major order, vst[g * BTp + t] (zero past n, to 16 tokens).
inline void v_scales_by_group(const Args& a, int64_t tok0, int n, Scratch& s) {
  const int ng = a.ng, BTp = s.BTp, nseg = (n + 15) / 16;
  const at::Half* sp = a.vs + tok0 * ng;
  const at::Half* zp = a.vz + tok0 * ng;
  float* st = s.vst.data();
  float* zt = s.vzt.data();
  auto halves = [](const at::Half* p, int cnt) {  // max(0, min(cnt, 16)) fp16 values, the rest 0
    const __mmask16 k = cnt >= 16 ? static_cast<__mmask16>(0xFFFF)
                        : cnt <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << cnt) - 1);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
  };
  if (ng == 1) {
    for (int sg = 0; sg < nseg; ++sg) {
      const int m = std::min(16, n - 16 * sg);
      _mm512_storeu_ps(st + 16 * sg, halves(sp + 16 * sg, m));
      _mm512_storeu_ps(zt + 16 * sg, halves(zp + 16 * sg, m));
    }
  } else if (ng == 2) {  // 16 tokens = 32 halves, interleaved by group: split by two lane permutes
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int sg = 0; sg < nseg; ++sg) {
      const int m = 2 * std::min(16, n - 16 * sg), o = 32 * sg;
      const __m512 s0 = halves(sp + o, m), s1 = halves(sp + o + 16, m - 16);
      const __m512 z0 = halves(zp + o, m), z1 = halves(zp + o + 16, m - 16);
      _mm512_storeu_ps(st + 16 * sg, _mm512_permutex2var_ps(s0, even, s1));
      _mm512_storeu_ps(st + BTp + 16 * sg, _mm512_permutex2var_ps(s0, odd, s1));
      _mm512_storeu_ps(zt + 16 * sg, _mm512_permutex2var_ps(z0, even, z1));
      _mm512_storeu_ps(zt + BTp + 16 * sg, _mm512_permutex2var_ps(z0, odd, z1));
    }
  } else {
    for (int g = 0; g < ng; ++g)
      for (int t = 0; t < 16 * nseg; ++t) {
        st[g * BTp + t] = t < n ? static_cast<float>(sp[t * ng + g]) : 0.f;
        zt[g * BTp + t] = t < n ? static_cast<float>(zp[t * ng + g]) : 0.f;
      }
  }
}

// v_block_prep for the VNNI V loop: per row, group and 16 tokens, the weights' three int8 parts (64 bytes: l, m,
// h, 16 tokens each, then 16 unused), and zacc[r][g] += sum_t p_rt z_tg.
inline void v_block_prep_vnni(const Args& a, int64_t tok0, int n, int rows, const float* p, int ldl, Scratch& s) {
  const int ng = a.ng, BTp = s.BTp, nseg = (n + 15) / 16;
  v_scales_by_group(a, tok0, n, s);
  float* st = s.vst.data();
  for (int g = 0; g < ng; ++g) {  // the factor of each group; its scales pre-multiplied by kVQ / smax
    __m512 mx = _mm512_setzero_ps();
    for (int sg = 0; sg < nseg; ++sg) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(st + g * BTp + 16 * sg)));
    const float smax = _mm512_reduce_max_ps(mx);
    const __m512 mul = _mm512_set1_ps(smax > 0.f ? kVQ / smax : 0.f);
    s.vdeq[g] = smax / kVQ;
    for (int sg = 0; sg < nseg; ++sg)
      _mm512_storeu_ps(st + g * BTp + 16 * sg, _mm512_mul_ps(_mm512_loadu_ps(st + g * BTp + 16 * sg), mul));
  }
  // byte 4i + j of qi + 0x8080 -> byte 16 j + i (j < 3); the low two parts get their top bit flipped
  alignas(64) static constexpr int8_t kSplit[64] = {
      0, 4, 8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1, 5, 9,  13, 17, 21, 25, 29, 33, 37, 41, 45,
      49, 53, 57, 61, 2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 3, 7, 11, 15, 19, 23, 27, 31,
      35, 39, 43, 47, 51, 55, 59, 63};
  const __m512i split = _mm512_load_si512(kSplit);
  const __m512i bias = _mm512_set1_epi32(0x8080);
  for (int r = 0; r < rows; ++r) {
    const float* pr = p + r * ldl;
    int8_t* wq = s.wq.data() + static_cast<int64_t>(r) * ng * BTp * 4;
    for (int g = 0; g < ng; ++g) {
      __m512 zs = _mm512_setzero_ps();
      for (int sg = 0; sg < nseg; ++sg) {
        const int m = std::min(16, n - 16 * sg);
        const __mmask16 k = m == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << m) - 1);
        const __m512 pv = _mm512_maskz_loadu_ps(k, pr + 16 * sg);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(pv, _mm512_loadu_ps(st + g * BTp + 16 * sg)));
        const __m512i x = _mm512_xor_si512(_mm512_add_epi32(qi, bias), bias);
        _mm512_storeu_si512(wq + (g * BTp + 16 * sg) * 4, _mm512_permutexvar_epi8(split, x));
        zs = _mm512_fmadd_ps(pv, _mm512_loadu_ps(s.vzt.data() + g * BTp + 16 * sg), zs);
      }
      s.zacc[r * ng + g] += _mm512_reduce_add_ps(zs);
    }
  }
}

// Chunk k of token rows t .. t+3 (W bytes apart): lane i = byte i of each, token j in byte j.
inline __m512i v_quad_chunk(const uint8_t* t0, int W, int k) {
  alignas(64) static constexpr int8_t kQuad[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
      7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61,
      14, 30, 46, 62, 15, 31, 47, 63};
  auto ld = [&](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(t0 + static_cast<int64_t>(j) * W + 16 * k)); };
  __m512i x = _mm512_castsi128_si512(ld(0));
  x = _mm512_inserti32x4(x, ld(1), 1);
  x = _mm512_inserti32x4(x, ld(2), 2);
  x = _mm512_inserti32x4(x, ld(3), 3);
  return _mm512_permutexvar_epi8(_mm512_load_si512(kQuad), x);
}

// The same for 32-byte rows (4-bit V at head_dim 64): the 4 rows are two zmm, one two-source permute per chunk.
inline __m512i v_quad_chunk32(__m512i r01, __m512i r23, int k) {
  alignas(64) static constexpr int8_t kQuad32[2][64] = {
      {0, 32, 64, 96, 1, 33, 65, 97, 2, 34, 66, 98, 3, 35, 67, 99, 4, 36, 68, 100, 5, 37, 69, 101, 6, 38, 70, 102,
       7, 39, 71, 103, 8, 40, 72, 104, 9, 41, 73, 105, 10, 42, 74, 106, 11, 43, 75, 107, 12, 44, 76, 108, 13, 45,
       77, 109, 14, 46, 78, 110, 15, 47, 79, 111},
      {16, 48, 80, 112, 17, 49, 81, 113, 18, 50, 82, 114, 19, 51, 83, 115, 20, 52, 84, 116, 21, 53, 85, 117, 22,
       54, 86, 118, 23, 55, 87, 119, 24, 56, 88, 120, 25, 57, 89, 121, 26, 58, 90, 122, 27, 59, 91, 123, 28, 60, 92,
       124, 29, 61, 93, 125, 30, 62, 94, 126, 31, 63, 95, 127}};
  return _mm512_permutex2var_epi8(r01, _mm512_load_si512(kQuad32[k]), r23);
}

// acc += c . (the dword at w, broadcast) by vpdpbusd with an embedded broadcast. Written in asm because GCC, given
// the intrinsic, kept 9 broadcasts in registers and copied the 18 accumulators around them (44 register moves
// per 4 tokens, twice the dot instructions); "+v" ties each accumulator to one register (by value: a reference
// puts the accumulators on the stack).
inline __m512i dpbusd_bcast(__m512i acc, __m512i c, const int8_t* w) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(c), "m"(*reinterpret_cast<const int32_t*>(w)));
  return acc;
}

// One pass of the VNNI V loop: chunks k0 .. k0+NC-1 (NC * 8 / VB = NU units) for NR rows over n tokens (a
// multiple of 4; the rows past the layer's end are never read: the caller passes a padded copy of the tail),
// NR * NU * 3 int32 accumulators in registers; then accp += deq * (65536 hi + 256 mid + lo).
// wq[r][c]: row r's weight parts for chunk c's group; deq[c] its factor.
template <int VB, int NR, int NC, bool W32>
inline void v_pass_vnni(const uint8_t* codes, int W, int k0, int n, const int8_t* const (*wq)[NC],
                        const float* deq, float* const* acc, bool prefetch) {
  constexpr int per = 8 / VB, NU = NC * per;
  __m512i hi[NR][NU], mid[NR][NU], lo[NR][NU];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NU; ++u) hi[r][u] = mid[r][u] = lo[r][u] = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << VB) - 1));
  for (int t = 0; t < n; t += 4) {
    const uint8_t* row = codes + static_cast<int64_t>(t) * W;
    if (prefetch) prefetch_ahead(row + kPrefetchV * W, 4 * W);
    __m512i c[NU];
    for (int cc = 0; cc < NC; ++cc) {
      __m512i x;
      if constexpr (W32) x = v_quad_chunk32(_mm512_loadu_si512(row), _mm512_loadu_si512(row + 64), k0 + cc);
      else x = v_quad_chunk(row, W, k0 + cc);
      for (int j = 0; j < per; ++j) {
        __m512i y = j == 0 ? x : _mm512_srli_epi32(x, VB * j);
        if constexpr (VB != 8) y = _mm512_and_si512(y, mask);
        c[cc * per + j] = y;
      }
    }
    const int off = (t / 16) * 64 + (t % 16);  // token t's weight byte in a 64-byte (16-token) record: part 0
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < NC; ++cc) {
        const int8_t* w = wq[r][cc] + off;
        for (int j = 0; j < per; ++j) {
          lo[r][cc * per + j] = dpbusd_bcast(lo[r][cc * per + j], c[cc * per + j], w);
          mid[r][cc * per + j] = dpbusd_bcast(mid[r][cc * per + j], c[cc * per + j], w + 16);
          hi[r][cc * per + j] = dpbusd_bcast(hi[r][cc * per + j], c[cc * per + j], w + 32);
        }
      }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NU; ++u) {
      const float d = deq[u / per];
      __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r][u]), _mm512_set1_ps(d));
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mid[r][u]), _mm512_set1_ps(256.f * d), f);
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r][u]), _mm512_set1_ps(65536.f * d), f);
      _mm512_storeu_ps(acc[r] + 16 * u, _mm512_add_ps(_mm512_loadu_ps(acc[r] + 16 * u), f));
    }
}

// accp[r] += sum_t w[r][t][g] * c_t over n packed tokens by integer dots (needs wpg % 16 == 0: a chunk lies in one
// V group, and W % 16 == 0: whole chunks). Passes of one chunk, rows three (4 bits) or two (2 bits) at a time; the
// last n % 4 tokens through a zero-padded copy of their rows (their weights are 0).
// 4 and 2 bits only: at 8 bits (one plane per chunk, no shift or mask to save, twice the bytes per token) it
// measured no faster than the float loop (0.99x, k8v8 at 8k and 32k tokens, 1 thread), so 8-bit V stays there.
template <int VB>
void v_acc_vnni(const Args& a, const uint8_t* codes, int n, int rows, const float* p, int ldl, Scratch& s,
                int64_t tok0) {
  static_assert(VB == 4 || VB == 2, "8-bit V takes the float loop");
  v_block_prep_vnni(a, tok0, n, rows, p, ldl, s);
  constexpr int per = 8 / VB, NC = 1;
  const int W = a.Wv, nch = a.nchv, ng = a.ng, BTp = s.BTp;
  const int n4 = n & ~3;
  alignas(64) uint8_t tail[4 * kVnniMaxW];
  const bool w32 = W == 32;
  if (n4 < n) {
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, codes + static_cast<int64_t>(n4) * W, static_cast<size_t>(n - n4) * W);
  }
  for (int k0 = 0; k0 < nch; k0 += NC) {
    int grp[NC];
    float deq[NC];
    for (int c = 0; c < NC; ++c) {
      grp[c] = (16 * (k0 + c)) / a.wpg;
      deq[c] = s.vdeq[grp[c]];
    }
    // NR * NU * 3 accumulators: 18 for 4 bits at 3 rows, 24 for 2 bits at 2 rows
    for_row_blocks<per == 4 ? 2 : 3>(rows, [&](auto nr, int r0) {
      constexpr int NR = decltype(nr)::value;
      const int8_t* wq[NR][NC];
      float* acc[NR];
      for (int r = 0; r < NR; ++r) {
        for (int c = 0; c < NC; ++c) wq[r][c] = s.wq.data() + (static_cast<int64_t>(r0 + r) * ng + grp[c]) * BTp * 4;
        acc[r] = s.accp.data() + (r0 + r) * a.Dpv + k0 * per * 16;
      }
      auto pass = [&](const uint8_t* base, int m, const int8_t* const (*w)[NC], bool pf) {
        if (w32) v_pass_vnni<VB, NR, NC, true>(base, W, k0, m, w, deq, acc, pf);
        else v_pass_vnni<VB, NR, NC, false>(base, W, k0, m, w, deq, acc, pf);
      };
      if (n4 > 0) pass(codes, n4, wq, k0 == 0 && r0 == 0);  // prefetch in the first pass over the rows
      if (n4 < n) {
        const int8_t* wt[NR][NC];  // the tail's weights start at token n4
        for (int r = 0; r < NR; ++r)
          for (int c = 0; c < NC; ++c) wt[r][c] = wq[r][c] + (n4 / 16) * 64 + (n4 % 16);
        pass(tail, 4, wt, false);
      }
    });
  }
}
#endif

// One pass of the V loop over n tokens: NU units (16 code bytes at offset off[u], plane j[u], all in V group
// grp[u]) for NR query rows; NR * NU <= 16 accumulators stay in registers. Every unit's 16 bytes lie inside
// the W-byte row (a narrower row goes through the AVX2 loop), so the loads need no bounds check.
template <int VB, int NR, int NU>
inline void v_pass_avx512(const uint8_t* codes, int W, const int* off, const int* j, const int* grp, int n, int ng,
                          const float* const* wt, float* const* acc) {
  __m512 a[NR][NU];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NU; ++u) a[r][u] = _mm512_loadu_ps(acc[r] + 16 * u);
  __m128i sh[NU];
  for (int u = 0; u < NU; ++u) sh[u] = _mm_cvtsi32_si128(VB * j[u]);
  const __m128i mask = _mm_set1_epi8(static_cast<char>((1 << VB) - 1));
  const float* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = wt[r];
  for (int t = 0; t < n; ++t, codes += W) {
    __m512 f[NU];
    for (int u = 0; u < NU; ++u) {
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + off[u]));
      if constexpr (VB != 8) c = _mm_and_si128(_mm_srl_epi16(c, sh[u]), mask);
      f[u] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
    }
    for (int r = 0; r < NR; ++r) {
      for (int u = 0; u < NU; ++u) a[r][u] = _mm512_fmadd_ps(f[u], _mm512_set1_ps(w[r][grp[u]]), a[r][u]);
      w[r] += ng;
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NU; ++u) _mm512_storeu_ps(acc[r] + 16 * u, a[r][u]);
}

// v_pass_avx512 for NC whole 16-byte chunks from byte k0 * 16 (all 8 / VB planes of each, in position order):
// each chunk is loaded and widened to 16 int32 lanes once, its planes are then a shift and a mask apart (the
// top plane needs no mask, plane 0 no shift). Chunk c lies in V group grp[c].
template <int VB, int NR, int NC>
inline void v_chunks_avx512(const uint8_t* codes, int W, int k0, const int* grp, int n, int ng,
                            const float* const* wt, float* const* acc) {
  constexpr int per = 8 / VB, NU = NC * per;
  __m512 a[NR][NU];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NU; ++u) a[r][u] = _mm512_loadu_ps(acc[r] + 16 * u);
  const __m512i mask = _mm512_set1_epi32((1 << VB) - 1);
  const float* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = wt[r];
  codes += 16 * k0;
  for (int t = 0; t < n; ++t, codes += W) {
    prefetch_ahead(codes + kPrefetchV * W, 1);
    __m512 f[NU];
    for (int c = 0; c < NC; ++c) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c)));
      for (int jj = 0; jj < per; ++jj) {
        __m512i y = jj == 0 ? x : _mm512_srli_epi32(x, VB * jj);
        if (jj + 1 < per) y = _mm512_and_si512(y, mask);
        f[c * per + jj] = _mm512_cvtepi32_ps(y);
      }
    }
    for (int r = 0; r < NR; ++r) {
      for (int u = 0; u < NU; ++u) a[r][u] = _mm512_fmadd_ps(f[u], _mm512_set1_ps(w[r][grp[u / per]]), a[r][u]);
      w[r] += ng;
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NU; ++u) _mm512_storeu_ps(acc[r] + 16 * u, a[r][u]);
}

// accp[r] += sum_t wt[r][t][g] * c_t over n packed tokens (needs wpg % 16 == 0: a unit lies in one V group, and
// W % 16 == 0: whole 16-byte chunks).
// Units in position order, four per pass, rows four at a time.
template <int VB>
void v_acc_avx512(const Args& a, const uint8_t* codes, int n, int rows, Scratch& s) {
  constexpr int per = 8 / VB, UP = 4;
  const int nu = a.nchv * per, ng = a.ng, BT = s.BT;
  for (int u0 = 0; u0 < nu; u0 += UP) {
    const int cnt = std::min(UP, nu - u0);
    int off[UP], j[UP], grp[UP];
    for (int u = 0; u < UP; ++u) {
      const int v = u0 + std::min(u, cnt - 1);
      off[u] = 16 * (v / per), j[u] = v % per, grp[u] = std::min(ng - 1, off[u] / a.wpg);
    }
    for_row_blocks<4>(rows, [&](auto nr, int r0) {
      constexpr int NR = decltype(nr)::value;
      const float* wt[NR];
      float* acc[NR];
      for (int r = 0; r < NR; ++r) {
        wt[r] = s.wt.data() + (r0 + r) * ng * BT;
        acc[r] = s.accp.data() + (r0 + r) * a.Dpv + u0 * 16;
      }
      if (cnt == UP) {  // whole chunks (u0 is a multiple of per): widen each chunk once; else a tail of units
        int cg[UP / per];
        for (int c = 0; c < UP / per; ++c) cg[c] = grp[c * per];
        v_chunks_avx512<VB, NR, UP / per>(codes, a.Wv, u0 / per, cg, n, ng, wt, acc);
        return;
      }
      switch (cnt) {
        case 3: v_pass_avx512<VB, NR, 3>(codes, a.Wv, off, j, grp, n, ng, wt, acc); break;
        case 2: v_pass_avx512<VB, NR, 2>(codes, a.Wv, off, j, grp, n, ng, wt, acc); break;
        default: v_pass_avx512<VB, NR, 1>(codes, a.Wv, off, j, grp, n, ng, wt, acc); break;
      }
    });
  }
}

}  // namespace moend

#endif
