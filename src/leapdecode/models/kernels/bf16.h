// bf16 <-> fp32 for the kernels (qgemm.cpp, attention.cpp, layers.cpp): one definition of the
// rounding that every kernel must share.
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_val(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  // round to nearest even (as vcvtneps2bf16 and torch); NaN stays NaN
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}
