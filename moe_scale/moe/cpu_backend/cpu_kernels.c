/* Per-expert products of the MoE experts on CPU (float32): register-tiled, and each reads (or writes) every
 * expert's weights once, in order, while the weights it reads next are already on their way from memory.
 *
 * Legend: W is [E, N, K] row-major; expert e owns rows [offsets[e], offsets[e + 1]) of the row operands.
 *   rows_times_wt  out[M, N] = a[rows of e] . W[e]^T      (x . w_in^T forward, g . w_out^T backward); `relu`
 *                  clamps the result at 0 (the experts' hidden layer); with `relu_hidden`, the ReLU's
 *                  backward and the gate's gradient on each finished row (relu_backward_rows)
 *   rows_times_w   out[M, K] = a[rows of e] . W[e]          (h . w_out forward, g . w_in backward)
 *   rows_outer     W[e]      = a[rows of e]^T . b[rows of e] (weight gradients; zeros for an expert with no rows;
 *                  `streaming`: W's pages are already mapped, see store_streaming)
 * A row index (rows_times_wt's `a_index`, rows_outer's `b_index`; NULL for none) makes row r read row
 * index[r] of its operand: the experts' gather of each (token, expert) pair's row, done while reading.
 *
 * Why the work has these shapes. An expert with m rows costs 2 m N K FLOPs against N K weights moved; with
 * d=256, h=512 this machine's balance (~13 FLOP per byte) puts the crossover near 25 rows, and MoE layers
 * with 8..4096 experts sit on both sides:
 *  - Arithmetic: broadcast tiles of TILE_ROWS x TILE_VECS vectors of accumulators (6 x 4 with 32 registers,
 *    6 x 2 with 16): per step TILE_VECS vector loads and TILE_ROWS scalars broadcast from L1 (a load, no
 *    shuffle) feed TILE_ROWS x TILE_VECS multiply-adds. rows_times_wt has no vectors of W^T to load, so an item of
 *    PANEL_MIN_ROWS+ rows transposes PANEL x PANEL_K blocks of W into a panel in L1 that its rows then take
 *    as above; at most DOT_MAX_ROWS (= LANES) rows take dot products, a few rows of W at a time against
 *    groups of rows (see wt_dots); with narrower vectors the rows in between are transposed themselves
 *    (blocks of LANES rows into a scratch [K, LANES], WT_TILE rows of W broadcast against them, the tile
 *    transposed back in registers). rows_outer sums many rows in passes whose rows of b, packed into panels as wide as a
 *    tile, stay in L2 (OUTER_PACK_BYTES), each tile reading a packed copy of its columns of a from L1.
 *  - Memory: experts go in contiguous runs (chunks of similar cost, handed to threads dynamically), and
 *    within a run the weights are prefetched PREFETCH_AHEAD bytes ahead of use, across expert boundaries
 *    (skipping experts without rows), so the next expert's weights arrive while this one computes;
 *    rows_outer, which writes W, prefetches the next expert's rows instead. (E=256, 16 rows per expert:
 *    rows_times_w 10.3 -> 7.3 ms from the prefetch, against a 5 ms memory bound on cold weights.)
 * Measured against torch's grouped GEMM (MKL) on the experts' forward and backward, see experts.py.
 *
 * Each output is computed by one thread in a fixed order, so results do not depend on the thread count.
 * Threads come from OpenMP: linked by soname, libgomp resolves to the copy torch has already loaded, so
 * these and torch's own ops use one thread pool.
 * Written with GCC/Clang vector extensions, as wide as the target's vector registers: 16 floats with
 * AVX-512, 8 with AVX, else 4 (SSE, NEON), and tiles sized to the register file (32 with AVX-512, else 16):
 * vectors or tiles wider than the registers are split and spilled (16-float vectors built for AVX2 ran
 * 4-14x slower).
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define VEC_BYTES 64
#define REGISTERS 32
#elif defined(__AVX__)
#define VEC_BYTES 32
#define REGISTERS 16
#else
#define VEC_BYTES 16
#define REGISTERS 16
#endif
typedef float vec __attribute__((vector_size(VEC_BYTES), aligned(4)));   /* any float alignment */
typedef int32_t ivec __attribute__((vector_size(VEC_BYTES), aligned(4)));
#define LANES (VEC_BYTES / 4)
#define LINE 64                   /* bytes per cache line */
/* Broadcast tiles: TILE_ROWS x TILE_VECS accumulators and TILE_VECS + 1 operands in registers. With 16
 * registers 6 x 2 (15 in use), not 4 x 3 (all 16, so the compiler shuffles accumulators between registers
 * every step): on AVX2 (Zen 3) one core's tile from L1 ran 88 against 52 GFLOP/s. */
#define TILE_ROWS 6
#if REGISTERS >= 32
#define TILE_VECS 4
#else
#define TILE_VECS 2
#endif
#define WT_TILE (LANES >= 8 ? LANES : 2 * LANES)   /* W rows per transposed tile: >= 8 accumulators in flight */
#define PANEL (TILE_VECS * LANES)  /* rows_times_wt with many rows: W rows per transposed panel */
#define PANEL_K 64                 /* ... and columns of W per panel */
#define PANEL_MIN_ROWS (DOT_MAX_ROWS >= 16 ? DOT_MAX_ROWS + 1 : 16)   /* ... from this many rows of an item */
#define DOT_MAX_ROWS LANES        /* rows_times_wt: a remainder this small takes dot products */
#define ITEM_ROWS 96              /* rows of one expert per work item (a multiple of TILE_ROWS and of LANES) */
#define CHUNKS_PER_THREAD 4       /* contiguous runs of items per thread: prefetch within, balance across */
#define STREAM_ROWS 24            /* an item's cost: streaming its weights costs about as much as this many rows */
/* Bytes of weights requested ahead of use. Measured in the layer (kernels' time, E=256..1024, k=1..4): 32 and
 * 64 KiB alike; 256 KiB 10-15% and 768 KiB 15-20% slower. Every line is requested: requesting every 2nd..16th
 * and leaving the rest to the hardware prefetcher was as slow as no prefetch (E=256, k=2: 20% slower). */
