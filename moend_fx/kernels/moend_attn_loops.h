// Inner loops of moend_attn.cpp: logits over K blocks and the V accumulation, for packed codes (2/4/8 bits)
// and raw 16-bit rows, each with an AVX2 path and a portable one.
//
// Code order. A token's codes are its row of W bytes (docs/cache-format.md: value j of byte w is channel
// w*per + j, per = 8/bits). The row is read in chunks of 16 bytes; chunk k, plane j (the j-th bit field of
// each byte), lane i is channel (16k + i)*per + j. That order, "position" u = (k*per + j)*16 + i, is what one
// load + shift + mask gives without shuffles, so the query (K side) and the V accumulator are kept in it:
// Args::permk / permv map a position to its channel (-1 for the zero padding of a partial last chunk).
//
// K side, per K group g (G tokens; per channel d a scale s_d and zero z_d):
//   q . k_t = sum_d q_d (s_d c_td + z_d) = sum_d (q_d s_d) c_td + q . z
// (q*s) is quantized once per group and row to int16, qi = round((q*s) / deq) with deq = max|q*s| / qmax, and
// dotted against the codes widened to int16 with _mm256_madd_epi16 (exact int32 sums), 8 tokens at a time;
// the logit is deq * sum + q.z. One code load feeds every query row of the GQA group.
// Why int16 and not int8 (maddubs): int8 q adds a relative logit error of ~4e-3, 100-150x over the 1e-4
// tolerance of the fused-graph tests; int16 (qmax = 32639) adds ~1.5e-5 of max|q*s| per channel, far below
// a 4-bit quantization step, for ~1.4x the K-side instructions (the V side dominates anyway).
//
// V side, per token t (per group of Gv channels a scale s_tg and zero z_tg):
//   sum_t p_t v_t[d] = sum_t (p_t s_tg) c_td + sum_t p_t z_tg
// The weights w_tg = p_t s_tg and the zero sums are computed per block; the codes are widened in registers
// and accumulated with FMAs into the permuted accumulator; the zero sums are added once per unit.

#pragma once

#include <vector>

#include "moend_attn_simd.h"

