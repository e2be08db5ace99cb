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