#define PREFETCH_AHEAD (64 * 1024)
#define N_CHUNK 32                /* rows_times_w: rows of W per pass, the accumulators reloaded between passes */
#define N_CHUNK_MANY_ROWS 128     /* ... for items of more than 64 rows */
#define MAX_PREFETCH_PER_STEP 8   /* lines prefetched per inner step at most */
#define OUTER_PASS_ROWS 384       /* rows_outer: rows summed per pass over W's tiles, at most */
#define OUTER_PACK_BYTES (128 * 1024)   /* ... and as many as keep the pass's packed rows of b within this */
#define OUTER_TILE_COLS (TILE_VECS * LANES)   /* rows_outer: columns of W per tile */
#define OUTER_ROW_MAX_ROWS 4      /* rows_outer: experts with at most this many rows write W row by row */

static inline vec load(const float* p) { return *(const vec*)p; }
static inline void store(float* p, vec v) { *(vec*)p = v; }
/* x - 0 is x for every float, so this is a plain broadcast; (vec){0} + x would keep a scalar add (0 + -0
 * is +0) in the innermost loops, on the ports the multiply-adds need. */
static inline vec splat(float x) { return x - (vec){0}; }
/* v, loaded once into a register: GCC otherwise folds the load into each multiply-add that uses v, reloading
 * it once per use (a load per multiply-add, where a Zen 4 core sustains about one 64-byte load a cycle). */
static inline vec in_register(vec v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+v"(v));
#endif
    return v;
}
static inline vec relu(vec v) { return (vec)((ivec)v & ~(ivec)(v < (vec){0})); }   /* keeps NaN, as torch */
static inline void prefetch_lines(const char* p, int lines) {
    /* into L2 (into L1: 15-35% slower, E=1024 alone) */
    for (int q = 0; q < lines; q++) __builtin_prefetch(p + q * LINE, 0, 2);
}

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

/* ---------------------------------------------------------------- LANES x LANES transposes in registers */

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, (ivec){__VA_ARGS__})
#endif
/* Round b swaps bit b of the row and the column index: rows i (bit b clear) and i | b exchange halves,
 * new_i[c] = c & b ? old_{i|b}[c ^ b] : old_i[c] and new_{i|b}[c] = c & b ? old_{i|b}[c] : old_i[c ^ b].
 * After a round per bit, element (i, j) sits at (j, i). */
#define UNPAREN(...) __VA_ARGS__
#define ROUND(r, B, LO, HI)                                                                                     \
    for (int i = 0; i < LANES; i++)                                                                             \
        if (!(i & (B))) {                                                                                       \
            const vec x = r[i], y = r[i | (B)];                                                                 \
            r[i] = SHUFFLE(x, y, UNPAREN LO);                                                                   \
            r[i | (B)] = SHUFFLE(x, y, UNPAREN HI);                                                             \
        }
/* The same rounds summing each pair's two halves instead of keeping both: rows i < B stay, the others are
 * folded into them. Sums commute with the shuffles, so after all rounds lane c of r[0] is the sum of row c. */
#define FOLD(r, B, LO, HI)                                                                                      \
    for (int i = 0; i < (B); i++) {                                                                             \
        const vec x = r[i], y = r[i | (B)];                                                                     \
        r[i] = SHUFFLE(x, y, UNPAREN LO) + SHUFFLE(x, y, UNPAREN HI);                                           \
    }
