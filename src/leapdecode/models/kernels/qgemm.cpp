// Batch-invariant weight-only matmul on GGUF-style block-quantized weights.
//
// Weights: w[n, k] = s[n, g] * c[n, k] + z[n, g] for the group g of column k (G = 16 or 32
// columns), with integer codes c as the GGUF stores them and fp32 scale s and offset z.
// Activations: each row's bf16 values are quantized per group of G columns to int8,
// xq = round(x / dx), dx = max|x| / 127 (as llama.cpp quantizes activations to Q8 blocks).
// (A group holding an inf or a NaN: codes 0, dx = NaN, so its row's outputs are all NaN.)
// Then, per row m, column n and group g, in this order:
//   dot  = sum_k v[n, k] * xq[m, k]            (v = the code's value, c - offset: exact int32
//                                                with vpdpbusd on the stored codes, any order)
//   a    = dx[m, g] * float(dot)                b = dx[m, g] * float(sum_k xq[m, k])
//   acc  = fma(s[n, g], a, acc);  acc = fma(z[n, g], b, acc)
//   y[m, n] = acc (+ bias[n]) rounded to bf16 or kept fp32.
// (Scale mode 3, where every z is +0, leaves the second FMA out: acc + (+-0) is acc, since acc,
// started at +0, is never -0 unless a product underflows below half the smallest subnormal.)
//
// Batch invariance: every output element goes through the same operations whatever the number
// of rows M and the thread count (rows never share accumulators; the integer dot products are
// exact), so a token's logits are the same bits in a tree forward as alone.  The portable C++
// path computes the very same values (integer sums, the same fp32 roundings and FMAs).
//
// Layout of the codes (written by leapdecode.models.kernel_pack.pack): output rows n of W in units of 16; per
// (unit u, group g) a block of bytes made of G/4 "quad vectors" of 64 codes, element e of quad q
// being (n = 16 u + e / 4, k = G g + 4 q + e % 4):
//   4-bit (codes 0..15): quads q, q+1 (q even) share 64 bytes: byte e's low nibble is element e
//          of q, its high nibble element e of q+1.  8 G bytes.
//   6-bit (codes 0..63, value c - offset): the low nibbles laid out as 4-bit (8 G bytes), then
//          the high 2 bits: quads q..q+3 (q % 4 == 0) share 64 bytes, byte e holding element e of
//          quad q + j in bits 2j, 2j+1 (4 G bytes).  12 G bytes.
//   8-bit (signed value v stored as v + 128): one byte per code.  16 G bytes.
//   2-bit (codes 0..3, Q2_K; groups of 16): quads q..q+3 (q % 4 == 0) share 64 bytes, byte e
//          holding element e of quad q + j in bits 2j, 2j+1.  4 G bytes.
//   3-bit (codes 0..7, value c - offset, Q3_K; groups of 16): the low 2 bits laid out as 2-bit
//          (4 G bytes), then the third bits: 8 bytes a quad, bit e of the little-endian 64-bit
//          word being element e (an AVX-512 mask register as it is).  6 G bytes.
//   IQ4 (format CODES_IQ4; 4-bit indices i into IQ4_NL's 16 signed values kIQ4, value kIQ4[i];
//          groups of 32): the indices laid out as 4-bit codes.  8 G bytes.  The kernel looks the
//          values up (vpshufb) and goes on as with 8-bit codes (stored code kIQ4[i] + 128).
// Scales and offsets, by scale mode (u, g, 16 columns):
//   0: s, z fp32 [N/16][K/G][16]
//   1: s, z fp16 [N/16][K/G][16] (the legacy GGUF types: d, m and 8 d are fp16 values)
//   2: s = dsup * sc, z = zsup * mc: sc, mc int8 [N/16][K/G][16], dsup, zsup fp16 [N/16][K/G/gps][16]
//      per super-block of gps groups (the K-quants' d * sc and -dmin * m, exact fp32 products).
//   3: mode 2 where every zsup is +0 (Q6_K has no offsets): z = +0, and the SIMD path does not
//      read zsup and mc at all (about 7% of a Q6_K tensor's bytes).
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <utility>
// LD_SIMD (ld_isa.h: the one place that decides it): 1 = AVX512-VNNI (vpdpbusd), 2 = AVX2
// (vpmaddubsw + vpmaddwd, exact in int16 as used below), 0 = portable C++; LD_VNNI256: the AVX2 path with
// vpdpbusd on ymm (AVX-VNNI); LD_AMX: the AVX-512 path with AMX tiles for blocks of 16 rows
// (unit_rows_amx).  All give the same bits.
#include "ld_isa.h"
#if LD_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MAX_ROWS 64  // rows handled per pass (more rows: several passes, same arithmetic)
// Each thread works on one 16-column unit at a time (it then streams one unit's codes and scales:
// measured on an AMD EPYC, Zen 4, 2 threads, all linear layers of qwen2.5-coder-1.5b at 1 row,
// blocks of 4 units 40.8 ms, 2 units 38.3, 1 unit 28.6: fewer streams than the prefetchers follow).
#ifndef RB_ROWS
#define RB_ROWS 12  // rows of one pass of unit_rows over a unit's weights: each group decoded once for them all
#endif
#ifndef RBLK2_4
#define RBLK2_4 4  // AVX2: rows of one rows_group2 call, 4-bit codes
#endif
#ifndef RBLK2_68
#define RBLK2_68 2  // AVX2: rows of one rows_group2 call, 6- and 8-bit codes
#endif
#ifndef MANY_ROWS
#define MANY_ROWS 12  // AVX2: from this many rows on, 4- and 6-bit codes take unit_rows_many
#endif
#define AMX_ROWS 16   // AMX builds: rows of a tile (its maximum; blocks of fewer rows measured slower)
#define AMX_GROUP 32  // AMX builds: the group size of the formats that take tiles
#ifndef AMX_CHUNK
#define AMX_CHUNK 8  // AMX builds: groups decoded, multiplied and finished at a time
#endif
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 8  // software prefetch distance, in groups (2 -> 6: 1 row 0.93x, 4 rows 0.89x the time; 4-12 alike)
#endif

// One translation unit, or several compiled at once (models/kernel_library.py builds it so: the few-row
// functions' ~450 instantiations take about a minute and a half of one core): LD_PART unset,
// everything; LD_PART = 4, 6, 8 or 9 (CODES_IQ4), only that format's few-row functions
// (unit_rows_of_<bits>); LD_PART = 2, those of the 2- and 3-bit codes; LD_PART = 0, everything else,
// calling them.  The same code either way, so the same bits.
#ifndef LD_PART
#define LD_PART -1
#endif

#if LD_PART <= 0
// the path compiled in: 1 AVX512-VNNI, 2 AVX2, 3 AVX2 with AVX-VNNI, 0 portable
extern "C" int ld_simd(void) { return LD_VNNI256 ? 3 : LD_SIMD; }
#endif

#include "bf16.h"
#include "ld_abi.h"

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

// The code formats: 2, 3, 4, 6 and 8 are bit widths; CODES_IQ4, 4-bit indices into kIQ4
#define CODES_IQ4 9
// IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl)
alignas(16) static const int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// whether a code format runs in groups of `group` columns (Q2_K and Q3_K: 16; the IQ4 types: 32)
static inline bool format_ok(int bits, int group) {
    if (bits == 2 || bits == 3) return group == 16;
    if (bits == CODES_IQ4) return group == 32;
    return (bits == 4 || bits == 6 || bits == 8) && (group == 16 || group == 32);
}

static constexpr inline int64_t unit_bytes(int bits, int group) {
    return bits == 2 ? 4 * group : bits == 3 ? 6 * group : (bits == 4 || bits == CODES_IQ4) ? 8 * group
         : bits == 6 ? 12 * group : 16 * group;
}

// the code offset: value = stored code - offset
static inline int code_offset(int bits, int offset) {
    return (bits == 2 || bits == 4) ? 0 : (bits == 3 || bits == 6) ? offset : 128;
}

