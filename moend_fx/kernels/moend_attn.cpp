// Fused CPU attention over one compressed layer (packed K/V + residual window; V may have none).
//
// One pass over the held tokens per work unit = (batch row x KV head, token split, block of query rows):
// logits of a block of tokens for every query row of the GQA group (integer dots against the K codes), online
// softmax, V accumulation (codes widened in registers). The layer is never materialised. Token splits are
// merged by log-sum-exp. An optional padding mask (bool [B, 1 or H, L, S], ANDed with the causal limit) hides
// tokens: their logits become -inf and their weights exactly 0, a block it hides from every row of a unit is
// skipped, a block it shows to every row runs unmasked, and a row it hides everything from gives 0 (as the
// reference). Units run on torch's OpenMP pool (at::parallel_for; built with -fopenmp against the libgomp torch
// loads). The inner loops and their maths are in moend_attn_loops.h.
//
// Registered as torch.ops.<MOEND_OP_NS>.packed_attention (default moend_cpu); moend_fx/kernels/ops.py makes it
// the CPU implementation of torch.ops.moend.packed_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "moend_attn_loops.h"
#include "moend_attn_avx512.h"

#ifndef MOEND_OP_NS
#define MOEND_OP_NS moend_cpu
#endif

namespace moend {
namespace {

// Logits of packed tokens [t0, t0+n) for `rows` query rows -> s.lg[r*ldl + i].
using KFn = void (*)(const Args&, int64_t bkv, int t0, int n, int rows, Scratch&, int ldl);
// Accumulate sum_i p[r*ldl + i] * v_{t0+i} into the unit's accumulators.
using VFn = void (*)(const Args&, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, Scratch&);

constexpr bool kAvx2 =
#ifdef __AVX2__
    true;
#else
    false;
#endif

// NV = Dpk / 16 for the AVX2 K loop, 0 = portable.
template <int KB, int NV>
void k_quantized(const Args& a, int64_t bkv, int t0, int n, int rows, Scratch& s, int ldl) {
  const uint8_t* codes = static_cast<const uint8_t*>(a.kp) + (bkv * a.P + t0) * a.Wk;
  const int64_t gbase = bkv * (a.P / a.G);
  for (int i0 = 0; i0 < n; i0 += a.G) {  // blocks start on a group boundary and hold whole groups
    const int64_t g = gbase + (t0 + i0) / a.G;
    const int m = std::min(a.G, n - i0);
#ifdef MOEND_AVX512
    if constexpr (NV == 2 || NV == 4 || NV == 8) {
#ifdef MOEND_VNNI
      if (a.D % 16 == 0 && a.Wk % 16 == 0) {
        k_group_prep_avx512<KB, NV / 2, true>(a, rows, a.ks + g * a.D, a.kz + g * a.D, s);
        k_dot_vnni<KB, NV / 2>(a, codes + static_cast<int64_t>(i0) * a.Wk, m, rows, s, s.lg.data() + i0, ldl);
        continue;
      }
#endif
      if (a.D % 16 == 0) k_group_prep_avx512<KB, NV / 2>(a, rows, a.ks + g * a.D, a.kz + g * a.D, s);
      else k_group_prep(a, rows, a.ks + g * a.D, a.kz + g * a.D, s);
      k_dot_avx512<KB, NV / 2>(a, codes + static_cast<int64_t>(i0) * a.Wk, m, rows, s, s.lg.data() + i0, ldl);
      continue;
    }
#endif
    k_group_prep(a, rows, a.ks + g * a.D, a.kz + g * a.D, s);
#ifdef __AVX2__
    if constexpr (NV > 0) {
      k_dot_avx2<KB, NV>(a, codes + static_cast<int64_t>(i0) * a.Wk, m, rows, s, s.lg.data() + i0, ldl);
      continue;
    }
#endif
    k_dot_scalar<KB>(a, codes + static_cast<int64_t>(i0) * a.Wk, m, rows, s, s.lg.data() + i0, ldl);
  }
}

template <typename T>
void k_rows(const Args& a, const T* base, int n, int rows, Scratch& s, int ldl) {
#ifdef __AVX2__
  if (a.D % 8 == 0) return k_raw_avx2<T>(base, n, rows, a.D, s, s.lg.data(), ldl);
#endif
  k_raw_scalar<T>(base, n, rows, a.D, s, s.lg.data(), ldl);
}

template <typename T>
void k_raw(const Args& a, int64_t bkv, int t0, int n, int rows, Scratch& s, int ldl) {
  k_rows<T>(a, static_cast<const T*>(a.kp) + (bkv * a.P + t0) * a.D, n, rows, s, ldl);
}

template <typename T>
void k_residual(const Args& a, int64_t bkv, int t0, int n, int rows, Scratch& s, int ldl) {
  k_rows<T>(a, static_cast<const T*>(a.kr) + (bkv * a.R + (t0 - a.P)) * a.D, n, rows, s, ldl);
}

template <int VB>
void v_quantized(const Args& a, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, Scratch& s) {
  const int64_t tok0 = bkv * a.Pv + t0;
  const uint8_t* codes = static_cast<const uint8_t*>(a.vp) + tok0 * a.Wv;
#ifdef MOEND_VNNI_V
  if constexpr (VB != 8) {
    if (a.wpg % 16 == 0 && a.Wv % 16 == 0 && a.Wv <= kVnniMaxW) return v_acc_vnni<VB>(a, codes, n, rows, p, ldl, s, tok0);
  }
#endif
#ifdef MOEND_AVX512
  if (16 % a.ng == 0) v_block_prep_avx512(a, tok0, n, rows, p, ldl, s);
  else v_block_prep(a, tok0, n, rows, p, ldl, s);
#else
  v_block_prep(a, tok0, n, rows, p, ldl, s);
#endif
#ifdef MOEND_AVX512
  if (a.wpg % 16 == 0 && a.Wv % 16 == 0) return v_acc_avx512<VB>(a, codes, n, rows, s);
#endif
#ifdef __AVX2__
  if (a.wpg % 8 == 0) return v_acc_avx2<VB>(a, codes, n, rows, s);
#endif
  v_acc_scalar<VB>(a, codes, n, rows, s);
}

template <typename T>
void v_rows(const Args& a, const T* base, int n, int rows, const float* p, int ldl, Scratch& s) {
#ifdef __AVX2__
  if (a.D % 16 == 0) return v_raw_avx2<T>(base, a.D, n, rows, p, ldl, s);
#endif
  v_raw_scalar<T>(base, a.D, n, rows, p, ldl, s);
}

template <typename T>
void v_raw(const Args& a, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, Scratch& s) {
  v_rows<T>(a, static_cast<const T*>(a.vp) + (bkv * a.Pv + t0) * a.D, n, rows, p, ldl, s);
}

template <typename T>
void v_residual(const Args& a, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, Scratch& s) {
  v_rows<T>(a, static_cast<const T*>(a.vr) + (bkv * a.Rv + (t0 - a.Pv)) * a.D, n, rows, p, ldl, s);
}

template <int KB>
KFn pick_k_nv(int nv) {
  if constexpr (kAvx2) {
    switch (nv) {
      case 2: return &k_quantized<KB, 2>;
      case 4: return &k_quantized<KB, 4>;
      case 8: return &k_quantized<KB, 8>;
      case 16: return &k_quantized<KB, 16>;
      default: break;
    }
  }
  return &k_quantized<KB, 0>;
}

template <typename T>
KFn pick_k(const Args& a) {
  switch (a.kbits) {
    case 2: return pick_k_nv<2>(a.Dpk / 16);
    case 4: return pick_k_nv<4>(a.Dpk / 16);
    case 8: return pick_k_nv<8>(a.Dpk / 16);
    default: return &k_raw<T>;
  }
}

template <typename T>
VFn pick_v(const Args& a) {
  switch (a.vbits) {
    case 2: return &v_quantized<2>;
    case 4: return &v_quantized<4>;
    case 8: return &v_quantized<8>;
    default: return &v_raw<T>;
  }
}

// How run() divides the work: a unit is (batch row x KV head, query block of MB rows, token split of `chunk`
// tokens); its partial result is MB rows of (acc[D], m, l), `stride` floats.
struct Work {
  int M, MB, nqb, BT, ns, chunk, stride;
  int64_t base_units, units;
};

Work plan_work(const Args& a, int num_splits) {
  Work w{};
  w.M = a.Gq * a.L;  // query rows of one GQA group: row m = head (m / L), query (m % L)
  w.MB = std::min(w.M, 32);
  w.nqb = (w.M + w.MB - 1) / w.MB;
  // Token block: a multiple of G so packed blocks never straddle a split boundary mid-group.
  w.BT = std::max(a.G, 128);
  w.base_units = static_cast<int64_t>(a.B) * a.Hkv * w.nqb;
  const int nblocks = std::max(1, (a.S + w.BT - 1) / w.BT);
  int ns = num_splits;
  if (ns <= 0) {
    // Enough units to keep every thread busy (a multiple of the thread count), each split >= 4 blocks long.
    const int nt = std::max(1, at::get_num_threads());
    const int max_ns = std::max(1, nblocks / 4);
    ns = static_cast<int>(std::min<int64_t>(max_ns, (4 * nt + w.base_units - 1) / w.base_units));
    while (ns < max_ns && (w.base_units * ns) % nt != 0) ++ns;
  }
  ns = std::max(1, std::min(ns, nblocks));
  w.chunk = ((nblocks + ns - 1) / ns) * w.BT;
  w.ns = std::max(1, (a.S + w.chunk - 1) / w.chunk);
  w.units = w.base_units * w.ns;
  w.stride = w.MB * (a.D + 2);
  return w;
}

// Largest of the first n logits.
inline float block_max(const float* lg, int n) {
  float mx = kNegInf;
  int i = 0;
#ifdef MOEND_AVX512
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(lg);
    for (i = 16; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(lg + i));
    mx = _mm512_reduce_max_ps(v);
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(lg);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(lg + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, lg[i]);
  return mx;
}

// exp(lg - m) in place for the first nvalid entries (16 or 8 lanes at a time), 0 for the rest of n; returns the sum.
inline float exp_block(float* lg, int n, int nvalid, float m) {
  float sum = 0.f;
  int i = 0;
#ifdef __AVX2__
  // 16 lanes (one zmm) on the AVX-512 tier, 8 otherwise: the same per-lane arithmetic, the sum folded in another
  // order
#ifdef MOEND_AVX512
  constexpr int kLanes = 16;
#else
  constexpr int kLanes = 8;
#endif
  typedef float v8f __attribute__((vector_size(4 * kLanes)));
  typedef int32_t v8i __attribute__((vector_size(4 * kLanes)));
  v8f vs = v8f{};
  for (; i + kLanes <= nvalid; i += kLanes) {
    v8f x;
    std::memcpy(&x, lg + i, sizeof(x));
    x -= m;
    const v8f lo = v8f{} - 87.0f;
    x = x < lo ? lo : x;
    const v8f t = x * 1.44269504088896341f;
    v8i ti = __builtin_convertvector(t, v8i);
    ti += (__builtin_convertvector(ti, v8f) > t);  // floor for t <= 0 (comparison lanes are -1 where true)
    v8f e = exp2_frac(t - __builtin_convertvector(ti, v8f));
    v8i ei;
    std::memcpy(&ei, &e, sizeof(ei));
    ei += ti << 23;
    std::memcpy(&e, &ei, sizeof(e));
    std::memcpy(lg + i, &e, sizeof(e));
    vs += e;
  }
#ifdef MOEND_AVX512
  sum = _mm512_reduce_add_ps(reinterpret_cast<__m512>(vs));
#else
  sum = ((vs[0] + vs[4]) + (vs[1] + vs[5])) + ((vs[2] + vs[6]) + (vs[3] + vs[7]));
#endif
#endif
  for (; i < nvalid; ++i) {
    lg[i] = exp_nonpos(lg[i] - m);
    sum += lg[i];
  }
  for (; i < n; ++i) lg[i] = 0.f;
  return sum;
}

// Masked logits of one row -> -inf over the first nvalid of a block (mk: the row's mask at the block's first
// token); returns nvalid, or 0 when the mask hides all of them.
inline int mask_logits(float* lg, const uint8_t* mk, int nvalid) {
  uint8_t any = 0;
#pragma omp simd reduction(| : any)
  for (int i = 0; i < nvalid; ++i) {
    any |= mk[i];
    lg[i] = mk[i] ? lg[i] : kNegInf;
  }
  return any ? nvalid : 0;
}

// exp_block, then exactly 0 for the masked entries (exp_block clamps -inf to exp(-87)); returns the sum.
inline float exp_block_masked(float* lg, const uint8_t* mk, int n, int nvalid, float m) {
  exp_block(lg, n, nvalid, m);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < nvalid; ++i) {
    lg[i] *= static_cast<float>(mk[i] != 0);
    sum += lg[i];
  }
  return sum;
}

// One online-softmax step of query row r over a block of n logits (nvalid visible by the causal limit; mk: the
// row's padding mask at the block's first token, or null): the logits become the unnormalised probabilities,
// the running (m, l) and the row's accumulators are rescaled to the new max.
inline void softmax_step(const Args& a, Scratch& s, int r, int n, int nvalid, const uint8_t* mk, float& m,
                         float& l) {
  float* lg = s.lg.data() + r * s.BT;
  if (mk != nullptr) nvalid = mask_logits(lg, mk, nvalid);
  if (nvalid == 0) {
    std::fill(lg, lg + n, 0.f);  // p = 0: this row sees none of the block
    return;
  }
  const float mnew = std::max(m, block_max(lg, nvalid));
  const float alpha = std::exp(m - mnew);  // 0 when m was -inf
  if (alpha != 1.f) {
    scale_row(s.accn.data() + r * a.D, a.D, alpha);
    scale_row(s.accp.data() + r * a.Dpv, a.Dpv, alpha);
    scale_row(s.zacc.data() + r * a.ng, a.ng, alpha);
  }
  l = l * alpha + (mk != nullptr ? exp_block_masked(lg, mk, n, nvalid, mnew) : exp_block(lg, n, nvalid, mnew));
  m = mnew;
}

// What the padding mask does to tokens [t0, t0 + n) for the unit's rows: hides them from every row (the block is
// skipped), shows them to every row (the block runs as unmasked), or neither.
enum class BlockMask { kHidden, kVisible, kMixed };
inline BlockMask block_mask(const uint8_t* const* mrows, int rows, int t0, int n) {
  uint8_t any = 0, all = 1;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* mk = mrows[r] + t0;
#pragma omp simd reduction(| : any) reduction(& : all)
    for (int i = 0; i < n; ++i) any |= mk[i], all &= mk[i];
  }
  return !any ? BlockMask::kHidden : all ? BlockMask::kVisible : BlockMask::kMixed;
}

