/* Per-expert products for many small experts on CPU (float32). With few rows per expert the time goes to
 * streaming the expert weights, and MKL's GEMM reaches about half the machine's bandwidth on such shapes.
 * Each kernel here reads (or writes) every expert's W exactly once, in order, prefetching ahead, with the
 * expert's few rows held in cache and the partial results in registers.
 *
 * Legend: W is [E, N, K] row-major; expert e owns rows [offsets[e], offsets[e + 1]) of the row operands.
 *   rows_times_wt  out[M, N] = a[M, K] . W[e]^T   (each row r of expert e: out[r] = W[e] a[r])
 *   rows_times_w   out[M, K] = a[M, N] . W[e]
 *   rows_outer     W[e]      = a[rows of e]^T . b[rows of e]   (a [M, N], b [M, K]; zeros for no rows;
 *                  `streaming`: W's pages are already mapped, see store_streaming)
 * Experts are shared out among `threads` OpenMP threads: linked by soname, libgomp resolves to the copy
 * torch has already loaded, so these and torch's own ops use one thread pool.
 * Written with GCC/Clang vector extensions: 16-float vectors, lowered to whatever SIMD -march provides.
 */
#include <stdint.h>

typedef float vec __attribute__((vector_size(64), aligned(4)));   /* 16 floats, any float alignment */
#define LANES 16
#define ROWS 4            /* rows of one expert processed together: 4 accumulator sets */
#define AHEAD 8           /* W rows prefetched ahead: covers memory latency at these row lengths */
#define NN_VECS 4         /* rows_times_w: ROWS x 64 output columns in registers */
#define OUTER_VECS 8      /* rows_outer: 128 gradient columns in registers */

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
#else
static inline void store_streaming(float* p, vec v) { store(p, v); }
static inline void fence_streaming_stores(void) {}
#endif
static inline vec splat(float x) { return (vec){0} + x; }
static inline float lane_sum(vec v) {
#if defined(__clang__) || __GNUC__ >= 12   /* a halving tree of shuffles: measured ~10% faster */
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
    for (int64_t k = 0; k < len; k += LANES) __builtin_prefetch(p + k, 0, 3);
}

/* The block of up to ROWS rows from row r of the expert's rows ending at `end`: `rows`, and row pointers into
 * `a` (row length `stride`); the spare slots repeat the first row and are not stored. */
#define ROW_BLOCK(a, stride, r, end)                                    \
    const int64_t rows = (end) - (r) < ROWS ? (end) - (r) : ROWS;       \
    const float* a0 = (a) + (r) * (stride);                             \
    const float* a1 = rows > 1 ? a0 + (stride) : a0;                    \
    const float* a2 = rows > 2 ? a0 + 2 * (stride) : a0;                \
    const float* a3 = rows > 3 ? a0 + 3 * (stride) : a0;

void rows_times_wt(const float* a, const float* w, float* out, const int64_t* offsets,
                   int64_t E, int64_t N, int64_t K, int threads) {
    const int64_t K_vec = K - K % LANES;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t e = 0; e < E; e++) {
        const float* w_e = w + e * N * K;
        for (int64_t r = offsets[e]; r < offsets[e + 1]; r += ROWS) {
            ROW_BLOCK(a, K, r, offsets[e + 1])
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
