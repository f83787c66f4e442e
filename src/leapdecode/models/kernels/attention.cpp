// Batch-invariant attention of single query rows over listed cache slots.
//
// For each new token t (a decoding step, or a node of a verified token tree) and each key head
// h, the query heads that share h attend over exactly the slots idx[offsets[t] .. offsets[t+1])
// (the committed prefix, then the token's pending ancestors, itself last: KVCache.attended_slots),
// in that order:
//   s[j]  = scale * dot(q, k[idx[j]])        fp32: 16 FMA chains (columns l, l+16, ...) added
//                                            in one fixed tree; with a soft cap c > 0 (Gemma 2),
//                                            then s[j] = tanh(s[j] / c) * c
//   m     = max_j s[j];  p[j] = exp(s[j] - m)  (the same polynomial exp for every element)
//   l     = sum_j p[j]                        (16 lanes by slot position mod 16, the same tree)
//   out   = (sum_j p[j] * v[idx[j]]) / l      (one FMA chain per column, in slot order)
// Every output goes through the same operations whatever the number of tokens T, the tree's
// shape and the thread count (a task never shares accumulators), so a token's attention output
// has the same bits alone as inside a tree: the property the engine's exactness rests on
// (tests/test_invariant_attention.py).  Inputs fp32 or bf16 (dtype 0 / 1), output the same dtype,
// laid out [T][Hq][D].  The loops over 16 lanes are plain C that the compiler vectorizes
// (-O3 -march=native; -ffp-contract=off keeps each multiply and add rounded as written, and the
// FMAs are explicit fmaf calls), so a portable build computes the same values.
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <vector>
#include "ld_isa.h"  // LD_SIMD: the instruction-set path, decided there for every source
#define LD_AVX512 (LD_SIMD == 1)
// AVX2 without AVX-512: the two hot loops below in 8-lane registers, a few keys or columns at a
// time so that their accumulators fit the 16 ymm registers (each lane's FMA chain unchanged), the
// scores' fixed-tree sums with hadd (sums16) and the exponentials 8 lanes at a time (exp_neg8):
// the scalar versions were half of a tree row's attention time (perf, qwen2.5-coder-1.5b shapes)
#define LD_AVX2 (LD_SIMD == 2)

#define LANES 16

// 16 fp32 lanes: AVX-512 registers, or plain arrays with the very same roundings (fmaf is
// one rounding, as vfmadd)
#if LD_AVX512
typedef __m512 V;
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V vfma1(float a, V b, V c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
#else
struct V { float x[16]; };
static inline V vload(const float* p) { V a; memcpy(a.x, p, sizeof a.x); return a; }
static inline void vstore(float* p, V a) { memcpy(p, a.x, sizeof a.x); }
static inline V vzero() { V a; for (int l = 0; l < 16; ++l) a.x[l] = 0.f; return a; }
static inline V vfma(V a, V b, V c) { for (int l = 0; l < 16; ++l) c.x[l] = fmaf(a.x[l], b.x[l], c.x[l]); return c; }
static inline V vfma1(float a, V b, V c) { for (int l = 0; l < 16; ++l) c.x[l] = fmaf(a, b.x[l], c.x[l]); return c; }
#endif
#define MAX_D 256
#define MAX_G 16

#include "bf16.h"
#include "ld_abi.h"

// row of D values as fp32
static inline void load_row(const void* p, int64_t at, int D, int dtype, float* out) {
    if (dtype == 0) {
        memcpy(out, (const float*)p + at, sizeof(float) * D);
    } else {
        const uint16_t* s = (const uint16_t*)p + at;
#if LD_AVX512
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(out + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s + d))), 16)));
#elif LD_AVX2
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s + d))), 16)));
#else
        for (int d = 0; d < D; ++d) out[d] = bf16_val(s[d]);
#endif
    }
}

