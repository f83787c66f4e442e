// Batch-invariant weight-only matmul on GGUF-style block-quantized weights.
//
// y[m, n] = bias[n] + sum_g ( s[n, g] * inner(m, n, g) + z[n, g] * xsum(m, g) )
//   inner(m, n, g) = sum_{k in group g} q[n, k] * x[m, k]        (codes q as exact bf16 values)
//   xsum(m, g)     = sum_{k in group g} x[m, k]
// i.e. w[n, k] = s[n, g] * q[n, k] + z[n, g], the GGUF block formula with fp32 scale and offset
// (Q4_K: s = d*sc, z = -dmin*m; Q4_0: q - 8 as code; Q6_K: s = d*sc, q - 32 as code; ...).
//
// Batch invariance: every output element is computed by the same sequence of floating-point
// operations whatever M (the number of rows) and whatever the thread count: the reduction over
// k runs in a fixed order per (m, n) (pairs of k through vdpbf16ps, groups in order), rows never
// share accumulators, and the column split across threads does not touch the k order.
//
// Layout of the codes (written by leapdecode.models.qkernel.pack):
//   columns in units of 16; for unit u and group g a block of bytes:
//   4-bit: G/2 "pair vectors" of 32 nibbles; pair vector p holds element i = (n = i/2, k = 2p + i%2).
//          Two consecutive pair vectors p, p+1 (p even) share 32 bytes: byte i low nibble = element i
//          of p, high nibble = element i of p+1.  Bytes per (u, g): 8 * G.
//   6-bit: one byte per code (0..63), table[c] = c - offset; same element order. Bytes: 16 * G.
//   8-bit: one signed byte per code; same element order. Bytes: 16 * G.
//   scales and offsets, by scale mode:
//     0: s, z fp32 [N/16][K/G][16]
//     1: s, z fp16 [N/16][K/G][16] (the legacy GGUF types: d, m and 8 d are fp16 values)
//     2: s = dsup * sc, z = zsup * mc: sc, mc int8 [N/16][K/G][16], dsup, zsup fp32
//        [N/16][K/G/gps][16] per super-block of gps groups (the K-quants' d * sc and -dmin * m,
//        exact fp32 products, stored as the file stores them).
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LD_AVX512BF16 1
#else
#define LD_AVX512BF16 0
#endif

#define MAX_ROWS 64   // rows handled per pass (more rows: several passes, same arithmetic)
#define MAX_NV 4      // column units (16 columns each) per block

static inline float bf16_to_f32(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even (as vcvtneps2bf16)
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);  // NaN stays NaN
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

extern "C" int ld_has_avx512bf16(void) { return LD_AVX512BF16; }

static inline int64_t unit_bytes(int bits, int group) { return bits == 4 ? 8 * group : 16 * group; }

// code of element i (0..31) of pair vector p inside one (unit, group) block, as an integer value
static inline int code_at(const uint8_t* blk, int bits, int offset, int p, int i) {
    if (bits == 4) {
        uint8_t b = blk[(p >> 1) * 32 + i];
        return (p & 1) ? (b >> 4) : (b & 15);
    }
    uint8_t b = blk[p * 32 + i];
    if (bits == 6) return (int)b - offset;
    return (int)(int8_t)b;
}

struct Scales {
    const void* s;
    const void* z;
    const float* dsup;
    const float* zsup;
    int mode;
    int gps;
};

static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, b;
    if (e == 0) {
        if (m == 0) b = sign;
        else {  // subnormal
            int sh = 0;
            while (!(m & 1024)) { m <<= 1; ++sh; }
            b = sign | ((uint32_t)(113 - sh) << 23) | ((m & 1023) << 13);
        }
    } else if (e == 31) b = sign | 0x7f800000u | (m << 13);
    else b = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &b, 4);
    return f;
}

