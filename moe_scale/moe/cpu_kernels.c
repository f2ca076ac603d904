/* Per-expert products for many small experts on CPU (float32). With few rows per expert the time goes to
 * streaming the expert weights, and MKL's GEMM reaches about half the machine's bandwidth on such shapes.
 * Each kernel here reads (or writes) every expert's W exactly once, in order, prefetching ahead, with the
 * expert's few rows held in cache and the partial results in registers.
 *
 * Legend: W is [E, N, K] row-major; expert e owns rows [offsets[e], offsets[e + 1]) of the row operands.
 *   rows_times_wt  out[M, N] = a[M, K] . W[e]^T   (each row r of expert e: out[r] = W[e] a[r]; dot products
 *                  of W's rows, one at a time for an expert with few rows, in 4 x 4 tiles for one with many)
 *   rows_times_w   out[M, K] = a[M, N] . W[e]
 *   rows_outer     W[e]      = a[rows of e]^T . b[rows of e]   (a [M, N], b [M, K]; zeros for no rows;
 *                  `streaming`: W's pages are already mapped, see store_streaming)
 * Experts are shared out among `threads` OpenMP threads: linked by soname, libgomp resolves to the copy
 * torch has already loaded, so these and torch's own ops use one thread pool.
 * Written with GCC/Clang vector extensions, as wide as the target's vector registers: 16 floats with AVX-512,
 * 8 with AVX, else 4 (SSE, NEON). Vectors wider than the registers are split by the compiler into register
 * pairs and spilled: 16-float vectors built for AVX2 ran these kernels 4-14x slower.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#define VEC_BYTES 64
#elif defined(__AVX__)
#define VEC_BYTES 32
#else
#define VEC_BYTES 16
#endif
typedef float vec __attribute__((vector_size(VEC_BYTES), aligned(4)));   /* any float alignment */
#define LANES (VEC_BYTES / 4)
#define LINE_FLOATS 16    /* floats per 64-byte cache line */
#define ROWS 4            /* rows of one expert processed together: 4 accumulator sets */
#define AHEAD 8           /* W rows prefetched ahead: covers memory latency at these row lengths */
#define NN_VECS 4         /* rows_times_w: ROWS x NN_VECS vectors of output columns in registers */
#define OUTER_VECS 8      /* rows_outer: OUTER_VECS vectors of gradient columns in registers */

static inline vec load(const float* p) { return *(const vec*)p; }
static inline void store(float* p, vec v) { *(vec*)p = v; }

/* Gradients are written whole and not read back soon: streaming stores skip reading each cache line before
 * writing it, half the memory traffic of an ordinary store (rows_outer into mapped memory: 2.5x faster).
 * Into fresh pages, which the kernel zero-fills on first touch, they are slower (1.2x): the caller says
 * which. They are weakly ordered, so each thread fences. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline void store_streaming(float* p, vec v) {
    if (((uintptr_t)p & 63) == 0) _mm512_stream_ps(p, (__m512)v); else store(p, v);
}
static inline void fence_streaming_stores(void) { _mm_sfence(); }
#elif defined(__AVX__)
#include <immintrin.h>
static inline void store_streaming(float* p, vec v) {
    if (((uintptr_t)p & 31) == 0) _mm256_stream_ps(p, (__m256)v); else store(p, v);
}
static inline void fence_streaming_stores(void) { _mm_sfence(); }
#else
static inline void store_streaming(float* p, vec v) { store(p, v); }
static inline void fence_streaming_stores(void) {}
#endif
static inline vec splat(float x) { return (vec){0} + x; }
static inline float lane_sum(vec v) {
#if LANES == 16 && (defined(__clang__) || __GNUC__ >= 12)   /* a halving tree of shuffles: ~10% faster */
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
#else
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}
/* Prefetch never faults, so running past the end of W (into the next expert or beyond) is harmless. */
static inline void prefetch(const float* p, int64_t len) {
    for (int64_t k = 0; k < len; k += LINE_FLOATS) __builtin_prefetch(p + k, 0, 3);
}

/* The block of up to ROWS rows from row r of the expert's rows ending at `end`: `rows`, and row pointers into
 * `a` (row length `stride`); the spare slots repeat the first row and are not stored. */
#define ROW_BLOCK(a, stride, r, end)                                    \
    const int64_t rows = (end) - (r) < ROWS ? (end) - (r) : ROWS;       \
    const float* a0 = (a) + (r) * (stride);                             \
    const float* a1 = rows > 1 ? a0 + (stride) : a0;                    \
    const float* a2 = rows > 2 ? a0 + 2 * (stride) : a0;                \
    const float* a3 = rows > 3 ? a0 + 3 * (stride) : a0;

/* rows_times_wt for one expert with few rows: W's rows in order, each against ROWS rows at a time. One
 * sequential stream through W per block of rows, which memory serves fastest when there is one block. */
