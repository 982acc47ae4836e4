// The body of one kernel table (kernels.h), written once for any vector width. Included by each
// kernels_<isa>.cc inside an anonymous namespace after it defines
//   V, VI   a vector of kW floats / int32 (GCC vector types),
//   kW      floats per vector, kMR the rows of a register block (kNV vectors wide),
//   Fma     Fma(a, b, c) = a * b + c, and Splat(x), x in every lane,
// so every copy has internal linkage and is compiled with its own unit's flags. No include guard: one
// inclusion per unit, on purpose.

constexpr float kInf = __builtin_inff();

typedef float VU __attribute__((vector_size(kW * 4), aligned(4), may_alias));  // unaligned access

inline V Load(const float* p) { return *reinterpret_cast<const VU*>(p); }
inline void Store(float* p, V v) { *reinterpret_cast<VU*>(p) = v; }
inline V Max(V a, V b) { return a > b ? a : b; }

// exp(x), kW at a time: x log2(e) = n + f with n an integer and |f| <= 1/2, 2^f by its degree-6 Taylor
// polynomial (relative error < 2e-7, about 1 ulp), 2^n put into the exponent bits. Inputs below -87 (incl.
// -inf) give exactly 0, above 88 the largest power of two that fits; NaN stays NaN.
inline V Exp(V x) {
  const V lo = Splat(-87.f), hi = Splat(88.f);
  const V t = (x < lo ? lo : x > hi ? hi : x) * 1.44269504088896341f;
  const VI n = __builtin_convertvector(t + (t >= Splat(0.f) ? Splat(0.5f) : Splat(-0.5f)), VI);
  const V f = t - __builtin_convertvector(n, V);
  V p = Splat(1.5403530393381606e-4f);  // ln(2)^k / k!, k = 6 .. 0
  p = Fma(p, f, Splat(1.3333558146428443e-3f));
  p = Fma(p, f, Splat(9.6181291076284772e-3f));
  p = Fma(p, f, Splat(5.5504108664821580e-2f));
  p = Fma(p, f, Splat(2.4022650695910071e-1f));
  p = Fma(p, f, Splat(6.9314718055994531e-1f));
  p = Fma(p, f, Splat(1.f));
  const V two_n = reinterpret_cast<V>((n + 127) << 23);
  return x < lo ? Splat(0.f) : p * two_n;
}

// --- matrix product ---------------------------------------------------------------------------------
// A kMR x (kNV * kW) block of C stays in registers over the whole k loop: per step, kNV loads of B and kMR
// broadcasts of A feed kMR * kNV multiply-adds. `kATrans`: A's column stride is 1 (a row-major A) or its
// row stride is (A is the transpose of a row-major tile); `sa` is the other stride.
template <int kRows, int kVecs, bool kATrans>
inline void Block(const float* a, int64_t sa, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t k,
                  bool accumulate, const float* row_scale) {
  V acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = Splat(0.f);
  for (int64_t l = 0; l < k; ++l) {
    V bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = Load(b + l * ldb + v * kW);
    for (int i = 0; i < kRows; ++i) {
      const V ai = Splat(kATrans ? a[l * sa + i] : a[i * sa + l]);
      for (int v = 0; v < kVecs; ++v) acc[i][v] = Fma(ai, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    const V scale = Splat(row_scale != nullptr ? row_scale[i] : 1.f);
    for (int v = 0; v < kVecs; ++v) {
      float* out = c + i * ldc + v * kW;
      Store(out, accumulate ? Fma(Load(out), scale, acc[i][v]) : acc[i][v]);
    }
  }
}

// The last rows of C, fewer than kMR: the block with exactly that many rows.
template <int kVecs, bool kATrans, int kRows = kMR>
inline void BlockRows(int64_t rows, const float* a, int64_t sa, const float* b, int64_t ldb, float* c,
                      int64_t ldc, int64_t k, bool accumulate, const float* row_scale) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return Block<kRows, kVecs, kATrans>(a, sa, b, ldb, c, ldc, k, accumulate, row_scale);
    BlockRows<kVecs, kATrans, kRows - 1>(rows, a, sa, b, ldb, c, ldc, k, accumulate, row_scale);
  }
}

