/* The noisy top-k gate's [tokens, experts] arithmetic on CPU (float32), one pass over each row per
 * direction, where torch's ops make about a dozen passes forward and twenty backward
 * (Shazeer et al. eq. 4-5, 8-9; the same arithmetic as moe/gating_ops.py, which documents it).
 *
 * Legend: N tokens, E experts, K top-k, M = min(K + 1, E) values kept per row.
 *   noisy_top_k_forward   sp = softplus(z), kept for the backward; std = sp + eps; noisy = clean + noise * std
 *                         (one fused multiply-add); the top M noisy values per row (descending; the lower index
 *                         first among equals); with `smooth_load`, load[e] = sum over rows of P(e stays in the
 *                         top K)
 *   noisy_top_k_backward  gradients of clean and z from those of the top values and of the load; std comes back
 *                         bitwise as sp + eps, and softplus'(z) = 1 - exp(-sp) is exact where std - eps would
 *                         cancel (gating_ops.py says why)
 * Rows go in fixed blocks of `rows_per_block`; the load sums per block and then over the blocks in order, so
 * results do not depend on the number of threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* glibc's vector math library (libmvec) has SIMD versions of these; declared so, GCC vectorises the loops
 * below that call them (glibc's own header declares them only under -ffast-math, which we avoid: it would
 * switch the whole process to flush-to-zero). Elsewhere the loops stay scalar. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define VECTOR_MATH __attribute__((simd("notinbranch")))
VECTOR_MATH float expf(float);
VECTOR_MATH float expm1f(float);
VECTOR_MATH float log1pf(float);
VECTOR_MATH float erff(float);
#endif

#define SQRT2 1.41421356237309504880f
#define INV_SQRT_PI 0.56418958354775628695f

/* libmvec computes a vector at full speed only while no lane's argument or result is near the ends of the
 * float range (overflow, underflow, denormals): one such lane sends the whole vector down a scalar path,
 * 10-20x slower per value. Once the logits had spread, the backward at E=1024 took 62 ms instead of 8.
 * So arguments are clamped where the result no longer changes: softplus(z) + eps is eps below z = -60 and
 * z above 20 (torch's threshold); softplus(z) itself, and with it softplus'(z) in the backward, is held at
 * softplus(-60) ~ 9e-27 below z = -60 (gating_ops._softplus_derivative holds it there too). A Gaussian
 * factor exp(-zz^2) below exp(-50) ~ 2e-22 is taken as 0 (as in gating_ops._gaussian): 2e-22 of the entries near the threshold, beyond float32's precision next to them,
 * and it keeps denormals out of the gradient that the router's matmuls take next (MKL runs 80x slower on
 * those: the layer took 4x longer at E=1024).
 * The clamp works on the bits: GCC turns a float clamp inside exp into a clamp of exp's result, which would
 * still call exp on the unclamped value. The map below orders the bits of floats as ints. */
static inline int32_t ordered_bits(float x) { int32_t i; memcpy(&i, &x, 4); return i ^ ((i >> 31) & 0x7fffffff); }
static inline float from_ordered_bits(int32_t i) { i ^= (i >> 31) & 0x7fffffff; float x; memcpy(&x, &i, 4); return x; }
static inline float clamp(float x, float low, float high) {
    const int32_t i = ordered_bits(x), lo = ordered_bits(low), hi = ordered_bits(high);
    return from_ordered_bits(i < lo ? lo : i > hi ? hi : i);
}
static inline float softplus(float z) { return z > 20.f ? z : log1pf(expf(clamp(z, -60.f, 20.f))); }
#define GAUSSIAN_CUTOFF 50.f
/* The cut-off masks the bits: a select after the call would let GCC make the call conditional, and a loop
 * with a conditional call does not vectorise. */
static inline float gaussian(float zz) {
    const float q = zz * zz;
    const float value = expf(-clamp(q, 0.f, GAUSSIAN_CUTOFF));
    int32_t bits;
    memcpy(&bits, &value, 4);
    bits &= -(int32_t)(q < GAUSSIAN_CUTOFF);
    float result;
    memcpy(&result, &bits, 4);
    return result;
}
static inline float noisy_logit(float clean, float noise, float std) { return fmaf(noise, std, clean); }
static inline float denominator(float std) { return std * SQRT2 + 1e-20f; }

#define SCAN_BLOCK 16   /* values compared with the top list's last entry at once (a vector) */

/* Inserts (value, index) into the descending top list of `kept` (< M or better than the last) entries. */
static inline int64_t keep_top(float* values, int64_t* indices, int64_t kept, int64_t M, float v, int64_t e) {
    if (kept == M && !(v > values[M - 1])) return kept;
    int64_t j = kept < M ? kept++ : M - 1;
    while (j > 0 && v > values[j - 1]) { values[j] = values[j - 1]; indices[j] = indices[j - 1]; j--; }
    values[j] = v; indices[j] = e;
    return kept;
}