// exp(x) for x <= 0: 2^n * P(r), r = x - n ln2 (Cody-Waite), P a degree-6 polynomial; about
// 2 ulp; below -87 it returns 0.  Branch-free, so the compiler vectorizes the loop calling it.
// Its constants, shared with exp_neg8 (which must give the same bits):
static constexpr float EXP_MIN = -87.0f, EXP_LOG2E = 1.44269504088896341f, EXP_ROUND = 12582912.0f;
static constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
static constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_neg(float x) {
    x = x < EXP_MIN ? EXP_MIN : x;
    const float t = x * EXP_LOG2E;
    const float n = (t + EXP_ROUND) - EXP_ROUND;  // round to nearest
    float r = x - n * EXP_LN2_HI;
    r = r - n * EXP_LN2_LO;
    float p = EXP_P[0];
    for (int i = 1; i < 6; ++i) p = p * r + EXP_P[i];
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

#if LD_AVX2
// exp_neg on 8 lanes: the very same IEEE operations in the same order (no contraction), so the
// same bits as the scalar function lane by lane
static inline __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x);  // (c > x ? c : x): a NaN x stays x, as in exp_neg
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E));
    const __m256 big = _mm256_set1_ps(EXP_ROUND);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, big), big);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)));
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P[i]));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// The 16 lanes of x added adjacent pairs first ((x0 + x1) + (x2 + x3)) + ...; x is overwritten.
static inline float tree_sum(float* x) {
    for (int width = LANES; width > 1; width /= 2)
        for (int i = 0; i < width / 2; ++i) x[i] = x[2 * i] + x[2 * i + 1];
    return x[0];
}

// Sums of the 16 lanes of each of 16 vectors a[0..15] in one fixed tree per vector: adjacent
// lanes first ((l0 + l1) + (l2 + l3)) + ..., so out[j] is the same function of a[j] whatever
// j is.  The AVX-512 branch gets there with 15 permute-and-add steps; the portable branch
// adds the same pairs.
static inline void sums16(const float (*a)[LANES], float* out) {
#if LD_AVX512
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm512_loadu_ps(a[j]);
    for (int width = 16; width > 1; width /= 2)
        for (int k = 0; k < width / 2; ++k)
            v[k] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * k], even, v[2 * k + 1]),
                                 _mm512_permutex2var_ps(v[2 * k], odd, v[2 * k + 1]));
    _mm512_storeu_ps(out, v[0]);
#elif LD_AVX2
    // 8 vectors at a time; float addition is commutative, so only the pairs matter: hadd adds
    // adjacent lanes (level 1 and 2 of the tree), the 128-bit halves then meet (level 3), and a
    // last hadd adds the two level-3 sums; the vectors are placed so that the results come out
    // in order
    for (int j0 = 0; j0 < 16; j0 += 8) {
        __m256 q[4];
        for (int i = 0; i < 4; ++i) {
            const float* x = a[j0 + 2 * i];
            const float* y = a[j0 + 2 * i + 1];
            const __m256 px = _mm256_hadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));  // x: 01 23 89 1011 | 45 67 1213 1415
            const __m256 py = _mm256_hadd_ps(_mm256_loadu_ps(y), _mm256_loadu_ps(y + 8));
            q[i] = _mm256_hadd_ps(px, py);  // x: 0-3 8-11, y: 0-3 8-11 | x: 4-7 12-15, y: 4-7 12-15
        }
        // level 3 (0-3 + 4-7, 8-11 + 12-15): vectors 0, 1 with 4, 5 and 2, 3 with 6, 7
        const __m256 r0 = _mm256_add_ps(_mm256_permute2f128_ps(q[0], q[2], 0x20), _mm256_permute2f128_ps(q[0], q[2], 0x31));
        const __m256 r1 = _mm256_add_ps(_mm256_permute2f128_ps(q[1], q[3], 0x20), _mm256_permute2f128_ps(q[1], q[3], 0x31));
        _mm256_storeu_ps(out + j0, _mm256_hadd_ps(r0, r1));  // 0, 1, 2, 3 | 4, 5, 6, 7
    }
#else
    for (int j = 0; j < 16; ++j) {
        float x[LANES];
        for (int l = 0; l < LANES; ++l) x[l] = a[j][l];
        out[j] = tree_sum(x);
    }
#endif
}