#if LANES == 16
#define ROUNDS(OP)                                                                                              \
    OP(r, 8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),                                          \
             (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))                                    \
    OP(r, 4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),                                        \
             (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))                                      \
    OP(r, 2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),                                        \
             (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))                                      \
    OP(r, 1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),                                       \
             (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#elif LANES == 8
#define ROUNDS(OP)                                                                                              \
    OP(r, 4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))                                          \
    OP(r, 2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))                                          \
    OP(r, 1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
#else
#define ROUNDS(OP)                                                                                              \
    OP(r, 2, (0, 1, 4, 5), (2, 3, 6, 7))                                                                        \
    OP(r, 1, (0, 4, 2, 6), (1, 5, 3, 7))
#endif
static inline void transpose(vec* r) { ROUNDS(ROUND) }

/* Lane c of the result is the sum of r[c]'s lanes (r is overwritten): half the shuffles of a transpose. */
static inline vec sum_rows(vec* r) {
    ROUNDS(FOLD)
    return r[0];
}

/* ---------------------------------------------------------------- work items and their order */

typedef struct {
    int64_t expert, first, rows;   /* rows [first, first + rows) of the row operands, all of this expert's */
    int64_t n0, n1;                /* rows_outer: W rows [n0, n1) of the expert; otherwise [0, N) */
} item;

/* The work items in expert order: row products split an expert's rows into items of at most ITEM_ROWS and
 * skip experts without rows; rows_outer (`split_n`) splits W's rows instead, when there are too few experts
 * to share, and has an item for every expert (those without rows are written as zeros). */
static int64_t make_items(const int64_t* offsets, int64_t E, int64_t N, int split_n, int threads, item* items) {
    int64_t count = 0, busy = 0;
    for (int64_t e = 0; e < E; e++) busy += offsets[e + 1] > offsets[e];
    int64_t parts = split_n && busy ? (8 * threads + busy - 1) / busy : 1;
    int64_t part_rows = (N + parts - 1) / parts;
    part_rows = (part_rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = offsets[e], rows = offsets[e + 1] - first;
        if (rows == 0) {   /* rows_outer writes its zeros, in order with the others; the products skip it */
            if (split_n) items[count++] = (item){e, first, 0, 0, N};
            continue;
        }
        if (split_n) {
            for (int64_t n0 = 0; n0 < N; n0 += part_rows)
                items[count++] = (item){e, first, rows, n0, n0 + part_rows < N ? n0 + part_rows : N};
        } else {
            for (int64_t r = 0; r < rows; r += ITEM_ROWS)
                items[count++] = (item){e, first + r, rows - r < ITEM_ROWS ? rows - r : ITEM_ROWS, 0, N};
        }
    }
    return count;
}

/* Splits items into at most `chunks` contiguous runs of similar cost; run c is [bounds[c], bounds[c + 1]). */
static int64_t make_chunks(const item* items, int64_t count, int64_t N, int64_t chunks, int64_t* bounds) {
    double total = 0.0;
    for (int64_t i = 0; i < count; i++) total += (double)(STREAM_ROWS + items[i].rows) * (items[i].n1 - items[i].n0) / N;
    if (chunks > count) chunks = count;
    int64_t made = 0;
    double seen = 0.0;
    bounds[0] = 0;
    for (int64_t i = 0; i < count; i++) {
        const double cost = (double)(STREAM_ROWS + items[i].rows) * (items[i].n1 - items[i].n0) / N;
        if (seen + cost / 2 >= total * (made + 1) / chunks && i > bounds[made] && made + 1 < chunks)
            bounds[++made] = i;
        seen += cost;
    }
    bounds[++made] = count;
    return made;
}

/* Runs `body(items, first item, end item, scratch)` over the chunks, in parallel. */
#define FOR_EACH_CHUNK(offsets, E, N, split_n, threads, scratch_floats, body)                                  \
    do {                                                                                                        \
        item* items_ = malloc(sizeof(item) * ((E) * ((split_n) ? 8 * (threads) + 1 : 1) +                       \
                                              (offsets)[E] / ITEM_ROWS + 1));                                   \
        const int64_t count_ = make_items(offsets, E, N, split_n, threads, items_);                             \
        int64_t* bounds_ = malloc(sizeof(int64_t) * (CHUNKS_PER_THREAD * (threads) + 2));                       \
        const int64_t chunks_ = count_ ? make_chunks(items_, count_, N, CHUNKS_PER_THREAD * (threads), bounds_) : 0; \
        _Pragma("omp parallel num_threads(threads)")                                                            \
        {                                                                                                       \
            const int64_t floats_ = ((scratch_floats) + 15) / 16 * 16;                                          \
            float* scratch_ = floats_ ? aligned_alloc(64, floats_ * sizeof(float)) : NULL;                      \
            _Pragma("omp for schedule(dynamic, 1)")                                                             \
            for (int64_t c_ = 0; c_ < chunks_; c_++) body(items_, bounds_[c_], bounds_[c_ + 1], scratch_);     \
            free(scratch_);                                                                                     \
            fence_streaming_stores();                                                                           \
        }                                                                                                       \
        free(bounds_);                                                                                          \
        free(items_);                                                                                           \
    } while (0)

/* Prefetches the weights of a run of items, PREFETCH_AHEAD bytes ahead of their use: the stream is the
 * items' W[e] one after the other, each expert once. `take` returns the next contiguous lines to request
 * for `used` more bytes of use. */
typedef struct {
    const item* items;
    int64_t first, end, next;      /* the run's items; [next, end) still to request, `next` up to `offset` */
    int64_t offset, w_bytes;       /* bytes of W[items[next].expert] requested; bytes of one expert's W */
    int64_t requested, used;       /* bytes requested and used so far */
    const float* w;
} prefetcher;

static prefetcher prefetcher_for(const item* items, int64_t first, int64_t end, const float* w, int64_t N, int64_t K) {
    return (prefetcher){items, first, end, first, 0, N * K * (int64_t)sizeof(float), 0, 0, w};
}

static int64_t take(prefetcher* p, int64_t used, const char** at) {
    p->used += used;
    while (p->next < p->end && (p->offset >= p->w_bytes ||
                                (p->next > p->first && p->offset == 0 &&
                                 p->items[p->next - 1].expert == p->items[p->next].expert))) {
        p->next++;      /* an expert's W is streamed once, however many items its rows make */
        p->offset = 0;
    }
    int64_t want = p->used + PREFETCH_AHEAD - p->requested;
    if (p->next >= p->end || want <= 0) return 0;
    if (want > p->w_bytes - p->offset) want = p->w_bytes - p->offset;
    *at = (const char*)(p->w + p->items[p->next].expert * (p->w_bytes / (int64_t)sizeof(float))) + p->offset;
    const int64_t lines = (want + LINE - 1) / LINE;
    p->offset += lines * LINE;
    p->requested += lines * LINE;
    return lines;
}

/* Past the lines a tile has issued (at most `issued`) of the `lines` still to request from `at`. */
static inline void advance(const char** at, int64_t* lines, int64_t issued) {
    if (issued > *lines) issued = *lines;
    *at += issued * LINE;
    *lines -= issued;
}

/* Lines to request per inner step, for `lines` over `steps` steps. */
static inline int per_step(int64_t lines, int64_t steps) {
    const int64_t q = steps > 0 ? (lines + steps - 1) / steps : lines;
    return q > MAX_PREFETCH_PER_STEP ? MAX_PREFETCH_PER_STEP : (int)q;
}

/* ---------------------------------------------------------------- rows_times_w: out[M, K] = a[M, N] . W[e] */

/* acc[i][j] (+)= sum over n < steps of a[i][n] W[n][j-th vector], then stored: rows x vecs of the tile. */
static inline __attribute__((always_inline)) void w_tile(const float* a, int64_t lda, const float* w, int64_t ldw,
                                                         float* out, int64_t ldo, int64_t steps, const int rows,
                                                         const int vecs, int accumulate, int apply_relu, const char* pf,
                                                         int pf_step, int64_t pf_lines) {
    vec acc[TILE_ROWS][TILE_VECS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) acc[i][j] = accumulate ? load(out + i * ldo + j * LANES) : (vec){0};
    for (int64_t n = 0; n < steps; n++) {
        if (pf_lines > 0) { prefetch_lines(pf, pf_step); pf += pf_step * LINE; pf_lines -= pf_step; }
        vec b[TILE_VECS];
        for (int j = 0; j < vecs; j++) b[j] = in_register(load(w + n * ldw + j * LANES));
        for (int i = 0; i < rows; i++) {
            const vec x = splat(a[i * lda + n]);
            for (int j = 0; j < vecs; j++) acc[i][j] += x * b[j];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) store(out + i * ldo + j * LANES, apply_relu ? relu(acc[i][j]) : acc[i][j]);
}

#define W_CASE(R, V) case (R) * 8 + (V): w_tile(a, lda, w, ldw, out, ldo, steps, R, V, acc, apply_relu, pf, pf_step, pf_lines); break;
#if TILE_VECS == 4
#define W_ROW_CASES(R) W_CASE(R, 1) W_CASE(R, 2) W_CASE(R, 3) W_CASE(R, 4)
#else
#define W_ROW_CASES(R) W_CASE(R, 1) W_CASE(R, 2)
#endif
/* w_tile with constant rows and vecs (its loops unroll fully and the accumulators stay in registers). */
static void w_tile_any(const float* a, int64_t lda, const float* w, int64_t ldw, float* out, int64_t ldo,
                       int64_t steps, int rows, int vecs, int acc, int apply_relu, const char* pf, int pf_step,
                       int64_t pf_lines) {
    switch (rows * 8 + vecs) {
        W_ROW_CASES(1) W_ROW_CASES(2) W_ROW_CASES(3) W_ROW_CASES(4) W_ROW_CASES(5) W_ROW_CASES(6)
    }
}

static void w_chunk(const item* items, int64_t first, int64_t end, const float* a, const float* w, float* out,
                    int64_t N, int64_t K) {
    const int64_t K_vec = K - K % LANES;
    const int64_t stripes = (K_vec + TILE_VECS * LANES - 1) / (TILE_VECS * LANES);
    prefetcher pf = prefetcher_for(items, first, end, w, N, K);
    for (int64_t t = first; t < end; t++) {
        const item it = items[t];
        const float* w_e = w + it.expert * N * K;
        const float* a_t = a + it.first * N;
        float* out_t = out + it.first * K;
        const int new_weights = t == first || items[t - 1].expert != it.expert;
        const int64_t blocks = (it.rows + TILE_ROWS - 1) / TILE_ROWS;
        /* Passes over a stretch of W's rows: short ones stream W from memory more evenly, long ones reload
         * the accumulators less often, which matters where W is in cache for many rows. */
        const int64_t n_chunk = it.rows > 64 ? N_CHUNK_MANY_ROWS : N_CHUNK;
        for (int64_t n0 = 0; n0 < N; n0 += n_chunk) {   /* W's rows n0.. : one contiguous stretch of W */
            const int64_t steps = N - n0 < n_chunk ? N - n0 : n_chunk;
            const char* at = NULL;
            int64_t lines = take(&pf, new_weights ? steps * K * (int64_t)sizeof(float) : 0, &at);
            const int step_lines = per_step(lines, stripes * blocks * steps);
            for (int64_t c = 0; c < K_vec; c += TILE_VECS * LANES) {
                const int vecs = (K_vec - c) / LANES < TILE_VECS ? (K_vec - c) / LANES : TILE_VECS;
                for (int64_t r = 0; r < it.rows; r += TILE_ROWS) {
                    const int rows = it.rows - r < TILE_ROWS ? it.rows - r : TILE_ROWS;
                    w_tile_any(a_t + r * N + n0, N, w_e + n0 * K + c, K, out_t + r * K + c, K, steps, rows, vecs,
                               n0 > 0, 0, at, step_lines, lines);
                    advance(&at, &lines, step_lines * steps);
                }
            }
            if (lines > 0) prefetch_lines(at, (int)lines);
        }
        for (int64_t r = 0; r < it.rows; r++)            /* columns past the last whole vector */
            for (int64_t k = K_vec; k < K; k++) {
                float s = 0.f;
                for (int64_t n = 0; n < N; n++) s += a_t[r * N + n] * w_e[n * K + k];
                out_t[r * K + k] = s;
            }
    }
}

void rows_times_w(const float* a, const float* w, float* out, const int64_t* offsets, int64_t E, int64_t N,
                  int64_t K, int threads) {
#define W_BODY(items, first, end, scratch) w_chunk(items, first, end, a, w, out, N, K)
    FOR_EACH_CHUNK(offsets, E, N, 0, threads, 0, W_BODY);
}

/* ---------------------------------------------------------------- rows_times_wt: out[M, N] = a[rows] . W[e]^T */

static inline const float* row_of(const float* base, const int64_t* index, int64_t r, int64_t len) {
    return base + (index ? index[r] : r) * len;
}

/* aT[k][l] = row l of the block at column k, for the block's `rows` rows (zeros beyond): [K, LANES]. */
static void pack_transposed(const float* a, const int64_t* index, int64_t first, int64_t rows, int64_t K, float* aT) {
    const float* row[LANES];
    for (int l = 0; l < LANES; l++) row[l] = l < rows ? row_of(a, index, first + l, K) : NULL;
    const int64_t K_vec = K - K % LANES;
    for (int64_t k0 = 0; k0 < K_vec; k0 += LANES) {
        vec r[LANES];
        for (int l = 0; l < LANES; l++) r[l] = row[l] ? load(row[l] + k0) : (vec){0};
        transpose(r);
        for (int l = 0; l < LANES; l++) store(aT + (k0 + l) * LANES, r[l]);
    }
    for (int64_t k = K_vec; k < K; k++)
        for (int l = 0; l < LANES; l++) aT[k * LANES + l] = row[l] ? row[l][k] : 0.f;
}

/* WT_TILE rows of W (`w_rows` of them real; the others repeat row 0 and are not stored) against the LANES
 * rows packed in aT: out[l][n] for l < rows. */
static void wt_tile(const float* aT, const float* w, int64_t K, int w_rows, float* out, int64_t ldo, int64_t rows,
                    int apply_relu, const char* pf, int pf_step, int64_t pf_lines) {
    const float* wr[WT_TILE];
    for (int i = 0; i < WT_TILE; i++) wr[i] = w + (i < w_rows ? i : 0) * K;
    vec acc[WT_TILE];
    for (int i = 0; i < WT_TILE; i++) acc[i] = (vec){0};
    for (int64_t k = 0; k < K; k++) {
        if ((k & (LANES - 1)) == 0) {
            /* the next line of each row into L1: one stream per row of W, too many for the core's own prefetcher */
            for (int i = 0; i < WT_TILE; i++) __builtin_prefetch(wr[i] + k + LANES, 0, 3);
            if (pf_lines > 0) { prefetch_lines(pf, pf_step); pf += pf_step * LINE; pf_lines -= pf_step; }
        }
        const vec b = load(aT + k * LANES);
        for (int i = 0; i < WT_TILE; i++) acc[i] += splat(wr[i][k]) * b;
    }
    for (int h = 0; h < WT_TILE; h += LANES) {   /* acc[h + i][l]: row l, column h + i */
        transpose(acc + h);
        for (int l = 0; l < rows; l++) {
            const vec v = apply_relu ? relu(acc[h + l]) : acc[h + l];
            if (w_rows >= h + LANES) store(out + l * ldo + h, v);
            else for (int i = 0; i < w_rows - h; i++) out[l * ldo + h + i] = v[i];
        }
    }
}

/* W rows per step of the dot products against a group of `rows` <= LANES / 2 rows (rows x W rows <= LANES
 * accumulators): 4 from 3 rows up to LANES / 4, else 2. With 1-2 rows the weights' stream from memory sets the
 * pace, and 4-16 rows of W at a time streamed them 2-10% slower. */
#define DOT_W_ROWS(rows) ((rows) >= 3 && (rows) <= LANES / 4 ? 4 : 2)

/* out[i][n + j] = x[i] . wr[j] for the `rows` rows x[i] and the `w_rows` real rows wr[j] of a block of WR rows
 * of W: rows x WR <= LANES accumulators, each step rows x WR independent multiply-adds, and one fold gives all
 * the sums (lane i * WR + j). `lines` lines of weights from `at` are requested meanwhile. */
static inline __attribute__((always_inline)) void dot_block(const float* const* x, const float* const* wr,
                                                            int64_t K, float* out, int64_t ldo, int w_rows,
                                                            const int rows, const int WR, int apply_relu,
                                                            const char* at, int64_t lines) {
    const int64_t K_vec = K - K % LANES;
    const int step_lines = per_step(lines, K_vec / LANES);
    vec acc[LANES];
    for (int q = 0; q < LANES; q++) acc[q] = (vec){0};
    for (int64_t k = 0; k < K_vec; k += LANES) {
        if (lines > 0) { prefetch_lines(at, step_lines); at += step_lines * LINE; lines -= step_lines; }
        vec v[LANES];
        for (int j = 0; j < WR; j++) v[j] = in_register(load(wr[j] + k));
        for (int i = 0; i < rows; i++) {
            const vec xi = in_register(load(x[i] + k));
            for (int j = 0; j < WR; j++) acc[i * WR + j] += xi * v[j];
        }
    }
    if (lines > 0) prefetch_lines(at, (int)lines);
    vec sums = sum_rows(acc);
    for (int i = 0; i < rows; i++)
        for (int64_t k = K_vec; k < K; k++)
            for (int j = 0; j < WR; j++) sums[i * WR + j] += x[i][k] * wr[j][k];
    if (apply_relu) sums = relu(sums);   /* on the vector: a branch per output would mispredict half the time */
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < WR; j++)
            if (j < w_rows) out[i * ldo + j] = sums[i * WR + j];
}

/* Dot products for `rows` <= DOT_MAX_ROWS rows x against every row of W, a block of rows of W at a time: up to
 * LANES / 2 rows as one group with DOT_W_ROWS(rows) rows of W per block, more as two groups (the second finds
 * the block in L1) with 2. Against 2 rows of W for every row count and transposed tiles from LANES / 2 + 1
 * rows, on one Zen 4 core with the weights in L2 (the two builds alternating in one process, 64 experts):
 * 3-4 rows 0.62-0.71 of the time, 8 rows 0.87, 9-16 rows 0.58-0.85; 1-2 and 5-6 rows within the noise. */
static inline __attribute__((always_inline)) void wt_dots(const float* const* x, const float* w, int64_t N,
                                                          int64_t K, float* out, int64_t ldo, const int rows,
                                                          int apply_relu, prefetcher* pf, int new_weights) {
    const int first_group = rows <= LANES / 2 ? rows : (rows + 1) / 2;
    const int WR = DOT_W_ROWS(first_group);   /* constants once inlined, as `rows` is */
    for (int64_t n = 0; n < N; n += WR) {
        const int w_rows = N - n < WR ? (int)(N - n) : WR;
        const float* wr[LANES];   /* rows past N repeat row n and are not stored */
        for (int j = 0; j < WR; j++) wr[j] = w + (n + (j < w_rows ? j : 0)) * K;
        const char* at = NULL;
        const int64_t lines = take(pf, new_weights ? w_rows * K * (int64_t)sizeof(float) : 0, &at);
        dot_block(x, wr, K, out + n, ldo, w_rows, first_group, WR, apply_relu, at, lines);
        if (rows > first_group)
            dot_block(x + first_group, wr, K, out + first_group * ldo + n, ldo, w_rows, rows - first_group, WR,
                      apply_relu, NULL, 0);
    }
}

#define DOT_CASE(R) case R: wt_dots(x, w, N, K, out, ldo, R, apply_relu, pf, new_weights); break;
static void wt_dots_any(const float* const* x, const float* w, int64_t N, int64_t K, float* out, int64_t ldo, int rows,
                        int apply_relu, prefetcher* pf, int new_weights) {
    switch (rows) {
        DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4)
#if DOT_MAX_ROWS >= 8
        DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
#endif
#if DOT_MAX_ROWS >= 16
        DOT_CASE(9) DOT_CASE(10) DOT_CASE(11) DOT_CASE(12) DOT_CASE(13) DOT_CASE(14) DOT_CASE(15) DOT_CASE(16)
#endif
    }
}