// stored code of element e (0..63) of quad q inside one (unit, group) block (IQ4: kIQ4[i] + 128)
static inline int code_at(const uint8_t* blk, int bits, int group, int q, int e) {
    if (bits == 8) return blk[q * 64 + e];
    if (bits == 2 || bits == 3) {
        int c = (blk[(q >> 2) * 64 + e] >> (2 * (q & 3))) & 3;
        if (bits == 3) c |= ((blk[4 * group + 8 * q + (e >> 3)] >> (e & 7)) & 1) << 2;
        return c;
    }
    uint8_t b = blk[(q >> 1) * 64 + e];
    int lo = (q & 1) ? (b >> 4) : (b & 15);
    if (bits == 4) return lo;
    if (bits == CODES_IQ4) return kIQ4[lo] + 128;
    return lo | (((blk[8 * group + (q >> 2) * 64 + e] >> (2 * (q & 3))) & 3) << 4);
}

struct Scales {
    const void* s;
    const void* z;
    const uint16_t* dsup;  // fp16
    const uint16_t* zsup;
    int mode;
    int gps;
};

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
            s[j] = half_to_f32(sc.dsup[si + j]) * (float)((const int8_t*)sc.s)[i + j];
            z[j] = half_to_f32(sc.zsup[si + j]) * (float)((const int8_t*)sc.z)[i + j];
        }
    }
}

// the activations of `rows` rows quantized per group, group-major so that the rows of one group are
// adjacent (a row's address is then a constant offset from the group's: no per-row pointers):
// q [ng][rows][G] int8, dx, isum, bx, ncorr [ng][rows]
struct Act {
    int64_t rows;
    int8_t* q;
    float* dx;
    int32_t* isum;
    float* bx;  // dx * (float)isum: the offset term's factor, computed once per row and group
    int32_t* ncorr;  // -offset * isum: where the integer dot product of the codes' values starts
};

// a quantized group's scale, integer sum and offset factor dx * isum
static inline void group_stats(float dx, int32_t sum, float* dxo, int32_t* isumo, float* bxo) {
    *dxo = dx;
    *isumo = sum;
    *bxo = dx * (float)sum;
}

// A group holding an inf or a NaN gets codes 0 and dx = NaN: every output of its row is NaN
// (as in a float product, where a NaN or an inf reaches every output; the SIMD paths send such
// a group here).
static void quantize_group(const uint16_t* xp, int group, int8_t* qp, float* dxo, int32_t* isumo, float* bxo) {
    float amax = 0.f;
    bool finite = true;
    for (int k = 0; k < group; ++k) {
        const float a = fabsf(bf16_val(xp[k]));
        finite = finite && a <= 3.4028235e38f;  // false for inf and NaN
        amax = fmaxf(amax, a);
    }
    if (!finite) {
        memset(qp, 0, group);
        group_stats(NAN, 0, dxo, isumo, bxo);
        return;
    }
    const float dx = amax / 127.0f;
    int32_t sum = 0;
    for (int k = 0; k < group; ++k) {
        int v = dx > 0.f ? (int)nearbyintf(bf16_val(xp[k]) / dx) : 0;
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        qp[k] = (int8_t)v;
        sum += v;
    }
    group_stats(dx, sum, dxo, isumo, bxo);
}

#if LD_SIMD == 1
// quantize_group with AVX-512: the same values (max is exact in any order, division and
// round-to-nearest-even are IEEE operations, the integer sum is exact)
static inline __m512 bf16x16_to_f32(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline void quantize_group_simd(const uint16_t* xp, int group, int8_t* qp, float* dxo, int32_t* isumo,
                                       float* bxo) {
    const __m512 v0 = bf16x16_to_f32(xp);
    const __m512 v1 = group == 32 ? bf16x16_to_f32(xp + 16) : _mm512_setzero_ps();
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    // max_ps drops a NaN operand: NaNs are looked for apart
    const __mmask16 nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
    if (!(amax <= 3.0e38f) || nan) {  // inf or NaN in the group (never in a sound model): the scalar rules
        quantize_group(xp, group, qp, dxo, isumo, bxo);
        return;
    }
    const float dx = amax / 127.0f;
    int32_t sum = 0;
    if (dx > 0.f) {
        const __m512 d = _mm512_set1_ps(dx), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
        const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v0, d), rounding), lo), hi));
        _mm_storeu_si128((__m128i*)qp, _mm512_cvtepi32_epi8(q0));
        if (group == 32) {
            __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v1, d), rounding), lo), hi));
            _mm_storeu_si128((__m128i*)(qp + 16), _mm512_cvtepi32_epi8(q1));
            q0 = _mm512_add_epi32(q0, q1);
        }
        sum = _mm512_reduce_add_epi32(q0);
    } else {
        memset(qp, 0, group);
    }
    group_stats(dx, sum, dxo, isumo, bxo);
}
#elif LD_SIMD == 2
// quantize_group with AVX2: the same values (as the AVX-512 version)
static inline __m256 bf16x8_to_f32(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline void quantize_group_simd(const uint16_t* xp, int group, int8_t* qp, float* dxo, int32_t* isumo,
                                       float* bxo) {
    const int nv = group / 8;  // 2 or 4 vectors of 8
    __m256 v[4];
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();  // max_ps drops a NaN operand: NaNs apart
    for (int i = 0; i < nv; ++i) {
        v[i] = bf16x8_to_f32(xp + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    if (!(amax <= 3.0e38f) || _mm256_movemask_ps(nan)) {  // inf or NaN in the group (never in a sound model): the scalar rules
        quantize_group(xp, group, qp, dxo, isumo, bxo);
        return;
    }
    const float dx = amax / 127.0f;
    int32_t sum = 0;
    if (dx > 0.f) {
        const __m256 d = _mm256_set1_ps(dx), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
        __m256i q[4], acc = _mm256_setzero_si256();
        for (int i = 0; i < nv; ++i) {
            const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            acc = _mm256_add_epi32(acc, q[i]);
        }
        alignas(32) int32_t t[32];
        for (int i = 0; i < nv; ++i) _mm256_store_si256((__m256i*)(t + 8 * i), q[i]);
        for (int k = 0; k < group; ++k) qp[k] = (int8_t)t[k];
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        sum = _mm_cvtsi128_si32(s4);
    } else {
        memset(qp, 0, group);
    }
    group_stats(dx, sum, dxo, isumo, bxo);
}
#endif

static void quantize_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t K, int group, int off,
                          const Act& act, int nthreads) {
    const int64_t ng = K / group;
    const int64_t n = rows * ng;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= 512)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t m = i / ng, g = i % ng, j = g * rows + m;
        const uint16_t* xp = x + m * ldx + g * group;
#if LD_SIMD
        quantize_group_simd(xp, group, act.q + j * group, act.dx + j, act.isum + j, act.bx + j);
#else
        quantize_group(xp, group, act.q + j * group, act.dx + j, act.isum + j, act.bx + j);
#endif
        act.ncorr[j] = -off * act.isum[j];
    }
}

static inline void store_row(float* acc16, const float* bias, void* y, int64_t ldy, int64_t m, int64_t n0, int out_fp32) {
    for (int j = 0; j < 16; ++j) {
        float r = bias ? acc16[j] + bias[n0 + j] : acc16[j];
        if (out_fp32) ((float*)y)[m * ldy + n0 + j] = r;
        else ((uint16_t*)y)[m * ldy + n0 + j] = to_bf16(r);
    }
}

// portable path: the same values as the SIMD path
static void block_generic(int64_t rows, const Act& act, int64_t K, const uint8_t* codes, const Scales& sc,
                          int bits, int offset, int group, int64_t u, const float* bias, void* y, int64_t ldy,
                          int out_fp32) {
    const int64_t ng = K / group;
    const int64_t ub = unit_bytes(bits, group);
    const int off = code_offset(bits, offset);
    for (int64_t m = 0; m < rows; ++m) {
        float acc[16] = {0};
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t* blk = codes + (u * ng + g) * ub;
            const int8_t* xq = act.q + (g * rows + m) * group;
            int32_t dot[16] = {0};
            for (int q = 0; q < group / 4; ++q)
                for (int e = 0; e < 64; ++e) dot[e / 4] += code_at(blk, bits, group, q, e) * (int32_t)xq[4 * q + e % 4];
            const int32_t isum = act.isum[g * rows + m];
            const float dx = act.dx[g * rows + m];
            const float b = act.bx[g * rows + m];
            float s[16], z[16];
            scales_at(sc, u, g, ng, s, z);
            for (int j = 0; j < 16; ++j) {
                const float a = dx * (float)(dot[j] - off * isum);
                acc[j] = fmaf(s[j], a, acc[j]);
                if (sc.mode != 3) acc[j] = fmaf(z[j], b, acc[j]);
            }
        }
        store_row(acc, bias, y, ldy, m, u * 16, out_fp32);
    }
}

