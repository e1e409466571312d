/* sdbench's CPU products for float32 decoding and verification: y [rows, out] = x [rows, n] W^T (+ b).
 *
 * Built at first use by models/forward/cpukernel.py with the machine's C compiler (-O3 -march=native -fopenmp, AVX2
 * and FMA required) and called through ctypes; the parallel loops run on the OpenMP runtime torch has loaded.
 *
 * Two layouts of W:
 *  - blocked (sd_pack): output rows in blocks of 8, each block holding for every input i the 8 weights
 *    w[8b + j][i] side by side, the last block padded with zeros. One output block is one sequential stream,
 *    a row of x meets it as a broadcast scalar per input, and no horizontal sums are needed. Any rows.
 *  - plain [out, n] (sd_linear_plain): a weight read in place (a vocabulary head tied to the embedding table),
 *    one sequential stream per output row. At most 8 rows.
 *
 * The sums run in another order than the library's product (as oneDNN's and MKL's differ from each other).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "sdbench's CPU products need AVX2 and FMA"
#endif

#define ALWAYS static inline __attribute__((always_inline))

void sd_pack(const float *w, float *wp, long out, long n) {
  long blocks = (out + 7) / 8;
#pragma omp parallel for schedule(static)
  for (long b = 0; b < blocks; b++)
    for (long i = 0; i < n; i++)
      for (long j = 0; j < 8; j++) {
        long o = 8 * b + j;
        wp[(b * n + i) * 8 + j] = o < out ? w[o * n + i] : 0.0f;
      }
}

void sd_unpack(const float *wp, float *w, long out, long n) {
#pragma omp parallel for schedule(static)
  for (long o = 0; o < out; o++)
    for (long i = 0; i < n; i++) w[o * n + i] = wp[((o / 8) * n + i) * 8 + o % 8];
}

/* one block of 8 outputs of one row: s (+ bias), the last block only as far as `out` */
ALWAYS void store8(float *y, long o, long out, __m256 s, const float *b) {
  if (o + 8 <= out) {
    if (b) s = _mm256_add_ps(s, _mm256_loadu_ps(b + o));
    _mm256_storeu_ps(y + o, s);
  } else {
    float t[8];
    _mm256_storeu_ps(t, s);
    for (long j = 0; o + j < out; j++) y[o + j] = t[j] + (b ? b[o + j] : 0.0f);
  }
}

/* Every accumulator is a named variable (R_n(F) repeats F(r) for r = 0..n-1): held in arrays, gcc keeps them in
 * memory and stores each one at every step, which made the wide products several times slower. */
#define R_1(F) F(0)
#define R_2(F) R_1(F) F(1)
#define R_3(F) R_2(F) F(2)
#define R_4(F) R_3(F) F(3)
#define R_5(F) R_4(F) F(4)
#define R_6(F) R_5(F) F(5)
#define R_7(F) R_6(F) F(6)
#define R_8(F) R_7(F) F(7)

#define ZERO(r) __m256 c##r = _mm256_setzero_ps();
#define ZERO2(r) __m256 c##r = _mm256_setzero_ps(), d##r = c##r;
#define FMA1(r) c##r = _mm256_fmadd_ps(wa, _mm256_broadcast_ss(x + r * n + i), c##r);
#define OUT1(r) store8(y + r * out, o, out, c##r, b);
#define OUT2(r) OUT1(r) store8(y + r * out, o + 8, out, d##r, b);

ALWAYS __m256 load8(const float *y, long o, long out) {
  if (o + 8 <= out) return _mm256_loadu_ps(y + o);
  float t[8] = {0};
  for (long j = 0; o + j < out; j++) t[j] = y[o + j];
  return _mm256_loadu_ps(t);
}

/* R rows of x against one output block (8 outputs): decoding and verification widths */
#define BLOCK1(R)                                                                                               \
  static void block1_##R(const float *x, long n, const float *wp, const float *b, float *y, long out, long o) { \
    R_##R(ZERO) for (long i = 0; i < n; i++) {                                                                  \
      __m256 wa = _mm256_load_ps(wp + i * 8);                                                                   \
      R_##R(FMA1)                                                                                               \
    }                                                                                                           \
    R_##R(OUT1)                                                                                                 \
  }
BLOCK1(5) BLOCK1(6) BLOCK1(7) BLOCK1(8)

/* 2-4 rows: two sums per row over alternate inputs, so that each row's chain of dependent FMAs is not what
 * limits the stream (a single chain waits an FMA's latency per 32 bytes of weights) */