/* panel[c][j] = W[j][c] for the `w_rows` rows of W at w (row length ldw) and `cols` columns; zeros up to
 * PANEL columns: [cols, PANEL]. */
static void transpose_panel(const float* w, int64_t ldw, int w_rows, int64_t cols, float* panel) {
    const int64_t cols_vec = cols - cols % LANES;
    for (int g = 0; g < PANEL; g += LANES) {
        for (int64_t c0 = 0; c0 < cols_vec; c0 += LANES) {
            vec r[LANES];
            for (int l = 0; l < LANES; l++) r[l] = g + l < w_rows ? load(w + (g + l) * ldw + c0) : (vec){0};
            transpose(r);
            for (int l = 0; l < LANES; l++) store(panel + (c0 + l) * PANEL + g, r[l]);
        }
        for (int64_t c = cols_vec; c < cols; c++)
            for (int l = 0; l < LANES; l++) panel[c * PANEL + g + l] = g + l < w_rows ? w[(g + l) * ldw + c] : 0.f;
    }
}

/* rows_times_wt for an item with many rows: PANEL rows x PANEL_K columns of W at a time are transposed into
 * a panel in L1, which then serves every row as rows_times_w's broadcast tiles do: W comes in by whole
 * vectors, where wt_tile broadcasts each of its floats from memory (a load per multiply-add, which stalls
 * on weights still arriving). The transposes cost ~10% at 96 rows. */
