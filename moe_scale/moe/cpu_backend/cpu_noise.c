/* Standard normal noise for the noisy gate on CPU (float32), counter-based: value i depends only on (seed, i).
 * torch.randn draws from one serial Mersenne Twister stream: 20 ms for the [2048, 1024] noise of one layer
 * here, where this takes 7 ms. It fills in parallel, and any thread count gives the same values.
 *
 * Philox4x32-10 (Salmon et al., SC'11: "Parallel random numbers: as easy as 1, 2, 3") turns counter
 * c = i / 4 under key `seed` into four 32-bit words; Box-Muller turns each pair of words into two normals:
 *   u1 = ((w0 >> 8) + 1) / 2^24 in (0, 1],  u2 = (w1 >> 8) / 2^24 in [0, 1)
 *   out[4c + 0], out[4c + 1] = sqrt(-2 ln u1) * (cos, sin)(2 pi u2);  words w2, w3 give out[4c + 2, 4c + 3].
 * 24-bit uniforms bound |value| by sqrt(2 ln 2^24) = 5.77 (a tail of 8e-9 is cut).
 */
#include <math.h>
#include <stdint.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define VECTOR_MATH __attribute__((simd("notinbranch")))   /* libmvec's SIMD variants, see cpu_gating.c */
VECTOR_MATH float logf(float);
VECTOR_MATH float sinf(float);
#endif

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define BLOCK 256          /* counters per chunk of work: 1024 values */
#define TWO_PI 6.28318530717958647692f
#define INV_2_24 5.9604644775390625e-08f

static inline void philox_round(uint32_t x[4], uint32_t k0, uint32_t k1) {
    const uint64_t p0 = (uint64_t)PHILOX_M0 * x[0], p1 = (uint64_t)PHILOX_M1 * x[2];
    const uint32_t y0 = (uint32_t)(p1 >> 32) ^ x[1] ^ k0, y1 = (uint32_t)p1;
    const uint32_t y2 = (uint32_t)(p0 >> 32) ^ x[3] ^ k1, y3 = (uint32_t)p0;
    x[0] = y0; x[1] = y1; x[2] = y2; x[3] = y3;
}

/* The counter x (four words) under the key (k0, k1), in place. */
static inline void philox4x32_10(uint32_t x[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; r++) {
        philox_round(x, k0, k1);
        k0 += PHILOX_W0; k1 += PHILOX_W1;
    }
}

/* One block, for the known-answer test against Random123's published vectors. */
void philox4x32_10_block(const uint32_t* counter, const uint32_t* key, uint32_t* out) {
    for (int j = 0; j < 4; j++) out[j] = counter[j];
    philox4x32_10(out, key[0], key[1]);
}

/* Box-Muller's radius, and its angle as a fraction of a turn. cos(2 pi f) is taken as sin(2 pi (f + 1/4)):
 * GCC would fuse a sin and a cos of one argument into a sincos, which has no vector version it can call. */
static inline float radius(uint32_t a) { return sqrtf(-2.f * logf((float)((a >> 8) + 1u) * INV_2_24)); }
static inline float turns(uint32_t b) { return (float)(b >> 8) * INV_2_24; }

void standard_normal(float* out, int64_t n, uint64_t seed, int threads) {
    const int64_t counters = (n + 3) / 4, blocks = (counters + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        uint32_t words[4][BLOCK];   /* word j of each counter: structure of arrays, so the loops vectorise */
        float values[4][BLOCK];
        const int64_t first = b * BLOCK;
        const int64_t count = counters - first < BLOCK ? counters - first : BLOCK;
        for (int64_t j = 0; j < count; j++) {
            const uint64_t c = (uint64_t)(first + j);   /* the counter's low two words; the key is the seed */
            uint32_t w[4] = {(uint32_t)c, (uint32_t)(c >> 32), 0u, 0u};
            philox4x32_10(w, (uint32_t)seed, (uint32_t)(seed >> 32));
            words[0][j] = w[0]; words[1][j] = w[1]; words[2][j] = w[2]; words[3][j] = w[3];
        }
        for (int pair = 0; pair < 2; pair++) {
            const uint32_t *radius_words = words[2 * pair], *angle_words = words[2 * pair + 1];
            float *first_value = values[2 * pair], *second_value = values[2 * pair + 1];
            #pragma omp simd
            for (int64_t j = 0; j < count; j++) {
                const float r = radius(radius_words[j]), f = turns(angle_words[j]);
                first_value[j] = r * sinf(TWO_PI * (f + 0.25f));
                second_value[j] = r * sinf(TWO_PI * f);
            }
        }
        for (int64_t j = 0; j < count; j++)   /* value 4c + q is word pair q's; the last counter may pass n */
            for (int q = 0; q < 4 && 4 * (first + j) + q < n; q++) out[4 * (first + j) + q] = values[q][j];
    }
}
