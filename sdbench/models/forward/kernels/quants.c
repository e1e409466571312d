/* sdbench's CPU products over weights in llama.cpp's quantised block formats, read as stored:
 * y [rows, out] = x [rows, n] W^T (+ b), x and y float32.
 *
 * W is [out, n] as a GGUF file stores it: each output row is its n / 32 blocks in order, each block a float16
 * scale d and 32 quantised inputs:
 *  - Q8_0 (34 bytes): 32 int8 q; w = d q;
 *  - Q4_0 (18 bytes): 16 bytes, input j in the low four bits of byte j and input j + 16 in the high four; w = d (q - 8).
 * A block is de-quantised to float32 in registers (d q is exact in float32: the value a de-quantised copy holds)
 * and met by every row of x while it is there, so the weights are read once per call whatever the rows; the sums
 * run in another order than a product over the de-quantised copy. Built with products.c (models/forward/cpukernel.py;
 * F16C for the scales).
 */
#include <immintrin.h>
#include <stdint.h>

#define ALWAYS static inline __attribute__((always_inline))
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

ALWAYS float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

/* R rows against one output row: two sums per row (parts 0, 2 and 1, 3), so that a row's dependent FMAs are not
 * what limits the stream; one row keeps four */
#define R_1(F) F(0)
#define R_2(F) R_1(F) F(1)
#define R_3(F) R_2(F) F(2)
#define R_4(F) R_3(F) F(3)
#define R_5(F) R_4(F) F(4)
#define R_6(F) R_5(F) F(5)
#define ZERO(r) __m256 a##r = _mm256_setzero_ps(), b##r = a##r;
#define FMA_A(r) a##r = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * n + j), a##r);
#define FMA_B(r) b##r = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * n + j), b##r);
#define STORE(r) y[r * out] = hsum8(_mm256_add_ps(a##r, b##r)) + bias;
#define ROWS(T, R)                                                                                             \
  static void rows_##T##_##R(const float *x, long n, const uint8_t *wr, float bias, float *y, long out) {     \
    R_##R(ZERO) for (long i = 0, k = 0; i < n; i += QK, k++) {                                                 \
      const void *blk = wr + k * sizeof(block_##T);                                                            \
      __m256 d = scale(blk), w = part_##T(blk, 0, d);                                                          \
      long j = i;                                                                                              \
      R_##R(FMA_A) w = part_##T(blk, 1, d), j = i + 8;                                                         \
      R_##R(FMA_B) w = part_##T(blk, 2, d), j = i + 16;                                                        \
      R_##R(FMA_A) w = part_##T(blk, 3, d), j = i + 24;                                                        \
      R_##R(FMA_B)                                                                                             \
    }                                                                                                          \
    R_##R(STORE)                                                                                               \
  }

/* one row: four sums, each block's sum taken before its scale (one multiply a block instead of four) */
#define ONE(T)                                                                                                 \
  static void rows_##T##_1(const float *x, long n, const uint8_t *wr, float bias, float *y, long out) {       \
    (void)out;                                                                                                 \
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, one = _mm256_set1_ps(1.0f);                                      \
    for (long i = 0, k = 0; i < n; i += QK, k++) {                                                             \
      const void *blk = wr + k * sizeof(block_##T);                                                            \
      __m256 t = _mm256_mul_ps(part_##T(blk, 0, one), _mm256_loadu_ps(x + i));                                 \
      __m256 u = _mm256_mul_ps(part_##T(blk, 1, one), _mm256_loadu_ps(x + i + 8));                             \
      t = _mm256_fmadd_ps(part_##T(blk, 2, one), _mm256_loadu_ps(x + i + 16), t);                              \
      u = _mm256_fmadd_ps(part_##T(blk, 3, one), _mm256_loadu_ps(x + i + 24), u);                              \
      if (k % 2)                                                                                               \
        s1 = _mm256_fmadd_ps(_mm256_add_ps(t, u), scale(blk), s1);                                             \
      else                                                                                                     \
        s0 = _mm256_fmadd_ps(_mm256_add_ps(t, u), scale(blk), s0);                                             \
    }                                                                                                          \
    y[0] = hsum8(_mm256_add_ps(s0, s1)) + bias;                                                                \
  }

typedef void (*rows_fn)(const float *, long, const uint8_t *, float, float *, long);
#define KERNELS(T)                                                                                             \
  ONE(T) ROWS(T, 2) ROWS(T, 3) ROWS(T, 4) ROWS(T, 5) ROWS(T, 6)                                                \
  static const rows_fn rows_##T[7] = {0, rows_##T##_1, rows_##T##_2, rows_##T##_3, rows_##T##_4, rows_##T##_5, \
                                      rows_##T##_6};
KERNELS(q8_0)
KERNELS(q4_0)

#define PASS 6    /* rows of x met by one read of a block */
#define CHUNK 48 /* rows of x per sweep over the outputs: a long prefill keeps its rows in cache */

static void product(const rows_fn *fns, size_t block, const float *x, const uint8_t *w, const float *b, float *y,
                    long rows, long n, long out) {
  size_t row_bytes = (size_t)(n / QK) * block;
  for (long c = 0; c < rows; c += CHUNK) {
    long chunk = rows - c < CHUNK ? rows - c : CHUNK;
#pragma omp parallel for schedule(static)
    for (long o = 0; o < out; o++)
      for (long r = c; r < c + chunk; r += PASS) {
        long k = c + chunk - r < PASS ? c + chunk - r : PASS;
        fns[k](x + r * n, n, w + o * row_bytes, b ? b[o] : 0.0f, y + r * out + o, out);
      }
  }
}

/* y [rows, out] = x [rows, n] W^T (+ b), W [out, n] in Q8_0 / Q4_0 blocks (n a multiple of 32): any rows */
void sd_linear_q8_0(const float *x, const uint8_t *w, const float *b, float *y, long rows, long n, long out) {
  product(rows_q8_0, sizeof(block_q8_0), x, w, b, y, rows, n, out);
}

void sd_linear_q4_0(const float *x, const uint8_t *w, const float *b, float *y, long rows, long n, long out) {
  product(rows_q4_0, sizeof(block_q4_0), x, w, b, y, rows, n, out);
}