// scale and offset of the 16 columns of unit u, group g (ng groups a row)
static inline void scales_at(const Scales& sc, int64_t u, int64_t g, int64_t ng, float* s, float* z) {
    const int64_t i = (u * ng + g) * 16;
    for (int j = 0; j < 16; ++j) {
        if (sc.mode == 0) {
            s[j] = ((const float*)sc.s)[i + j];
            z[j] = ((const float*)sc.z)[i + j];
        } else if (sc.mode == 1) {
            s[j] = half_to_f32(((const uint16_t*)sc.s)[i + j]);
            z[j] = half_to_f32(((const uint16_t*)sc.z)[i + j]);
        } else {
            const int64_t nsup = ng / sc.gps, si = (u * nsup + g / sc.gps) * 16;
            s[j] = sc.dsup[si + j] * (float)((const int8_t*)sc.s)[i + j];
            z[j] = sc.zsup[si + j] * (float)((const int8_t*)sc.z)[i + j];
        }
    }
}

// xsum(m, g) in a fixed order: float sums over the group, k ascending
static void group_sums(const uint16_t* x, int64_t ldx, int64_t rows, int64_t K, int group, float* xs) {
    int64_t ng = K / group;
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t g = 0; g < ng; ++g) {
            float s = 0.f;
            const uint16_t* xp = x + m * ldx + g * group;
            for (int k = 0; k < group; ++k) s += bf16_to_f32(xp[k]);
            xs[m * ng + g] = s;
        }
}

#if LD_AVX512BF16
// dequantize the codes of one (unit, group) block into G/2 bf16 pair vectors (exact integer values)
static inline void decode_block(const uint8_t* blk, int bits, int group, const __m512i& table_lo,
                                const __m512i& table_hi, __m512bh* out) {
    const int pairs = group / 2;
    if (bits == 4) {
        const __m512i mask = _mm512_set1_epi16(15);
        for (int p = 0; p < pairs; p += 2) {
            __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(blk + (p >> 1) * 32)));
            __m512i lo = _mm512_and_si512(v, mask);
            __m512i hi = _mm512_srli_epi16(v, 4);
            out[p] = (__m512bh)_mm512_permutexvar_epi16(lo, table_lo);
            out[p + 1] = (__m512bh)_mm512_permutexvar_epi16(hi, table_lo);
        }
    } else if (bits == 6) {
        for (int p = 0; p < pairs; ++p) {
            __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(blk + p * 32)));
            out[p] = (__m512bh)_mm512_permutex2var_epi16(table_lo, v, table_hi);
        }
    } else {
        for (int p = 0; p < pairs; ++p) {
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + p * 32))));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + p * 32 + 16))));
            out[p] = _mm512_cvtne2ps_pbh(b, a);  // lanes 0..15 from a, 16..31 from b
        }
    }
}

static inline void scales_avx512(const Scales& sc, int64_t u, int64_t g, int64_t ng, __m512& s, __m512& z) {
    const int64_t i = (u * ng + g) * 16;
    if (sc.mode == 0) {
        s = _mm512_loadu_ps((const float*)sc.s + i);
        z = _mm512_loadu_ps((const float*)sc.z + i);
    } else if (sc.mode == 1) {
        s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sc.s + i)));
        z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sc.z + i)));
    } else {
        const int64_t nsup = ng / sc.gps, si = (u * nsup + g / sc.gps) * 16;
        s = _mm512_mul_ps(_mm512_loadu_ps(sc.dsup + si),
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)sc.s + i)))));
        z = _mm512_mul_ps(_mm512_loadu_ps(sc.zsup + si),
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)sc.z + i)))));
    }
}