// one token, one key head: the G query heads of that key head, keys in blocks of 16
static void attend_group(const float (*qf)[MAX_D], int G, const void* k, int64_t kh_off, int64_t k_slot,
                         const void* v, int64_t vh_off, int64_t v_slot, const int64_t* idx, int64_t n, int D,
                         int dtype, float scale, float softcap, std::vector<float>& s, void* out,
                         int64_t out_off) {
    const int64_t nb = (n + LANES - 1) / LANES * LANES;  // scores padded to whole blocks
    s.resize((size_t)G * (size_t)nb);
    // rows past a block's last key and columns past D stay zero (whole registers below)
    alignas(64) float rows[LANES][MAX_D] = {};
    alignas(64) float part[LANES][LANES];
    alignas(64) float sums[LANES];
    // scores: lane l of key j's partial sum holds columns l, l + 16, ... (one FMA chain each; the
    // 16 keys' chains run side by side, each in its own order)
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        const int m = n - j0 < LANES ? (int)(n - j0) : LANES;
        for (int jj = 0; jj < m; ++jj) load_row(k, kh_off + idx[j0 + jj] * k_slot, D, dtype, rows[jj]);
        if (m < LANES)
            for (int jj = m; jj < LANES; ++jj) memset(rows[jj], 0, sizeof(float) * D);
        for (int g = 0; g < G; ++g) {
#if LD_AVX2
            for (int j4 = 0; j4 < LANES; j4 += 4) {  // 4 keys at a time, two halves of 8 lanes each
                __m256 a[4][2];
                for (int jj = 0; jj < 4; ++jj) a[jj][0] = a[jj][1] = _mm256_setzero_ps();
                for (int d0 = 0; d0 < D; d0 += LANES) {
                    const __m256 q0 = _mm256_loadu_ps(qf[g] + d0), q1 = _mm256_loadu_ps(qf[g] + d0 + 8);
                    for (int jj = 0; jj < 4; ++jj) {
                        a[jj][0] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(rows[j4 + jj] + d0), a[jj][0]);
                        a[jj][1] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(rows[j4 + jj] + d0 + 8), a[jj][1]);
                    }
                }
                for (int jj = 0; jj < 4; ++jj) {
                    _mm256_storeu_ps(part[j4 + jj], a[jj][0]);
                    _mm256_storeu_ps(part[j4 + jj] + 8, a[jj][1]);
                }
            }
#else
            V a[LANES];
            for (int jj = 0; jj < LANES; ++jj) a[jj] = vzero();
            for (int d0 = 0; d0 < D; d0 += LANES) {
                const V qv = vload(qf[g] + d0);
                for (int jj = 0; jj < LANES; ++jj) a[jj] = vfma(qv, vload(rows[jj] + d0), a[jj]);
            }
            for (int jj = 0; jj < LANES; ++jj) vstore(part[jj], a[jj]);
#endif
            sums16(part, sums);
            float* sg = s.data() + (size_t)g * nb + j0;
            for (int jj = 0; jj < LANES; ++jj) sg[jj] = sums[jj] * scale;
            if (softcap > 0.f)
                for (int jj = 0; jj < LANES; ++jj) sg[jj] = tanhf(sg[jj] / softcap) * softcap;
        }
    }
    // softmax: the max (any order gives the same), exp, then the sum in 16 lanes (lane = slot
    // position mod 16) added in the fixed tree
    float denom[MAX_G];
    for (int g = 0; g < G; ++g) {
        float* sg = s.data() + (size_t)g * nb;
        for (int64_t j = n; j < nb; ++j) sg[j] = -INFINITY;  // padding: never the max
        float lmax[LANES];
        for (int l = 0; l < LANES; ++l) lmax[l] = sg[l];
        for (int64_t j0 = LANES; j0 < nb; j0 += LANES)
            for (int l = 0; l < LANES; ++l) lmax[l] = sg[j0 + l] > lmax[l] ? sg[j0 + l] : lmax[l];
        float mx = lmax[0];  // a max: the same value in any order
        for (int l = 1; l < LANES; ++l) mx = lmax[l] > mx ? lmax[l] : mx;
        int64_t j = 0;
#if LD_AVX2
        for (; j + 8 <= n; j += 8)
            _mm256_storeu_ps(sg + j, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), _mm256_set1_ps(mx))));