// Unit u's query rows, scaled, in natural and in K position order; returns each row's last visible key and (with
// a padding mask) where its mask row starts.
void load_queries(const Args& a, int64_t b, int64_t kvh, int m0, int rows, Scratch& s, int* limit,
                  const uint8_t** mrows) {
  const int D = a.D;
  for (int r = 0; r < rows; ++r) {
    const int m = m0 + r, h = static_cast<int>(kvh) * a.Gq + m / a.L, l = m % a.L;
    const float* qsrc = a.q + ((b * a.H + h) * a.L + l) * D;
    for (int d = 0; d < D; ++d) s.qsc[r * D + d] = qsrc[d] * a.scale;
    for (int u = 0; u < a.Dpk; ++u) s.qperm[r * a.Dpk + u] = a.permk[u] >= 0 ? s.qsc[r * D + a.permk[u]] : 0.f;
    // bottom-right causal mask: query l of the newest L tokens sees keys j <= S - L + l
    limit[r] = (a.causal && a.L > 1) ? a.S - a.L + l : a.S - 1;
    mrows[r] = a.mask != nullptr ? a.mask + b * a.msb + h * a.msh + l * a.msl : nullptr;
  }
}

// The unit's accumulators in channel order: accn + accp (positions) + the V zero sums, into acc [rows, D].
void finish_unit(const Args& a, int rows, const Scratch& s, float* acc) {
  const int D = a.D;
  for (int r = 0; r < rows; ++r) {
    float* o = acc + r * D;
    for (int d = 0; d < D; ++d) o[d] = s.accn[r * D + d];
    if (a.vbits == 16) continue;
    for (int u = 0; u < a.Dpv; ++u)
      if (a.permv[u] >= 0) o[a.permv[u]] += s.accp[r * a.Dpv + u];
    for (int d = 0; d < D; ++d) o[d] += s.zacc[r * a.ng + d / a.Gv];
  }
}

