/* sdbench's CPU products over weights in llama.cpp's quantised block formats, read as stored:
 * y [rows, out] = x [rows, n] W^T (+ b), x and y float32.
 *
 * W is [out, n] as a GGUF file stores it: each output row is its n / 32 blocks in order, each block a float16
 * scale d and 32 quantised inputs:
 *  - Q8_0 (34 bytes): 32 int8 q; w = d q;
 *  - Q4_0 (18 bytes): 16 bytes, input j in the low four bits of byte j and input j + 16 in the high four; w = d (q - 8).
 * A block is de-quantised to float32 in registers (d q is exact in float32: the value a de-quantised copy holds)
 * and met by every row of x while it is there, so the weights are read once per call whatever the rows; the sums
 * run in another order than a product over the de-quantised copy, and in the same order for a row whatever the rows
 * beside it (width-invariant; the integer products below are too: their block sums are exact). Compiled after products.c as one unit
 * (models/forward/cpukernel.py), whose ALWAYS, R_n and hsum it uses; F16C for the scales.
 */
#include <stdint.h>

#define QK 32 /* inputs per block */

typedef struct {
  uint16_t d;
  int8_t q[QK];
} __attribute__((packed)) block_q8_0;

typedef struct {
  uint16_t d;
  uint8_t q[QK / 2];
} __attribute__((packed)) block_q4_0;

ALWAYS __m256 widen(__m128i bytes, __m256 d) { /* the low 8 int8 lanes of bytes, times d */
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}

/* part k (inputs 8k..8k+7) of a block, de-quantised */
ALWAYS __m256 part_q8_0(const void *blk, int k, __m256 d) {
  return widen(_mm_loadl_epi64((const __m128i *)(((const block_q8_0 *)blk)->q + 8 * k)), d);
}

ALWAYS __m256 part_q4_0(const void *blk, int k, __m256 d) {
  __m128i v = _mm_loadu_si128((const __m128i *)((const block_q4_0 *)blk)->q), m = _mm_set1_epi8(15);
  __m128i q = k < 2 ? _mm_and_si128(v, m) : _mm_and_si128(_mm_srli_epi16(v, 4), m);
  if (k % 2) q = _mm_srli_si128(q, 8);
  return widen(_mm_sub_epi8(q, _mm_set1_epi8(8)), d);
}

ALWAYS __m256 scale(const void *blk) { return _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)blk)); }

/* R rows against one output row, each row in the one order a row alone takes (width-invariant): per block the parts'
 * products over its de-quantised quants, t = p0 x0 + p2 x2 and u = p1 x1 + p3 x3, and (t + u) times the block's scale
 * into one of two sums (even and odd blocks), added at the end; the scale is met once a block instead of four times */
#define BZERO(r) __m256 s##r = _mm256_setzero_ps(), z##r = s##r;
#define BBLOCK(r)                                                                                              \
  {                                                                                                            \
    const float *xr = x + r * n + i;                                                                           \
    __m256 t = _mm256_mul_ps(p0, _mm256_loadu_ps(xr)), u = _mm256_mul_ps(p1, _mm256_loadu_ps(xr + 8));          \
    t = _mm256_fmadd_ps(p2, _mm256_loadu_ps(xr + 16), t);                                                      \
    u = _mm256_fmadd_ps(p3, _mm256_loadu_ps(xr + 24), u);                                                      \
    if (k % 2)                                                                                                 \
      z##r = _mm256_fmadd_ps(_mm256_add_ps(t, u), d, z##r);                                                    \
    else                                                                                                       \
      s##r = _mm256_fmadd_ps(_mm256_add_ps(t, u), d, s##r);                                                    \
  }