#if LD_SIMD
// software prefetch of the group PREFETCH_GROUPS groups after blk (ub bytes a group), if the unit has it
static inline void prefetch_ahead(const uint8_t* blk, const uint8_t* end, int64_t ub) {
    if (blk + PREFETCH_GROUPS * ub < end)
        for (int64_t o = 0; o < ub; o += 64) _mm_prefetch((const char*)blk + PREFETCH_GROUPS * ub + o, _MM_HINT_T0);
}
#endif

#if LD_SIMD == 1
// the G/4 quad vectors of one (unit, group) block as unsigned bytes
static inline void decode_block(const uint8_t* blk, int bits, int group, __m512i* out) {
    const int quads = group / 4;
    const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
    if (bits == 2 || bits == 3) {
        const __m512i low2 = _mm512_set1_epi8(3);
        for (int q = 0; q < quads; q += 4) {
            __m512i v = _mm512_loadu_si512(blk + (q >> 2) * 64);
            out[q] = _mm512_and_si512(v, low2);
            out[q + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 2), low2);
            out[q + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low2);
            out[q + 3] = _mm512_and_si512(_mm512_srli_epi16(v, 6), low2);
        }
        if (bits == 3)  // the third bits: a quad's 64 of them are a mask, bit e for element e
            for (int q = 0; q < quads; ++q) {
                uint64_t m;
                memcpy(&m, blk + 4 * group + 8 * q, 8);
                out[q] = _mm512_mask_add_epi8(out[q], _cvtu64_mask64(m), out[q], _mm512_set1_epi8(4));
            }
    } else if (bits == 4 || bits == CODES_IQ4) {
        for (int q = 0; q < quads; q += 2) {
            __m512i v = _mm512_loadu_si512(blk + (q >> 1) * 64);
            out[q] = _mm512_and_si512(v, low4);
            out[q + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if (bits == CODES_IQ4) {  // the values, stored as value + 128 (as 8-bit codes)
            const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kIQ4)),
                                                   _mm512_set1_epi8((char)0x80));
            for (int q = 0; q < quads; ++q) out[q] = _mm512_shuffle_epi8(table, out[q]);
        }
    } else if (bits == 6) {
        const uint8_t* hib = blk + 8 * group;
        for (int q = 0; q < quads; q += 4) {
            __m512i a = _mm512_loadu_si512(blk + (q >> 1) * 64);
            __m512i b = _mm512_loadu_si512(blk + (q >> 1) * 64 + 64);
            __m512i h = _mm512_loadu_si512(hib + (q >> 2) * 64);
            out[q] = _mm512_or_si512(_mm512_and_si512(a, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4), bits45));
            out[q + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low4),
                                         _mm512_and_si512(_mm512_slli_epi16(h, 2), bits45));
            out[q + 2] = _mm512_or_si512(_mm512_and_si512(b, low4), _mm512_and_si512(h, bits45));
            out[q + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), low4),
                                         _mm512_and_si512(_mm512_srli_epi16(h, 2), bits45));
        }
    } else {
        for (int q = 0; q < quads; ++q) out[q] = _mm512_loadu_si512(blk + q * 64);
    }
}

// The scales and offsets of one unit's groups in order (g = 0, 1, ...), for a scale mode known at
// compile time; the K-quant modes read each super-block's fp16 factors once.
template <int SMODE>
struct ScaleWalk {
    const Scales& sc;
    const int64_t u, ng, gps;
    const uint16_t* dsp;
    const uint16_t* zsp;
    __m512 dsv = _mm512_setzero_ps(), zsv = _mm512_setzero_ps();
    int64_t gi = 0;  // group within the super-block

    ScaleWalk(const Scales& sc_, int64_t u_, int64_t ng_)
        : sc(sc_), u(u_), ng(ng_), gps(SMODE >= 2 ? sc_.gps : 1),
          dsp(SMODE >= 2 ? sc_.dsup + u_ * (ng_ / gps) * 16 : nullptr),
          zsp(SMODE == 2 ? sc_.zsup + u_ * (ng_ / gps) * 16 : nullptr) {}

    inline void next(int64_t g, __m512& s, __m512& z) {
        const int64_t i = (u * ng + g) * 16;
        if (SMODE == 0) {
            s = _mm512_loadu_ps((const float*)sc.s + i);
            z = _mm512_loadu_ps((const float*)sc.z + i);
        } else if (SMODE == 1) {
            s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sc.s + i)));
            z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sc.z + i)));
        } else {
            if (gi == 0) {
                dsv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)dsp));
                dsp += 16;
                if (SMODE == 2) {
                    zsv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)zsp));
                    zsp += 16;
                }
            }
            if (++gi == gps) gi = 0;
            s = _mm512_mul_ps(dsv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)sc.s + i)))));
            // mode 3: every zsup is +0, so z = +0 * mc = +0 (the same value, its bytes not read)
            z = SMODE == 2 ? _mm512_mul_ps(zsv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)sc.z + i)))))
                           : _mm512_setzero_ps();
        }
    }
};

// One group of RB rows against one unit's decoded group w (scales s, offsets z): the rows' integer
// dot products, started at -offset * isum (so the codes' offset costs no instruction), then the
// documented epilogue into acc[0 .. RB-1], with the offset term's factor dx * isum from
// quantize_rows.  Rows are 4 Q bytes apart in x and adjacent in dx, ncorr, bx.  Every row goes
// through it, whatever the rows beside it, so every output goes through the same operations.
template <int BITS, int SMODE, int RB, int Q>
__attribute__((always_inline)) static inline void rows_group(const int8_t* x, const float* dx, const int32_t* ncorr,
                              const float* bx, const __m512i* w, __m512 s, __m512 z, __m512* acc) {
    __m512i dot[RB];
    for (int r = 0; r < RB; ++r) dot[r] = BITS == 4 || BITS == 2 ? _mm512_setzero_si512() : _mm512_set1_epi32(ncorr[r]);
    for (int q = 0; q < Q; ++q)
        for (int r = 0; r < RB; ++r) {
            int32_t four;
            memcpy(&four, x + r * 4 * Q + 4 * q, 4);
            dot[r] = _mm512_dpbusd_epi32(dot[r], w[q], _mm512_set1_epi32(four));
        }
    for (int r = 0; r < RB; ++r) {
        const __m512 a = _mm512_mul_ps(_mm512_set1_ps(dx[r]), _mm512_cvtepi32_ps(dot[r]));
        acc[r] = _mm512_fmadd_ps(s, a, acc[r]);
        if (SMODE != 3) acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(bx[r]), acc[r]);
    }
}

// rows_group over rows B0 .. RB - 1 in blocks of 4 (accumulators acc[B0 ..]), all against one decoded group
template <int BITS, int SMODE, int RB, int Q, int B0>
__attribute__((always_inline)) static inline void row_blocks(const int8_t* x, const float* dx, const int32_t* nc,
                                                             const float* bx, const __m512i* w, __m512 s, __m512 z,
                                                             __m512* acc) {
    constexpr int n = RB - B0 < 4 ? RB - B0 : 4;
    if constexpr (n > 0) {
        rows_group<BITS, SMODE, n, Q>(x + B0 * 4 * Q, dx + B0, nc + B0, bx + B0, w, s, z, acc + B0);
        row_blocks<BITS, SMODE, RB, Q, B0 + 4>(x, dx, nc, bx, w, s, z, acc);
    }
}