#endif
        for (; j < n; ++j) sg[j] = exp_neg(sg[j] - mx);
        for (int64_t j = n; j < nb; ++j) sg[j] = 0.f;
        float lanes[LANES] = {0};
        for (int64_t j0 = 0; j0 < nb; j0 += LANES)
            for (int l = 0; l < LANES; ++l) lanes[l] = lanes[l] + sg[j0 + l];
        denom[g] = tree_sum(lanes);
    }
    // weighted values: column d of query g accumulates p[j] * v[j][d] over j in slot order
    alignas(64) float acc[MAX_G][MAX_D];
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
    // eight column chunks at a time (D rounded up to 128 columns: the extra ones are zeros and
    // unused), each chunk's chain over the keys in slot order
    const int DW = (D + 8 * LANES - 1) / (8 * LANES) * (8 * LANES);
    for (int g = 0; g < G; ++g)
        for (int d = D; d < DW; ++d) acc[g][d] = 0.f;
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        const int m = n - j0 < LANES ? (int)(n - j0) : LANES;
        for (int jj = 0; jj < m; ++jj) load_row(v, vh_off + idx[j0 + jj] * v_slot, D, dtype, rows[jj]);
        for (int g = 0; g < G; ++g) {
            const float* p = s.data() + (size_t)g * nb + j0;
#if LD_AVX2
            // 64 columns (8 registers: as many FMA chains as hide the FMA latency) at a time
            for (int c0 = 0; c0 < DW; c0 += 64) {
                __m256 a[8];
                for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc[g] + c0 + 8 * c);
                for (int jj = 0; jj < m; ++jj) {
                    const __m256 pj = _mm256_set1_ps(p[jj]);
                    for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(rows[jj] + c0 + 8 * c), a[c]);
                }
                for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc[g] + c0 + 8 * c, a[c]);
            }
            continue;
#endif
            for (int c0 = 0; c0 < DW; c0 += 8 * LANES) {
                V a[8];
                for (int c = 0; c < 8; ++c) a[c] = vload(acc[g] + c0 + c * LANES);
                for (int jj = 0; jj < m; ++jj)
                    for (int c = 0; c < 8; ++c) a[c] = vfma1(p[jj], vload(rows[jj] + c0 + c * LANES), a[c]);
                for (int c = 0; c < 8; ++c) vstore(acc[g] + c0 + c * LANES, a[c]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) {
            const float o = acc[g][d] / denom[g];
            if (dtype == 0) ((float*)out)[out_off + (int64_t)g * D + d] = o;
            else ((uint16_t*)out)[out_off + (int64_t)g * D + d] = to_bf16(o);
        }
}

// Where a row's keys and values are: slot i of key head h at k[h * k_head + i * k_slot], the same
// for values.
struct LayerKV {
    const void* k;
    int64_t k_head, k_slot;
    const void* v;
    int64_t v_head, v_slot;
};

static int check_attend(int64_t T, int Hq, int Hkv, int D, int dtype, const int64_t* offsets) {
    if (D <= 0 || D > MAX_D || D % LANES) return -1;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G) return -2;
    if (dtype != 0 && dtype != 1) return -3;
    for (int64_t t = 0; t < T; ++t)
        if (offsets[t + 1] <= offsets[t]) return -4;  // every token sees at least itself
    return 0;
}

// Every (row, key head) task: row t's queries over its slots in the cache kv_of(t) names.  The one
// loop of ld_attend_rows and ld_rope_attend_segments, so a row's operations are the same in both.
template <typename KVOf>
static void attend_tasks(const void* q, int64_t q_row, int64_t q_head, KVOf kv_of, const int64_t* idx,
                         const int64_t* offsets, int64_t T, int Hq, int Hkv, int D, int dtype, float scale,
                         float softcap, void* out, int nthreads) {
    const int G = Hq / Hkv;
    const int64_t tasks = T * Hkv;
#pragma omp parallel num_threads(nthreads < 1 ? 1 : nthreads)
    {
        std::vector<float> s;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t t = task / Hkv;
            const int h = (int)(task % Hkv);
            const LayerKV& c = kv_of(t);
            float qf[MAX_G][MAX_D];
            for (int g = 0; g < G; ++g) load_row(q, t * q_row + (int64_t)(h * G + g) * q_head, D, dtype, qf[g]);
            attend_group(qf, G, c.k, h * c.k_head, c.k_slot, c.v, h * c.v_head, c.v_slot, idx + offsets[t],
                         offsets[t + 1] - offsets[t], D, dtype, scale, softcap, s, out, (t * Hq + (int64_t)h * G) * D);
        }
    }
}