static void wt_by_panels(const item it, const float* a, const int64_t* a_index, const float* w_e, float* out,
                         int64_t N, int64_t K, int apply_relu, prefetcher* pf, int new_weights, float* scratch) {
    float* panel = scratch;                                 /* [PANEL_K, PANEL] */
    float* rows_K = panel + PANEL_K * PANEL;                /* the item's rows, gathered: [rows, K] */
    float* ragged = rows_K + ITEM_ROWS * K;                 /* a last panel narrower than a vector: [rows, PANEL] */
    const float* x = a + it.first * K;
    if (a_index) {
        for (int64_t r = 0; r < it.rows; r++)
            for (int64_t k = 0; k < K; k++) rows_K[r * K + k] = a[a_index[it.first + r] * K + k];
        x = rows_K;
    }
    const int64_t blocks = (it.rows + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        const int w_rows = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        const int vecs = (w_rows + LANES - 1) / LANES, whole = w_rows % LANES == 0;
        const char* at = NULL;
        int64_t lines = take(pf, new_weights ? w_rows * K * (int64_t)sizeof(float) : 0, &at);
        const int step_lines = per_step(lines, blocks * K);
        for (int64_t k0 = 0; k0 < K; k0 += PANEL_K) {
            const int64_t cols = K - k0 < PANEL_K ? K - k0 : PANEL_K;
            transpose_panel(w_e + n0 * K + k0, K, w_rows, cols, panel);
            for (int64_t r = 0; r < it.rows; r += TILE_ROWS) {
                const int rows = it.rows - r < TILE_ROWS ? (int)(it.rows - r) : TILE_ROWS;
                float* o = whole ? out + (it.first + r) * N + n0 : ragged + r * PANEL;
                w_tile_any(x + r * K + k0, K, panel, PANEL, o, whole ? N : PANEL, cols, rows, vecs, k0 > 0,
                           apply_relu && k0 + cols == K, at, step_lines, lines);
                advance(&at, &lines, step_lines * cols);
            }
        }
        if (lines > 0) prefetch_lines(at, (int)lines);
        if (!whole)
            for (int64_t r = 0; r < it.rows; r++)
                for (int j = 0; j < w_rows; j++) out[(it.first + r) * N + n0 + j] = ragged[r * PANEL + j];
    }
}

