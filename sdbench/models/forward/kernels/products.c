/* sdbench's CPU products for float32 decoding and verification: y [rows, out] = x [rows, n] W^T (+ b).
 *
 * Built at first use by models/forward/cpukernel.py with the machine's C compiler (-O3 -march=native -fopenmp, AVX2
 * and FMA required) and called through ctypes; the parallel loops run on the OpenMP runtime torch has loaded.
 *
 * Two layouts of W:
 *  - blocked (sd_pack): output rows in blocks of 8, each block holding for every input i the 8 weights
 *    w[8b + j][i] side by side, the last block padded with zeros. One output block is one sequential stream,
 *    a row of x meets it as a broadcast scalar per input, and no horizontal sums are needed. Any rows.
 * Both are width-invariant: a row's outputs are the same bits whatever the number of rows in the call (a
 * verification's row, a tree's node, a row of a batch equal the same token decoded alone).
 *  - plain [out, n] (sd_linear_plain): a weight read in place (a vocabulary head tied to the embedding table),
 *    one sequential stream per output row. At most 8 rows.
 *
 * The sums run in another order than the library's product (as oneDNN's and MKL's differ from each other).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
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

/* how far ahead (bytes) a stream of blocked weights is asked for: the hardware's own prefetch read Qwen2.5-Coder-1.5B's
 * float32 products at 23.7 GB/s a row on the 2-core Xeon; 4 KiB ahead, 28.7 (one row 260 -> 215 ms, five 285 -> 227) */
#define PF32 4096

/* Every row of x meets an output block in one order, whatever the rows beside it (width-invariant: a verification's
 * row is the same bits as that token decoded alone): two sums over the inputs i mod 2, the last input (n odd) in the
 * first, then s0 + s1. A call meets R rows against two output blocks at once (pa, pb) or, the last of an odd number
 * of blocks, one (pa; pb NULL) over the inputs [i0, i1) (i0 even), the sums so far waiting in acc [R, 2, 2, 8]
 * (row, block, sum) between calls: many rows (a prefill) pass over the blocks a chunk of inputs at a time, which
 * stays in L1 while every group of rows meets it. Each broadcast of an input meets both blocks, and the two streams
 * of weights are read side by side: four independent sums a row keep the FMAs' latency hidden even for one row. */
#define PZERO(r)                                                                                               \
  __m256 s##r = _mm256_load_ps(acc + 32 * r), t##r = _mm256_load_ps(acc + 32 * r + 8),                         \
         u##r = _mm256_load_ps(acc + 32 * r + 16), v##r = _mm256_load_ps(acc + 32 * r + 24);
#define PFMA(r, k, A, B)                                                                                       \
  {                                                                                                            \
    __m256 xv = _mm256_broadcast_ss(x + r * n + i + k);                                                        \
    A##r = _mm256_fmadd_ps(wa, xv, A##r);                                                                      \
    if (pb) B##r = _mm256_fmadd_ps(wb, xv, B##r);                                                              \
  }
