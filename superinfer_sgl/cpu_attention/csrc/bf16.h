/* bfloat16 <-> float32 conversions shared by the CPU kernels (rounding as torch does). */
#ifndef SUPERINFER_BF16_H
#define SUPERINFER_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)h) << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u); /* NaN */
    x.u += 0x7fffu + ((x.u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(x.u >> 16);
}

#endif