/* The ReLU's backward on finished rows of rows_times_wt's output g, while they are in cache, with each row's dot
 * product against the hidden rows h (the gate's gradient): dot[r] = sum_n g[r][n] h[r][n], then
 * g[r][n] = h[r][n] > 0 ? g[r][n] * scale[r] : 0. */
typedef struct { const float* hidden; const float* scale; float* dot; } relu_grad;

static void relu_backward_rows(float* g, const relu_grad* rg, int64_t first, int64_t rows, int64_t N) {
    const int64_t N_vec = N - N % LANES;
    for (int64_t r = first; r < first + rows; r++) {
        float* g_r = g + r * N;
        const float* h_r = rg->hidden + r * N;
        const float s = rg->scale[r];
        vec dot = {0};
        for (int64_t n = 0; n < N_vec; n += LANES) {
            const vec v = load(g_r + n), h = load(h_r + n);
            dot += v * h;
            store(g_r + n, (vec)((ivec)(v * s) & (ivec)(h > (vec){0})));
        }
        float total = 0.f;
        for (int i = 0; i < LANES; i++) total += dot[i];
        for (int64_t n = N_vec; n < N; n++) {
            total += g_r[n] * h_r[n];
            g_r[n] = h_r[n] > 0.f ? g_r[n] * s : 0.f;
        }
        rg->dot[r] = total;
    }
}

static void wt_chunk(const item* items, int64_t first, int64_t end, const float* a, const int64_t* a_index,
                     const float* w, float* out, int64_t N, int64_t K, int apply_relu, const relu_grad* rg,
                     float* aT) {
    prefetcher pf = prefetcher_for(items, first, end, w, N, K);
    for (int64_t t = first; t < end; t++) {
        const item it = items[t];
        const float* w_e = w + it.expert * N * K;
        int new_weights = t == first || items[t - 1].expert != it.expert;
        if (it.rows >= PANEL_MIN_ROWS) {
            wt_by_panels(it, a, a_index, w_e, out, N, K, apply_relu, &pf, new_weights, aT);
            if (rg) relu_backward_rows(out, rg, it.first, it.rows, N);
            continue;
        }
        /* Blocks of LANES rows (the last one padded), all packed first: each tile of W then comes from memory
         * once and serves every block from L1, and the weights stream at one pace through the whole item. */
        int64_t blocks = 0, r = 0;
        for (; it.rows - r > DOT_MAX_ROWS; r += LANES, blocks++)
            pack_transposed(a, a_index, it.first + r, it.rows - r < LANES ? it.rows - r : LANES, K,
                            aT + blocks * K * LANES);
        for (int64_t n = 0; blocks && n < N; n += WT_TILE) {
            const int w_rows = N - n < WT_TILE ? (int)(N - n) : WT_TILE;
            const char* at = NULL;
            int64_t lines = take(&pf, new_weights ? w_rows * K * (int64_t)sizeof(float) : 0, &at);
            const int step_lines = per_step(lines, blocks * ((K + LANES - 1) / LANES));
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t first_row = b * LANES, rows = it.rows - first_row < LANES ? it.rows - first_row : LANES;
                wt_tile(aT + b * K * LANES, w_e + n * K, K, w_rows, out + (it.first + first_row) * N + n, N, rows,
                        apply_relu, at, step_lines, lines);
                advance(&at, &lines, step_lines * ((K + LANES - 1) / LANES));
            }
            if (lines > 0) prefetch_lines(at, (int)lines);
        }
        if (blocks) new_weights = 0;   /* the remaining rows find W in cache */
        if (r < it.rows) {
            const float* x[DOT_MAX_ROWS];
            for (int64_t i = 0; i < it.rows - r; i++) x[i] = row_of(a, a_index, it.first + r + i, K);
            wt_dots_any(x, w_e, N, K, out + (it.first + r) * N, N, (int)(it.rows - r), apply_relu, &pf, new_weights);
        }
        if (rg) relu_backward_rows(out, rg, it.first, it.rows, N);
    }
}

