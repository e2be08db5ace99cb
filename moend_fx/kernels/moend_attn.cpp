// Fused CPU attention over one compressed layer (packed K/V + residual window).
//
// One pass over the held tokens per (batch, KV head, token split, query block): unpack the codes of a
// token, dequantize, dot with every query row of the GQA group, online softmax, accumulate V. The layer is
// never materialised: the only buffers are a few rows of D floats per work unit.
//
// Layout (docs/cache-format.md): codes are packed along head_dim, value j of byte w is channel w*per + j
// (per = 8 / bits). Unpacking into the *permuted* order `j*W + w` turns a row into `per` contiguous,
// vectorisable passes over its W bytes; the query (K side) and the accumulator (V side) live in the same
// permuted order, and the output is un-permuted once at the end.
//
// K is quantized per channel (scale/zero per group of G tokens and channel), so within a K group
//   q . k_t = sum_d (q_d s_d) c_td + sum_d q_d z_d
// and the (q*s, q.z) pair is computed once per group instead of dequantizing every key.
//
// Registered as torch.ops.moend_cpu.packed_attention; moend_fx/kernels/ops.py makes it the CPU
// implementation of torch.ops.moend.packed_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// 2^f for f in [0, 1), on one float or on 8 lanes (v8f): a degree-6 polynomial (relative error ~1e-7, below
// fp32 accumulation noise here).
template <typename V>
inline V exp2_frac(V f) {
  V p = V{} + 2.1871262e-04f;
  p = p * f + 1.2382416e-03f;
  p = p * f + 9.6861860e-03f;
  p = p * f + 5.5478912e-02f;
  p = p * f + 2.4023110e-01f;
  p = p * f + 6.9314682e-01f;
  p = p * f + 1.0f;
  return p;
}

// exp(x) for x <= 0 (logit minus the running max), vectorisable: 2^t = 2^floor(t) * 2^frac(t).
inline float exp_nonpos(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float p = exp2_frac(t - fi);
  return std::bit_cast<float>(std::bit_cast<int32_t>(p) + (static_cast<int32_t>(fi) << 23));
}

// GCC/Clang vector extensions: 8 floats, lowered to AVX2 where compiled with it and emulated otherwise.
// The auto-vectoriser handled the multi-row reductions below poorly, so they are written out.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp_nonpos on 8 lanes; floor via truncation (t <= 0, so floor = trunc - (trunc > t)).
inline v8f exp8_nonpos(v8f x) {
  const v8f lo = v8f{} - 87.0f;
  x = x < lo ? lo : x;
  const v8f t = x * 1.44269504088896341f;
  v8i ti = __builtin_convertvector(t, v8i);
  v8f tf = __builtin_convertvector(ti, v8f);
  ti += (tf > t);  // comparison lanes are -1 where true
  tf = __builtin_convertvector(ti, v8f);
  v8f p = exp2_frac(t - tf);
  v8i pi;
  std::memcpy(&pi, &p, sizeof(pi));
  pi += ti << 23;
  std::memcpy(&p, &pi, sizeof(p));
  return p;
}

// out[r * ldl] = Q[r] . c + bias[r] for NR rows at once, so each element of c is loaded once.
template <int NR>
inline void dot_rows_n(const float* __restrict Q, int D, const float* __restrict c, float* __restrict out,
                       int ldl, const float* bias) {
  float s[NR];
  if (D % 8 == 0) {
    v8f acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = v8f{};
    for (int i = 0; i < D; i += 8) {
      const v8f ci = load8(c + i);
      for (int r = 0; r < NR; ++r) acc[r] += load8(Q + r * D + i) * ci;
    }
    for (int r = 0; r < NR; ++r) s[r] = hsum8(acc[r]);
  } else {
    for (int r = 0; r < NR; ++r) s[r] = dot(Q + r * D, c, D);
  }
  for (int r = 0; r < NR; ++r) out[r * ldl] = s[r] + (bias ? bias[r] : 0.f);
}