// q: element (t, h, d) at q[t * q_row + h * q_head + d]; keys/values: slot i of key head h at
// k[h * k_head + i * k_slot]; out [T][Hq][D].  Returns 0, or a negative code for an unsupported
// shape.  softcap: 0, or Gemma 2's cap of the scores.
extern "C" int ld_attend_rows(const void* q, int64_t q_row, int64_t q_head, const void* k, int64_t k_head,
                              int64_t k_slot, const void* v, int64_t v_head, int64_t v_slot, const int64_t* idx,
                              const int64_t* offsets, int64_t T, int Hq, int Hkv, int D, int dtype, float scale,
                              float softcap, void* out, int nthreads) {
    const int rc = check_attend(T, Hq, Hkv, D, dtype, offsets);
    if (rc) return rc;
    const LayerKV kv = {k, k_head, k_slot, v, v_head, v_slot};
    attend_tasks(q, q_row, q_head, [&kv](int64_t) -> const LayerKV& { return kv; }, idx, offsets, T, Hq, Hkv, D,
                 dtype, scale, softcap, out, nthreads);
    return 0;
}

// RMSNorm of bf16 rows, with the sum of squares in 16 lanes (column mod 16) added in the fixed tree: one
// row's result never depends on the other rows.  One thread: the rows of a decoding step are few and
// short.  As the Llama/Qwen2 decoders define it (ld_rmsnorm_bf16): y = w * bf16(x * rsqrt(mean(x^2) + eps)),
// each product rounded to bf16; as Gemma's (ld_rmsnorm1p_bf16): y = bf16(x * rsqrt(...) * (1 + w)), the
// products in fp32 and rounded once, as transformers' Gemma3RMSNorm computes it in float32.
template <bool PlusOne>
static int rmsnorm_rows(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, float eps,
                        uint16_t* y, int64_t ldy) {
    if (K <= 0 || K % LANES) return -1;
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = x + m * ldx;
        float lanes[LANES] = {0};
        for (int64_t k0 = 0; k0 < K; k0 += LANES)
            for (int l = 0; l < LANES; ++l) {
                const float v = bf16_val(xr[k0 + l]);
                lanes[l] = fmaf(v, v, lanes[l]);
            }
        const float r = 1.0f / sqrtf(tree_sum(lanes) / (float)K + eps);
        uint16_t* yr = y + m * ldy;
        for (int64_t k = 0; k < K; ++k)
            yr[k] = PlusOne ? to_bf16(bf16_val(xr[k]) * r * (1.0f + bf16_val(w[k])))
                            : to_bf16(bf16_val(w[k]) * bf16_val(to_bf16(bf16_val(xr[k]) * r)));
    }
    return 0;
}

extern "C" int ld_rmsnorm_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, float eps,
                               uint16_t* y, int64_t ldy) {
    return rmsnorm_rows<false>(x, M, K, ldx, w, eps, y, ldy);
}

extern "C" int ld_rmsnorm1p_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, float eps,
                                 uint16_t* y, int64_t ldy) {
    return rmsnorm_rows<true>(x, M, K, ldx, w, eps, y, ldy);
}

// Rotary embedding of the new tokens' queries and keys, and the keys' and values' store into the
// cache, in one pass (what Block.rotary_qkv and KVCache.write do with a dozen torch ops):
// qkv [T][Hq*D + 2*Hkv*D] (row stride ld), cos/sin [T][D] in the same dtype; per element
// rope(x)[d] = x[d]*cos[d] + rot(x)[d]*sin[d], rot(x) = (-x[D/2:], x[:D/2]), each product and the
// sum rounded to the dtype as torch's elementwise ops round them.  Queries go to q_out [T][Hq][D];
// keys and values of token t to slot slot0 + t of each key head of the cache.
static inline float round_to(float v, int dtype) { return dtype == 0 ? v : bf16_val(to_bf16(v)); }

static inline float get(const void* p, int64_t i, int dtype) {
    return dtype == 0 ? ((const float*)p)[i] : bf16_val(((const uint16_t*)p)[i]);
}

static inline void put(void* p, int64_t i, float v, int dtype) {
    if (dtype == 0) ((float*)p)[i] = v;
    else ((uint16_t*)p)[i] = to_bf16(v);
}

static void rope_head(const void* x, int64_t xi, const void* cos, const void* sin, int64_t ci, int D, int dtype,
                      void* out, int64_t oi) {
    const int half = D / 2;
    for (int d = 0; d < D; ++d) {
        const float v = get(x, xi + d, dtype);
        const float r = d < half ? -get(x, xi + d + half, dtype) : get(x, xi + d - half, dtype);
        const float a = round_to(v * get(cos, ci + d, dtype), dtype);
        const float b = round_to(r * get(sin, ci + d, dtype), dtype);
        put(out, oi + d, a + b, dtype);
    }
}