#define BSTORE(r) y[r * out] = hsum(_mm256_add_ps(s##r, z##r)) + bias;
#define ROWS(T, R)                                                                                             \
  static void rows_##T##_##R(const float *x, long n, const uint8_t *wr, float bias, float *y, long out) {     \
    __m256 one = _mm256_set1_ps(1.0f);                                                                         \
    R_##R(BZERO) for (long i = 0, k = 0; i < n; i += QK, k++) {                                                 \
      const void *blk = wr + k * sizeof(block_##T);                                                            \
      __m256 d = scale(blk), p0 = part_##T(blk, 0, one), p1 = part_##T(blk, 1, one);                           \
      __m256 p2 = part_##T(blk, 2, one), p3 = part_##T(blk, 3, one);                                           \
      R_##R(BBLOCK)                                                                                            \
    }                                                                                                          \
    R_##R(BSTORE)                                                                                              \
  }

typedef void (*rows_fn)(const float *, long, const uint8_t *, float, float *, long);
#define KERNELS(T)                                                                                             \
  ROWS(T, 1) ROWS(T, 2) ROWS(T, 3) ROWS(T, 4) ROWS(T, 5) ROWS(T, 6)                                                \
  static const rows_fn rows_##T[7] = {0, rows_##T##_1, rows_##T##_2, rows_##T##_3, rows_##T##_4, rows_##T##_5, \
                                      rows_##T##_6};
KERNELS(q8_0)
KERNELS(q4_0)

#define PASS 6    /* rows of x met by one read of a block */
#define SWEEP 48 /* rows of x per sweep over the outputs: a long prefill keeps its rows in cache */

static void product(const rows_fn *fns, size_t block, const float *x, const uint8_t *w, const float *b, float *y,
                    long rows, long n, long out) {
  size_t row_bytes = (size_t)(n / QK) * block;
  for (long c = 0; c < rows; c += SWEEP) {
    long chunk = rows - c < SWEEP ? rows - c : SWEEP;
#pragma omp parallel for schedule(static)
    for (long o = 0; o < out; o++)
      for (long r = c; r < c + chunk; r += PASS) {
        long k = c + chunk - r < PASS ? c + chunk - r : PASS;
        fns[k](x + r * n, n, w + o * row_bytes, b ? b[o] : 0.0f, y + r * out + o, out);
      }
  }
}

/* y [rows, out] = x [rows, n] W^T (+ b), W [out, n] in Q8_0 / Q4_0 blocks as stored (n a multiple of 32): any rows */
void sd_linear_q8_0(const float *x, const uint8_t *w, const float *b, float *y, long rows, long n, long out) {
  product(rows_q8_0, sizeof(block_q8_0), x, w, b, y, rows, n, out);
}

void sd_linear_q4_0(const float *x, const uint8_t *w, const float *b, float *y, long rows, long n, long out) {
  product(rows_q4_0, sizeof(block_q4_0), x, w, b, y, rows, n, out);
}

/* ---- 8-bit activations and integer dot products (VNNI), on blocks regrouped by G output rows ----
 *
 * What llama.cpp's CPU products compute: each row of x quantised per block of 32 as Q8_0 is (dx = max|x| / 127
 * stored in float16, xq = round(x / dx)), then per block the exact integer sum of wq xq, scaled by dw dx. The
 * weights are regrouped (models/forward/quants.py `group`) so that one vector holds 4 inputs of G output rows (G = 16
 * with AVX-512's 64-byte vectors, else 8): one VNNI instruction multiplies them by a broadcast of 4 of x's bytes into
 * the G rows' sums, and the G scales of a block are one vector, so nothing is summed across lanes. A group-block is
 * the G rows' float16 scales (2G bytes) then the quants, for k = 0..7 (Q8_0) the inputs 4k..4k+3 of rows 0..G-1 as
 * unsigned bytes w + 128 (32 G bytes), or for k = 0..3 (Q4_0) bytes 4k..4k+3 of rows 0..G-1 as stored, low halves
 * the inputs 4k.., high halves 16 + 4k.. (16 G bytes). The unsigned offset (128, or Q4_0's 8) comes back out as
 * offset * sum(xq).
 */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SD_VNNI 1
