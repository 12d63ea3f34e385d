// rollcorr::row_pass — the correction's statistics in one read of (B, T), vectorised with ATen's Vectorized
// (its exp / expm1 / log1p are SLEEF's 1-ulp vector functions, the ones torch's own kernels call).
//
// Built ahead of any run by `python -m rollcorr.correction.native build` (scripts/setup.sh runs it), once per CPU
// capability (AVX2, AVX512: -DCPU_CAPABILITY=...), and loaded by rollcorr/correction/native.py. Never compiled
// at call time.
//
// Per position, with valid = mask, o = log π_old (or π_θ), r = log μ, both 0 on padding:
//   ℓ = o − r        ℓ_c = clamp(ℓ, ±bound)     e = expm1(ℓ_c) = ρ − 1      ρ = exp(ℓ_c)
//   k2 = ½ℓ_c²       k3 = e − ℓ_c               q = log1p(e/2)               p_old = e^o, p_μ = e^r, Δp = p_old − p_μ
// Per row, the sums (and maxima) listed in `Slot`; the batch's totals in float64. Sums run in float32 lanes over
// chunks of CHUNK positions, then in a second float32 level per row, then in float64 across lanes and rows.
// Token IS (flag TOKEN_IS) writes w = threshold(ρ·valid) into the (B, T) output.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kLanes = Vec::size();
constexpr int64_t kChunk = 256;  // positions per lane-sum before it joins the row's second level

// The per-row outputs, in this order (native.py reads them by these names: keep the two lists in step).
enum Slot : int {
  N, BAD_OLD, BAD_ROLLOUT, LR, LR_C, K2, K3, OLD, ROLLOUT, K3_UNCLAMPED, E, E_SQ, E_LR, JS_A, E_Q, E_ABS, ABS,
  P_OLD, P_ROLLOUT, P_OLD_SQ, P_ROLLOUT_SQ, P_CROSS, D, SMALL, GE0, GE1, GE2, W, W_SQ, RAW, HIGH, LOW,
  SUMS,  // the maxima follow the sums
  MAX_K2 = SUMS, MAX_K3, D_MAX, W_MAX, W_MIN, SLOTS
};
constexpr int kMaxima = SLOTS - SUMS;

enum Flag : int64_t {
  DIAGNOSTICS = 1, TOKEN_IS = 2, MASK_MODE = 4, VERL = 8, NEED_LR_C = 16, NEED_K2 = 32, NEED_K3 = 64,
};

struct Options {
  float bound, tol_old, tol_rollout, lower, upper, lo, hi;
  bool has_lower, has_upper;
  int64_t flags;
  bool on(Flag f) const { return (flags & f) != 0; }
};

inline Vec mask_floats(const uint8_t* m, int count) {
  if (count == kLanes) {
#if defined(CPU_CAPABILITY_AVX512)
    return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)))));
#elif defined(CPU_CAPABILITY_AVX2)
    return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)))));
#endif
  }
  alignas(64) float buf[kLanes];
  for (int i = 0; i < kLanes; ++i) buf[i] = i < count ? static_cast<float>(m[i] != 0) : 0.0f;
  return Vec::loadu(buf);
}

// Whether every lane of the comparison result ``m`` is set.
inline bool all_lanes(const Vec& m) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_movepi32_mask(_mm512_castps_si512(m)) == 0xFFFF;
#else
  return _mm256_movemask_ps(m) == 0xFF;
#endif
}

constexpr float kLog2e = 1.44269504088896340736f;

// e^x as 2^(x·log2 e): SLEEF's exp2 costs about half its exp; the rounding of x·log2 e adds a relative error
// ≲ |x|·u (u = 2^-24), ≤ 1.2e-6 at the ±20 clamp, and ≲ u/e in absolute terms for x ≤ 0 (a probability).
inline Vec exp_via_exp2(const Vec& x) { return (x * Vec(kLog2e)).exp2(); }