// A unit's rows m0 .. m0 + RB - 1 (RB <= RB_ROWS) with everything known at compile time (code width,
// group, scale mode) and the accumulators in registers for the whole row of groups.  Each group's
// codes and scales are decoded once for all RB rows, so a tree's rows ride on the weights a
// decoding step streams anyway (every linear layer of qwen2.5-coder-1.5b: 6-16 rows 0.85-0.89x the
// time of the earlier 4-row passes and memory-resident accumulators, 24-64 rows 0.94-0.98x, 1-4
// rows the same: docs/lab-notes/benchmarks.md section 30).  Each output goes through exactly the portable path's operations
// in the same order, so the bits are the same (tests compare them).
template <int BITS, int GROUP, int SMODE, int RB>
static void unit_rows(int64_t m0, const Act& act, int64_t K, const uint8_t* codes, const Scales& sc, int offset,
                      int64_t u, const float* bias, void* y, int64_t ldy, int out_fp32) {
    constexpr int Q = GROUP / 4;
    constexpr int64_t UB = unit_bytes(BITS, GROUP);
    const int64_t ng = K / GROUP;
    const uint8_t* blk = codes + u * ng * UB;
    const uint8_t* end = blk + ng * UB;
    const int64_t rows = act.rows;  // the group-major activations of rows m0 .. (x, dx, bx, nc: group 0's)
    const int8_t* x = act.q + m0 * GROUP;
    const float* dx = act.dx + m0;
    const float* bx = act.bx + m0;
    const int32_t* nc = act.ncorr + m0;
    __m512 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
    ScaleWalk<SMODE> scales(sc, u, ng);
    for (int64_t g = 0; g < ng; ++g, blk += UB) {
        prefetch_ahead(blk, end, UB);
        __m512i w[Q];
        decode_block(blk, BITS, GROUP, w);
        __m512 s, z;
        scales.next(g, s, z);
        // rows 0-3, 4-7, ... against the same decoded group (one pass over the weights)
        row_blocks<BITS, SMODE, RB, Q, 0>(x + g * rows * GROUP, dx + g * rows, nc + g * rows, bx + g * rows, w, s, z,
                                          acc);
    }
    alignas(64) float tmp[16];
    for (int r = 0; r < RB; ++r) {
        _mm512_store_ps(tmp, acc[r]);
        store_row(tmp, bias, y, ldy, m0 + r, u * 16, out_fp32);
    }
}

#elif LD_SIMD == 2
// AVX2 (no VNNI): a 16-column unit is two 8-lane halves (columns 0-7 are bytes 0-31 of a quad
// vector, columns 8-15 bytes 32-63).  vpmaddubsw multiplies unsigned code bytes by the signed
// activation bytes and adds adjacent pairs into int16 with saturation, which is never reached here:
// a pair is at most 2 * 63 * 127 for codes of up to 6 bits, and 8-bit codes and IQ4's values go in
// as |v| with the activation's sign moved onto them (vpsignb; at most 2 * 128 * 127).  QACC quads of
// pairs are added in int16 (4-bit: 8 * 3810 < 32768; 3-bit: 8 * 1778) before vpmaddwd with ones
// widens them to int32.  So the
// dot products are the same exact integers as vpdpbusd's and the portable loop's, and the
// epilogue is the same FMAs lane by lane: the same bits.  With AVX-VNNI (LD_VNNI256: vpdpbusd on ymm) the
// dot products are vpdpbusd's on the stored codes from -offset * isum, as on the AVX-512 path: the same
// exact integers.

// the codes' values go in signed (|v| and the activations' signs), not as unsigned codes
template <int BITS>
constexpr bool signed_values() { return BITS == 8 || BITS == CODES_IQ4; }

// 32 bits -> 32 bytes, byte i 0xff where bit i is set
static inline __m256i bit_bytes(uint32_t b) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)b), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
}

// half h (columns 8 h .. 8 h + 7) of quad q of one (unit, group) block as bytes: unsigned codes
// (2, 3, 4, 6 bits), or the signed values (8 bits: stored code - 128; IQ4: kIQ4[i])
template <int BITS, int GROUP>
__attribute__((always_inline)) static inline __m256i decode_half(const uint8_t* blk, int q, int h) {
    if (BITS == 8)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + q * 64 + 32 * h)), _mm256_set1_epi8((char)0x80));
    if (BITS == 2 || BITS == 3) {
        __m256i a = _mm256_loadu_si256((const __m256i*)(blk + (q >> 2) * 64 + 32 * h));
        a = _mm256_and_si256(_mm256_srli_epi16(a, 2 * (q & 3)), _mm256_set1_epi8(3));
        if (BITS == 3) {  // the third bits of elements 32 h .. 32 h + 31: bytes 4 h .. 4 h + 3 of the quad's 8
            uint32_t b;
            memcpy(&b, blk + 4 * GROUP + 8 * q + 4 * h, 4);
            a = _mm256_or_si256(a, _mm256_and_si256(bit_bytes(b), _mm256_set1_epi8(4)));
        }
        return a;
    }
    __m256i a = _mm256_loadu_si256((const __m256i*)(blk + (q >> 1) * 64 + 32 * h));
    if (q & 1) a = _mm256_srli_epi16(a, 4);
    a = _mm256_and_si256(a, _mm256_set1_epi8(15));
    if (BITS == CODES_IQ4)
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kIQ4)), a);
    if (BITS == 6) {  // bits 2j, 2j+1 of the high-bits byte (j = q % 4) become bits 4, 5
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 8 * GROUP + (q >> 2) * 64 + 32 * h));
        a = _mm256_or_si256(a, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * (q & 3)), _mm256_set1_epi8(3)), 4));
    }
    return a;
}

// decode_half as the stored unsigned codes (8 bits and IQ4: value + 128), for vpdpbusd
template <int BITS, int GROUP>
__attribute__((always_inline)) static inline __m256i stored_half(const uint8_t* blk, int q, int h) {
    const __m256i v = decode_half<BITS, GROUP>(blk, q, h);
    return signed_values<BITS>() ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
}

// the scales and offsets of one unit's groups in order, as two halves of 8 lanes
template <int SMODE>
struct ScaleWalk2 {
    const Scales& sc;
    const int64_t u, ng, gps;
    const uint16_t* dsp;
    const uint16_t* zsp;
    __m256 ds0 = _mm256_setzero_ps(), ds1 = _mm256_setzero_ps(), zs0 = _mm256_setzero_ps(), zs1 = _mm256_setzero_ps();
    int64_t gi = 0;

    ScaleWalk2(const Scales& sc_, int64_t u_, int64_t ng_)
        : sc(sc_), u(u_), ng(ng_), gps(SMODE >= 2 ? sc_.gps : 1),
          dsp(SMODE >= 2 ? sc_.dsup + u_ * (ng_ / gps) * 16 : nullptr),
          zsp(SMODE == 2 ? sc_.zsup + u_ * (ng_ / gps) * 16 : nullptr) {}

    static inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static inline __m256 int8x8(const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    }

    inline void next(int64_t g, __m256* s, __m256* z) {
        const int64_t i = (u * ng + g) * 16;
        if (SMODE == 0) {
            s[0] = _mm256_loadu_ps((const float*)sc.s + i);
            s[1] = _mm256_loadu_ps((const float*)sc.s + i + 8);
            z[0] = _mm256_loadu_ps((const float*)sc.z + i);
            z[1] = _mm256_loadu_ps((const float*)sc.z + i + 8);
        } else if (SMODE == 1) {
            s[0] = half8((const uint16_t*)sc.s + i);
            s[1] = half8((const uint16_t*)sc.s + i + 8);
            z[0] = half8((const uint16_t*)sc.z + i);
            z[1] = half8((const uint16_t*)sc.z + i + 8);
        } else {
            if (gi == 0) {
                ds0 = half8(dsp);
                ds1 = half8(dsp + 8);
                dsp += 16;
                if (SMODE == 2) {
                    zs0 = half8(zsp);
                    zs1 = half8(zsp + 8);
                    zsp += 16;
                }
            }
            if (++gi == gps) gi = 0;
            s[0] = _mm256_mul_ps(ds0, int8x8((const int8_t*)sc.s + i));
            s[1] = _mm256_mul_ps(ds1, int8x8((const int8_t*)sc.s + i + 8));
            if (SMODE == 2) {
                z[0] = _mm256_mul_ps(zs0, int8x8((const int8_t*)sc.z + i));
                z[1] = _mm256_mul_ps(zs1, int8x8((const int8_t*)sc.z + i + 8));
            } else {
                z[0] = z[1] = _mm256_setzero_ps();
            }
        }
    }
};