#define G 16
typedef __m512 vf;
typedef __m512i vi;
#define DOT4(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define VF(x) _mm512_##x##_ps
#define VI(x) _mm512_##x
#define LOADI(p) _mm512_loadu_si512((const void *)(p))
#define SCALES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VAND _mm512_and_si512
#elif (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define SD_VNNI 1
#define G 8
typedef __m256 vf;
typedef __m256i vi;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT4(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
#define DOT4(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#define VF(x) _mm256_##x##_ps
#define VI(x) _mm256_##x
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define SCALES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VAND _mm256_and_si256
#endif
#if defined(SD_VNNI) && !defined(SD_NO_VNNI)
#include <math.h>

typedef struct {
  float d;       /* the block's scale, as its float16 holds it */
  int32_t sum;   /* sum of q */
  int8_t q[QK];
} xblock;

/* round half away from zero, exactly (as C's roundf): floor(a) + floor(2 (a - floor(a))) with a = |v| */
ALWAYS __m256 round_away(__m256 v) {
  __m256 sign = _mm256_set1_ps(-0.0f), a = _mm256_andnot_ps(sign, v), f = _mm256_floor_ps(a);
  __m256 r = _mm256_add_ps(f, _mm256_floor_ps(_mm256_add_ps(_mm256_sub_ps(a, f), _mm256_sub_ps(a, f))));
  return _mm256_or_ps(r, _mm256_and_ps(sign, v));
}

/* rows of x [rows, n] as Q8_0 blocks, xb [rows * n / 32] */
static void quantise_x(const float *x, long rows, long n, xblock *xb) {
  long nb = n / QK;
  for (long t = 0; t < rows * nb; t++) {
    const float *v = x + (t / nb) * n + (t % nb) * QK;
    __m256 sign = _mm256_set1_ps(-0.0f), p[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
      p[k] = _mm256_loadu_ps(v + 8 * k);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, p[k]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float d = _mm_cvtss_f32(h) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i q[4], total = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
      q[k] = _mm256_cvtps_epi32(round_away(_mm256_mul_ps(p[k], _mm256_set1_ps(id))));
      total = _mm256_add_epi32(total, q[k]);
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)xb[t].q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    xb[t].sum = _mm_cvtsi128_si32(s);
    xb[t].d = _cvtsh_ss(_cvtss_sh(d, 0));
  }
}

ALWAYS void quads_q8_0(const uint8_t *gb, vi w[8]) {
  for (int k = 0; k < 8; k++) w[k] = LOADI(gb + 2 * G + 4 * G * k);
}

ALWAYS void quads_q4_0(const uint8_t *gb, vi w[8]) {
  vi m = VI(set1_epi8)(15);
  for (int k = 0; k < 4; k++) {
    vi v = LOADI(gb + 2 * G + 4 * G * k);
    w[k] = VAND(v, m);
    w[k + 4] = VAND(VI(srli_epi16)(v, 4), m);
  }
}

/* R rows against one group of G outputs: y[r * out + j] for j < live */
#define GZERO(r) vf a##r = VF(setzero)();
#define GROW(r)                                                                                               \
  {                                                                                                           \
    const xblock *xr = xb + r * nb + b;                                                                       \
    const int32_t *xq = (const int32_t *)xr->q;                                                              \
    vi p = VI(set1_epi32)(-OFF * xr->sum), e = VI(set1_epi32)(0); /* two chains of four */                   \
    for (int k = 0; k < 8; k += 2) {                                                                          \
      p = DOT4(p, w[k], VI(set1_epi32)(xq[k]));                                                               \
      e = DOT4(e, w[k + 1], VI(set1_epi32)(xq[k + 1]));                                                       \
    }                                                                                                         \
    a##r = VF(fmadd)(VI(cvtepi32_ps)(VI(add_epi32)(p, e)), VF(mul)(dw, VF(set1)(xr->d)), a##r);               \
  }
#define GSTORE(r)                                                                                             \
  {                                                                                                           \
    float t[G];                                                                                               \
    VF(storeu)(t, a##r);                                                                                      \
    for (long j = 0; j < live; j++) y[r * out + j] = t[j] + (bias ? bias[j] : 0.0f);                         \
  }
#define GROUP(T, R)                                                                                           \
  static void group_##T##_##R(const xblock *xb, long nb, const uint8_t *g, const float *bias, float *y,        \
                              long out, long live) {                                                          \
    R_##R(GZERO) for (long b = 0; b < nb; b++) {                                                              \
      const uint8_t *gb = g + b * GROUP_BYTES_##T;                                                            \
      for (int l = 0; l < GROUP_BYTES_##T; l += 64) _mm_prefetch((const char *)gb + PF + l, _MM_HINT_T0);    \
      vf dw = SCALES(gb);                                                                                     \
      vi w[8];                                                                                                \
      quads_##T(gb, w);                                                                                       \
      R_##R(GROW)                                                                                             \
    }                                                                                                         \
    R_##R(GSTORE)                                                                                             \
  }

typedef void (*group_fn)(const xblock *, long, const uint8_t *, const float *, float *, long, long);
#define GROUP_BYTES_q8_0 (2 * G + 4 * G * 8)
#define GROUP_BYTES_q4_0 (2 * G + 4 * G * 4)
#define GROUPS(T)                                                                                             \
  GROUP(T, 1) GROUP(T, 2) GROUP(T, 3) GROUP(T, 4) GROUP(T, 5) GROUP(T, 6)                                     \
  static const group_fn groups_##T[GPASS + 1] = {0, group_##T##_1, group_##T##_2, group_##T##_3, group_##T##_4, \
                                                 group_##T##_5, group_##T##_6};
/* how far ahead (bytes) each group-block asks for its weights: the hardware's own prefetch left one row's product at
 * 17 GB/s and five rows' at 1.38 times its time (Qwen2.5-Coder-1.5B's products at Q4_0 on the 2-core Xeon); 4 KiB
 * ahead, 21.7 GB/s and 1.11 times (1 KiB: 1.22, 2 KiB: 1.18, 8-16 KiB: 1.15-1.16) */
#define PF 4096
#define GPASS 6 /* rows met by one group-block's quants in registers (8 of them, and a sum per row) */
#define OFF 128
GROUPS(q8_0)
#undef OFF
#define OFF 8
GROUPS(q4_0)
#undef OFF

static void grouped(const group_fn *fns, size_t group_bytes, const float *x, const uint8_t *w, const float *b,
                    float *y, long rows, long n, long out) {
  long nb = n / QK, groups = (out + G - 1) / G;
  xblock *xb = aligned_alloc(64, ((rows * nb * sizeof(xblock) + 63) / 64) * 64);
  quantise_x(x, rows, n, xb);
  for (long c = 0; c < rows; c += SWEEP) {
    long chunk = rows - c < SWEEP ? rows - c : SWEEP;
#pragma omp parallel for schedule(static)
    for (long g = 0; g < groups; g++) {
      long live = out - g * G < G ? out - g * G : G;
      for (long r = c; r < c + chunk; r += GPASS) {
        long k = c + chunk - r < GPASS ? c + chunk - r : GPASS;
        fns[k](xb + r * nb, nb, w + g * nb * group_bytes, b ? b + g * G : 0, y + r * out + g * G, out, live);
      }
    }
  }
  free(xb);
}

/* the output rows per group where the grouped integer products are built here (the weights are then grouped:
 * sd_linear_grouped_*), else 0 */
int sd_grouped(void) { return G; }

void sd_linear_grouped_q8_0(const float *x, const uint8_t *w, const float *b, float *y, long rows, long n, long out) {
  grouped(groups_q8_0, GROUP_BYTES_q8_0, x, w, b, y, rows, n, out);
}

void sd_linear_grouped_q4_0(const float *x, const uint8_t *w, const float *b, float *y, long rows, long n, long out) {
  grouped(groups_q4_0, GROUP_BYTES_q4_0, x, w, b, y, rows, n, out);
}
#else
int sd_grouped(void) { return 0; }
#endif