#define P0(r) PFMA(r, 0, s, u)
#define P1(r) PFMA(r, 1, t, v)
#define PKEEP(r)                                                                                               \
  _mm256_store_ps(acc + 32 * r, s##r), _mm256_store_ps(acc + 32 * r + 8, t##r);                                \
  _mm256_store_ps(acc + 32 * r + 16, u##r), _mm256_store_ps(acc + 32 * r + 24, v##r);
#define PSTEP(k)                                                                                               \
  wa = _mm256_load_ps(pa + (i + k) * 8);                                                                       \
  if (pb) wb = _mm256_load_ps(pb + (i + k) * 8);
#define PAIR(R)                                                                                                \
  static void pair_##R(const float *x, long n, long i0, long i1, const float *pa, const float *pb, float *acc) { \
    R_##R(PZERO) long i = i0;                                                                                  \
    __m256 wa, wb = _mm256_setzero_ps();                                                                       \
    for (; i + 2 <= i1; i += 2) {                                                                              \
      _mm_prefetch((const char *)(pa + i * 8) + PF32, _MM_HINT_T0);                                            \
      if (pb) _mm_prefetch((const char *)(pb + i * 8) + PF32, _MM_HINT_T0);                                    \
      PSTEP(0) R_##R(P0) PSTEP(1) R_##R(P1)                                                                    \
    }                                                                                                          \
    for (; i < i1; i++) {                                                                                      \
      PSTEP(0) R_##R(P0)                                                                                       \
    }                                                                                                          \
    R_##R(PKEEP)                                                                                               \
  }
PAIR(1) PAIR(2) PAIR(3) PAIR(4) PAIR(5) PAIR(6)

typedef void (*pair_fn)(const float *, long, long, long, const float *, const float *, float *);
static const pair_fn pairs[7] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6};
/* rows a call meets: four sums a row held in registers (AVX-512's 32 vector registers hold six rows' with the
 * weights; AVX2's 16, three) */
#if defined(__AVX512VL__)
#define PROWS 6
#else
#define PROWS 3
#endif
#define CHUNK 256  /* inputs a group of rows meets at a time when there are several groups (even) */
#define SWEEP 48   /* rows of x per sweep over the outputs (their sums: 6 KiB a block) */

/* s0 + s1 of a row's two sums for one block (acc [2, 8]), with the bias, into y */
ALWAYS void finish(const float *acc, float *y, long o, long out, const float *b) {
  store8(y, o, out, _mm256_add_ps(_mm256_load_ps(acc), _mm256_load_ps(acc + 8)), b);
}

/* rows (<= SWEEP) of x against the output block at o (pa its weights) and the next one (pb; NULL: none) */
static void block_rows(const float *x, long rows, long n, const float *pa, const float *pb, const float *b, float *y,
                       long out, long o) {
  float acc[SWEEP * 32] __attribute__((aligned(32)));
  for (long j = 0; j < rows * 32; j++) acc[j] = 0.0f;
  long step = rows <= PROWS ? n : CHUNK;
  for (long i0 = 0; i0 < n; i0 += step) {
    long i1 = i0 + step < n ? i0 + step : n;
    for (long r0 = 0; r0 < rows; r0 += PROWS)
      pairs[rows - r0 < PROWS ? rows - r0 : PROWS](x + r0 * n, n, i0, i1, pa, pb, acc + 32 * r0);
  }
  for (long r = 0; r < rows; r++) {
    finish(acc + 32 * r, y + r * out, o, out, b);
    if (pb) finish(acc + 32 * r + 16, y + r * out, o + 8, out, b);
  }
}

/* y [rows, out] = x [rows, n] W^T (+ b), W blocked (sd_pack); x and y contiguous, wp 32-byte aligned: the blocks in
 * pairs, the last one alone where their number is odd */
void sd_linear_blocked(const float *x, const float *wp, const float *b, float *y, long rows, long n, long out) {
  long blocks = (out + 7) / 8, units = (blocks + 1) / 2;
  for (long c = 0; c < rows; c += SWEEP) {
    long chunk = rows - c < SWEEP ? rows - c : SWEEP;
#pragma omp parallel for schedule(static)
    for (long k = 0; k < units; k++) {
      const float *second = 2 * k + 1 < blocks ? wp + (2 * k + 1) * n * 8 : 0;
      block_rows(x + c * n, chunk, n, wp + 2 * k * n * 8, second, b, y + c * out, out, 16 * k);
    }
  }
}

ALWAYS float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* R rows of x against one plain output row o, two sums per row: each row's the same whatever R */
#define ZERO2(r) __m256 c##r = _mm256_setzero_ps(), d##r = c##r;
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
        _mm_prefetch((const char *)(wr + i) + PF32, _MM_HINT_T0);                                        \
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