// RB (<= rblk2(BITS)) rows against one (unit, group) block: integer dot products, then the
// documented epilogue into acc[2 r + h] (row r, half h of 8 columns).  Rows are GROUP bytes apart
// in x and adjacent in dx, ncorr, bx.  Each quad's two halves are decoded once for the RB rows, and each
// row's 4 activation bytes broadcast once for both halves.
template <int BITS, int GROUP, int SMODE, int RB>
__attribute__((always_inline)) static inline void rows_group2(const int8_t* x, const float* dx, const int32_t* ncorr,
                                                              const float* bx, const uint8_t* blk, const __m256* s,
                                                              const __m256* z, __m256* acc) {
    constexpr int Q = GROUP / 4;
#if LD_VNNI256
    // AVX-VNNI: vpdpbusd on the stored (unsigned) codes, as the AVX-512 path, from -offset * isum
    __m256i dot[2 * RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
        dot[2 * r + 0] = dot[2 * r + 1] = BITS == 4 || BITS == 2 ? _mm256_setzero_si256() : _mm256_set1_epi32(ncorr[r]);
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) {
        const __m256i w0 = stored_half<BITS, GROUP>(blk, q, 0), w1 = stored_half<BITS, GROUP>(blk, q, 1);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
            int32_t four;
            memcpy(&four, x + r * GROUP + 4 * q, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            dot[2 * r + 0] = _mm256_dpbusd_avx_epi32(dot[2 * r + 0], w0, xb);
            dot[2 * r + 1] = _mm256_dpbusd_avx_epi32(dot[2 * r + 1], w1, xb);
        }
    }
#else
    constexpr int QACC = BITS == 6 ? 2 : signed_values<BITS>() ? 1 : 8;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot[2 * RB], p16[2 * RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)  // 3, 6 bits: start at -offset * isum; 2, 4 bits: offset 0; 8 bits, IQ4: signed values
        dot[2 * r + 0] = dot[2 * r + 1] = BITS == 6 || BITS == 3 ? _mm256_set1_epi32(ncorr[r]) : _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) {
        const __m256i w0 = decode_half<BITS, GROUP>(blk, q, 0), w1 = decode_half<BITS, GROUP>(blk, q, 1);
        constexpr bool sv = signed_values<BITS>();
        const __m256i a0 = sv ? _mm256_abs_epi8(w0) : w0, a1 = sv ? _mm256_abs_epi8(w1) : w1;
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
            int32_t four;
            memcpy(&four, x + r * GROUP + 4 * q, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            const __m256i m0 = _mm256_maddubs_epi16(a0, sv ? _mm256_sign_epi8(xb, w0) : xb);
            const __m256i m1 = _mm256_maddubs_epi16(a1, sv ? _mm256_sign_epi8(xb, w1) : xb);
            p16[2 * r + 0] = q % QACC == 0 ? m0 : _mm256_add_epi16(p16[2 * r + 0], m0);
            p16[2 * r + 1] = q % QACC == 0 ? m1 : _mm256_add_epi16(p16[2 * r + 1], m1);
            // keep each sum where it is written (here and below): without this GCC defers the adds
            // to the end of the group and keeps every product alive on the stack (2-3x the time)
            asm("" : "+x"(p16[2 * r + 0]), "+x"(p16[2 * r + 1]));
            if (q % QACC == QACC - 1 || q == Q - 1) {
                dot[2 * r + 0] = _mm256_add_epi32(dot[2 * r + 0], _mm256_madd_epi16(p16[2 * r + 0], ones));
                dot[2 * r + 1] = _mm256_add_epi32(dot[2 * r + 1], _mm256_madd_epi16(p16[2 * r + 1], ones));
                asm("" : "+x"(dot[2 * r + 0]), "+x"(dot[2 * r + 1]));
            }
        }
    }
#endif
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
        const __m256 d = _mm256_set1_ps(dx[r]);
        const __m256 b = _mm256_set1_ps(bx[r]);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[2 * r + h]));
            acc[2 * r + h] = _mm256_fmadd_ps(s[h], a, acc[2 * r + h]);
            if (SMODE != 3) acc[2 * r + h] = _mm256_fmadd_ps(z[h], b, acc[2 * r + h]);
        }
    }
}

// rows per rows_group2 call: their int16 and int32 sums, the decoded quad and the broadcast
// activations within the 16 ymm registers
template <int BITS>
constexpr int rblk2() { return LD_VNNI256 ? RBLK2_4 : BITS == 6 || signed_values<BITS>() ? RBLK2_68 : RBLK2_4; }

template <int BITS, int GROUP, int SMODE, int RB, int B0>
__attribute__((always_inline)) static inline void row_blocks2(const int8_t* x, const float* dx, const int32_t* nc,
                                                              const float* bx, const uint8_t* blk, const __m256* s,
                                                              const __m256* z, __m256* acc) {
    constexpr int n = RB - B0 < rblk2<BITS>() ? RB - B0 : rblk2<BITS>();
    if constexpr (n > 0) {
        rows_group2<BITS, GROUP, SMODE, n>(x + B0 * GROUP, dx + B0, nc + B0, bx + B0, blk, s, z, acc + 2 * B0);
        row_blocks2<BITS, GROUP, SMODE, RB, B0 + rblk2<BITS>()>(x, dx, nc, bx, blk, s, z, acc);
    }
}

// a unit's rows m0 .. m0 + RB - 1 (the AVX-512 unit_rows' plan on 8-lane halves)
template <int BITS, int GROUP, int SMODE, int RB>
static void unit_rows(int64_t m0, const Act& act, int64_t K, const uint8_t* codes, const Scales& sc, int offset,
                      int64_t u, const float* bias, void* y, int64_t ldy, int out_fp32) {
    constexpr int64_t UB = unit_bytes(BITS, GROUP);
    const int64_t ng = K / GROUP;
    const uint8_t* blk = codes + u * ng * UB;
    const uint8_t* end = blk + ng * UB;
    const int64_t rows = act.rows;  // the group-major activations of rows m0 .. (x, dx, bx, nc: group 0's)
    const int8_t* x = act.q + m0 * GROUP;
    const float* dx = act.dx + m0;
    const float* bx = act.bx + m0;
    const int32_t* nc = act.ncorr + m0;
    __m256 acc[2 * RB];
    for (int r = 0; r < 2 * RB; ++r) acc[r] = _mm256_setzero_ps();
    ScaleWalk2<SMODE> scales(sc, u, ng);
    for (int64_t g = 0; g < ng; ++g, blk += UB) {
        prefetch_ahead(blk, end, UB);
        __m256 s[2], z[2];
        scales.next(g, s, z);
        row_blocks2<BITS, GROUP, SMODE, RB, 0>(x + g * rows * GROUP, dx + g * rows, nc + g * rows, bx + g * rows, blk,
                                               s, z, acc);
    }
    alignas(32) float tmp[16];
    for (int r = 0; r < RB; ++r) {
        _mm256_store_ps(tmp, acc[2 * r]);
        _mm256_store_ps(tmp + 8, acc[2 * r + 1]);
        store_row(tmp, bias, y, ldy, m0 + r, u * 16, out_fp32);
    }
}