// f(std::integral_constant<int, NR>{}, r) for the query rows [r, r + NR) of `rows`: blocks of 4, then the 1 to 3
// rows left, so that every call works on a row count known at compile time.
template <typename F>
inline void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

inline void dot_rows(const float* Q, int rows, int D, const float* c, float* out, int ldl, const float* bias) {
  for_row_blocks(rows, [&](auto nr, int r) {
    dot_rows_n<decltype(nr)::value>(Q + r * D, D, c, out + r * ldl, ldl, bias ? bias + r : nullptr);
  });
}

// acc[r] += p[r * ldl] * v for NR rows at once.
template <int NR>
inline void axpy_rows_n(const float* __restrict p, int ldl, const float* __restrict v, float* __restrict acc,
                        int D) {
  float pr[NR];
  for (int r = 0; r < NR; ++r) pr[r] = p[r * ldl];
#pragma omp simd
  for (int i = 0; i < D; ++i) {
    const float vi = v[i];
    for (int r = 0; r < NR; ++r) acc[r * D + i] += pr[r] * vi;
  }
}

template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Row i of raw [n, D] storage as fp32: the row itself when it is stored as float, else converted into buf.
template <typename T>
inline const float* row_as_float(const T* base, int i, int D, float* buf) {
  const T* src = base + static_cast<int64_t>(i) * D;
  if constexpr (std::is_same<T, float>::value) {
    return src;
  } else {
    to_float(src, buf, D);
    return buf;
  }
}

// Unpack one row of W bytes into D = W * per floats, permuted order j*W + w.
template <int BITS>
inline void unpack_row(const uint8_t* __restrict row, float* __restrict out, int W) {
  constexpr int per = 8 / BITS;
  constexpr int mask = (1 << BITS) - 1;
  for (int j = 0; j < per; ++j) {
    float* __restrict o = out + j * W;
#pragma omp simd
    for (int w = 0; w < W; ++w) o[w] = static_cast<float>((row[w] >> (BITS * j)) & mask);
  }
}

struct Args {
  int B, H, Hkv, Gq, L, D, P, R, S, G, Gv;
  int kbits, vbits, kper, vper, Wk, Wv;
  bool causal;
  float scale;
  const float* q;  // [B, H, L, D] fp32
  const void* kp;  // codes [B, Hkv, P, Wk] uint8, or raw [B, Hkv, P, D] T
  const at::Half* ks;
  const at::Half* kz;  // [B, Hkv, P/G, D]
  const void* vp;
  const at::Half* vs;
  const at::Half* vz;  // [B, Hkv, P, D/Gv]
  const void* kr;
  const void* vr;  // [B, Hkv, R, D] T
};

// Per work unit scratch.
struct Scratch {
  std::vector<float> qsc, qs, qz, lg, row, row2, sw, zw;
  Scratch(int rows, int D, int BT)
      : qsc(rows * D), qs(rows * D), qz(rows), lg(rows * BT), row(D), row2(D), sw(D), zw(D) {}
};

// Logits of tokens [t0, t0+n) of the packed region for `rows` query rows -> lg[r*ldl + i].
using KFn = void (*)(const Args&, int64_t bkv, int t0, int n, int rows, Scratch&, int ldl);
// acc[r] += sum_i p[r*ldl + i] * v_{t0+i}, acc in V's permuted order.
using VFn = void (*)(const Args&, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, float* acc,
                     Scratch&);

template <typename T>
void k_raw_rows(const T* base, int n, int rows, int D, Scratch& s, int ldl) {
  for (int i = 0; i < n; ++i)
    dot_rows(s.qsc.data(), rows, D, row_as_float(base, i, D, s.row.data()), s.lg.data() + i, ldl, nullptr);
}