namespace moend {

struct Args {
  int B, H, Hkv, Gq, L, D, P, R, S, G, Gv;
  int Pv, Rv;  // V's packed / residual tokens: (P, R) when V is split like K, (S, 0) when packed on arrival
  int kbits, vbits, kper, vper, Wk, Wv;
  int nchk, nchv, Dpk, Dpv;  // 16-byte chunks per code row; positions (nch * 16 * per) per side
  int ng, wpg;               // V groups per token; bytes per V group
  float qmax;                // int16 range of the quantized query (no int32 overflow over Dpk codes)
  bool causal;
  float scale;
  // Padding mask, bool [B, Hm, L, S] (True = may attend; Hm = 1 or H), or null: row (b, h, l) starts at
  // mask + b*msb + h*msh + l*msl (msh = 0 when Hm = 1), tokens contiguous.
  const uint8_t* mask;
  int64_t msb, msh, msl;
  const float* q;  // [B, H, L, D] fp32
  const void* kp;  // codes [B, Hkv, P, Wk] uint8, or raw [B, Hkv, P, D] T
  const at::Half* ks;
  const at::Half* kz;  // [B, Hkv, P/G, D]
  const void* vp;
  const at::Half* vs;
  const at::Half* vz;  // [B, Hkv, Pv, D/Gv]
  const void* kr;  // [B, Hkv, R, D] T
  const void* vr;  // [B, Hkv, Rv, D] T
  std::vector<int> permk, permv;  // position -> channel, or -1
  std::vector<int> gatherk;       // position -> channel, or D (padding)
};

// Per-thread scratch, sized for MB query rows and blocks of BT tokens.
struct Scratch {
  int BT;
  std::vector<float> qsc, qperm, qs, deq, bias, sf, zf, sperm, lg, wt, accp, accn, zacc, row;
  std::vector<int16_t> qi, crow;
  std::vector<int8_t> qh, ql;  // qi's int8 halves (the VNNI K loop)
  std::vector<int32_t> tmp;
  // The VNNI V loop (moend_attn_avx512.h): the block's V scales / zeros group-major (BTp = BT rounded up to 16
  // tokens per group), each V group's dequantization factor, and the weights' int8 parts, 64 bytes per row,
  // group and 16 tokens.
  int BTp;
  std::vector<float> vst, vzt, vdeq;
  std::vector<int8_t> wq;
  Scratch(const Args& a, int rows, int BT)
      : BT(BT), qsc(rows * a.D), qperm(rows * a.Dpk), qs(a.Dpk), deq(rows), bias(rows),
        sf(std::max(a.D + 1, BT * a.ng)), zf(std::max(a.D, BT * a.ng)), sperm(a.Dpk), lg(rows * BT + 16),
        wt(rows * a.ng * BT), accp(rows * a.Dpv), accn(rows * a.D),
        zacc(rows * a.ng), row(a.D), qi(rows * a.Dpk), crow(std::max(a.Dpk, a.Dpv)),
        qh(rows * (a.Dpk + 64)), ql(rows * (a.Dpk + 64)), tmp(rows * 64), BTp((BT + 15) / 16 * 16),
        vst(a.ng * BTp), vzt(a.ng * BTp), vdeq(a.ng), wq(static_cast<size_t>(rows) * a.ng * BTp * 4) {}
};

// ------------------------------------------------------------------------------------------------ K side

// Group g's (q*s) as int16 per row (positions order), its deq factor, and q.z (bias), for all rows.
// sf has D + 1 entries: sf[D] = 0 is where the padding positions of permk (index D) read.
inline void k_group_prep(const Args& a, int rows, const at::Half* sp, const at::Half* zp, Scratch& s) {
  const int D = a.D, Dp = a.Dpk;
  to_float(sp, s.sf.data(), D);
  to_float(zp, s.zf.data(), D);
  s.sf[D] = 0.f;
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int u = 0; u < Dp; u += 8)
    _mm256_storeu_ps(s.sperm.data() + u, _mm256_i32gather_ps(s.sf.data(), _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(a.gatherk.data() + u)), 4));
  for (int r = 0; r < rows; ++r) {
    const float* qp = s.qperm.data() + r * Dp;
    __m256 mx = _mm256_setzero_ps();
    for (int u = 0; u < Dp; u += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qp + u), _mm256_loadu_ps(s.sperm.data() + u));
      _mm256_storeu_ps(s.qs.data() + u, x);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    __m256 bz = _mm256_setzero_ps();
    const float* q = s.qsc.data() + r * D;
    int d = 0;
    for (; d + 8 <= D; d += 8) bz = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(s.zf.data() + d), bz);
    float bias = hsum_ps(bz);
    for (; d < D; ++d) bias += q[d] * s.zf[d];
    round_to_i16(s.qs.data(), m > 0.f ? a.qmax / m : 0.f, s.qi.data() + r * Dp, Dp);
    s.deq[r] = m / a.qmax;
    s.bias[r] = bias;
  }
#else
  for (int u = 0; u < Dp; ++u) s.sperm[u] = s.sf[a.gatherk[u]];
  for (int r = 0; r < rows; ++r) {
    const float* qp = s.qperm.data() + r * Dp;
    float m = 0.f;
    for (int u = 0; u < Dp; ++u) {
      s.qs[u] = qp[u] * s.sperm[u];
      m = std::max(m, std::fabs(s.qs[u]));
    }
    round_to_i16(s.qs.data(), m > 0.f ? a.qmax / m : 0.f, s.qi.data() + r * Dp, Dp);
    s.deq[r] = m / a.qmax;
    s.bias[r] = dot(s.qsc.data() + r * D, s.zf.data(), D);
  }
#endif
}

