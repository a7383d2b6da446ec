/* Small per-layer CPU ops for SGLang's decode path, one C call each instead of 6-15 torch ops:
 *   - RMSNorm (optionally fused with the residual add), as RMSNorm.forward_native computes it;
 *   - rotary embedding (neox and GPT-J style), as RotaryEmbedding.forward_native computes it.
 * Built by native.py (gcc -O3 -march=native -ffp-contract=off -shared -fPIC), called via ctypes.
 *
 * Rounding follows the torch code step by step: every elementwise torch op rounds its result to
 * the tensor dtype, so each step here rounds too (-ffp-contract=off keeps a*b - c*d from being
 * fused into one FMA, which would round once instead of three times). The rotary kernel is
 * therefore bit-identical to forward_native in float32 and bfloat16; RMSNorm differs only in
 * the summation order of the mean of squares.
 *
 * Layouts: rows of x / q / k are [T, ...] with a token stride (elements) and a contiguous last
 * dimension; outputs are written to separate, caller-allocated buffers.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp512.h"

static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define LANES 16

/* Sum of squares of s[0..H), 16 partial sums (vectorises; torch also sums in vector lanes). */
static inline float sum_squares(const float *s, int H) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= H; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += s[i + l] * s[i + l];
    float tail = 0.f;
    for (; i < H; ++i) tail += s[i] * s[i];
    float total = 0.f;
    for (int l = 0; l < LANES; ++l) total += acc[l];
    return total + tail;
}

#define MAX_H 16384

/* out = rmsnorm(x [+ residual]) * w; res_out = x + residual (when residual != NULL).
 * cast_before_mul: out = w * bf16(x_normed) (RMSNorm.cast_x_before_out_mul), else
 * bf16(x_normed * w). Returns 0, or -1 if H is too large. */
int superinfer_rmsnorm_f32(const float *x, int64_t xs, const float *res, int64_t rs, const float *w,
                           float *out, int64_t os, float *res_out, int64_t ros, int T, int H, float eps,
                           int cast_before_mul) {
    (void)cast_before_mul; /* identical in float32 */
    if (H > MAX_H) return -1;
    float s[MAX_H];
    for (int t = 0; t < T; ++t) {
        const float *xr = x + t * xs;
        if (res) {
            const float *rr = res + t * rs;
            float *ro = res_out + t * ros;
            for (int i = 0; i < H; ++i) { s[i] = xr[i] + rr[i]; ro[i] = s[i]; }
        } else {
            memcpy(s, xr, sizeof(float) * (size_t)H);
        }
        float var = sum_squares(s, H) / (float)H;
        float inv = 1.0f / sqrtf(var + eps);
        float *o = out + t * os;
        for (int i = 0; i < H; ++i) { float y = s[i] * inv; o[i] = y * w[i]; }
    }
    return 0;
}

int superinfer_rmsnorm_bf16(const uint16_t *x, int64_t xs, const uint16_t *res, int64_t rs, const uint16_t *w,
                            uint16_t *out, int64_t os, uint16_t *res_out, int64_t ros, int T, int H, float eps,
                            int cast_before_mul) {
    if (H > MAX_H) return -1;
    float s[MAX_H];
    for (int t = 0; t < T; ++t) {
        const uint16_t *xr = x + t * xs;
        if (res) {
            const uint16_t *rr = res + t * rs;
            uint16_t *ro = res_out + t * ros;
            for (int i = 0; i < H; ++i) { s[i] = bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]); ro[i] = f32_to_bf16(s[i]); }
        } else {
            for (int i = 0; i < H; ++i) s[i] = bf16_to_f32(xr[i]);
        }
        float var = sum_squares(s, H) / (float)H;
        float inv = 1.0f / sqrtf(var + eps);
        uint16_t *o = out + t * os;
        if (cast_before_mul) {
            for (int i = 0; i < H; ++i) { float y = rbf(s[i] * inv); o[i] = f32_to_bf16(bf16_to_f32(w[i]) * y); }
        } else {
            for (int i = 0; i < H; ++i) { float y = s[i] * inv; o[i] = f32_to_bf16(y * bf16_to_f32(w[i])); }
        }
    }
    return 0;
}