// expm1(x): where every lane has |x| < 1/2 (small mismatch, the common case) its Taylor series to x⁹/9!
// (truncation < 1.1e-8 |x|, below u), else SLEEF's expm1 (1 ulp).
inline Vec expm1_small_first(const Vec& x) {
  if (!all_lanes(x.abs() < Vec(0.5f))) return x.expm1();
  Vec p(1.0f / 362880.0f);
  for (float c : {1.0f / 40320.0f, 1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f,
                  0.5f, 1.0f})
    p = at::vec::fmadd(p, x, Vec(c));
  return p * x;
}

// log1p(z): where every lane has |z| < 1/8 its series to z⁸/8 (truncation < 7e-9 |z|), else SLEEF's log1p.
inline Vec log1p_small_first(const Vec& z) {
  if (!all_lanes(z.abs() < Vec(0.125f))) return z.log1p();
  Vec p(-1.0f / 8.0f);
  for (float c : {1.0f / 7.0f, -1.0f / 6.0f, 1.0f / 5.0f, -1.0f / 4.0f, 1.0f / 3.0f, -0.5f, 1.0f})
    p = at::vec::fmadd(p, z, Vec(c));
  return p * z;
}

// The token weights w = threshold(raw), raw = ρ·valid (0 on padding), as weights.apply_threshold computes them.
inline Vec threshold(const Vec& raw, const Vec& mf, const Options& opt) {
  if (opt.on(MASK_MODE)) {
    Vec w = opt.has_upper ? raw.le(Vec(opt.upper)) * raw : raw;
    return opt.has_lower && opt.lower != 0.0f ? raw.ge(Vec(opt.lower)) * w : w;
  }
  Vec w = raw;
  if (opt.has_lower) w = at::vec::maximum(w, Vec(opt.lower)) * mf;  // a lower clamp would lift padding off 0
  if (opt.has_upper) w = at::vec::minimum(w, Vec(opt.upper));
  return w;
}

struct Accumulators {
  Vec sum[SUMS];
  Vec max[kMaxima];
};