// Many rows (2-, 3-, 4- and 6-bit codes): each (unit, group) block is decoded once for all the pass's rows,
// QH quads at a time (2 QH registers), and a plain loop over the rows runs inside; a row's sums
// cross from one slice of quads to the next, and its accumulators from one group to the next, in
// small buffers that stay in L1.  Per row and group that is the vpmaddubsw and vpaddw the dot
// products need, the broadcasts of the activations and the epilogue, and little else (unit_rows
// decodes a group again for every RBLK2_4 rows and spills a fully unrolled block's registers).
// The same exact integers and the same epilogue in the same order of groups: the same bits.
template <int BITS, int GROUP, int SMODE>
static void unit_rows_many(int64_t rows, const Act& act, int64_t K, const uint8_t* codes, const Scales& sc,
                           int64_t u, const float* bias, void* y, int64_t ldy, int out_fp32) {
    static_assert(!signed_values<BITS>(), "8-bit codes and IQ4 take unit_rows");
#if !LD_VNNI256  // (vpdpbusd sums in int32 directly)
    constexpr bool I16 = BITS != 6;  // a row's sums in int16 pairs within a group (2, 3, 4 bits), or in int32
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    constexpr int Q = GROUP / 4;       // quads of a group: 4 or 8
    constexpr int QH = Q < 4 ? Q : 4;  // quads of a slice
    constexpr int NS = Q / QH;         // slices of a group
    constexpr int64_t UB = unit_bytes(BITS, GROUP);
    const int64_t ng = K / GROUP;
    const uint8_t* blk = codes + u * ng * UB;
    const uint8_t* end = blk + ng * UB;
    alignas(32) float acc[MAX_ROWS][16];
    // a row's sums between slices: int16 pairs (2, 3, 4 bits: 8 quads stay below 2^15) or int32 (6 bits)
    alignas(32) int32_t part[MAX_ROWS][16];
    for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < 16; ++j) acc[r][j] = 0.f;
    ScaleWalk2<SMODE> scales(sc, u, ng);
    for (int64_t g = 0; g < ng; ++g, blk += UB) {
        prefetch_ahead(blk, end, UB);
        __m256 s[2], z[2];
        scales.next(g, s, z);
        const int8_t* xg = act.q + g * rows * GROUP;
        const float* dx = act.dx + g * rows;
        const float* bx = act.bx + g * rows;
        const int32_t* nc = act.ncorr + g * rows;
#pragma GCC unroll 2
        for (int sl = 0; sl < NS; ++sl) {
            __m256i w[2 * QH];
#pragma GCC unroll 4
            for (int j = 0; j < QH; ++j) {
                w[2 * j] = decode_half<BITS, GROUP>(blk, sl * QH + j, 0);
                w[2 * j + 1] = decode_half<BITS, GROUP>(blk, sl * QH + j, 1);
            }
            for (int64_t r = 0; r < rows; ++r) {
                const int8_t* xr = xg + r * GROUP + 4 * QH * sl;
                __m256i d0, d1;  // 2, 3, 4 bits: int16 pair sums; 6 bits: int32 sums
#if LD_VNNI256  // int32 sums from -offset * isum, vpdpbusd on the codes
                d0 = sl ? _mm256_load_si256((const __m256i*)part[r])
                        : BITS == 4 || BITS == 2 ? _mm256_setzero_si256() : _mm256_set1_epi32(nc[r]);
                d1 = sl ? _mm256_load_si256((const __m256i*)part[r] + 1) : d0;
#pragma GCC unroll 4
                for (int j = 0; j < QH; ++j) {
                    int32_t four;
                    memcpy(&four, xr + 4 * j, 4);
                    const __m256i xb = _mm256_set1_epi32(four);
                    d0 = _mm256_dpbusd_avx_epi32(d0, w[2 * j], xb);
                    d1 = _mm256_dpbusd_avx_epi32(d1, w[2 * j + 1], xb);
                }
                if (sl < NS - 1) {
                    _mm256_store_si256((__m256i*)part[r], d0);
                    _mm256_store_si256((__m256i*)part[r] + 1, d1);
                    continue;
                }
#else
                if (I16) {
                    d0 = sl ? _mm256_load_si256((const __m256i*)part[r]) : _mm256_setzero_si256();
                    d1 = sl ? _mm256_load_si256((const __m256i*)part[r] + 1) : _mm256_setzero_si256();
                } else {
                    d0 = sl ? _mm256_load_si256((const __m256i*)part[r]) : _mm256_set1_epi32(nc[r]);
                    d1 = sl ? _mm256_load_si256((const __m256i*)part[r] + 1) : d0;
                }
                __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int j = 0; j < QH; ++j) {
                    int32_t four;
                    memcpy(&four, xr + 4 * j, 4);
                    const __m256i xb = _mm256_set1_epi32(four);
                    const __m256i m0 = _mm256_maddubs_epi16(w[2 * j], xb);
                    const __m256i m1 = _mm256_maddubs_epi16(w[2 * j + 1], xb);
                    if (I16) {
                        d0 = _mm256_add_epi16(d0, m0);
                        d1 = _mm256_add_epi16(d1, m1);
                        asm("" : "+x"(d0), "+x"(d1));  // (as in rows_group2: the adds where they are written)
                    } else {  // pairs of quads in int16, then widened
                        p0 = j % 2 ? _mm256_add_epi16(p0, m0) : m0;
                        p1 = j % 2 ? _mm256_add_epi16(p1, m1) : m1;
                        asm("" : "+x"(p0), "+x"(p1));
                        if (j % 2) {
                            d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(p0, ones));
                            d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(p1, ones));
                            asm("" : "+x"(d0), "+x"(d1));
                        }
                    }
                }
                if (sl < NS - 1) {
                    _mm256_store_si256((__m256i*)part[r], d0);
                    _mm256_store_si256((__m256i*)part[r] + 1, d1);
                    continue;
                }
                if (I16) {
                    d0 = _mm256_madd_epi16(d0, ones);
                    d1 = _mm256_madd_epi16(d1, ones);
                    if (BITS == 3) {  // the codes' offset: -offset * isum
                        d0 = _mm256_add_epi32(d0, _mm256_set1_epi32(nc[r]));
                        d1 = _mm256_add_epi32(d1, _mm256_set1_epi32(nc[r]));
                    }
                }
#endif
                const __m256 d = _mm256_set1_ps(dx[r]);
                __m256 a0 = _mm256_fmadd_ps(s[0], _mm256_mul_ps(d, _mm256_cvtepi32_ps(d0)), _mm256_load_ps(acc[r]));
                __m256 a1 = _mm256_fmadd_ps(s[1], _mm256_mul_ps(d, _mm256_cvtepi32_ps(d1)), _mm256_load_ps(acc[r] + 8));
                if (SMODE != 3) {
                    const __m256 b = _mm256_set1_ps(bx[r]);
                    a0 = _mm256_fmadd_ps(z[0], b, a0);
                    a1 = _mm256_fmadd_ps(z[1], b, a1);
                }
                _mm256_store_ps(acc[r], a0);
                _mm256_store_ps(acc[r] + 8, a1);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) store_row(acc[r], bias, y, ldy, r, u * 16, out_fp32);
}
#endif

#if LD_SIMD
typedef void (*UnitRowsFn)(int64_t, const Act&, int64_t, const uint8_t*, const Scales&, int, int64_t, const float*,
                           void*, int64_t, int);

template <int BITS, int GROUP, int SMODE, int... RB>
static UnitRowsFn unit_rows_pick(int rb, std::integer_sequence<int, RB...>) {
    static const UnitRowsFn table[] = {unit_rows<BITS, GROUP, SMODE, RB + 1>...};
    return table[rb - 1];
}

template <int BITS, int GROUP, int SMODE>
static UnitRowsFn unit_rows_fn(int rb) {
    return unit_rows_pick<BITS, GROUP, SMODE>(rb < 1 ? 1 : rb > RB_ROWS ? RB_ROWS : rb,
                                              std::make_integer_sequence<int, RB_ROWS>{});
}

template <int BITS, int GROUP>
static UnitRowsFn unit_rows_fn(int smode, int rb) {
    return smode == 0 ? unit_rows_fn<BITS, GROUP, 0>(rb) : smode == 1 ? unit_rows_fn<BITS, GROUP, 1>(rb)
         : smode == 2 ? unit_rows_fn<BITS, GROUP, 2>(rb) : unit_rows_fn<BITS, GROUP, 3>(rb);
}

// the specialized few-row functions of one code width, for a group size, a scale mode and a block
// of rb rows (1..RB_ROWS)
#define LD_UNIT_ROWS_OF(B)                                                                              \
    __attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_##B(int group, int smode, int rb) {  \
        return group == 16 ? unit_rows_fn<B, 16>(smode, rb) : unit_rows_fn<B, 32>(smode, rb);           \
    }
// a format of one group size only (format_ok)
#define LD_UNIT_ROWS_OF_GROUP(B, G)                                                                     \
    __attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_##B(int group, int smode, int rb) {  \
        return group == G ? unit_rows_fn<B, G>(smode, rb) : nullptr;                                    \
    }
#if LD_PART == -1 || LD_PART == 4
LD_UNIT_ROWS_OF(4)
#endif
#if LD_PART == -1 || LD_PART == 6
LD_UNIT_ROWS_OF(6)
#endif
#if LD_PART == -1 || LD_PART == 8
LD_UNIT_ROWS_OF(8)
#endif
#if LD_PART == -1 || LD_PART == 2
LD_UNIT_ROWS_OF_GROUP(2, 16)
LD_UNIT_ROWS_OF_GROUP(3, 16)
#endif
#if LD_PART == -1 || LD_PART == CODES_IQ4
LD_UNIT_ROWS_OF_GROUP(9, 32)
#endif