#ifdef __AVX2__
// The logits of 8 tokens from their per-pair partial sums tmp[r][4 pairs][8 lanes] (the rest of the hadd tree of
// hsum8x8_epi32, whose first level the K loops do per token pair): lg[r*ldl + i] = deq[r] * sum_i + bias[r], for
// the first nt tokens.
inline void finish_logits8(const int32_t* tmp, int rows, const Scratch& s, float* lg, int ldl, int nt) {
  for (int r = 0; r < rows; ++r) {
    auto ld = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tmp + (r * 4 + i) * 8)); };
    const __m256i x = _mm256_hadd_epi32(ld(0), ld(1)), y = _mm256_hadd_epi32(ld(2), ld(3));
    const __m256i tot = _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20), _mm256_permute2x128_si256(x, y, 0x31));
    const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(s.deq[r]), _mm256_set1_ps(s.bias[r]));
    if (nt == 8) {  // the common case: one store, no copy through a stack buffer
      _mm256_storeu_ps(lg + r * ldl, f);
      continue;
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, f);
    std::memcpy(lg + r * ldl, out, nt * sizeof(float));
  }
}

// Logits of n tokens of one K group: lg[r*ldl + i] = deq[r] * (qi[r] . c_i) + bias[r]. NV = Dpk / 16.
template <int KB, int NV>
inline void k_unpack_row(const uint8_t* codes, int W, int t, int nt, __m256i* cv) {
  constexpr int per = 8 / KB, NCH = NV / per;
  if (t < nt) {
    const uint8_t* row = codes + static_cast<int64_t>(t) * W;
    for (int k = 0; k < NCH; ++k) unpack16_epi16<KB>(load_codes16(row + 16 * k, W - 16 * k), cv + k * per);
  } else {
    for (int v = 0; v < NV; ++v) cv[v] = _mm256_setzero_si256();
  }
}

// Logits of n tokens of one K group: lg[r*ldl + i] = deq[r] * (qi[r] . c_i) + bias[r]. NV = Dpk / 16.
// Tokens go in pairs: each query vector loaded feeds two tokens, and the pair's sums leave as one hadd.
template <int KB, int NV>
void k_dot_avx2(const Args& a, const uint8_t* codes, int n, int rows, Scratch& s, float* lg, int ldl) {
  const int W = a.Wk;
  const int16_t* __restrict qbase = s.qi.data();
  int32_t* __restrict tmp = s.tmp.data();  // [rows][4 token pairs][8 lanes]
  for (int t8 = 0; t8 < n; t8 += 8) {
    const int nt = std::min(8, n - t8);
    const uint8_t* base = codes + static_cast<int64_t>(t8) * W;
    prefetch_ahead(base + kPrefetchK * W, 8 * W);
    for (int t = 0; t < 8; t += 2) {
      __m256i c0[NV], c1[NV];
      k_unpack_row<KB, NV>(base, W, t, nt, c0);
      k_unpack_row<KB, NV>(base, W, t + 1, nt, c1);
      for (int r = 0; r < rows; ++r) {
        const __m256i* q = reinterpret_cast<const __m256i*>(qbase + r * NV * 16);
        __m256i qv = _mm256_loadu_si256(q);
        __m256i a0 = _mm256_madd_epi16(c0[0], qv), a1 = _mm256_madd_epi16(c1[0], qv);
#pragma GCC unroll 16
        for (int v = 1; v < NV; ++v) {
          qv = _mm256_loadu_si256(q + v);
          a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(c0[v], qv));
          a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(c1[v], qv));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + (r * 4 + t / 2) * 8), _mm256_hadd_epi32(a0, a1));
      }
    }
    finish_logits8(tmp, rows, s, lg + t8, ldl, nt);
  }
}