static void wt_by_w_row(const float* a, const float* w_e, float* out, int64_t first, int64_t last, int64_t N,
                        int64_t K) {
    const int64_t K_vec = K - K % LANES;
    for (int64_t r = first; r < last; r += ROWS) {
        ROW_BLOCK(a, K, r, last)
        for (int64_t n = 0; n < N; n++) {
            const float* w_n = w_e + n * K;
            const float* ahead = w_n + AHEAD * K;
            vec c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t k = 0; k < K_vec; k += LANES) {
                __builtin_prefetch(ahead + k, 0, 3);
                const vec wv = load(w_n + k);
                c0 += load(a0 + k) * wv; c1 += load(a1 + k) * wv;
                c2 += load(a2 + k) * wv; c3 += load(a3 + k) * wv;
            }
            float s0 = lane_sum(c0), s1 = lane_sum(c1), s2 = lane_sum(c2), s3 = lane_sum(c3);
            for (int64_t k = K_vec; k < K; k++) {
                s0 += a0[k] * w_n[k]; s1 += a1[k] * w_n[k]; s2 += a2[k] * w_n[k]; s3 += a3[k] * w_n[k];
            }
            float* o = out + r * N + n;
            o[0] = s0;
            if (rows > 1) o[N] = s1;
            if (rows > 2) o[2 * N] = s2;
            if (rows > 3) o[3 * N] = s3;
        }
    }
}

#if LANES == 16   /* 16 accumulators and 8 operands fit AVX-512's 32 registers; fewer, narrower ones spill */
#define W_ROWS 4          /* rows_times_wt, tiled: ROWS x W_ROWS dot products, one vector of sums */
#define TILE_AHEAD 16     /* W rows prefetched ahead */
#define TILED_MIN_ROWS 12 /* for experts with at least this many rows (measured crossover: 8-12) */

/* One vector of 16 vectors' lane sums, lane i holding v[i]'s: four rounds of pairing, each adding two vectors'
 * matching halves (then quarters, eighths, single lanes), 15 adds and 30 shuffles where 16 separate lane sums
 * take 64 of each. Pairing interleaves the order; bit-reversed indices undo it. */
#if defined(__clang__) || __GNUC__ >= 12
static inline vec pair_halves(vec a, vec b, int round) {
    switch (round) {
    case 0: return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                 + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    case 1: return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
                 + __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    case 2: return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
                 + __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    default: return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
                  + __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
}
static inline vec lane_sums_of_16(const vec* v) {
    static const int bit_reversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    vec pairs[16];
    for (int i = 0; i < 16; i++) pairs[i] = v[bit_reversed[i]];
    for (int round = 0, count = 16; count > 1; round++, count /= 2)
        for (int i = 0; i < count / 2; i++) pairs[i] = pair_halves(pairs[2 * i], pairs[2 * i + 1], round);
    return pairs[0];
}
#else   /* no __builtin_shufflevector (GCC < 12): one lane sum at a time */
static inline vec lane_sums_of_16(const vec* v) {
    vec sums;
    for (int i = 0; i < 16; i++) sums[i] = lane_sum(v[i]);
    return sums;
}
#endif

/* rows_times_wt for one expert with many rows: tiles of ROWS rows x W_ROWS rows of W (16 accumulators, 8 loads
 * per 16 multiply-adds where wt_by_w_row does 5 per 4), W's rows outermost: each 4 of them come from memory
 * once, while the expert's rows stay in cache. Measured 1.1-1.2x faster than wt_by_w_row at 16-64 rows. */
static void wt_tiled(const float* a, const float* w_e, float* out, int64_t first, int64_t last, int64_t N,
                     int64_t K) {
    const int64_t K_vec = K - K % LANES;
    for (int64_t n = 0; n < N; n += W_ROWS) {
        const int64_t w_rows = N - n < W_ROWS ? N - n : W_ROWS;
        const float* w0 = w_e + n * K;
        const float* w1 = w_rows > 1 ? w0 + K : w0;
        const float* w2 = w_rows > 2 ? w0 + 2 * K : w0;
        const float* w3 = w_rows > 3 ? w0 + 3 * K : w0;
        const float* ahead = w0 + TILE_AHEAD * K;
        for (int64_t r = first; r < last; r += ROWS) {
            ROW_BLOCK(a, K, r, last)
            vec c[ROWS * W_ROWS] = {{0}};   /* c[W_ROWS * i + j]: row i of the block . W row n + j */
            for (int64_t k = 0; k < K_vec; k += LANES) {
                if (r == first) {   /* the tile's next W rows, once */
                    __builtin_prefetch(ahead + k, 0, 3); __builtin_prefetch(ahead + K + k, 0, 3);
                    __builtin_prefetch(ahead + 2 * K + k, 0, 3); __builtin_prefetch(ahead + 3 * K + k, 0, 3);
                }
                const vec x0 = load(a0 + k), x1 = load(a1 + k), x2 = load(a2 + k), x3 = load(a3 + k);
                const vec v0 = load(w0 + k), v1 = load(w1 + k), v2 = load(w2 + k), v3 = load(w3 + k);
                c[0] += x0 * v0; c[1] += x0 * v1; c[2] += x0 * v2; c[3] += x0 * v3;
                c[4] += x1 * v0; c[5] += x1 * v1; c[6] += x1 * v2; c[7] += x1 * v3;
                c[8] += x2 * v0; c[9] += x2 * v1; c[10] += x2 * v2; c[11] += x2 * v3;
                c[12] += x3 * v0; c[13] += x3 * v1; c[14] += x3 * v2; c[15] += x3 * v3;
            }
            vec sums = lane_sums_of_16(c);
            const float* x[ROWS] = {a0, a1, a2, a3};
            const float* v[W_ROWS] = {w0, w1, w2, w3};
            for (int64_t k = K_vec; k < K; k++)
                for (int i = 0; i < ROWS; i++)
                    for (int j = 0; j < W_ROWS; j++) sums[W_ROWS * i + j] += x[i][k] * v[j][k];
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < w_rows; j++) out[(r + i) * N + n + j] = sums[W_ROWS * i + j];
        }
    }
}
#endif