// Prefetch the scales and zeros of tokens [t, t + n) (K: their groups' rows, V: theirs): two short streams
// beside the code streams, read in a burst once per block, that the loops' code prefetches do not cover.
inline void prefetch_scales(const Args& a, int64_t bkv, int t, int n) {
#ifdef __AVX2__
  if (a.kbits != 16 && t < a.P) {
    const int64_t off = (bkv * (a.P / a.G) + t / a.G) * a.D;
    const int bytes = std::max(1, n / a.G) * a.D * 2;
    prefetch_ahead(reinterpret_cast<const uint8_t*>(a.ks + off), bytes);
    prefetch_ahead(reinterpret_cast<const uint8_t*>(a.kz + off), bytes);
  }
  if (a.vbits != 16 && t < a.Pv) {
    const int64_t off = (bkv * a.Pv + t) * a.ng;
    prefetch_ahead(reinterpret_cast<const uint8_t*>(a.vs + off), n * a.ng * 2);
    prefetch_ahead(reinterpret_cast<const uint8_t*>(a.vz + off), n * a.ng * 2);
  }
#endif
}

// Work unit u: attend its query rows over its token split, leaving (acc, m, l) partials in `part`.
template <typename T>
void attend_unit(const Args& a, const Work& w, int64_t u, Scratch& s, float* part, KFn kfn, VFn vfn) {
  const int D = a.D, MB = w.MB, BT = w.BT;
  const int split = static_cast<int>(u % w.ns);
  const int qb = static_cast<int>((u / w.ns) % w.nqb);
  const int64_t bkv = u / (static_cast<int64_t>(w.ns) * w.nqb);  // b * Hkv + kv head
  const int m0 = qb * MB, rows = std::min(MB, w.M - m0);
  float* acc = part + u * w.stride;
  float* mrow = acc + MB * D;
  float* lrow = mrow + MB;
  std::fill(s.accn.begin(), s.accn.end(), 0.f);
  std::fill(s.accp.begin(), s.accp.end(), 0.f);
  std::fill(s.zacc.begin(), s.zacc.end(), 0.f);
  int limit[32];
  const uint8_t* mrows[32];
  load_queries(a, bkv / a.Hkv, bkv % a.Hkv, m0, rows, s, limit, mrows);
  const int max_limit = *std::max_element(limit, limit + rows);
  for (int r = 0; r < rows; ++r) mrow[r] = kNegInf, lrow[r] = 0.f;
  const int t_begin = split * w.chunk, t_end = std::min(a.S, (split + 1) * w.chunk);
  for (int t0 = t_begin; t0 < t_end && t0 <= max_limit;) {
    // A block lies wholly in the packed region or wholly in the residual window.
    const int t1 = t0 < a.P ? std::min({t_end, a.P, t0 + BT}) : std::min(t_end, t0 + BT);
    const int n = t1 - t0;
    const bool packed = t0 < a.P;
    const BlockMask bm = a.mask != nullptr ? block_mask(mrows, rows, t0, n) : BlockMask::kVisible;
    if (bm == BlockMask::kHidden) {  // e.g. left padding: no work, p = 0
      t0 = t1;
      continue;
    }
    prefetch_scales(a, bkv, t0 + 2 * BT, BT);
    (packed ? kfn : &k_residual<T>)(a, bkv, t0, n, rows, s, BT);
    for (int r = 0; r < rows; ++r)
      softmax_step(a, s, r, n, std::max(0, std::min(n, limit[r] - t0 + 1)),
                   bm == BlockMask::kMixed ? mrows[r] + t0 : nullptr, mrow[r], lrow[r]);
    // V packed on arrival (Rv = 0) reads its codes for the residual window's tokens too
    (packed || a.Rv == 0 ? vfn : &v_residual<T>)(a, bkv, t0, n, rows, s.lg.data(), BT, s);
    t0 = t1;
  }
  finish_unit(a, rows, s, acc);
}