// Logits over n raw rows (fp32/fp16/bf16, D a multiple of 8): 8 tokens at a time, float hadd tree.
template <typename T>
void k_raw_avx2(const T* base, int n, int rows, int D, Scratch& s, float* lg, int ldl) {
  float* tmp = reinterpret_cast<float*>(s.tmp.data());
  float* krow = s.row.data();
  for (int t8 = 0; t8 < n; t8 += 8) {
    const int nt = std::min(8, n - t8);
    for (int t = 0; t < 8; ++t) {
      if (t < nt) to_float(base + static_cast<int64_t>(t8 + t) * D, krow, D);
      for (int r = 0; r < rows; ++r) {
        __m256 acc = _mm256_setzero_ps();
        if (t < nt) {
          const float* q = s.qsc.data() + r * D;
          for (int c = 0; c < D; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(krow + c), _mm256_loadu_ps(q + c), acc);
        }
        _mm256_storeu_ps(tmp + (r * 8 + t) * 8, acc);
      }
    }
    for (int r = 0; r < rows; ++r) {
      alignas(32) float out[8];
      _mm256_store_ps(out, hsum8x8_ps(tmp + r * 64));
      std::memcpy(lg + r * ldl + t8, out, nt * sizeof(float));
    }
  }
}
#endif

// Portable: the same int16 dot (same integer sums), one token at a time.
template <int KB>
void k_dot_scalar(const Args& a, const uint8_t* codes, int n, int rows, Scratch& s, float* lg, int ldl) {
  constexpr int per = 8 / KB, mask = (1 << KB) - 1;
  const int W = a.Wk, Dp = a.Dpk;
  int16_t* cu = s.crow.data();
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + static_cast<int64_t>(t) * W;
    for (int k = 0; k < a.nchk; ++k)
      for (int j = 0; j < per; ++j)
        for (int i = 0; i < 16; ++i) {
          const int w = 16 * k + i;
          cu[(k * per + j) * 16 + i] = static_cast<int16_t>(w < W ? (row[w] >> (KB * j)) & mask : 0);
        }
    for (int r = 0; r < rows; ++r) {
      const int16_t* q = s.qi.data() + r * Dp;
      int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int u = 0; u < Dp; ++u) acc += static_cast<int32_t>(q[u]) * cu[u];
      lg[r * ldl + t] = s.deq[r] * static_cast<float>(acc) + s.bias[r];
    }
  }
}

template <typename T>
void k_raw_scalar(const T* base, int n, int rows, int D, Scratch& s, float* lg, int ldl) {
  for (int t = 0; t < n; ++t) {
    to_float(base + static_cast<int64_t>(t) * D, s.row.data(), D);
    for (int r = 0; r < rows; ++r) lg[r * ldl + t] = dot(s.qsc.data() + r * D, s.row.data(), D);
  }
}

// ------------------------------------------------------------------------------------------------ V side

// Tokens [t0, n) of v_block_prep for one row, one at a time (pr: the row's weights p, w / zacc its outputs).
inline void v_prep_tail(const Scratch& s, const float* pr, int t0, int n, int ng, float* w, float* zacc) {
  for (int t = t0; t < n; ++t)
    for (int g = 0; g < ng; ++g) {
      w[t * ng + g] = pr[t] * s.sf[t * ng + g];
      zacc[g] += pr[t] * s.zf[t * ng + g];
    }
}

// Per block of n packed tokens: weights wt[r][t*ng + g] = p_rt * s_tg, and zacc[r][g] += sum_t p_rt z_tg.
// (scales and zeros are [tokens, ng] in memory: one block is n*ng contiguous halves, read with F16C.)
inline void v_block_prep(const Args& a, int64_t tok0, int n, int rows, const float* p, int ldl, Scratch& s) {
  const int ng = a.ng, nu = n * ng;
  to_float(a.vs + tok0 * ng, s.sf.data(), nu);
  to_float(a.vz + tok0 * ng, s.zf.data(), nu);
  for (int r = 0; r < rows; ++r) {
    const float* pr = p + r * ldl;
    float* w = s.wt.data() + r * ng * s.BT;
    float* zacc = s.zacc.data() + r * ng;
    int u = 0;
#ifdef __AVX2__
    if (8 % ng == 0) {  // lane l of 8 is token u/ng + l/ng, group l % ng: p expanded by a lane permutation
      const __m256i idx = _mm256_setr_epi32(0, 1 / ng, 2 / ng, 3 / ng, 4 / ng, 5 / ng, 6 / ng, 7 / ng);
      __m256 zs = _mm256_setzero_ps();
      const int step = 8 / ng;  // tokens per 8 lanes
      for (int t = 0; u + 8 <= nu; u += 8, t += step) {
        const __m256 pe = _mm256_permutevar8x32_ps(_mm256_loadu_ps(pr + t), idx);
        _mm256_storeu_ps(w + u, _mm256_mul_ps(pe, _mm256_loadu_ps(s.sf.data() + u)));
        zs = _mm256_fmadd_ps(pe, _mm256_loadu_ps(s.zf.data() + u), zs);
      }
      alignas(32) float z8[8];
      _mm256_store_ps(z8, zs);
      for (int l = 0; l < 8; ++l) zacc[l % ng] += z8[l];
    }
#endif
    v_prep_tail(s, pr, u / ng, n, ng, w, zacc);
  }
}