template <int KB, typename T>
void k_packed(const Args& a, int64_t bkv, int t0, int n, int rows, Scratch& s, int ldl) {
  const int D = a.D;
  if constexpr (KB == 16) {
    const T* base = static_cast<const T*>(a.kp) + (bkv * a.P + t0) * D;
    k_raw_rows<T>(base, n, rows, D, s, ldl);
  } else {
    constexpr int per = 8 / KB;
    const int W = a.Wk;
    const uint8_t* codes = static_cast<const uint8_t*>(a.kp);
    const int ngroups = a.P / a.G;
    for (int i0 = 0; i0 < n;) {
      const int t = t0 + i0;
      const int g = t / a.G;
      const int i1 = std::min(n, (g + 1) * a.G - t0);
      // (q * s) in permuted order and q . z for this K group.
      const at::Half* sp = a.ks + (bkv * ngroups + g) * D;
      const at::Half* zp = a.kz + (bkv * ngroups + g) * D;
      to_float(sp, s.sw.data(), D);
      to_float(zp, s.zw.data(), D);
      for (int r = 0; r < rows; ++r) {
        const float* qr = s.qsc.data() + r * D;
        float* qs = s.qs.data() + r * D;
        for (int d = 0; d < D; ++d) qs[(d % per) * W + d / per] = qr[d] * s.sw[d];
        s.qz[r] = dot(qr, s.zw.data(), D);
      }
      for (int i = i0; i < i1; ++i) {
        unpack_row<KB>(codes + (bkv * a.P + t0 + i) * W, s.row.data(), W);
        dot_rows(s.qs.data(), rows, D, s.row.data(), s.lg.data() + i, ldl, s.qz.data());
      }
      i0 = i1;
    }
  }
}

template <typename T>
void k_residual(const Args& a, int64_t bkv, int t0, int n, int rows, Scratch& s, int ldl) {
  const T* base = static_cast<const T*>(a.kr) + (bkv * a.R + (t0 - a.P)) * a.D;
  k_raw_rows<T>(base, n, rows, a.D, s, ldl);
}

inline void v_accumulate(const float* v, int n_i, int rows, const float* p, int ldl, float* acc, int D) {
  p += n_i;
  for_row_blocks(rows, [&](auto nr, int r) {
    axpy_rows_n<decltype(nr)::value>(p + r * ldl, ldl, v, acc + r * D, D);
  });
}

template <int VB, typename T>
void v_packed(const Args& a, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, float* acc,
              Scratch& s) {
  const int D = a.D;
  if constexpr (VB == 16) {
    const T* base = static_cast<const T*>(a.vp) + (bkv * a.P + t0) * D;
    for (int i = 0; i < n; ++i) v_accumulate(row_as_float(base, i, D, s.row.data()), i, rows, p, ldl, acc, D);
  } else {
    constexpr int per = 8 / VB;
    constexpr int mask = (1 << VB) - 1;
    const int W = a.Wv;
    const int ng = D / a.Gv;
    const int wpg = a.Gv / per;  // bytes of one V group: channel w*per+j is in group w / wpg
    const uint8_t* codes = static_cast<const uint8_t*>(a.vp);
    for (int i = 0; i < n; ++i) {
      const int64_t tok = bkv * a.P + t0 + i;
      const at::Half* sp = a.vs + tok * ng;
      const at::Half* zp = a.vz + tok * ng;
      for (int g = 0; g < ng; ++g) {
        const float sg = static_cast<float>(sp[g]), zg = static_cast<float>(zp[g]);
        for (int w = g * wpg; w < (g + 1) * wpg; ++w) {
          s.sw[w] = sg;
          s.zw[w] = zg;
        }
      }
      const uint8_t* __restrict row = codes + tok * W;
      float* __restrict out = s.row.data();
      const float* __restrict sw = s.sw.data();
      const float* __restrict zw = s.zw.data();
      for (int j = 0; j < per; ++j) {
#pragma omp simd
        for (int w = 0; w < W; ++w)
          out[j * W + w] = static_cast<float>((row[w] >> (VB * j)) & mask) * sw[w] + zw[w];
      }
      v_accumulate(out, i, rows, p, ldl, acc, D);
    }
  }
}