// Merge the token splits (log-sum-exp) into out [B, H, L, D].
void merge_splits(const Args& a, const Work& w, const float* part, float* out) {
  const int D = a.D, MB = w.MB, ns = w.ns, stride = w.stride;
  // Parallel only for many (batch x KV head) rows: a parallel region costs more than merging a few.
  at::parallel_for(0, w.base_units, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bu = begin; bu < end; ++bu) {
      const int qb = static_cast<int>(bu % w.nqb);
      const int64_t bkv = bu / w.nqb;
      const int64_t b = bkv / a.Hkv, kvh = bkv % a.Hkv;
      const int m0 = qb * MB, rows = std::min(MB, w.M - m0);
      for (int r = 0; r < rows; ++r) {
        const int m = m0 + r, h = static_cast<int>(kvh) * a.Gq + m / a.L, l = m % a.L;
        float* o = out + ((b * a.H + h) * a.L + l) * D;
        std::fill(o, o + D, 0.f);
        float mmax = kNegInf, lsum = 0.f;
        for (int sp = 0; sp < ns; ++sp) mmax = std::max(mmax, part[(bu * ns + sp) * stride + MB * D + r]);
        if (mmax != kNegInf) {
          for (int sp = 0; sp < ns; ++sp) {
            const float* pp = part + (bu * ns + sp) * stride;
            const float ms = pp[MB * D + r];
            if (ms == kNegInf) continue;
            const float wt = std::exp(ms - mmax);
            lsum += wt * pp[MB * D + MB + r];
            axpy(wt, pp + r * D, o, D);
          }
        }
        scale_row(o, D, lsum > 0.f ? 1.f / lsum : 0.f);  // no visible key -> 0, like the reference
      }
    }
  });
}