#if LD_PART <= 0
__attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_2(int group, int smode, int rb);
__attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_3(int group, int smode, int rb);
__attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_4(int group, int smode, int rb);
__attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_6(int group, int smode, int rb);
__attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_8(int group, int smode, int rb);
__attribute__((visibility("hidden"))) UnitRowsFn unit_rows_of_9(int group, int smode, int rb);

// the specialized few-row function for a format and a block of rb rows (1..RB_ROWS)
static UnitRowsFn select_unit_rows(int bits, int group, int smode, int rb) {
    switch (bits) {
        case 2: return unit_rows_of_2(group, smode, rb);
        case 3: return unit_rows_of_3(group, smode, rb);
        case 4: return unit_rows_of_4(group, smode, rb);
        case 6: return unit_rows_of_6(group, smode, rb);
        case CODES_IQ4: return unit_rows_of_9(group, smode, rb);
        default: return unit_rows_of_8(group, smode, rb);
    }
}
#endif
#endif

#if LD_PART <= 0  // the library's entry points (the rest of the file)

#if LD_SIMD == 2
typedef void (*ManyRowsFn)(int64_t, const Act&, int64_t, const uint8_t*, const Scales&, int64_t, const float*, void*,
                           int64_t, int);

template <int BITS, int GROUP>
static ManyRowsFn many_rows_fn(int smode) {
    return smode == 0 ? unit_rows_many<BITS, GROUP, 0> : smode == 1 ? unit_rows_many<BITS, GROUP, 1>
         : smode == 2 ? unit_rows_many<BITS, GROUP, 2> : unit_rows_many<BITS, GROUP, 3>;
}

// the many-row function of a format (none for 8-bit codes and IQ4)
static ManyRowsFn select_many_rows(int bits, int group, int smode) {
    if (bits == 2) return many_rows_fn<2, 16>(smode);
    if (bits == 3) return many_rows_fn<3, 16>(smode);
    if (bits == 4) return group == 16 ? many_rows_fn<4, 16>(smode) : many_rows_fn<4, 32>(smode);
    if (bits == 6) return group == 16 ? many_rows_fn<6, 16>(smode) : many_rows_fn<6, 32>(smode);
    return nullptr;
}
#endif

#if LD_AMX
// AMX (the tile extension of Intel's Xeons since Sapphire Rapids): TDPBSUD multiplies a tile of 16
// rows of signed bytes (A: the activations of AMX_ROWS rows in one group, G = 32 bytes each, adjacent in
// the group-major buffer) by a tile of unsigned bytes (B: one unit's decoded group, its quad vectors as
// they are, quad q being B's row q: byte e is column e / 4, k = 4 q + e % 4), each of the 16 x 16
// int32 outputs the exact sum of its G products: the integer dot products of 16 rows in one
// instruction.  Then the rows' epilogue as rows_group's, row by row, in the same order (the dot
// product plus -offset * isum is the same exact integer as when it starts there): the same bits.
// Tiles 0 and 1 hold the dot products of a pair of groups, 2 and 3 their activations, 4 and 5
// their codes.  Measured on a 2-core Xeon VM (docs/lab-notes/benchmarks.md section 55): storing a
// product tile (1 KB for 16 rows) costs about as much as the tile loads and TDPBSUD together, and
// the epilogue's fp32 operations per row and group are as many as the tile part's time again, so
// 16 rows of 4-bit codes in groups of 32 cost about 0.75-0.85x the AVX-512 path's time, 12 rows
// and groups of 16 more than it: tiles take blocks of 16 rows of the formats in groups of 32 only.

// whether this process may use the tiles (Linux gives a process their state when it asks)
static bool amx_ready() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// this thread's tiles (the layout above: AMX_ROWS rows, groups of 32 columns)
static void amx_configure() {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; ++t) {
        cfg.rows[t] = t < 4 ? AMX_ROWS : AMX_GROUP / 4;
        cfg.colsb[t] = t == 2 || t == 3 ? AMX_GROUP : 64;
    }
    _tile_loadconfig(&cfg);
}

// a group's product: codes b into tile B, activations a into tile A, their dot products into tile C
// (GCC's tile intrinsics take the tiles' numbers as literals)
#define AMX_PRODUCT(C, A, B, a, b)       \
    do {                                 \
        _tile_loadd(B, b, 64);           \
        _tile_loadd(A, a, AMX_GROUP);    \
        _tile_zero(C);                   \
        _tile_dpbsud(C, A, B);           \
    } while (0)

// rows_group's epilogue for the AMX_ROWS rows of dot products dot[r][16] (without -offset * isum: added here)
template <int SMODE, bool NC>
__attribute__((always_inline)) static inline void amx_epilogue(const int32_t* dot, const float* dx,
                                                               const int32_t* nc, const float* bx, __m512 s,
                                                               __m512 z, __m512* acc) {
    for (int r = 0; r < AMX_ROWS; ++r) {
        __m512i d = _mm512_load_si512(dot + 16 * r);
        if (NC) d = _mm512_add_epi32(d, _mm512_set1_epi32(nc[r]));
        const __m512 a = _mm512_mul_ps(_mm512_set1_ps(dx[r]), _mm512_cvtepi32_ps(d));
        acc[r] = _mm512_fmadd_ps(s, a, acc[r]);
        if (SMODE != 3) acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(bx[r]), acc[r]);
    }
}

// A unit's rows m0 .. m0 + AMX_ROWS - 1
template <int BITS, int SMODE>
static void unit_rows_amx(int64_t m0, const Act& act, int64_t K, const uint8_t* codes, const Scales& sc,
                          int64_t u, const float* bias, void* y, int64_t ldy, int out_fp32) {
    constexpr int GROUP = AMX_GROUP, Q = GROUP / 4;
    constexpr int64_t UB = unit_bytes(BITS, GROUP);
    constexpr bool NC = !(BITS == 4 || BITS == 2);  // codes with an offset
    const int64_t ng = K / GROUP, rows = act.rows;
    const uint8_t* blk = codes + u * ng * UB;
    const uint8_t* end = blk + ng * UB;
    const int8_t* x = act.q + m0 * GROUP;
    const float* dx = act.dx + m0;
    const float* bx = act.bx + m0;
    const int32_t* nc = act.ncorr + m0;
    // The groups in chunks of AMX_CHUNK: decoded, then multiplied, then finished (so that a tile load
    // never waits on the stores just before it, nor a vector load on the tile store just before it)
    alignas(64) uint8_t wb[AMX_CHUNK][Q * 64];
    alignas(64) int32_t dot[AMX_CHUNK][AMX_ROWS * 16];
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
    ScaleWalk<SMODE> scales(sc, u, ng);
    for (int64_t c0 = 0; c0 < ng; c0 += AMX_CHUNK) {
        const int n = ng - c0 < AMX_CHUNK ? (int)(ng - c0) : AMX_CHUNK;
        for (int i = 0; i < n; ++i) {
            const uint8_t* b = blk + (c0 + i) * UB;
            prefetch_ahead(b, end, UB);
            __m512i w[Q];
            decode_block(b, BITS, GROUP, w);
            for (int q = 0; q < Q; ++q) _mm512_store_si512(wb[i] + 64 * q, w[q]);
        }
        const int8_t* xc = x + c0 * rows * GROUP;
        int i = 0;
        for (; i + 1 < n; i += 2) {
            AMX_PRODUCT(0, 2, 4, xc + i * rows * GROUP, wb[i]);
            AMX_PRODUCT(1, 3, 5, xc + (i + 1) * rows * GROUP, wb[i + 1]);
            _tile_stored(0, dot[i], 64);
            _tile_stored(1, dot[i + 1], 64);
        }
        if (i < n) {
            AMX_PRODUCT(0, 2, 4, xc + i * rows * GROUP, wb[i]);
            _tile_stored(0, dot[i], 64);
        }
        for (i = 0; i < n; ++i) {
            const int64_t g = c0 + i;
            __m512 s, z;
            scales.next(g, s, z);
            amx_epilogue<SMODE, NC>(dot[i], dx + g * rows, nc + g * rows, bx + g * rows, s, z, acc);
        }
    }
    alignas(64) float tmp[16];
    for (int r = 0; r < AMX_ROWS; ++r) {
        _mm512_store_ps(tmp, acc[r]);
        store_row(tmp, bias, y, ldy, m0 + r, u * 16, out_fp32);
    }
}

typedef void (*AmxRowsFn)(int64_t, const Act&, int64_t, const uint8_t*, const Scales&, int64_t, const float*, void*,
                          int64_t, int);

