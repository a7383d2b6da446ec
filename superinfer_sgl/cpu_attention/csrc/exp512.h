/* exp over 16 floats for AVX-512: Cephes' expf polynomial (relative error < 2e-7) with an exact
 * 2^n scale, the argument clamped to [-87, 88]. glibc's expf stays scalar here (its vector
 * variants need -ffast-math, which would break -INFINITY handling). Shared by paged_decode.c
 * (softmax) and cpu_ops.c (SiLU). */
#ifndef SUPERINFER_EXP512_H
#define SUPERINFER_EXP512_H
#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 exp512(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    __m512 e = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(e, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fnmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, e);
}
#endif
#endif