template <typename T>
void run(const Args& a, float* out, int num_splits) {
  const Work w = plan_work(a, num_splits);
  std::vector<float> part(static_cast<size_t>(w.units) * w.stride);
  const KFn kfn = pick_k<T>(a);
  const VFn vfn = pick_v<T>(a);
  at::parallel_for(0, w.units, 1, [&](int64_t begin, int64_t end) {
    Scratch s(a, w.MB, w.BT);
    for (int64_t u = begin; u < end; ++u) attend_unit<T>(a, w, u, s, part.data(), kfn, vfn);
  });
  merge_splits(a, w, part.data(), out);
}

// Position order of a side with `bits` (see moend_attn_loops.h): position -> channel or -1; sets nch and Dp.
std::vector<int> positions(int D, int bits, int& nch, int& Dp) {
  const int per = bits == 16 ? 1 : 8 / bits, W = D / per;
  nch = (W + 15) / 16;
  Dp = nch * 16 * per;
  std::vector<int> perm(Dp, -1);
  for (int k = 0; k < nch; ++k)
    for (int j = 0; j < per; ++j)
      for (int i = 0; i < 16; ++i)
        if (16 * k + i < W) perm[(k * per + j) * 16 + i] = (16 * k + i) * per + j;
  return perm;
}

// A side's storage: uint8 codes with fp16 scales and zeros, or (16-bit) raw rows in its residual's dtype.
void check_side_dtypes(const char* side, const char* res_name, int64_t bits, const at::Tensor& packed,
                       const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& res, int P) {
  if (bits != 16) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf &&
                    zero.scalar_type() == at::kHalf, side, " codes uint8, scales fp16");
  } else {
    TORCH_CHECK(P == 0 || packed.scalar_type() == res.scalar_type(), "raw ", side, " dtype must match ", res_name);
  }
}