template <int BITS>
static AmxRowsFn amx_rows_fn(int smode) {
    return smode == 0 ? unit_rows_amx<BITS, 0> : smode == 1 ? unit_rows_amx<BITS, 1>
         : smode == 2 ? unit_rows_amx<BITS, 2> : unit_rows_amx<BITS, 3>;
}

// the tile function of a format in groups of 32 columns (Q4_K, Q5_K, Q8_0, IQ4_NL/XS, ...); none in groups
// of 16 (Q6_K, Q2_K, Q3_K): there a tile stores its products every 16 columns of K, and measured
// (section 55) that costs more than the AVX-512 path
static AmxRowsFn select_amx_rows(int bits, int group, int smode) {
    if (group != AMX_GROUP) return nullptr;
    switch (bits) {
        case 4: return amx_rows_fn<4>(smode);
        case 6: return amx_rows_fn<6>(smode);
        case CODES_IQ4: return amx_rows_fn<CODES_IQ4>(smode);
        case 8: return amx_rows_fn<8>(smode);
        default: return nullptr;
    }
}
#endif

// whether products of several rows take AMX tiles here (an AMX build on a CPU and kernel that allow them)
extern "C" int ld_amx(void) {
#if LD_AMX
    return amx_ready() ? 1 : 0;
#else
    return 0;
#endif
}

// bytes of the work buffer ld_qgemm needs for K columns in groups of `group`
extern "C" int64_t ld_work_bytes(int64_t K, int group) { return MAX_ROWS * (K + 16 * (K / group)); }

// y[M, N] (row stride ldy; bf16 or fp32) = x[M, K] (bf16, row stride ldx) @ W.T (+ bias)
// returns 0, or a negative error code for an unsupported shape/format
extern "C" int ld_qgemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes,
                        const void* scales, const void* zeros, const void* dsup, const void* zsup,
                        int smode, int gps, int bits, int offset, int group,
                        int64_t N, const float* bias, void* y, int64_t ldy, int out_fp32, int nthreads,
                        void* work) {
    if (N % 16 || (group != 16 && group != 32) || K % group) return -1;
    if (!format_ok(bits, group)) return -2;
    if ((bits == 6 && (offset < 0 || offset > 63)) || (bits == 3 && (offset < 0 || offset > 7))) return -3;
    if (smode < 0 || smode > 3 || (smode >= 2 && (gps <= 0 || (K / group) % gps))) return -4;
    if (nthreads < 1) nthreads = 1;
    const Scales sc = {scales, zeros, (const uint16_t*)dsup, (const uint16_t*)zsup, smode, gps};
    const int64_t ng = K / group;
    const int64_t units = N / 16;
    Act act;
    act.q = (int8_t*)work;
    act.dx = (float*)((char*)work + MAX_ROWS * K);
    act.isum = (int32_t*)((char*)work + MAX_ROWS * K + 4 * MAX_ROWS * ng);
    act.bx = (float*)((char*)work + MAX_ROWS * K + 8 * MAX_ROWS * ng);
    act.ncorr = (int32_t*)((char*)work + MAX_ROWS * K + 12 * MAX_ROWS * ng);
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t rows = M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS;
        void* yr = out_fp32 ? (void*)((float*)y + r0 * ldy) : (void*)((uint16_t*)y + r0 * ldy);
        act.rows = rows;
        quantize_rows(x + r0 * ldx, ldx, rows, K, group, code_offset(bits, offset), act, nthreads);
#if LD_SIMD == 2
        const ManyRowsFn many = rows >= MANY_ROWS ? select_many_rows(bits, group, smode) : nullptr;
        if (many) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
            for (int64_t u = 0; u < units; ++u) many(rows, act, K, codes, sc, u, bias, yr, ldy, out_fp32);
            continue;
        }
#endif
#if LD_SIMD
        // AMX builds: the blocks of AMX_ROWS rows on tiles (a format in groups of 32); then each unit's
        // (other) rows in passes of up to RB_ROWS, accumulators in registers
#if LD_AMX
        const AmxRowsFn amx = rows >= AMX_ROWS && amx_ready() ? select_amx_rows(bits, group, smode) : nullptr;
#else
        const void* const amx = nullptr;
#endif
        const int64_t tiled = amx ? rows - rows % AMX_ROWS : 0;
        const int nb = (int)((rows - tiled + RB_ROWS - 1) / RB_ROWS);
        UnitRowsFn fn[MAX_ROWS];
        for (int b = 0; b < nb; ++b) {
            const int64_t left = rows - tiled - RB_ROWS * b;
            fn[b] = select_unit_rows(bits, group, smode, (int)(left < RB_ROWS ? left : RB_ROWS));
        }
#pragma omp parallel num_threads(nthreads)
        {
#if LD_AMX
            if (amx) amx_configure();
#endif
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; ++u) {
#if LD_AMX
                for (int64_t m0 = 0; m0 < tiled; m0 += AMX_ROWS) amx(m0, act, K, codes, sc, u, bias, yr, ldy, out_fp32);
#endif
                for (int b = 0; b < nb; ++b) fn[b](tiled + RB_ROWS * b, act, K, codes, sc, offset, u, bias, yr, ldy, out_fp32);
            }
#if LD_AMX
            if (amx) _tile_release();
#endif
        }
#else
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t u = 0; u < units; ++u)
            block_generic(rows, act, K, codes, sc, bits, offset, group, u, bias, yr, ldy, out_fp32);
#endif
    }
    return 0;
}

// the stored codes of one (unit, group) block as c[row j][column k within the group]
static void codes_of_block(const uint8_t* blk, int bits, int group, int c[16][32]) {
    for (int q = 0; q < group / 4; ++q)
        for (int e = 0; e < 64; ++e) c[e / 4][4 * q + e % 4] = code_at(blk, bits, group, q, e);
}

// the weight [N, K], s * value + z in fp32 (one rounding per product and per sum), stored as
// fp32 (tests) or rounded to bf16 (the prefill path's copy)
template <typename T>
static int dequant(const uint8_t* codes, const void* scales, const void* zeros, const void* dsup, const void* zsup,
                   int smode, int gps, int bits, int offset, int group, int64_t N, int64_t K, T* out, int nthreads) {
    if (N % 16 || (group != 16 && group != 32) || K % group) return -1;
    if (!format_ok(bits, group)) return -2;
    if (smode < 0 || smode > 3 || (smode >= 2 && (gps <= 0 || (K / group) % gps))) return -4;
    const Scales sc = {scales, zeros, (const uint16_t*)dsup, (const uint16_t*)zsup, smode, gps};
    const int64_t ng = K / group;
    const int64_t ub = unit_bytes(bits, group);
    const int off = code_offset(bits, offset);
#pragma omp parallel for schedule(static) num_threads(nthreads < 1 ? 1 : nthreads)
    for (int64_t u = 0; u < N / 16; ++u)
        for (int64_t g = 0; g < ng; ++g) {
            int c[16][32];
            codes_of_block(codes + (u * ng + g) * ub, bits, group, c);
            float s[16], z[16];
            scales_at(sc, u, g, ng, s, z);
            for (int j = 0; j < 16; ++j) {
                T* row = out + (u * 16 + j) * K + g * group;
                for (int k = 0; k < group; ++k) {
                    const float w = s[j] * (float)(c[j][k] - off) + z[j];
                    if constexpr (sizeof(T) == 4) row[k] = w;
                    else row[k] = to_bf16(w);
                }
            }
        }
    return 0;
}

extern "C" int ld_qdequant(const uint8_t* codes, const void* scales, const void* zeros, const void* dsup,
                           const void* zsup, int smode, int gps, int bits, int offset, int group,
                           int64_t N, int64_t K, float* out, int nthreads) {
    return dequant<float>(codes, scales, zeros, dsup, zsup, smode, gps, bits, offset, group, N, K, out, nthreads);
}

extern "C" int ld_qdequant_bf16(const uint8_t* codes, const void* scales, const void* zeros, const void* dsup,
                                const void* zsup, int smode, int gps, int bits, int offset, int group,
                                int64_t N, int64_t K, uint16_t* out, int nthreads) {
    return dequant<uint16_t>(codes, scales, zeros, dsup, zsup, smode, gps, bits, offset, group, N, K, out, nthreads);
}
#endif  // LD_PART <= 0