extern "C" int ld_rope_store(const void* qkv, int64_t T, int64_t ld, const void* cos, const void* sin, int Hq,
                             int Hkv, int D, int dtype, void* q_out, void* k, int64_t k_head, int64_t k_slot,
                             void* v, int64_t v_head, int64_t v_slot, int64_t slot0) {
    if (D <= 0 || D % 2 || (dtype != 0 && dtype != 1)) return -1;
    const int64_t kbase = (int64_t)Hq * D, vbase = kbase + (int64_t)Hkv * D;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t row = t * ld, ci = t * D;
        for (int h = 0; h < Hq; ++h) rope_head(qkv, row + (int64_t)h * D, cos, sin, ci, D, dtype, q_out, (t * Hq + h) * D);
        for (int h = 0; h < Hkv; ++h) {
            const int64_t ks = h * k_head + (slot0 + t) * k_slot, vs = h * v_head + (slot0 + t) * v_slot;
            rope_head(qkv, row + kbase + (int64_t)h * D, cos, sin, ci, D, dtype, k, ks);
            const int64_t vi = row + vbase + (int64_t)h * D;
            if (dtype == 0) memcpy((float*)v + vs, (const float*)qkv + vi, sizeof(float) * D);
            else memcpy((uint16_t*)v + vs, (const uint16_t*)qkv + vi, sizeof(uint16_t) * D);
        }
    }
    return 0;
}

// Several sequences' new tokens in one call per layer (a batched forward, NativeCausalLM.forward_batch):
// rows seg_start[s] .. seg_start[s+1]-1 of qkv / cos / sin belong to sequence s, whose layer cache
// is described by kv[7 s .. 7 s + 6] = {key address, key head stride, key slot stride, value
// address, value head stride, value slot stride, first new slot} (strides in elements).  Each
// sequence's rows go through exactly ld_rope_store (queries to q_tmp [N][Hq][D]), then every row
// through ld_attend_rows's per-row work over its own cache (idx/offsets: all rows' slot lists, the
// offsets global over the N rows): each token gets the bits it gets in its own sequence's call.
extern "C" int ld_rope_attend_segments(const void* qkv, int64_t N, int64_t ld, const void* cos, const void* sin,
                                       int nseg, const int64_t* seg_start, const int64_t* kv, const int64_t* idx,
                                       const int64_t* offsets, int Hq, int Hkv, int D, int dtype, float scale,
                                       void* q_tmp, void* out, int nthreads) {
    const int bad = check_attend(N, Hq, Hkv, D, dtype, offsets);
    if (bad) return bad;
    if (D % 2) return -1;
    if (nseg < 1 || seg_start[0] != 0 || seg_start[nseg] != N) return -5;
    const size_t esize = dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    std::vector<LayerKV> caches((size_t)nseg);
    std::vector<int> seg_of((size_t)N);
    for (int s = 0; s < nseg; ++s) {
        const int64_t r0 = seg_start[s], r1 = seg_start[s + 1];
        if (r1 < r0) return -5;
        for (int64_t t = r0; t < r1; ++t) seg_of[(size_t)t] = s;
        const int64_t* e = kv + 7 * s;
        caches[(size_t)s] = {(const void*)e[0], e[1], e[2], (const void*)e[3], e[4], e[5]};
        const int rc = ld_rope_store((const char*)qkv + (size_t)(r0 * ld) * esize, r1 - r0, ld,
                                     (const char*)cos + (size_t)(r0 * D) * esize, (const char*)sin + (size_t)(r0 * D) * esize,
                                     Hq, Hkv, D, dtype, (char*)q_tmp + (size_t)(r0 * Hq * D) * esize,
                                     (void*)e[0], e[1], e[2], (void*)e[3], e[4], e[5], e[6]);
        if (rc) return rc;
    }
    attend_tasks(q_tmp, (int64_t)Hq * D, D,
                 [&caches, &seg_of](int64_t t) -> const LayerKV& { return caches[(size_t)seg_of[(size_t)t]]; },
                 idx, offsets, N, Hq, Hkv, D, dtype, scale, 0.f, out, nthreads);
    return 0;
}