template <int NV>
static void block_avx512(const uint16_t* x, int64_t rows, int64_t ldx, const float* xs, int64_t K,
                         const uint8_t* codes, const Scales& sc, int bits,
                         int group, int64_t u0, const float* bias, void* y, int64_t ldy, int out_fp32,
                         const __m512i& table_lo, const __m512i& table_hi) {
    const int64_t ng = K / group;
    const int pairs = group / 2;
    const int64_t ub = unit_bytes(bits, group);
    __m512 acc[MAX_ROWS][NV];
    __m512bh w[NV][16];  // group <= 32
    for (int64_t m = 0; m < rows; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        __m512 s[NV], z[NV];
        for (int v = 0; v < NV; ++v) {
            const int64_t u = u0 + v;
            decode_block(codes + (u * ng + g) * ub, bits, group, table_lo, table_hi, w[v]);
            scales_avx512(sc, u, g, ng, s[v], z[v]);
        }
        for (int64_t m = 0; m < rows; ++m) {
            const uint16_t* xp = x + m * ldx + g * group;
            __m512 inner[NV];
            for (int v = 0; v < NV; ++v) inner[v] = _mm512_setzero_ps();
            for (int p = 0; p < pairs; ++p) {
                uint32_t pr;
                memcpy(&pr, xp + 2 * p, 4);
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pr);
                for (int v = 0; v < NV; ++v) inner[v] = _mm512_dpbf16_ps(inner[v], w[v][p], xb);
            }
            const __m512 xsum = _mm512_set1_ps(xs[m * ng + g]);
            for (int v = 0; v < NV; ++v) {
                acc[m][v] = _mm512_fmadd_ps(s[v], inner[v], acc[m][v]);
                acc[m][v] = _mm512_fmadd_ps(z[v], xsum, acc[m][v]);
            }
        }
    }
    for (int64_t m = 0; m < rows; ++m)
        for (int v = 0; v < NV; ++v) {
            const int64_t n0 = (u0 + v) * 16;
            __m512 r = acc[m][v];
            if (bias) r = _mm512_add_ps(r, _mm512_loadu_ps(bias + n0));
            if (out_fp32) {
                _mm512_storeu_ps((float*)y + m * ldy + n0, r);
            } else {
                __m256bh h = _mm512_cvtneps_pbh(r);
                _mm256_storeu_si256((__m256i*)((uint16_t*)y + m * ldy + n0), (__m256i)h);
            }
        }
}
#endif

// portable path (same formula, same order per element; used where AVX512-BF16 is missing)
static void block_generic(const uint16_t* x, int64_t rows, int64_t ldx, const float* xs, int64_t K,
                          const uint8_t* codes, const Scales& sc, int bits,
                          int offset, int group, int64_t u, const float* bias, void* y, int64_t ldy,
                          int out_fp32) {
    const int64_t ng = K / group;
    const int pairs = group / 2;
    const int64_t ub = unit_bytes(bits, group);
    for (int64_t m = 0; m < rows; ++m) {
        float acc[16] = {0};
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t* blk = codes + (u * ng + g) * ub;
            const uint16_t* xp = x + m * ldx + g * group;
            float inner[16] = {0};
            for (int p = 0; p < pairs; ++p) {
                float x0 = bf16_to_f32(xp[2 * p]), x1 = bf16_to_f32(xp[2 * p + 1]);
                for (int j = 0; j < 16; ++j) {
                    inner[j] += (float)code_at(blk, bits, offset, p, 2 * j + 1) * x1;
                    inner[j] += (float)code_at(blk, bits, offset, p, 2 * j) * x0;
                }
            }
            float s[16], z[16];
            scales_at(sc, u, g, ng, s, z);
            for (int j = 0; j < 16; ++j) {
                acc[j] = fmaf(s[j], inner[j], acc[j]);
                acc[j] = fmaf(z[j], xs[m * ng + g], acc[j]);
            }
        }
        for (int j = 0; j < 16; ++j) {
            const int64_t n = u * 16 + j;
            float r = acc[j] + (bias ? bias[n] : 0.f);
            if (out_fp32) ((float*)y)[m * ldy + n] = r;
            else ((uint16_t*)y)[m * ldy + n] = f32_to_bf16(r);
        }
    }
}

