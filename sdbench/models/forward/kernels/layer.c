/* The rest of a decoder layer's step around the products (Llama's): RMSNorm, SiLU(gate) * up, and causal attention
 * over a dense cache with the new keys rotated into it; the fast path's fused layer, models/forward/cpulayer.py.
 * Compiled after products.c as one unit (models/forward/cpukernel.py), whose ALWAYS and hsum it uses.
 *
 * e^x is taken eight values at a time (exp8), within a few units in the last place of the C library's expf, and the
 * sums run in other orders than torch's: attention and the activation agree with torch's to float32's rounding, not
 * bit for bit (as the products' sums do). Each is width-invariant: a query's output, a row's norm, are the same
 * bits whatever the number of tokens in the step and the rows in the batch (a key's score is taken the same way in
 * whichever block of 8 keys it falls; the softmax and the value mix run over a query's keys in their order).
 */

/* y [rows, n] = w * (x * 1/sqrt(mean(x^2) + eps)), as Llama's RMSNorm computes it in float32 */
void sd_rms_norm(const float *x, const float *w, float *y, long rows, long n, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (long r = 0; r < rows; r++) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    double ss = 0.0;
    for (long i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
    float inv = 1.0f / sqrtf((float)(ss / n) + eps);
    for (long i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
  }
}

#define SPLAT(c) _mm256_set1_ps(c)

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r by Cephes' degree-6
 * polynomial, 2^n laid into the exponent bits. Below -87.3 (e^x under float32's smallest normal) it gives 0; above
 * 88.3, e^88.3 (float32's largest is e^88.7); NaN stays NaN. */
ALWAYS __m256 exp8(__m256 x) {
  __m256 under = _mm256_cmp_ps(x, SPLAT(-87.3f), _CMP_LT_OQ);
  __m256 c = _mm256_min_ps(SPLAT(88.3f), _mm256_max_ps(SPLAT(-87.3f), x)); /* a NaN x passes through */
  __m256 n = _mm256_round_ps(_mm256_mul_ps(c, SPLAT(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, SPLAT(-2.12194440e-4f), _mm256_fnmadd_ps(n, SPLAT(0.693359375f), c));
  __m256 p = _mm256_fmadd_ps(SPLAT(1.9875691500e-4f), r, SPLAT(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, SPLAT(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, SPLAT(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, SPLAT(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, SPLAT(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, SPLAT(1.0f)));
  __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

ALWAYS __m256 silu_mul8(__m256 g, __m256 u) {
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(SPLAT(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u);
}

/* y [rows, inter] = silu(gate) * up, gu [rows, 2 * inter] holding gate then up */
void sd_silu_mul(const float *gu, float *y, long rows, long inter) {
  long vecs = (inter + 7) / 8;
#pragma omp parallel for collapse(2) schedule(static) /* each element alone: split across the threads, same values */
  for (long r = 0; r < rows; r++)
    for (long k = 0; k < vecs; k++) {
      const float *g = gu + r * 2 * inter + 8 * k;
      float *out = y + r * inter + 8 * k;
      if (8 * k + 8 <= inter) {
        _mm256_storeu_ps(out, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(g + inter)));
        continue;
      }
      float a[8] = {0}, b[8] = {0}, c[8]; /* the last part vector */
      for (long j = 0; j < inter - 8 * k; j++) a[j] = g[j], b[j] = g[inter + j];
      _mm256_storeu_ps(c, silu_mul8(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));
      for (long j = 0; j < inter - 8 * k; j++) out[j] = c[j];
    }
}

/* x [D] rotated by (cos, sin') [Dr] into out [D]: the first Dr dims as x*cos + roll(x, Dr/2)*sin' (sin' holds
 * sin with its first half negated, as the rotary tables do), the rest copied */
static void rotate(const float *x, const float *cos, const float *sin, float *out, long D, long Dr) {
  long half = Dr / 2;
  for (long d = 0; d < Dr; d++) out[d] = x[d] * cos[d] + x[d < half ? d + half : d - half] * sin[d];
  for (long d = Dr; d < D; d++) out[d] = x[d];
}

/* q [D] against 8 keys k [8, D]: the 8 dot products in one vector, each key its own sum */
#define KEY(j) a##j = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + j * D + i), a##j);
static __m256 dot8(const float *q, const float *k, long D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  long i = 0;
  for (; i + 8 <= D; i += 8) {
    __m256 x = _mm256_loadu_ps(q + i);
    KEY(0) KEY(1) KEY(2) KEY(3) KEY(4) KEY(5) KEY(6) KEY(7)
  }
  __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* keys 0-3, each lane's two halves */
  __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7)); /* keys 4-7 */
  __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  if (i == D) return s;
  float t[8] = {0};
  for (long j = 0; j < 8; j++)
    for (long d = i; d < D; d++) t[j] += q[d] * k[j * D + d];
  return _mm256_add_ps(s, _mm256_loadu_ps(t));
}

ALWAYS float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* s [n] = e^(s [n] - max) for one query's scores, padded with zeros up to a whole vector; returns their sum */
static float softmax_weights(float *s, long n) {
  __m256 top8 = SPLAT(-INFINITY), sum = _mm256_setzero_ps();
  long j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
  float top = hmax(top8);
  for (; j < n; j++)
    if (s[j] > top) top = s[j];
  for (; j % 8; j++) s[j] = -INFINITY; /* e^-inf = 0 */
  for (long i = 0; i < j; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), SPLAT(top)));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

/* o [D] += sum over m rows r of p [r] v_r, v [m, D]: 64 dimensions a pass held in registers over the rows */
#define ACC(c) o##c = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + r * D + d + 8 * c), o##c);
#define LOAD(c) __m256 o##c = _mm256_loadu_ps(o + d + 8 * c);
#define KEEP(c) _mm256_storeu_ps(o + d + 8 * c, o##c);
static void mix(const float *p, const float *v, long m, long D, float *o) {
  long d = 0;
  for (; d + 64 <= D; d += 64) {
    LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5) LOAD(6) LOAD(7)
    for (long r = 0; r < m; r++) {
      __m256 pr = _mm256_broadcast_ss(p + r);
      ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    }
    KEEP(0) KEEP(1) KEEP(2) KEEP(3) KEEP(4) KEEP(5) KEEP(6) KEEP(7)
  }
  for (; d + 8 <= D; d += 8) {
    __m256 a = _mm256_loadu_ps(o + d);
    for (long r = 0; r < m; r++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r), _mm256_loadu_ps(v + r * D + d), a);
    _mm256_storeu_ps(o + d, a);
  }
  for (; d < D; d++)
    for (long r = 0; r < m; r++) o[d] += p[r] * v[r * D + d];
}

#define MIX_BYTES 8192 /* the values each pass of mix meets, for all of a step's queries: 8 KiB (16 and 32 no faster) */
/* the values a pass of mix meets for all of a step's queries (MIX_BYTES of them, at least 8 rows): they stay in L1 */
static long mix_rows(long D) {
  long rows = MIX_BYTES / (D * (long)sizeof(float));
  return rows < 8 ? 8 : rows;
}

/* s [m] = q's scores against the keys at slots slot [m] (times scale), 8 at a time in blocks padded with zero keys:
 * each key the score dot8 gives it in a full block of the cache (width-invariant: the same bits whichever block) */
static void gathered_scores(const float *q, const float *keys, const long *slot, long m, long D, float scale,
                            float *s) {
  float pad[8 * D];
  for (long k0 = 0; k0 < m; k0 += 8) {
    for (long k = 0; k < 8; k++)
      for (long d = 0; d < D; d++) pad[k * D + d] = k0 + k < m ? keys[slot[k0 + k] * D + d] : 0.0f;
    _mm256_storeu_ps(s + k0, _mm256_mul_ps(dot8(q, pad, D), SPLAT(scale)));
  }
}

/* The T queries q [T, D] of one head over its keys and values [start + T, D], query t seeing the first
 * start + t + 1 and writing softmax(q k^T * scale) v to o + t * ostride; s is room for [T, stride] scores (stride
 * start + T rounded up to 8). Each block of 8 keys, then each MIX_BYTES of values, is read once for all the queries
 * while it is in L1: a step verifying T tokens reads the head's cache once, not T times. */
static void attend_head(const float *q, const float *keys, const float *values, long T, long start, long D,
                        float scale, float *s, long stride, float *o, long ostride) {
  long seen = start + T, j = 0; /* query t sees key j where t >= j - start */
  for (; j + 8 <= seen; j += 8) /* a block past a query's last key gives it scores softmax_weights masks */
    for (long t = j > start ? j - start : 0; t < T; t++)
      _mm256_storeu_ps(s + t * stride + j, _mm256_mul_ps(dot8(q + t * D, keys + j * D, D), SPLAT(scale)));
  long last[8], tail = 0; /* the last keys, fewer than 8 */
  for (long k = j; k < seen; k++) last[tail++] = k;
  for (long t = j > start ? j - start : 0; tail && t < T; t++)
    gathered_scores(q + t * D, keys, last, tail, D, scale, s + t * stride + j);
  float total[T];
  for (long t = 0; t < T; t++) {
    total[t] = softmax_weights(s + t * stride, start + t + 1);
    for (long d = 0; d < D; d++) o[t * ostride + d] = 0.0f;
  }
  long rows = mix_rows(D);
  for (j = 0; j < seen; j += rows)
    for (long t = j > start ? j - start : 0; t < T; t++) {
      long m = start + t + 1 - j;
      mix(s + t * stride + j, values + j * D, m < rows ? m : rows, D, o + t * ostride);
    }
  for (long t = 0; t < T; t++)
    for (long d = 0; d < D; d++) o[t * ostride + d] *= 1.0f / total[t];
}

/* The T nodes q [T, D] of one head's token tree (anc [T, T]: anc[t][u] = 1 where node u is node t or one of its
 * ancestors, ancestors before their descendants) over the cache's first `start` keys and values and the tree's, node
 * u's at slot start + u: node t sees the prefix, then its ancestors and itself in order, and gets the bits a chain's
 * query gets at its depth (plain decoding's, one token at a time): the same score per key (dot8), softmax and value
 * mix over its keys in the same order. The prefix's whole blocks of 8 keys are read once for all nodes; the rest,
 * per node, gathered into padded blocks. s is room for [T, stride] scores, v room for [T, D] values. */
static void attend_tree_head(const float *q, const float *keys, const float *values, long T, long start, long D,
                             float scale, float *s, long stride, float *v, const uint8_t *anc, float *o,
                             long ostride) {
  long full = start / 8 * 8;
  for (long j = 0; j < full; j += 8)
    for (long t = 0; t < T; t++)
      _mm256_storeu_ps(s + t * stride + j, _mm256_mul_ps(dot8(q + t * D, keys + j * D, D), SPLAT(scale)));
  long rows = mix_rows(D), slot[8 + T];
  for (long t = 0; t < T; t++) {
    long m = 0; /* the node's keys past the whole blocks: the prefix's last ones, then its path */
    for (long j = full; j < start; j++) slot[m++] = j;
    for (long u = 0; u < T; u++)
      if (anc[t * T + u]) slot[m++] = start + u;
    gathered_scores(q + t * D, keys, slot, m, D, scale, s + t * stride + full);
    float total = softmax_weights(s + t * stride, full + m), *ot = o + t * ostride;
    for (long d = 0; d < D; d++) ot[d] = 0.0f;
    for (long j = 0; j < start; j += rows) /* the prefix's values in place, then the path's gathered */
      mix(s + t * stride + j, values + j * D, start - j < rows ? start - j : rows, D, ot);
    long path = m - (start - full);
    for (long k = 0; k < path; k++)
      for (long d = 0; d < D; d++) v[k * D + d] = values[slot[start - full + k] * D + d];
    mix(s + t * stride + start, v, path, D, ot);
    for (long d = 0; d < D; d++) ot[d] *= 1.0f / total;
  }
}

/* One step of causal attention over a dense cache for T new tokens per row at slots start..start+T-1 (T a few:
 * each query head holds T rows of scores over the cache while it works):
 * qkv [B, T, (Hq + 2 Hk) D] (queries, keys, values side by side), cos/sin [B, T, Dr]; the rotated keys and the
 * values are written to kc/vc [B, Hk, cap, D] at their slots, and out [B, T, Hq D] gets each query's
 * softmax(q k^T * scale) v over the slots up to its own (query head h reads key/value head h / (Hq / Hk)); with
 * tree [B, T, T] (not NULL), the tokens are a token tree's nodes and each sees the slots before start, its
 * ancestors and itself (attend_tree_head). */
void sd_attend(const float *qkv, const float *cos, const float *sin, float *kc, float *vc, float *out, long B,
               long T, long Hq, long Hk, long D, long Dr, long start, long cap, float scale, const uint8_t *tree) {
  long width = (Hq + 2 * Hk) * D, group = Hq / Hk;
#pragma omp parallel for collapse(2) schedule(static)
  for (long b = 0; b < B; b++)
    for (long g = 0; g < Hk; g++)
      for (long t = 0; t < T; t++) {
        const float *row = qkv + (b * T + t) * width;
        long slot = ((b * Hk + g) * cap + start + t) * D;
        rotate(row + (Hq + g) * D, cos + (b * T + t) * Dr, sin + (b * T + t) * Dr, kc + slot, D, Dr);
        for (long d = 0; d < D; d++) vc[slot + d] = row[(Hq + Hk + g) * D + d];
      }
#pragma omp parallel for collapse(2) schedule(static)
  for (long b = 0; b < B; b++)
    for (long h = 0; h < Hq; h++) {
      long g = h / group, stride = (start + T + 7) / 8 * 8;
      float *q = malloc((2 * T * D + T * stride) * sizeof(float));
      for (long t = 0; t < T; t++)
        rotate(qkv + (b * T + t) * width + h * D, cos + (b * T + t) * Dr, sin + (b * T + t) * Dr, q + t * D, D, Dr);
      const float *keys = kc + (b * Hk + g) * cap * D, *values = vc + (b * Hk + g) * cap * D;
      float *o = out + b * T * Hq * D + h * D;
      if (tree)
        attend_tree_head(q, keys, values, T, start, D, scale, q + 2 * T * D, stride, q + T * D, tree + b * T * T, o,
                         Hq * D);
      else
        attend_head(q, keys, values, T, start, D, scale, q + 2 * T * D, stride, o, Hq * D);
      free(q);
    }
}