#define FMA1D(r) d##r = _mm256_fmadd_ps(wb, _mm256_broadcast_ss(x + r * n + i + 1), d##r);
#define SUM2(r) c##r = _mm256_add_ps(c##r, d##r);
#define BLOCK1U2(R)                                                                                             \
  static void block1_##R(const float *x, long n, const float *wp, const float *b, float *y, long out, long o) { \
    R_##R(ZERO2) long i = 0;                                                                                    \
    for (; i + 2 <= n; i += 2) {                                                                                \
      __m256 wa = _mm256_load_ps(wp + i * 8), wb = _mm256_load_ps(wp + i * 8 + 8);                              \
      R_##R(FMA1) R_##R(FMA1D)                                                                                  \
    }                                                                                                           \
    for (; i < n; i++) {                                                                                        \
      __m256 wa = _mm256_load_ps(wp + i * 8);                                                                   \
      R_##R(FMA1)                                                                                               \
    }                                                                                                           \
    R_##R(SUM2) R_##R(OUT1)                                                                                     \
  }
BLOCK1U2(2) BLOCK1U2(3) BLOCK1U2(4)

/* how far ahead (bytes) a stream of blocked weights is asked for: the hardware's own prefetch read Qwen2.5-Coder-1.5B's
 * float32 products at 23.7 GB/s a row on the 2-core Xeon; 4 KiB ahead, 28.7 (one row 260 -> 215 ms, five 285 -> 227) */
#define PF32 4096
/* one row (decoding): four sums over inputs i mod 4 */
static void block1_1(const float *x, long n, const float *wp, const float *b, float *y, long out, long o) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  long i = 0;
  for (; i + 4 <= n; i += 4) {
    _mm_prefetch((const char *)(wp + i * 8) + PF32, _MM_HINT_T0);
    _mm_prefetch((const char *)(wp + i * 8) + PF32 + 64, _MM_HINT_T0);
    s0 = _mm256_fmadd_ps(_mm256_load_ps(wp + i * 8), _mm256_broadcast_ss(x + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_load_ps(wp + i * 8 + 8), _mm256_broadcast_ss(x + i + 1), s1);
    s2 = _mm256_fmadd_ps(_mm256_load_ps(wp + i * 8 + 16), _mm256_broadcast_ss(x + i + 2), s2);
    s3 = _mm256_fmadd_ps(_mm256_load_ps(wp + i * 8 + 24), _mm256_broadcast_ss(x + i + 3), s3);
  }
  for (; i < n; i++) s0 = _mm256_fmadd_ps(_mm256_load_ps(wp + i * 8), _mm256_broadcast_ss(x + i), s0);
  store8(y, o, out, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)), b);
}

/* R (<= 6) rows against two output blocks over the inputs [i0, i1): the 6x16 tile of a wide product (a
 * prefill). The inputs come in chunks that keep both blocks' weights and the rows' inputs in L1 while every
 * group of rows passes over them; the sums so far wait in y between chunks (bias added after the last). */
#define LOAD2(r)                             \
  __m256 c##r = load8(y + r * out, o, out),  \
         d##r = load8(y + r * out, o + 8, out);
#define FMA2(r)                                           \
  {                                                       \
    __m256 xv = _mm256_broadcast_ss(x + r * n + i);       \
    c##r = _mm256_fmadd_ps(wa, xv, c##r);                 \
    d##r = _mm256_fmadd_ps(wb, xv, d##r);                 \
  }
#define TILE(R)                                                                                               \
  static void tile_##R(const float *x, long n, long i0, long i1, const float *pa, const float *pb,           \
                       const float *b, float *y, long out, long o) {                                         \
    R_##R(LOAD2) for (long i = i0; i < i1; i++) {                                                             \
      _mm_prefetch((const char *)(pa + i * 8) + PF32, _MM_HINT_T0);                                           \
      _mm_prefetch((const char *)(pb + i * 8) + PF32, _MM_HINT_T0);                                           \
      __m256 wa = _mm256_load_ps(pa + i * 8), wb = _mm256_load_ps(pb + i * 8);                                \
      R_##R(FMA2)                                                                                             \
    }                                                                                                         \
    R_##R(OUT2)                                                                                               \
  }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

typedef void (*tile_fn)(const float *, long, long, long, const float *, const float *, const float *, float *, long,
                        long);
static const tile_fn tiles[7] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#define CHUNK 256