template <typename T>
void v_residual(const Args& a, int64_t bkv, int t0, int n, int rows, const float* p, int ldl, float* acc,
                Scratch& s) {
  const int D = a.D, per = a.vper, W = a.Wv;
  const T* base = static_cast<const T*>(a.vr) + (bkv * a.R + (t0 - a.P)) * D;
  for (int i = 0; i < n; ++i) {
    const float* vr;
    if (per == 1) {
      vr = row_as_float(base, i, D, s.row.data());
    } else {
      // Residual rows are stored plainly; put them into the accumulator's permuted order.
      const T* src = base + static_cast<int64_t>(i) * D;
      for (int d = 0; d < D; ++d) s.row[(d % per) * W + d / per] = static_cast<float>(src[d]);
      vr = s.row.data();
    }
    v_accumulate(vr, i, rows, p, ldl, acc, D);
  }
}

// The specialisation of a side's function for its bit width (16 = raw rows).
template <typename Fn>
Fn pick_bits(int bits, Fn f2, Fn f4, Fn f8, Fn f16) {
  switch (bits) {
    case 2: return f2;
    case 4: return f4;
    case 8: return f8;
    default: return f16;
  }
}

template <typename T>
KFn pick_k(int bits) {
  return pick_bits<KFn>(bits, &k_packed<2, T>, &k_packed<4, T>, &k_packed<8, T>, &k_packed<16, T>);
}