/* Rotary embedding of one [T, nh, head_size] tensor x (token stride xs, head stride head_size)
 * into out (token stride os). cache [max_pos, rot_dim] (cache_s per position): cos half then sin
 * half. Dimensions >= rot_dim are copied. */
#define ROPE_BODY(T_, LOAD, STORE, ROUND)                                                          \
    int half = rot_dim / 2;                                                                       \
    for (int t = 0; t < T; ++t) {                                                                 \
        int64_t p = pos[t];                                                                       \
        if (p < 0 || p >= max_pos) return -1;                                                     \
        const T_ *cs = cache + p * cache_s;                                                       \
        for (int h = 0; h < nh; ++h) {                                                            \
            const T_ *xr = x + t * xs + (int64_t)h * head_size;                                   \
            T_ *o = out + t * os + (int64_t)h * head_size;                                        \
            for (int j = 0; j < half; ++j) {                                                      \
                int i1 = neox ? j : 2 * j, i2 = neox ? j + half : 2 * j + 1;                      \
                float x1 = LOAD(xr[i1]), x2 = LOAD(xr[i2]);                                       \
                float c = LOAD(cs[j]), s = LOAD(cs[half + j]);                                    \
                float a = ROUND(x1 * c), b = ROUND(x2 * s);                                       \
                float d = ROUND(x2 * c), e = ROUND(x1 * s);                                       \
                o[i1] = STORE(a - b);                                                             \
                o[i2] = STORE(d + e);                                                             \
            }                                                                                     \
            for (int i = rot_dim; i < head_size; ++i) o[i] = xr[i];                               \
        }                                                                                         \
    }                                                                                             \
    return 0;

#define ID(v) (v)

int superinfer_rope_f32(const int64_t *pos, const float *x, int64_t xs, float *out, int64_t os, int T, int nh,
                        int head_size, int rot_dim, const float *cache, int64_t cache_s, int64_t max_pos, int neox) {
    ROPE_BODY(float, ID, ID, ID)
}

int superinfer_rope_bf16(const int64_t *pos, const uint16_t *x, int64_t xs, uint16_t *out, int64_t os, int T,
                         int nh, int head_size, int rot_dim, const uint16_t *cache, int64_t cache_s,
                         int64_t max_pos, int neox) {
    ROPE_BODY(uint16_t, bf16_to_f32, f32_to_bf16, rbf)
}

/* SiLU-and-mul: out[t, i] = silu(x[t, i]) * x[t, d + i], i < d, as F.silu(x[..., :d]) * x[..., d:]:
 * silu(g) = g / (1 + exp(-g)) in float32, rounded to the dtype, then the product rounded.
 * exp: AVX-512 uses exp512.h (Cephes, relative error < 2e-7); torch uses Sleef's (< 1 ulp):
 * results differ in the last bit at most (bf16: after rounding, almost never). */

#define CHUNK 256 /* elements per block: no size limit, small stack buffers */

static inline void silu_block(const float *g, float *s, int n) {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(s + i, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    }
#endif
    for (; i < n; ++i) s[i] = g[i] / (1.f + expf(-g[i]));
}

int superinfer_silu_mul_f32(const float *x, int64_t xs, float *out, int64_t os, int T, int d) {
    float s[CHUNK];
    for (int t = 0; t < T; ++t) {
        const float *xr = x + t * xs;
        float *o = out + t * os;
        for (int c = 0; c < d; c += CHUNK) {
            int n = d - c < CHUNK ? d - c : CHUNK;
            silu_block(xr + c, s, n);
            for (int i = 0; i < n; ++i) o[c + i] = s[i] * xr[d + c + i];
        }
    }
    return 0;
}

int superinfer_silu_mul_bf16(const uint16_t *x, int64_t xs, uint16_t *out, int64_t os, int T, int d) {
    float g[CHUNK], s[CHUNK];
    for (int t = 0; t < T; ++t) {
        const uint16_t *xr = x + t * xs;
        uint16_t *o = out + t * os;
        for (int c = 0; c < d; c += CHUNK) {
            int n = d - c < CHUNK ? d - c : CHUNK;
            for (int i = 0; i < n; ++i) g[i] = bf16_to_f32(xr[c + i]);
            silu_block(g, s, n);
            for (int i = 0; i < n; ++i) o[c + i] = f32_to_bf16(rbf(s[i]) * bf16_to_f32(xr[d + c + i]));
        }
    }
    return 0;
}
