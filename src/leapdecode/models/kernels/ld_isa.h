// The one place that decides which instruction-set path the kernel library compiles (every source
// includes it): from the compiler's target (-march=native for the first-use build, or a prebuilt
// variant's flags: models/kernel_build.py VARIANTS), or the portable C++ with -DLD_PORTABLE.
//   LD_SIMD 1: AVX-512 F/BW with VNNI (vpdpbusd)          the "avx512-vnni" variant
//   LD_SIMD 2: AVX2 with FMA and F16C (vpmaddubsw)         the "avx2" variant
//   LD_VNNI256 1: LD_SIMD 2 with AVX-VNNI (vpdpbusd on ymm: Alder Lake, Zen 5 and later; qgemm.cpp;
//              -DLD_NO_VNNI256 leaves it out): the "avx2-vnni" variant
//   LD_SIMD 0: portable C++                                the "portable" variant
//   LD_AMX 1:  LD_SIMD 1 and AMX-INT8 tiles for products of many rows (qgemm.cpp; -DLD_NO_AMX leaves
//              them out): the "amx" variant
// Every path computes the same bits (each source documents its arithmetic; tests compare them).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(LD_PORTABLE)
#define LD_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(LD_PORTABLE)
#define LD_SIMD 2
#else
#define LD_SIMD 0
#endif

#if LD_SIMD == 2 && defined(__AVXVNNI__) && !defined(LD_NO_VNNI256)
#define LD_VNNI256 1
#else
#define LD_VNNI256 0
#endif

#if LD_SIMD == 1 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(LD_NO_AMX)
#define LD_AMX 1
#else
#define LD_AMX 0
#endif

#if LD_SIMD
#include <immintrin.h>
#endif