template <typename T>
VFn pick_v(int bits) {
  return pick_bits<VFn>(bits, &v_packed<2, T>, &v_packed<4, T>, &v_packed<8, T>, &v_packed<16, T>);
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
  w.BT = std::max(a.G, 64);
  w.base_units = static_cast<int64_t>(a.B) * a.Hkv * w.nqb;
  const int nblocks = std::max(1, (a.S + w.BT - 1) / w.BT);
  int ns = num_splits;
  if (ns <= 0) {
    // Enough units to keep every thread busy, each split at least 4 blocks long.
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

// One online-softmax step of one query row over a block of n logits lg (nvalid of them visible): lg becomes the
// unnormalised probabilities (0 where not visible), the running max m and sum l and the accumulator row are
// rescaled to the new max.
inline void softmax_step(float* lg, int n, int nvalid, float& m, float& l, float* acc_row, int D) {
  if (nvalid == 0) {
    std::fill(lg, lg + n, 0.f);  // p = 0: this row sees none of the block
    return;
  }
  float mx = kNegInf;
  {
    int i = 0;
    if (nvalid >= 8) {
      v8f vm = load8(lg);
      for (i = 8; i + 8 <= nvalid; i += 8) {
        const v8f x = load8(lg + i);
        vm = x > vm ? x : vm;
      }
      for (int j = 0; j < 8; ++j) mx = std::max(mx, vm[j]);
    }
    for (; i < nvalid; ++i) mx = std::max(mx, lg[i]);
  }
  const float mnew = std::max(m, mx);
  const float alpha = std::exp(m - mnew);  // 0 when m was -inf
  if (alpha != 1.f) {
#pragma omp simd
    for (int d = 0; d < D; ++d) acc_row[d] *= alpha;
  }
  float sum = 0.f;
  {
    int i = 0;
    v8f vs = v8f{};
    for (; i + 8 <= nvalid; i += 8) {
      const v8f e = exp8_nonpos(load8(lg + i) - mnew);
      store8(lg + i, e);
      vs += e;
    }
    sum = hsum8(vs);
    for (; i < nvalid; ++i) {
      lg[i] = exp_nonpos(lg[i] - mnew);
      sum += lg[i];
    }
    for (; i < n; ++i) lg[i] = 0.f;
  }
  l = l * alpha + sum;
  m = mnew;
}

// Work unit u: attend its query rows over its token split, leaving (acc, m, l) partials in `part`.
template <typename T>
void attend_unit(const Args& a, const Work& w, int64_t u, Scratch& s, float* part, KFn kfn, VFn vfn) {
  const int D = a.D, MB = w.MB, BT = w.BT;
  const int split = static_cast<int>(u % w.ns);
  const int qb = static_cast<int>((u / w.ns) % w.nqb);
  const int64_t bkv = u / (static_cast<int64_t>(w.ns) * w.nqb);  // b * Hkv + kv head
  const int64_t b = bkv / a.Hkv, kvh = bkv % a.Hkv;
  const int m0 = qb * MB, rows = std::min(MB, w.M - m0);
  float* acc = part + u * w.stride;
  float* mrow = acc + MB * D;
  float* lrow = mrow + MB;
  std::fill(acc, acc + MB * D, 0.f);
  std::vector<int> limit(rows);
  int max_limit = 0;
  for (int r = 0; r < rows; ++r) {
    const int m = m0 + r, h = static_cast<int>(kvh) * a.Gq + m / a.L, l = m % a.L;
    const float* qsrc = a.q + ((b * a.H + h) * a.L + l) * D;
    for (int d = 0; d < D; ++d) s.qsc[r * D + d] = qsrc[d] * a.scale;
    // bottom-right causal mask: query l of the newest L tokens sees keys j <= S - L + l
    limit[r] = (a.causal && a.L > 1) ? a.S - a.L + l : a.S - 1;
    max_limit = std::max(max_limit, limit[r]);
    mrow[r] = kNegInf;
    lrow[r] = 0.f;
  }
  const int t_begin = split * w.chunk, t_end = std::min(a.S, (split + 1) * w.chunk);
  for (int t0 = t_begin; t0 < t_end && t0 <= max_limit;) {
    // A block lies wholly in the packed region or wholly in the residual window.
    const int t1 = t0 < a.P ? std::min({t_end, a.P, t0 + BT}) : std::min(t_end, t0 + BT);
    const int n = t1 - t0;
    const bool packed = t0 < a.P;
    if (packed) kfn(a, bkv, t0, n, rows, s, BT);
    else k_residual<T>(a, bkv, t0, n, rows, s, BT);
    for (int r = 0; r < rows; ++r) {
      const int nvalid = std::max(0, std::min(n, limit[r] - t0 + 1));
      softmax_step(s.lg.data() + r * BT, n, nvalid, mrow[r], lrow[r], acc + r * D, D);
    }
    if (packed) vfn(a, bkv, t0, n, rows, s.lg.data(), BT, acc, s);
    else v_residual<T>(a, bkv, t0, n, rows, s.lg.data(), BT, acc, s);
    t0 = t1;
  }
}

// Merge the token splits (log-sum-exp) and un-permute V's channel order into out [B, H, L, D].
void merge_splits(const Args& a, const Work& w, const float* part, float* out) {
  const int D = a.D, MB = w.MB, ns = w.ns, stride = w.stride;
  const int per = a.vper, W = a.Wv;
  at::parallel_for(0, w.base_units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> accum(D);
    for (int64_t bu = begin; bu < end; ++bu) {
      const int qb = static_cast<int>(bu % w.nqb);
      const int64_t bkv = bu / w.nqb;
      const int64_t b = bkv / a.Hkv, kvh = bkv % a.Hkv;
      const int m0 = qb * MB, rows = std::min(MB, w.M - m0);
      for (int r = 0; r < rows; ++r) {
        float mmax = kNegInf;
        for (int sp = 0; sp < ns; ++sp) {
          const float* pp = part + (bu * ns + sp) * stride;
          mmax = std::max(mmax, pp[MB * D + r]);
        }
        std::fill(accum.begin(), accum.end(), 0.f);
        float lsum = 0.f;
        if (mmax != kNegInf) {
          for (int sp = 0; sp < ns; ++sp) {
            const float* pp = part + (bu * ns + sp) * stride;
            const float ms = pp[MB * D + r];
            if (ms == kNegInf) continue;
            const float wt = std::exp(ms - mmax);
            lsum += wt * pp[MB * D + MB + r];
            axpy(wt, pp + r * D, accum.data(), D);
          }
        }
        const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // no visible key -> 0, like the reference
        const int m = m0 + r, h = static_cast<int>(kvh) * a.Gq + m / a.L, l = m % a.L;
        float* o = out + ((b * a.H + h) * a.L + l) * D;
        for (int d = 0; d < D; ++d) o[d] = accum[(d % per) * W + d / per] * inv;
      }
    }
  });
}

template <typename T>
void run(const Args& a, float* out, int num_splits) {
  const Work w = plan_work(a, num_splits);
  std::vector<float> part(static_cast<size_t>(w.units) * w.stride);
  const KFn kfn = pick_k<T>(a.kbits);
  const VFn vfn = pick_v<T>(a.vbits);
  at::parallel_for(0, w.units, 1, [&](int64_t begin, int64_t end) {
    Scratch s(w.MB, a.D, w.BT);
    for (int64_t u = begin; u < end; ++u) attend_unit<T>(a, w, u, s, part.data(), kfn, vfn);
  });
  merge_splits(a, w, part.data(), out);
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

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
                            const at::Tensor& k_zero, const at::Tensor& v_packed, const at::Tensor& v_scale,
                            const at::Tensor& v_zero, const at::Tensor& k_res, const at::Tensor& v_res,
                            int64_t k_bits, int64_t v_bits, int64_t group_size, double scale, bool causal,
                            int64_t num_splits) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous fp32 [B,H,L,D]");
  TORCH_CHECK(k_res.dim() == 4 && k_res.is_contiguous() && v_res.is_contiguous(), "k_res/v_res: contiguous");
  TORCH_CHECK(k_res.scalar_type() == v_res.scalar_type(), "k_res and v_res dtypes differ");
  Args a{};
  a.B = q.size(0);
  a.H = q.size(1);
  a.L = q.size(2);
  a.D = q.size(3);
  a.Hkv = k_res.size(1);
  TORCH_CHECK(a.H % a.Hkv == 0, "query heads must be a multiple of KV heads");
  a.Gq = a.H / a.Hkv;
  a.P = k_packed.size(2);
  a.R = k_res.size(2);
  a.S = a.P + a.R;
  a.G = static_cast<int>(group_size);
  a.Gv = std::min(a.G, a.D);
  a.kbits = static_cast<int>(k_bits);
  a.vbits = static_cast<int>(v_bits);
  a.kper = k_bits == 16 ? 1 : 8 / k_bits;
  a.vper = v_bits == 16 ? 1 : 8 / v_bits;
  a.Wk = a.D / a.kper;
  a.Wv = a.D / a.vper;
  TORCH_CHECK(a.D % a.kper == 0 && a.D % a.vper == 0 && a.Gv % a.vper == 0, "unsupported head_dim/group");
  TORCH_CHECK(a.P % a.G == 0, "packed tokens must be a multiple of group_size");
  a.causal = causal;
  a.scale = static_cast<float>(scale);
  for (const at::Tensor* t : {&k_packed, &k_scale, &k_zero, &v_packed, &v_scale, &v_zero})
    TORCH_CHECK(t->is_contiguous(), "packed tensors must be contiguous");
  check_side_dtypes("K", "k_res", k_bits, k_packed, k_scale, k_zero, k_res, a.P);
  check_side_dtypes("V", "v_res", v_bits, v_packed, v_scale, v_zero, v_res, a.P);
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
  switch (k_res.scalar_type()) {
    case at::kFloat: run<float>(a, out.data_ptr<float>(), static_cast<int>(num_splits)); break;
    case at::kHalf: run<at::Half>(a, out.data_ptr<float>(), static_cast<int>(num_splits)); break;
    case at::kBFloat16: run<at::BFloat16>(a, out.data_ptr<float>(), static_cast<int>(num_splits)); break;
    default: TORCH_CHECK(false, "residual dtype must be float32, float16 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(moend_cpu, m) {
  m.def(
      "packed_attention(Tensor q, Tensor k_packed, Tensor k_scale, Tensor k_zero, Tensor v_packed, "
      "Tensor v_scale, Tensor v_zero, Tensor k_res, Tensor v_res, int k_bits, int v_bits, int group_size, "
      "float scale, bool causal, int num_splits) -> Tensor");
  m.impl("packed_attention", c10::DispatchKey::CPU, TORCH_FN(packed_attention));
}