/* relu_hidden (with relu_scale and relu_dot; else NULL): the ReLU backward, see relu_backward_rows. */
void rows_times_wt(const float* a, const int64_t* a_index, const float* w, float* out, const int64_t* offsets,
                   int64_t E, int64_t N, int64_t K, int apply_relu, const float* relu_hidden, const float* relu_scale,
                   float* relu_dot, int threads) {
    const relu_grad grad = {relu_hidden, relu_scale, relu_dot};
    const relu_grad* rg = relu_hidden ? &grad : NULL;
#define WT_BODY(items, first, end, scratch) wt_chunk(items, first, end, a, a_index, w, out, N, K, apply_relu, rg, scratch)
    FOR_EACH_CHUNK(offsets, E, N, 0, threads, (ITEM_ROWS + LANES) * K + (PANEL_K + ITEM_ROWS) * PANEL, WT_BODY);
}

/* ---------------------------------------------------------------- rows_outer: W[e] = a[rows]^T . b[rows] */

/* W[n + i][c + j-th vector] (+)= sum over m rows r of a_packed[r][i] b_packed[r][j-th vector]: rows x vecs of
 * the tile, both operands packed (see outer_chunk), so every step reads two contiguous runs. */
static inline __attribute__((always_inline)) void outer_tile(const float* a_packed, const float* b_packed, int64_t m,
                                                             float* out, int64_t ldo, const int rows, const int vecs,
                                                             int accumulate, int streaming) {
    vec acc[TILE_ROWS][TILE_VECS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) acc[i][j] = accumulate ? load(out + i * ldo + j * LANES) : (vec){0};
    for (int64_t r = 0; r < m; r++) {
        const float* b_r = b_packed + r * OUTER_TILE_COLS;
        vec bv[TILE_VECS];
        for (int j = 0; j < vecs; j++) bv[j] = in_register(load(b_r + j * LANES));
        for (int i = 0; i < rows; i++) {
            const vec x = splat(a_packed[r * TILE_ROWS + i]);
            for (int j = 0; j < vecs; j++) acc[i][j] += x * bv[j];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) {
            if (streaming) store_streaming(out + i * ldo + j * LANES, acc[i][j]);
            else store(out + i * ldo + j * LANES, acc[i][j]);
        }
}

#define O_CASE(R, V) case (R) * 8 + (V): outer_tile(a_packed, b_packed, m, out, ldo, R, V, acc, streaming); break;
#if TILE_VECS == 4
#define O_ROW_CASES(R) O_CASE(R, 1) O_CASE(R, 2) O_CASE(R, 3) O_CASE(R, 4)
#else
#define O_ROW_CASES(R) O_CASE(R, 1) O_CASE(R, 2)
#endif
static void outer_tile_any(const float* a_packed, const float* b_packed, int64_t m, float* out, int64_t ldo, int rows,
                           int vecs, int acc, int streaming) {
    switch (rows * 8 + vecs) {
        O_ROW_CASES(1) O_ROW_CASES(2) O_ROW_CASES(3) O_ROW_CASES(4) O_ROW_CASES(5) O_ROW_CASES(6)
    }
}

/* Requests the rows of item `next` (a's, then b's) while the tiles of this one run: `lines` per call. The
 * position is kept as (row, line) rather than as a count divided into them on every call (outer_rows calls once
 * per row of W). */
typedef struct {
    const float *a, *b;
    const int64_t* b_index;
    int64_t first, rows, N, K;
    int64_t a_lines, b_row_lines;   /* the item's rows of a (contiguous) and one row of b, in lines */
    int64_t a_done, b_row, b_line;  /* a's lines requested; then the row of b and its line next */
} row_prefetch;

static row_prefetch rows_of_item(const float* a, const float* b, const int64_t* b_index, int64_t first,
                                 int64_t rows, int64_t N, int64_t K) {
    return (row_prefetch){a, b, b_index, first, rows, N, K, (rows * N * (int64_t)sizeof(float) + LINE - 1) / LINE,
                          (K * (int64_t)sizeof(float) + LINE - 1) / LINE, 0, 0, 0};
}

static void prefetch_rows(row_prefetch* p, int64_t lines) {
    for (; lines > 0 && p->a_done < p->a_lines; lines--, p->a_done++)
        __builtin_prefetch((const char*)(p->a + p->first * p->N) + p->a_done * LINE, 0, 2);
    for (; lines > 0 && p->b_row < p->rows; lines--) {
        __builtin_prefetch((const char*)row_of(p->b, p->b_index, p->first + p->b_row, p->K) + p->b_line * LINE, 0, 2);
        if (++p->b_line == p->b_row_lines) { p->b_line = 0; p->b_row++; }
    }
}

/* Rows summed per pass: the pass's packed rows of b stay in L2 while every tile of W reads them. */
static int64_t outer_pass_rows(int64_t K) {
    const int64_t rows = OUTER_PACK_BYTES / ((K + OUTER_TILE_COLS) * (int64_t)sizeof(float));
    return rows < TILE_ROWS ? TILE_ROWS : rows > OUTER_PASS_ROWS ? OUTER_PASS_ROWS : rows;
}

/* Scratch: the pass's rows of b, [K_vec / OUTER_TILE_COLS (rounded up)][pass rows][OUTER_TILE_COLS], and of a
 * for one tile of W's rows, [pass rows][TILE_ROWS]. */
static int64_t outer_scratch_floats(int64_t K) {
    const int64_t col_tiles = (K + OUTER_TILE_COLS - 1) / OUTER_TILE_COLS;
    return outer_pass_rows(K) * (col_tiles * OUTER_TILE_COLS + TILE_ROWS);
}

/* W[n][...] = sum over the m (at most OUTER_ROW_MAX_ROWS) rows r of a[r][n] b_rows[r][...], a row of W at a
 * time. With so few rows W's tiles are bound by writing W, and the tiles wrote TILE_ROWS lines a row of W apart
 * between bursts of arithmetic; row by row the stores are one sequential stream, which write-combining takes
 * at close to the machine's store bandwidth (E=1024..4096, 1-4 rows per expert: 15-21 -> 23-24 GB/s of W,
 * against 26-28 GB/s for a fill). Each element is the same sum in the same order as in a tile. */
static void outer_rows(const item* it, const float* a_t, const float* const* b_rows, float* w_e, int64_t N,
                       int64_t K, int64_t K_vec, int streaming, row_prefetch* next, int64_t next_lines) {
    const int64_t m = it->rows, width = it->n1 > it->n0 ? it->n1 - it->n0 : 1;
    const int64_t per_row = (next_lines + width - 1) / width;
    for (int64_t n = it->n0; n < it->n1; n++) {
        float x[OUTER_ROW_MAX_ROWS];
        for (int64_t r = 0; r < m; r++) x[r] = a_t[r * N + n];
        prefetch_rows(next, per_row);
        float* out = w_e + n * K;
        for (int64_t c = 0; c < K_vec; c += LANES) {
            vec acc = (vec){0};
            for (int64_t r = 0; r < m; r++) acc += splat(x[r]) * load(b_rows[r] + c);
            if (streaming) store_streaming(out + c, acc);
            else store(out + c, acc);
        }
    }
}

/* W[n0..n1][...] = a[rows]^T . b[rows] in tiles. Many rows are summed in passes; W's tiles carry the partial
 * sums (ordinary stores) until the last. The tiles read packed copies: the pass's b rows (gathered through
 * b_index once, not once per tile) in OUTER_TILE_COLS-wide panels, and a tile's TILE_ROWS columns of a. Read
 * in place, each step of a tile touched two cache lines a row apart, and a pass did not fit in a 512 KiB L2:
 * 30% slower with 512 rows per expert. Each element is still the sum over the rows in order, whatever the
 * pass size. */
static void outer_tiles(const item* it, const float* a_t, const float* b, const int64_t* b_index, float* w_e,
                        int64_t N, int64_t K, int64_t K_vec, int streaming, row_prefetch* next, int64_t next_lines,
                        float* scratch) {
    const int64_t max_pass_rows = outer_pass_rows(K), col_tiles = (K_vec + OUTER_TILE_COLS - 1) / OUTER_TILE_COLS;
    float* b_packed = scratch;
    float* a_packed = scratch + max_pass_rows * col_tiles * OUTER_TILE_COLS;
    const int64_t tiles = (it->n1 - it->n0 + TILE_ROWS - 1) / TILE_ROWS * col_tiles;
    const int64_t per_tile = tiles ? (next_lines + tiles - 1) / tiles : 0;
    const int64_t passes = (it->rows + max_pass_rows - 1) / max_pass_rows;
    const int64_t pass_rows = (it->rows + passes - 1) / passes;
    for (int64_t m0 = 0; m0 < it->rows; m0 += pass_rows) {
        const int64_t m = it->rows - m0 < pass_rows ? it->rows - m0 : pass_rows;
        const int last = m0 + pass_rows >= it->rows;
        for (int64_t r = 0; r < m; r++) {
            const float* b_r = row_of(b, b_index, it->first + m0 + r, K);
            for (int64_t c = 0; c < K_vec; c += LANES)
                store(b_packed + (c / OUTER_TILE_COLS * m + r) * OUTER_TILE_COLS + c % OUTER_TILE_COLS, load(b_r + c));
        }
        for (int64_t n = it->n0; n < it->n1; n += TILE_ROWS) {
            const int rows = it->n1 - n < TILE_ROWS ? (int)(it->n1 - n) : TILE_ROWS;
            for (int64_t r = 0; r < m; r++)
                for (int i = 0; i < rows; i++) a_packed[r * TILE_ROWS + i] = a_t[(m0 + r) * N + n + i];
            for (int64_t c = 0; c < K_vec; c += OUTER_TILE_COLS) {
                const int vecs = (K_vec - c) / LANES < TILE_VECS ? (K_vec - c) / LANES : TILE_VECS;
                if (last) prefetch_rows(next, per_tile);
                outer_tile_any(a_packed, b_packed + c * m, m, w_e + n * K + c, K, rows, vecs, m0 > 0,
                               last && streaming);
            }
        }
    }
}

static void outer_chunk(const item* items, int64_t first, int64_t end, const float* a, const float* b,
                        const int64_t* b_index, float* w, int64_t N, int64_t K, int streaming, float* scratch) {
    const int64_t K_vec = K - K % LANES;
    for (int64_t t = first; t < end; t++) {
        const item it = items[t];
        float* w_e = w + it.expert * N * K;
        const float* a_t = a + it.first * N;
        const int next_expert = t + 1 < end && items[t + 1].expert != it.expert;   /* its rows, requested meanwhile */
        row_prefetch next = rows_of_item(a, b, b_index, next_expert ? items[t + 1].first : 0,
                                         next_expert ? items[t + 1].rows : 0, N, K);
        const int64_t next_lines = (next.rows * (N + K) * (int64_t)sizeof(float)) / LINE + next.rows;
        if (it.rows <= OUTER_ROW_MAX_ROWS) {   /* also an expert without rows: its zeros */
            const float* b_rows[OUTER_ROW_MAX_ROWS];
            for (int64_t r = 0; r < it.rows; r++) b_rows[r] = row_of(b, b_index, it.first + r, K);
            outer_rows(&it, a_t, b_rows, w_e, N, K, K_vec, streaming, &next, next_lines);
        } else {
            outer_tiles(&it, a_t, b, b_index, w_e, N, K, K_vec, streaming, &next, next_lines, scratch);
        }
        for (int64_t n = it.n0; n < it.n1; n++)          /* columns past the last whole vector */
            for (int64_t k = K_vec; k < K; k++) {
                float s = 0.f;
                for (int64_t r = 0; r < it.rows; r++) s += a_t[r * N + n] * row_of(b, b_index, it.first + r, K)[k];
                w_e[n * K + k] = s;
            }
    }
}

void rows_outer(const float* a, const float* b, const int64_t* b_index, float* w, const int64_t* offsets, int64_t E,
                int64_t N, int64_t K, int threads, int streaming) {
#define OUTER_BODY(items, first, end, scratch) outer_chunk(items, first, end, a, b, b_index, w, N, K, streaming, scratch)
    FOR_EACH_CHUNK(offsets, E, N, 1, threads, outer_scratch_floats(K), OUTER_BODY);
}