// y[M, N] (row stride ldy; bf16 or fp32) = x[M, K] (bf16, row stride ldx) @ W.T (+ bias)
// returns 0, or a negative error code for an unsupported shape/format
extern "C" int ld_qgemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes,
                        const void* scales, const void* zeros, const float* dsup, const float* zsup,
                        int smode, int gps, int bits, int offset, int group,
                        int64_t N, const float* bias, void* y, int64_t ldy, int out_fp32, int nthreads,
                        float* xs_buf) {
    if (N % 16 || group <= 0 || group > 32 || group % 4 || K % group) return -1;
    if (smode < 0 || smode > 2 || (smode == 2 && (gps <= 0 || (K / group) % gps))) return -4;
    const Scales sc = {scales, zeros, dsup, zsup, smode, gps};
    if (bits != 4 && bits != 6 && bits != 8) return -2;
    if (bits == 6 && (offset < 0 || offset > 63)) return -3;
    if (nthreads < 1) nthreads = 1;
    const int64_t ng = K / group;
    const int64_t units = N / 16;
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t rows = M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS;
        const uint16_t* xr = x + r0 * ldx;
        void* yr = out_fp32 ? (void*)((float*)y + r0 * ldy) : (void*)((uint16_t*)y + r0 * ldy);
        group_sums(xr, ldx, rows, K, group, xs_buf);
#if LD_AVX512BF16
        uint16_t tl[32], th[32];
        for (int i = 0; i < 32; ++i) {
            float lo = bits == 4 ? (float)(i & 15) : (float)(i - offset);
            float hi = (float)(i + 32 - offset);
            tl[i] = f32_to_bf16(lo);
            th[i] = f32_to_bf16(hi);
        }
        const __m512i table_lo = _mm512_loadu_si512(tl), table_hi = _mm512_loadu_si512(th);
        const int64_t blocks = (units + MAX_NV - 1) / MAX_NV;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t u0 = b * MAX_NV;
            const int nv = units - u0 < MAX_NV ? (int)(units - u0) : MAX_NV;
            switch (nv) {
                case 4: block_avx512<4>(xr, rows, ldx, xs_buf, K, codes, sc, bits, group, u0, bias, yr, ldy, out_fp32, table_lo, table_hi); break;
                case 3: block_avx512<3>(xr, rows, ldx, xs_buf, K, codes, sc, bits, group, u0, bias, yr, ldy, out_fp32, table_lo, table_hi); break;
                case 2: block_avx512<2>(xr, rows, ldx, xs_buf, K, codes, sc, bits, group, u0, bias, yr, ldy, out_fp32, table_lo, table_hi); break;
                default: block_avx512<1>(xr, rows, ldx, xs_buf, K, codes, sc, bits, group, u0, bias, yr, ldy, out_fp32, table_lo, table_hi); break;
            }
        }
#else
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t u = 0; u < units; ++u)
            block_generic(xr, rows, ldx, xs_buf, K, codes, sc, bits, offset, group, u, bias, yr, ldy, out_fp32);
#endif
    }
    (void)ng;
    return 0;
}

// the weight as fp32 [N, K] (s * q + z, rounded once): for tests and for large-M (prefill) paths
extern "C" int ld_qdequant(const uint8_t* codes, const void* scales, const void* zeros, const float* dsup,
                           const float* zsup, int smode, int gps, int bits, int offset, int group,
                           int64_t N, int64_t K, float* out, int nthreads) {
    if (N % 16 || group <= 0 || group > 32 || group % 4 || K % group) return -1;
    if (smode < 0 || smode > 2 || (smode == 2 && (gps <= 0 || (K / group) % gps))) return -4;
    const Scales sc = {scales, zeros, dsup, zsup, smode, gps};
    const int64_t ng = K / group;
    const int64_t ub = unit_bytes(bits, group);
    const int pairs = group / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads < 1 ? 1 : nthreads)
    for (int64_t u = 0; u < N / 16; ++u)
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t* blk = codes + (u * ng + g) * ub;
            float s[16], z[16];
            scales_at(sc, u, g, ng, s, z);
            for (int p = 0; p < pairs; ++p)
                for (int i = 0; i < 32; ++i) {
                    const int j = i / 2;
                    const int64_t k = g * group + 2 * p + (i & 1);
                    out[(u * 16 + j) * K + k] = s[j] * (float)code_at(blk, bits, offset, p, i) + z[j];
                }
        }
    return 0;
}