// Panels of B (k x kNV vectors) outside, row blocks of A inside: a panel is read from cache once per row
// block while it stays in L1.
template <bool kATrans>
void GemmImpl(const GemmArgs& g) {
  const int64_t sa = kATrans ? g.a_col : g.a_row;
  for (int64_t j0 = 0; j0 < g.n; j0 += kNV * kW) {
    const bool wide = j0 + kNV * kW <= g.n;  // else one vector is left (n is a multiple of kW)
    for (int64_t i0 = 0; i0 < g.m; i0 += kMR) {
      const int64_t rows = g.m - i0 < kMR ? g.m - i0 : kMR;
      const float* a = g.a + (kATrans ? i0 : i0 * sa);
      float* c = g.c + i0 * g.ldc + j0;
      const float* rs = g.row_scale != nullptr ? g.row_scale + i0 : nullptr;
      if (wide)
        BlockRows<kNV, kATrans>(rows, a, sa, g.b + j0, g.ldb, c, g.ldc, g.k, g.accumulate, rs);
      else
        BlockRows<1, kATrans>(rows, a, sa, g.b + j0, g.ldb, c, g.ldc, g.k, g.accumulate, rs);
    }
  }
}

void Gemm(const GemmArgs& g) {
  if (g.a_col == 1)
    GemmImpl<false>(g);
  else
    GemmImpl<true>(g);
}

// --- online softmax, one query per lane -----------------------------------------------------------------
void Softmax(const SoftmaxArgs& s) {
  for (int64_t i0 = 0; i0 < s.n; i0 += kW) {
    float* col = s.st + i0;
    const V m_old = Load(s.m + i0);
    V mx0 = m_old, mx1 = Splat(-kInf);  // two chains: a max has a latency of several cycles
    int64_t j = 0;
    for (; j + 2 <= s.keys; j += 2) {
      mx0 = Max(mx0, Load(col + j * s.ld));
      mx1 = Max(mx1, Load(col + (j + 1) * s.ld));
    }
    if (j < s.keys) mx0 = Max(mx0, Load(col + j * s.ld));
    const V m_new = Max(mx0, mx1);
    const V shift = m_new == Splat(-kInf) ? Splat(0.f) : m_new;  // no key seen yet: P = 0, not NaN
    const V alpha = Exp(m_old - shift);
    V sum0 = Splat(0.f), sum1 = Splat(0.f);
    for (j = 0; j + 2 <= s.keys; j += 2) {
      const V e0 = Exp(Load(col + j * s.ld) - shift), e1 = Exp(Load(col + (j + 1) * s.ld) - shift);
      Store(col + j * s.ld, e0);
      Store(col + (j + 1) * s.ld, e1);
      sum0 += e0;
      sum1 += e1;
    }
    if (j < s.keys) {
      const V e = Exp(Load(col + j * s.ld) - shift);
      Store(col + j * s.ld, e);
      sum0 += e;
    }
    Store(s.l + i0, Fma(Load(s.l + i0), alpha, sum0 + sum1));
    Store(s.m + i0, m_new);
    Store(s.alpha + i0, alpha);
  }
}

// --- the backward's P and dS ------------------------------------------------------------------------------
void ProbsGrads(const ProbsGradsArgs& a) {
  const bool cap = a.softcap > 0.f;
  const V inv_cap = Splat(cap ? 1.f / a.softcap : 0.f), zero = Splat(0.f), one = Splat(1.f);
  for (int64_t j = 0; j < a.keys; ++j) {
    float* pt = a.pt + j * a.ld;
    float* dpt = a.dpt + j * a.ld;
    const float* zt = a.zt != nullptr ? a.zt + j * a.ld : nullptr;
    for (int64_t i0 = 0; i0 < a.n; i0 += kW) {
      const V s = Load(pt + i0), lse = Load(a.lse + i0);
      V p = lse == Splat(-kInf) ? zero : Exp(s - lse);
      V dp = Load(dpt + i0);
      if (zt != nullptr) dp *= Load(zt + i0);
      V ds = p == zero ? zero : p * (dp - Load(a.delta + i0));
      if (cap) {
        const V t = s * inv_cap;
        ds = ds == zero ? zero : ds * (one - t * t);  // s may be -inf where ds = 0
      }
      if (zt != nullptr) p *= Load(zt + i0);
      Store(pt + i0, p);
      Store(dpt + i0, ds);
    }
  }
}