template <bool kDiagnostics, bool kTokenIs>
inline void step(const float* o_ptr, const float* r_ptr, const uint8_t* m_ptr, float* w_ptr, int count,
                 const Options& opt, Vec* acc, Vec* mx) {
  const Vec zero(0.0f), ninf(-std::numeric_limits<float>::infinity());
  const Vec x_in = count == kLanes ? Vec::loadu(o_ptr) : Vec::loadu(o_ptr, count);
  const Vec y_in = count == kLanes ? Vec::loadu(r_ptr) : Vec::loadu(r_ptr, count);
  const Vec mf = mask_floats(m_ptr, count);
  const Vec valid = mf > zero;
  // a valid log-prob must be finite and ≤ its tolerance (NaN fails both comparisons)
  acc[BAD_OLD] += Vec::blendv(mf, zero, (x_in > ninf) & (x_in <= Vec(opt.tol_old)));
  acc[BAD_ROLLOUT] += Vec::blendv(mf, zero, (y_in > ninf) & (y_in <= Vec(opt.tol_rollout)));
  const Vec x = Vec::blendv(zero, x_in, valid), y = Vec::blendv(zero, y_in, valid);
  const Vec lr = x - y;
  const Vec lrc = at::vec::clamp(lr, Vec(-opt.bound), Vec(opt.bound));
  acc[N] += mf;
  acc[LR] += lr;
  acc[OLD] += x;
  acc[ROLLOUT] += y;
  if (opt.on(NEED_LR_C)) acc[LR_C] += lrc;
  if (opt.on(NEED_K2)) {
    const Vec k2 = lrc * lrc * Vec(0.5f);
    acc[K2] += k2;
    mx[MAX_K2 - SUMS] = at::vec::maximum(mx[MAX_K2 - SUMS], Vec::blendv(ninf, k2, valid));
  }
  Vec e = zero, rho = zero;
  if (kDiagnostics || opt.on(NEED_K3)) {
    e = expm1_small_first(lrc);
    const Vec k3 = e - lrc;
    acc[K3] += k3;
    mx[MAX_K3 - SUMS] = at::vec::maximum(mx[MAX_K3 - SUMS], Vec::blendv(ninf, k3, valid));
  }
  // ρ itself (1 + e loses its relative precision where ρ ≪ 1), by SLEEF's exp: the token IS weights are ρ
  if (kDiagnostics || kTokenIs) rho = lrc.exp();
  if constexpr (kDiagnostics) {
    if (opt.on(VERL)) acc[K3_UNCLAMPED] += lr.expm1() - lr;  // verl's k3_kl: e^ℓ − 1 − ℓ of the unclamped ℓ
    const Vec q = log1p_small_first(e * Vec(0.5f));            // log((1 + ρ)/2)
    acc[E] += e;
    acc[E_SQ] += e * e;
    acc[E_LR] += e * lrc;
    acc[JS_A] += lrc - q - q;
    acc[E_Q] += e * q;
    acc[E_ABS] += at::vec::maximum(e, zero - e / rho);  // e^|ℓ_c| − 1
    acc[ABS] += lrc.abs();
    const Vec p_old = exp_via_exp2(x), p_rollout = exp_via_exp2(y);  // 1 on padding
    const Vec p_old_m = p_old * mf, p_rollout_m = p_rollout * mf;
    acc[P_OLD] += p_old_m;
    acc[P_ROLLOUT] += p_rollout_m;
    acc[P_OLD_SQ] += p_old_m * p_old;
    acc[P_ROLLOUT_SQ] += p_rollout_m * p_rollout;
    acc[P_CROSS] += p_old_m * p_rollout;
    const Vec d = (p_old - p_rollout).abs();  // 0 on padding
    acc[D] += d;
    mx[D_MAX - SUMS] = at::vec::maximum(mx[D_MAX - SUMS], d);
    acc[SMALL] += Vec::blendv(zero, mf, d < Vec(1e-3f));
    acc[GE0] += d.ge(Vec(0.01f));
    acc[GE1] += d.ge(Vec(0.05f));
    acc[GE2] += d.ge(Vec(0.1f));
  }
  if constexpr (kTokenIs) {
    const Vec raw = rho * mf;
    const Vec w = threshold(raw, mf, opt);
    if (count == kLanes) w.store(w_ptr); else w.store(w_ptr, count);
    acc[W] += w;
    acc[W_SQ] += w * w;
    acc[RAW] += raw;
    acc[HIGH] += raw.gt(Vec(opt.hi));
    acc[LOW] += Vec::blendv(zero, mf, raw < Vec(opt.lo));
    mx[W_MAX - SUMS] = at::vec::maximum(mx[W_MAX - SUMS], w);
    mx[W_MIN - SUMS] = at::vec::minimum(mx[W_MIN - SUMS], Vec::blendv(Vec(std::numeric_limits<float>::infinity()), w, valid));
  }
}

template <bool kDiagnostics, bool kTokenIs>
void rows(const float* old, const float* rollout, const uint8_t* mask, float* w, int64_t begin, int64_t end,
          int64_t batch, int64_t length, const Options& opt, float* out) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t b = begin; b < end; ++b) {
    const int64_t at = b * length;
    Vec level2[SUMS], chunk[SUMS], mx[kMaxima];
    for (int s = 0; s < SUMS; ++s) level2[s] = Vec(0.0f);
    for (int s = 0; s < kMaxima; ++s) mx[s] = Vec(s == W_MIN - SUMS ? inf : -inf);
    mx[D_MAX - SUMS] = mx[W_MAX - SUMS] = Vec(0.0f);  // |Δp| and w are ≥ 0, 0 on padding
    for (int64_t c0 = 0; c0 < length; c0 += kChunk) {
      for (int s = 0; s < SUMS; ++s) chunk[s] = Vec(0.0f);
      const int64_t c1 = std::min(c0 + kChunk, length);
      for (int64_t t = c0; t < c1; t += kLanes) {
        const int count = static_cast<int>(std::min<int64_t>(kLanes, c1 - t));
        step<kDiagnostics, kTokenIs>(old + at + t, rollout + at + t, mask + at + t, kTokenIs ? w + at + t : nullptr,
                                     count, opt, chunk, mx);
      }
      for (int s = 0; s < SUMS; ++s) level2[s] += chunk[s];
    }
    alignas(64) float lanes[kLanes];
    for (int s = 0; s < SUMS; ++s) {
      level2[s].store(lanes);
      double total = 0.0;
      for (int i = 0; i < kLanes; ++i) total += lanes[i];
      out[s * batch + b] = static_cast<float>(total);
    }
    for (int s = 0; s < kMaxima; ++s) {
      mx[s].store(lanes);
      const bool is_min = s == W_MIN - SUMS;
      float v = lanes[0];
      for (int i = 1; i < kLanes; ++i) v = is_min ? std::min(v, lanes[i]) : std::max(v, lanes[i]);
      out[(SUMS + s) * batch + b] = v;
    }
  }
}