void rows_times_wt(const float* a, const float* w, float* out, const int64_t* offsets,
                   int64_t E, int64_t N, int64_t K, int threads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = offsets[e], last = offsets[e + 1];
#if LANES == 16
        if (last - first >= TILED_MIN_ROWS) {
            wt_tiled(a, w + e * N * K, out, first, last, N, K);
            continue;
        }
#endif
        wt_by_w_row(a, w + e * N * K, out, first, last, N, K);
    }
}

void rows_times_w(const float* a, const float* w, float* out, const int64_t* offsets,
                  int64_t E, int64_t N, int64_t K, int threads) {
    const int64_t C = NN_VECS * LANES;
    const int64_t K_chunks = K - K % C;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t e = 0; e < E; e++) {
        const float* w_e = w + e * N * K;
        for (int64_t r = offsets[e]; r < offsets[e + 1]; r += ROWS) {
            ROW_BLOCK(a, N, r, offsets[e + 1])
            float* o = out + r * K;
            for (int64_t c = 0; c < K_chunks; c += C) {   /* one column stripe of W per pass */
                vec acc[ROWS][NN_VECS] = {{{0}}};
                for (int64_t n = 0; n < N; n++) {
                    const float* w_nc = w_e + n * K + c;
                    prefetch(w_nc + AHEAD * K, C);
                    const vec x0 = splat(a0[n]), x1 = splat(a1[n]), x2 = splat(a2[n]), x3 = splat(a3[n]);
                    for (int j = 0; j < NN_VECS; j++) {
                        const vec wv = load(w_nc + j * LANES);
                        acc[0][j] += x0 * wv; acc[1][j] += x1 * wv; acc[2][j] += x2 * wv; acc[3][j] += x3 * wv;
                    }
                }
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < NN_VECS; j++) store(o + i * K + c + j * LANES, acc[i][j]);
            }
            for (int i = 0; i < rows; i++) {                /* columns past the last full stripe */
                for (int64_t k = K_chunks; k < K; k++) {
                    float s = 0.f;
                    for (int64_t n = 0; n < N; n++) s += a0[i * N + n] * w_e[n * K + k];
                    o[i * K + k] = s;
                }
            }
        }
    }
}

void rows_outer(const float* a, const float* b, float* w, const int64_t* offsets,
                int64_t E, int64_t N, int64_t K, int threads, int streaming) {
    const int64_t C = OUTER_VECS * LANES;
    const int64_t K_chunks = K - K % C;
    #pragma omp parallel num_threads(threads)
    {
    #pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
        float* w_e = w + e * N * K;
        const int64_t first = offsets[e], last = offsets[e + 1];
        for (int64_t n = 0; n < N; n++) {
            float* w_n = w_e + n * K;
            for (int64_t c = 0; c < K_chunks; c += C) {
                vec acc[OUTER_VECS] = {{0}};
                for (int64_t r = first; r < last; r++) {
                    const vec x = splat(a[r * N + n]);
                    const float* b_rc = b + r * K + c;
                    for (int j = 0; j < OUTER_VECS; j++) acc[j] += x * load(b_rc + j * LANES);
                }
                if (streaming)
                    for (int j = 0; j < OUTER_VECS; j++) store_streaming(w_n + c + j * LANES, acc[j]);
                else
                    for (int j = 0; j < OUTER_VECS; j++) store(w_n + c + j * LANES, acc[j]);
            }
            for (int64_t k = K_chunks; k < K; k++) {
                float s = 0.f;
                for (int64_t r = first; r < last; r++) s += a[r * N + n] * b[r * K + k];
                w_n[k] = s;
            }
        }
    }
    fence_streaming_stores();
    }
}