#ifdef __AVX2__
// One pass of the V loop: NU (1 or 2) "plane units" (16 channels each: 16 code bytes at byte offset off[u],
// bit field j[u]) for NR query rows over n tokens. NU * 2 * NR <= 12 accumulators stay in registers, enough
// independent FMA chains to hide the FMA latency. wt[r] + t*ng + grp[h]: the weight of 8-lane half h
// (ONE: all halves are one V group, so one broadcast per row and token).
template <int VB, int NR, int NU, bool ONE>
inline void v_pass_avx2(const uint8_t* codes, int W, const int* off, const int* j, const int* grp, int n, int ng,
                        const float* const* wt, float* const* acc) {
  __m256 a[NR][2 * NU];
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < 2 * NU; ++h) a[r][h] = _mm256_loadu_ps(acc[r] + 8 * h);
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + static_cast<int64_t>(t) * W;
    if (off[0] == 0) prefetch_ahead(row + kPrefetchV * W, 1);  // once per token: the pass that reads byte 0
    // One unit at a time (2 code vectors live, not 2 * NU): 12 accumulators + 2 + 1 broadcast fit 16 registers.
    for (int u = 0; u < NU; ++u) {
      const __m128i c = code_plane<VB>(load_codes16(row + off[u], W - off[u]), j[u]);
      const __m256 f0 = bytes8_to_ps(c), f1 = bytes8_to_ps(_mm_srli_si128(c, 8));
      for (int r = 0; r < NR; ++r) {
        const float* w = wt[r] + t * ng;
        const __m256 b0 = _mm256_broadcast_ss(w + grp[2 * u]);
        a[r][2 * u] = _mm256_fmadd_ps(f0, b0, a[r][2 * u]);
        a[r][2 * u + 1] = _mm256_fmadd_ps(f1, ONE ? b0 : _mm256_broadcast_ss(w + grp[2 * u + 1]), a[r][2 * u + 1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < 2 * NU; ++h) _mm256_storeu_ps(acc[r] + 8 * h, a[r][h]);
}

// f(std::integral_constant<int, NR>{}, r0) over row blocks of at most MAXR (3 or 4) rows.
template <int MAXR, typename F>
inline void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + MAXR <= rows; r += MAXR) f(std::integral_constant<int, MAXR>{}, r);
  switch (rows - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// accp[r] += sum_t wt[r][t][g] * c_t over n packed tokens (needs wpg % 8 == 0: 8 lanes share one group).
// Plane units (chunk k, field j) in position order, two per pass, rows three at a time.
template <int VB>
void v_acc_avx2(const Args& a, const uint8_t* codes, int n, int rows, Scratch& s) {
  constexpr int per = 8 / VB;
  const int nu = a.nchv * per, ng = a.ng, BT = s.BT;
  for (int u0 = 0; u0 < nu; u0 += 2) {
    int off[2], j[2], grp[4];
    const int cnt = std::min(2, nu - u0);
    for (int u = 0; u < 2; ++u) {
      const int k = (u0 + std::min(u, cnt - 1)) / per;
      off[u] = 16 * k, j[u] = (u0 + std::min(u, cnt - 1)) % per;
      grp[2 * u] = std::min(ng - 1, off[u] / a.wpg), grp[2 * u + 1] = std::min(ng - 1, (off[u] + 8) / a.wpg);
    }
    const bool one = grp[0] == grp[1] && grp[0] == grp[2] && grp[0] == grp[3];
    for_row_blocks<3>(rows, [&](auto nr, int r0) {
      constexpr int NR = decltype(nr)::value;
      const float* wt[NR];
      float* acc[NR];
      for (int r = 0; r < NR; ++r) {
        wt[r] = s.wt.data() + (r0 + r) * ng * BT;
        acc[r] = s.accp.data() + (r0 + r) * a.Dpv + u0 * 16;
      }
      if (cnt == 2 && one) v_pass_avx2<VB, NR, 2, true>(codes, a.Wv, off, j, grp, n, ng, wt, acc);
      else if (cnt == 2) v_pass_avx2<VB, NR, 2, false>(codes, a.Wv, off, j, grp, n, ng, wt, acc);
      else v_pass_avx2<VB, NR, 1, false>(codes, a.Wv, off, j, grp, n, ng, wt, acc);
    });
  }
}

// accn[r] += sum_t p_rt * v_t over n raw rows (D a multiple of 16).
template <typename T>
void v_raw_avx2(const T* base, int D, int n, int rows, const float* p, int ldl, Scratch& s) {
  for (int c = 0; c < D; c += 16) {
    for_row_blocks<4>(rows, [&](auto nr, int r0) {
      constexpr int NR = decltype(nr)::value;
      __m256 lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) {
        lo[r] = _mm256_loadu_ps(s.accn.data() + (r0 + r) * D + c);
        hi[r] = _mm256_loadu_ps(s.accn.data() + (r0 + r) * D + c + 8);
      }
      for (int t = 0; t < n; ++t) {
        const T* row = base + static_cast<int64_t>(t) * D + c;
        const __m256 f0 = load8f(row), f1 = load8f(row + 8);
        for (int r = 0; r < NR; ++r) {
          const __m256 pw = _mm256_broadcast_ss(p + (r0 + r) * ldl + t);
          lo[r] = _mm256_fmadd_ps(f0, pw, lo[r]);
          hi[r] = _mm256_fmadd_ps(f1, pw, hi[r]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        _mm256_storeu_ps(s.accn.data() + (r0 + r) * D + c, lo[r]);
        _mm256_storeu_ps(s.accn.data() + (r0 + r) * D + c + 8, hi[r]);
      }
    });
  }
}
#endif

// Portable V over packed codes (any V group size).
template <int VB>
void v_acc_scalar(const Args& a, const uint8_t* codes, int n, int rows, Scratch& s) {
  constexpr int per = 8 / VB, mask = (1 << VB) - 1;
  const int W = a.Wv, BT = s.BT, ng = a.ng, Dp = a.Dpv;
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + static_cast<int64_t>(t) * W;
    for (int r = 0; r < rows; ++r) {
      float* acc = s.accp.data() + r * Dp;
      const float* w = s.wt.data() + r * ng * BT + t * ng;
      for (int k = 0; k < a.nchv; ++k)
        for (int i = 0; i < 16 && 16 * k + i < W; ++i) {
          const int byte = row[16 * k + i];
          const float wg = w[(16 * k + i) / a.wpg];
          for (int j = 0; j < per; ++j) acc[(k * per + j) * 16 + i] += wg * static_cast<float>((byte >> (VB * j)) & mask);
        }
    }
  }
}

template <typename T>
void v_raw_scalar(const T* base, int D, int n, int rows, const float* p, int ldl, Scratch& s) {
  for (int t = 0; t < n; ++t) {
    to_float(base + static_cast<int64_t>(t) * D, s.row.data(), D);
    for (int r = 0; r < rows; ++r) axpy(p[r * ldl + t], s.row.data(), s.accn.data() + r * D, D);
  }
}

}  // namespace moend