using RowsFn = void (*)(const float*, const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t,
                        const Options&, float*);

std::tuple<at::Tensor, at::Tensor, at::Tensor> row_pass(
    const at::Tensor& old, const at::Tensor& rollout, const at::Tensor& mask, double bound, double tol_old,
    double tol_rollout, int64_t flags, std::optional<double> lower, std::optional<double> upper, double lo,
    double hi) {
  TORCH_CHECK(old.dim() == 2 && old.sizes() == rollout.sizes() && old.sizes() == mask.sizes(),
              "row_pass: old, rollout and mask must be (B, T) of one shape");
  TORCH_CHECK(old.scalar_type() == at::kFloat && rollout.scalar_type() == at::kFloat, "row_pass: float32 inputs");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "row_pass: a bool mask");
  TORCH_CHECK(old.is_cpu() && old.is_contiguous() && rollout.is_contiguous() && mask.is_contiguous(),
              "row_pass: contiguous CPU tensors");
  const int64_t batch = old.size(0), length = old.size(1);
  Options opt{static_cast<float>(bound), static_cast<float>(tol_old), static_cast<float>(tol_rollout),
              static_cast<float>(lower.value_or(0.0)), static_cast<float>(upper.value_or(0.0)),
              static_cast<float>(lo), static_cast<float>(hi), lower.has_value(), upper.has_value(), flags};
  const bool token_is = opt.on(TOKEN_IS), diagnostics = opt.on(DIAGNOSTICS);
  at::Tensor out = at::empty({SLOTS, batch}, old.options());
  at::Tensor w = at::empty({token_is ? batch : 0, token_is ? length : 0}, old.options());
  RowsFn fn = diagnostics ? (token_is ? rows<true, true> : rows<true, false>)
                          : (token_is ? rows<false, true> : rows<false, false>);
  const float *o = old.data_ptr<float>(), *r = rollout.data_ptr<float>();
  const auto* m = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  float *w_ptr = token_is ? w.data_ptr<float>() : nullptr, *out_ptr = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(length, 1));
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    fn(o, r, m, w_ptr, begin, end, batch, length, opt, out_ptr);
  });
  // the batch's totals in float64: sums of the row sums, the larger / smaller of the row maxima / minima
  at::Tensor totals = at::empty({SLOTS}, old.options().dtype(at::kDouble));
  double* t = totals.data_ptr<double>();
  for (int s = 0; s < SLOTS; ++s) {
    const float* row = out_ptr + s * batch;
    const bool is_min = s == W_MIN, is_max = s >= SUMS && !is_min;
    double v = is_min ? std::numeric_limits<double>::infinity()
                      : (is_max ? -std::numeric_limits<double>::infinity() : 0.0);
    for (int64_t b = 0; b < batch; ++b) v = is_min ? std::min<double>(v, row[b]) : is_max ? std::max<double>(v, row[b]) : v + row[b];
    t[s] = v;
  }
  return {out, totals, w};
}

}  // namespace

TORCH_LIBRARY(rollcorr, m) {
  m.def("row_pass(Tensor old, Tensor rollout, Tensor mask, float bound, float tol_old, float tol_rollout, "
        "int flags, float? lower, float? upper, float lo, float hi) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollcorr, CPU, m) { m.impl("row_pass", &row_pass); }