void noisy_top_k_forward(const float* clean, const float* z, const float* noise, float* softplus_out,
                         float* top_values, int64_t* top_idx, float* load, float* load_blocks,
                         int64_t N, int64_t E, int64_t K, int64_t M, int64_t rows_per_block, float eps,
                         int smooth_load, int threads) {
    const int64_t blocks = (N + rows_per_block - 1) / rows_per_block;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        float* block_load = load_blocks + b * E;
        if (smooth_load) memset(block_load, 0, E * sizeof(float));
        const int64_t last = (b + 1) * rows_per_block < N ? (b + 1) * rows_per_block : N;
        for (int64_t n = b * rows_per_block; n < last; n++) {
            const float *c = clean + n * E, *zn = z + n * E, *g = noise + n * E;
            float* sp = softplus_out + n * E;
            float* tv = top_values + n * M;
            int64_t* ti = top_idx + n * M;
            #pragma omp simd
            for (int64_t e = 0; e < E; e++) sp[e] = softplus(zn[e]);
            int64_t kept = 0, e = 0;
            for (; e < M; e++) kept = keep_top(tv, ti, kept, M, noisy_logit(c[e], g[e], sp[e] + eps), e);
            /* The list is full: a value joins it only if it beats the last kept one, which only rises, so a
             * block in which no value beats it now can be skipped whole (most blocks, once a few have passed). */
            for (; e + SCAN_BLOCK <= E; e += SCAN_BLOCK) {
                const float last_kept = tv[M - 1];
                int beats = 0;
                #pragma omp simd reduction(|:beats)
                for (int64_t j = e; j < e + SCAN_BLOCK; j++)
                    beats |= noisy_logit(c[j], g[j], sp[j] + eps) > last_kept;
                if (beats)
                    for (int64_t j = e; j < e + SCAN_BLOCK; j++)
                        kept = keep_top(tv, ti, kept, M, noisy_logit(c[j], g[j], sp[j] + eps), j);
            }
            for (; e < E; e++) kept = keep_top(tv, ti, kept, M, noisy_logit(c[e], g[e], sp[e] + eps), e);
            if (!smooth_load) continue;
            const float thr_in = tv[K], thr_out = tv[K - 1];   /* the (K+1)-th and K-th noisy values */
            #pragma omp simd
            for (int64_t e = 0; e < E; e++) {
                const float std = sp[e] + eps;
                const float thr = noisy_logit(c[e], g[e], std) > thr_in ? thr_in : thr_out;
                block_load[e] += 0.5f * (1.f + erff((c[e] - thr) / denominator(std)));
            }
        }
    }
    if (!smooth_load) return;
    memset(load, 0, E * sizeof(float));
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t e = 0; e < E; e++) load[e] += load_blocks[b * E + e];
}

/* grad_top [N, M] is written over (the thresholds' share is added to it); grad_load may be NULL. */
void noisy_top_k_backward(const float* clean, const float* noise, const float* softplus_in, const float* top_values,
                          const int64_t* top_idx, float* grad_top, const float* grad_load,
                          float* grad_clean, float* grad_z, int64_t N, int64_t E, int64_t K, int64_t M,
                          float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const float *c = clean + n * E, *g = noise + n * E, *sp = softplus_in + n * E, *tv = top_values + n * M;
        const int64_t* ti = top_idx + n * M;
        float *gt = grad_top + n * M, *gc = grad_clean + n * E, *gz = grad_z + n * E;
        if (grad_load) {
            const float thr_in = tv[K], thr_out = tv[K - 1];
            #pragma omp simd
            for (int64_t e = 0; e < E; e++) {
                const float std = sp[e] + eps;
                const int is_in = noisy_logit(c[e], g[e], std) > thr_in;
                const float denom = denominator(std);
                const float zz = (c[e] - (is_in ? thr_in : thr_out)) / denom;
                /* d Phi(zz * sqrt2) / d clean = exp(-zz^2) / sqrt(pi) / denom */
                const float d_clean = gaussian(zz) * INV_SQRT_PI / denom * grad_load[e];
                gc[e] = d_clean;
                gz[e] = -SQRT2 * d_clean * zz;                  /* d zz / d std = -zz sqrt2 / denom */
            }
            /* The thresholds are noisy top values: each takes the gradient of the entries it is the threshold
             * of. Summed in a second pass over the row (in cache): sums in the loop above, which calls expf,
             * keep GCC from vectorising it (E=1024: 17 -> 2 ms). */
            float through_in = 0.f, through_all = 0.f;
            #pragma omp simd reduction(+:through_in, through_all)
            for (int64_t e = 0; e < E; e++) {
                through_in += noisy_logit(c[e], g[e], sp[e] + eps) > thr_in ? gc[e] : 0.f;
                through_all += gc[e];
            }
            gt[K] -= through_in;
            gt[K - 1] -= through_all - through_in;
        } else {
            memset(gc, 0, E * sizeof(float));
            memset(gz, 0, E * sizeof(float));
        }
        for (int64_t j = 0; j < M; j++) {                       /* noisy = clean + noise * std */
            gc[ti[j]] += gt[j];
            gz[ti[j]] += gt[j] * g[ti[j]];
        }
        #pragma omp simd
        for (int64_t e = 0; e < E; e++)   /* softplus' = 1 - exp(-softplus): 1 in float32 past softplus 17 */
            gz[e] *= -expm1f(-clamp(sp[e], 0.f, 30.f));
    }
}
