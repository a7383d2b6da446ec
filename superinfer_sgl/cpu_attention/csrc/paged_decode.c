/* Paged decode attention on the CPU: one query token per request, K/V read in place from the
 * token-slot pool (no gather copy). Built at first use by native.py with
 *   gcc -O3 -march=native -fopenmp -shared -fPIC
 * and called through ctypes; torch's own libgomp (soname libgomp.so.1, loaded first) serves
 * the OpenMP pragmas, so this shares torch's thread pool.
 *
 * Layouts (strides in elements):
 *   q    [B, Hq, D]      q_sb, q_sh        (last dim contiguous)
 *   k/v  [slots, Hkv, D] kv_ss, kv_sh      (last dim contiguous; K and V share strides)
 *   out  [B, Hq, Dv]     o_sb, o_sh
 *   req_to_token [rows, r2t_s] int32; req_pool_indices [B] int64; seq_lens [B] int64
 * Query head hq uses KV head hq / G, G = Hq / Hkv (GQA), as torch SDPA's enable_gqa does.
 * Softmax is exact (two passes over the keys), in float32: scores are kept per work item.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_G 32
#define MAX_D 256
#define PREFETCH 8 /* rows ahead: slots are scattered, so the hardware prefetcher cannot guess */

static inline void prefetch_row(const void *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 1);
}

#include "bf16.h"
#include "exp512.h"

/* q . k over d < D. The hot loop of the score pass: with AVX-512 one fused multiply-add chain
 * and one tree reduction per dot product (the auto-vectorised loop reduced lane by lane). */
static inline float dot(const float *a, const float *b, int D) {
#ifdef __AVX512F__
    if ((D & 15) == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += a[d] * b[d];
    return s;
}

/* x[j] = exp(x[j] - m) for j < n; returns the sum (AVX-512: exp512.h). */
static inline float exp_shift_sum(float *x, int64_t n, float m) {
    float sum = 0.f;
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        /* x[j] <= m, so exp512's upper clamp never applies: the same bits as clamping below only. */
        __m512 p = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm)));
        _mm512_mask_storeu_ps(x + j, k, p);
        acc = _mm512_add_ps(acc, p);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; ++j) {
        x[j] = expf(x[j] - m);
        sum += x[j];
    }
    return sum;
}

/* One (request, KV head) work item, for element type T with loader LOAD and storer STORE. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE)                                                        \
static void NAME(const T *q, const T *k, const T *v, T *out, const int32_t *slots, int64_t len,   \
                 int G, int D, int Dv, int64_t q_sh, int64_t o_sh, int64_t kv_ss, float scale,    \
                 float *scores) {                                                                 \
    float qf[MAX_G][MAX_D];                                                                       \
    float acc[MAX_G][MAX_D];                                                                      \
    float mx[MAX_G], den[MAX_G];                                                                  \
    for (int g = 0; g < G; ++g) {                                                                 \
        for (int d = 0; d < D; ++d) qf[g][d] = LOAD(q[g * q_sh + d]) * scale;                    \
        for (int d = 0; d < Dv; ++d) acc[g][d] = 0.f;                                             \
        mx[g] = -INFINITY;                                                                        \
        den[g] = 0.f;                                                                             \
    }                                                                                             \
    for (int64_t j = 0; j < len; ++j) {                                                           \
        const T *kr = k + (int64_t)slots[j] * kv_ss;                                              \
        if (j + PREFETCH < len) prefetch_row(k + (int64_t)slots[j + PREFETCH] * kv_ss, D * sizeof(T)); \
        float kf[MAX_D];                                                                          \
        for (int d = 0; d < D; ++d) kf[d] = LOAD(kr[d]);                                          \
        for (int g = 0; g < G; ++g) {                                                             \
            float s = dot(qf[g], kf, D);                                                          \
            scores[g * len + j] = s;                                                              \
            if (s > mx[g]) mx[g] = s;                                                             \
        }                                                                                         \
    }                                                                                             \
    for (int g = 0; g < G; ++g) {                                                                 \
        den[g] = exp_shift_sum(scores + g * len, len, mx[g]);                                     \
    }                                                                                             \
    for (int64_t j = 0; j < len; ++j) {                                                           \
        const T *vr = v + (int64_t)slots[j] * kv_ss;                                              \
        if (j + PREFETCH < len) prefetch_row(v + (int64_t)slots[j + PREFETCH] * kv_ss, Dv * sizeof(T)); \
        float vf[MAX_D];                                                                          \
        for (int d = 0; d < Dv; ++d) vf[d] = LOAD(vr[d]);                                         \
        for (int g = 0; g < G; ++g) {                                                             \
            float p = scores[g * len + j];                                                        \
            _Pragma("omp simd")                                                                   \
            for (int d = 0; d < Dv; ++d) acc[g][d] += p * vf[d];                                  \
        }                                                                                         \
    }                                                                                             \
    for (int g = 0; g < G; ++g) {                                                                 \
        float inv = 1.f / den[g];                                                                 \
        for (int d = 0; d < Dv; ++d) out[g * o_sh + d] = STORE(acc[g][d] * inv);                  \
    }                                                                                             \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_BF16(x) f32_to_bf16(x)

DEFINE_ITEM(item_f32, float, LOAD_F32, STORE_F32)
DEFINE_ITEM(item_bf16, uint16_t, LOAD_BF16, STORE_BF16)

/* Returns 0 on success, a negative code for an unsupported shape (the caller falls back). */
#define DEFINE_ENTRY(NAME, ITEM, T)                                                              \
int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k_cache, const T *v_cache,             \
         int64_t kv_ss, int64_t kv_sh, const int32_t *req_to_token, int64_t r2t_s,                \
         const int64_t *req_pool_indices, const int64_t *seq_lens, T *out, int64_t o_sb,          \
         int64_t o_sh, int B, int Hq, int Hkv, int D, int Dv, float scale, int max_len,           \
         int num_threads) {                                                                       \
    if (Hkv <= 0 || Hq % Hkv != 0) return -1;                                                     \
    const int G = Hq / Hkv;                                                                       \
    if (G > MAX_G || D > MAX_D || Dv > MAX_D) return -2;                                          \
    const int64_t items = (int64_t)B * Hkv;                                                       \
    int bad = 0;                                                                                  \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:bad)")                            \
    {                                                                                             \
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(max_len > 0 ? max_len : 1)); \
        if (!scores) bad = 1;                                                                     \
        _Pragma("omp for schedule(dynamic, 1)")                                                   \
        for (int64_t it = 0; it < items; ++it) {                                                  \
            if (!scores) continue;                                                                \
            const int64_t b = it / Hkv, h = it % Hkv, len = seq_lens[b];                          \
            if (len <= 0 || len > max_len) { bad = 1; continue; }                                 \
            const int32_t *slots = req_to_token + req_pool_indices[b] * r2t_s;                    \
            ITEM(q + b * q_sb + h * G * q_sh, k_cache + h * kv_sh, v_cache + h * kv_sh,           \
                 out + b * o_sb + h * G * o_sh, slots, len, G, D, Dv, q_sh, o_sh, kv_ss, scale,   \
                 scores);                                                                         \
        }                                                                                         \
        free(scores);                                                                             \
    }                                                                                             \
    return bad ? -3 : 0;                                                                          \
}

DEFINE_ENTRY(superinfer_paged_decode_f32, item_f32, float)
DEFINE_ENTRY(superinfer_paged_decode_bf16, item_bf16, uint16_t)