typedef void (*block_fn)(const float *, long, const float *, const float *, float *, long, long);
static const block_fn blocks1[9] = {0, block1_1, block1_2, block1_3, block1_4, block1_5, block1_6, block1_7, block1_8};

/* any rows against one output block, 8 at a time */
static void narrow(const float *x, long rows, long n, const float *wp, const float *b, float *y, long out, long o) {
  for (long r0 = 0; r0 < rows; r0 += 8)
    blocks1[rows - r0 < 8 ? rows - r0 : 8](x + r0 * n, n, wp, b, y + r0 * out, out, o);
}

/* any rows against two output blocks: chunk by chunk of the inputs, 6 rows at a time */
static void wide(const float *x, long rows, long n, const float *pa, const float *pb, const float *b, float *y,
                 long out, long o) {
  for (long r = 0; r < rows; r++) {
    store8(y + r * out, o, out, _mm256_setzero_ps(), 0);
    store8(y + r * out, o + 8, out, _mm256_setzero_ps(), 0);
  }
  for (long i0 = 0; i0 < n; i0 += CHUNK) {
    long i1 = i0 + CHUNK < n ? i0 + CHUNK : n;
    const float *bias = i1 == n ? b : 0;
    for (long r0 = 0; r0 < rows; r0 += 6)
      tiles[rows - r0 < 6 ? rows - r0 : 6](x + r0 * n, n, i0, i1, pa, pb, bias, y + r0 * out, out, o);
  }
}

/* y [rows, out] = x [rows, n] W^T (+ b), W blocked (sd_pack); x and y contiguous, wp 32-byte aligned */
void sd_linear_blocked(const float *x, const float *wp, const float *b, float *y, long rows, long n, long out) {
  long blocks = (out + 7) / 8;
  if (rows == 1) { /* decoding: one block at a time; two or more rows meet two blocks per broadcast (fewer loads) */
#pragma omp parallel for schedule(static)
    for (long k = 0; k < blocks; k++) narrow(x, rows, n, wp + k * n * 8, b, y, out, 8 * k);
    return;
  }
  long pairs = blocks / 2;
#pragma omp parallel for schedule(static)
  for (long k = 0; k < pairs; k++)
    wide(x, rows, n, wp + 2 * k * n * 8, wp + (2 * k + 1) * n * 8, b, y, out, 16 * k);
  if (blocks % 2) narrow(x, rows, n, wp + (blocks - 1) * n * 8, b, y, out, 8 * (blocks - 1));
}

ALWAYS float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* R rows of x against one plain output row o, two sums per row */
#define DOT(r)                                                              \
  c##r = _mm256_fmadd_ps(wa, _mm256_loadu_ps(x + r * n + i), c##r);         \
  d##r = _mm256_fmadd_ps(wb, _mm256_loadu_ps(x + r * n + i + 8), d##r);
#define TAIL(r)                                                             \
  {                                                                         \
    float t = hsum(_mm256_add_ps(c##r, d##r));                              \
    for (long k = i; k < n; k++) t += wr[k] * x[r * n + k];                 \
    y[r * out + o] = t + (b ? b[o] : 0.0f);                                 \
  }
#define PLAIN(R)                                                                                         \
  static void plain_##R(const float *x, const float *w, const float *b, float *y, long n, long out) {   \
    _Pragma("omp parallel for schedule(static)") for (long o = 0; o < out; o++) {                        \
      const float *wr = w + o * n;                                                                       \
      R_##R(ZERO2) long i = 0;                                                                           \
      for (; i + 16 <= n; i += 16) {                                                                     \
        __m256 wa = _mm256_loadu_ps(wr + i), wb = _mm256_loadu_ps(wr + i + 8);                           \
        R_##R(DOT)                                                                                       \
      }                                                                                                  \
      R_##R(TAIL)                                                                                        \
    }                                                                                                    \
  }
PLAIN(1) PLAIN(2) PLAIN(3) PLAIN(4) PLAIN(5) PLAIN(6) PLAIN(7) PLAIN(8)

typedef void (*plain_fn)(const float *, const float *, const float *, float *, long, long);
static const plain_fn plains[9] = {0, plain_1, plain_2, plain_3, plain_4, plain_5, plain_6, plain_7, plain_8};

/* y [rows, out] = x [rows, n] W^T (+ b), W plain [out, n]; rows 1..8 (else nothing is written and 1 returned) */
int sd_linear_plain(const float *x, const float *w, const float *b, float *y, long rows, long n, long out) {
  if (rows < 1 || rows > 8) return 1;
  plains[rows](x, w, b, y, n, out);
  return 0;
}