void fill_shapes(Args& a, const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_res,
                 const at::Tensor& v_packed, const at::Tensor& v_res, int64_t k_bits, int64_t v_bits,
                 int64_t group_size) {
  a.B = q.size(0), a.H = q.size(1), a.L = q.size(2), a.D = q.size(3);
  a.Hkv = k_res.size(1);
  TORCH_CHECK(a.H % a.Hkv == 0, "query heads must be a multiple of KV heads");
  a.Gq = a.H / a.Hkv;
  a.P = k_packed.size(2), a.R = k_res.size(2), a.S = a.P + a.R;
  a.Rv = v_res.size(2), a.Pv = a.S - a.Rv;
  TORCH_CHECK(v_res.dim() == 4 && (a.Rv == a.R || a.Rv == 0) && v_packed.size(2) == a.Pv,
              "V must be split like K or have no residual (packed on arrival)");
  a.G = static_cast<int>(group_size);
  a.Gv = std::min(a.G, a.D);
  a.kbits = static_cast<int>(k_bits), a.vbits = static_cast<int>(v_bits);
  a.kper = k_bits == 16 ? 1 : 8 / k_bits;
  a.vper = v_bits == 16 ? 1 : 8 / v_bits;
  a.Wk = a.D / a.kper, a.Wv = a.D / a.vper;
  TORCH_CHECK(a.D % a.kper == 0 && a.D % a.vper == 0 && a.Gv % a.vper == 0, "unsupported head_dim/group");
  TORCH_CHECK(a.P % a.G == 0, "packed tokens must be a multiple of group_size");
  a.permk = positions(a.D, a.kbits, a.nchk, a.Dpk);
  a.permv = positions(a.D, a.vbits, a.nchv, a.Dpv);
  a.gatherk.resize(a.Dpk);
  for (int u = 0; u < a.Dpk; ++u) a.gatherk[u] = a.permk[u] >= 0 ? a.permk[u] : a.D;
  a.ng = a.D / a.Gv;
  a.wpg = a.Gv / a.vper;
  const int maxcode = a.kbits == 16 ? 1 : (1 << a.kbits) - 1;
  // 32639 = 127 * 256 + 127: the largest |qi| whose int8 halves (the VNNI K loop) fit; every loop uses it, so
  // the tiers round q alike.
  a.qmax = static_cast<float>(std::min<int64_t>(32639, 2147483647LL / (int64_t{a.Dpk} * maxcode)));
}

// The padding mask's row pointer and strides (null when there is none): bool [B, 1 or H, L, S], tokens contiguous.
void fill_mask(Args& a, const std::optional<at::Tensor>& mask) {
  a.mask = nullptr, a.msb = a.msh = a.msl = 0;
  if (!mask.has_value()) return;
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == a.B &&
                  (m.size(1) == 1 || m.size(1) == a.H) && m.size(2) == a.L && m.size(3) == a.S,
              "mask: bool [B, 1 or H, L, S]");
  TORCH_CHECK(a.S <= 1 || m.stride(3) == 1, "mask: tokens (last dim) must be contiguous");
  a.mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
  a.msb = m.stride(0), a.msh = m.size(1) == 1 ? 0 : m.stride(1), a.msl = m.stride(2);
}

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
                            const at::Tensor& k_zero, const at::Tensor& v_packed, const at::Tensor& v_scale,
                            const at::Tensor& v_zero, const at::Tensor& k_res, const at::Tensor& v_res,
                            int64_t k_bits, int64_t v_bits, int64_t group_size, double scale, bool causal,
                            const std::optional<at::Tensor>& mask, int64_t num_splits) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous fp32 [B,H,L,D]");
  TORCH_CHECK(k_res.dim() == 4 && k_res.is_contiguous() && v_res.is_contiguous() && v_packed.dim() == 4,
              "k_res/v_res: contiguous");
  TORCH_CHECK(k_res.scalar_type() == v_res.scalar_type(), "k_res and v_res dtypes differ");
  Args a{};
  fill_shapes(a, q, k_packed, k_res, v_packed, v_res, k_bits, v_bits, group_size);
  a.causal = causal;
  a.scale = static_cast<float>(scale);
  fill_mask(a, mask);
  for (const at::Tensor* t : {&k_packed, &k_scale, &k_zero, &v_packed, &v_scale, &v_zero})
    TORCH_CHECK(t->is_contiguous(), "packed tensors must be contiguous");
  check_side_dtypes("K", "k_res", k_bits, k_packed, k_scale, k_zero, k_res, a.P);
  check_side_dtypes("V", "v_res", v_bits, v_packed, v_scale, v_zero, v_res, a.Pv);
  a.q = q.data_ptr<float>();
  a.kp = k_packed.data_ptr();
  a.vp = v_packed.data_ptr();
  a.ks = k_bits != 16 ? k_scale.data_ptr<at::Half>() : nullptr;
  a.kz = k_bits != 16 ? k_zero.data_ptr<at::Half>() : nullptr;
  a.vs = v_bits != 16 ? v_scale.data_ptr<at::Half>() : nullptr;
  a.vz = v_bits != 16 ? v_zero.data_ptr<at::Half>() : nullptr;
  a.kr = k_res.data_ptr();
  a.vr = v_res.data_ptr();
  at::Tensor out = at::empty({a.B, a.H, a.L, a.D}, q.options());
  if (a.S == 0) return out.zero_();
  const int ns = static_cast<int>(num_splits);
  switch (k_res.scalar_type()) {
    case at::kFloat: run<float>(a, out.data_ptr<float>(), ns); break;
    case at::kHalf: run<at::Half>(a, out.data_ptr<float>(), ns); break;
    case at::kBFloat16: run<at::BFloat16>(a, out.data_ptr<float>(), ns); break;
    default: TORCH_CHECK(false, "residual dtype must be float32, float16 or bfloat16");
  }
  return out;
}

}  // namespace
}  // namespace moend

// One level of indirection so that MOEND_OP_NS is expanded before TORCH_LIBRARY pastes it.
#define MOEND_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
MOEND_TORCH_LIBRARY(MOEND_OP_NS, m) {
  m.def(
      "packed_attention(Tensor q, Tensor k_packed, Tensor k_scale, Tensor k_zero, Tensor v_packed, "
      "Tensor v_scale, Tensor v_zero, Tensor k_res, Tensor v_res, int k_bits, int v_bits, int group_size, "
      "float scale, bool causal, Tensor? mask, int num_splits) -> Tensor");
  m.impl("packed_attention", c10::DispatchKey::CPU, TORCH_FN(moend::packed_attention));
}
