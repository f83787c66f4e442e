// A Llama/Qwen decoder's layers over the new tokens of one sequence (or of several side by side),
// in one call.
//
// Per layer, exactly what NativeCausalLM runs op by op on the kernels' route (models/native.py
// Block.forward with QLinear layers, the invariant attention kernel and a plain KV cache), with
// the same functions and roundings, so the same bits:
//   h    = rmsnorm(x, attn_norm)                        ld_rmsnorm_bf16
//   qkv  = h @ Wqkv.T (+ bias)                          ld_qgemm, per packed part
//   q, k = rmsnorm per head (q_norm, k_norm: Qwen3)       ld_rmsnorm_bf16, in place
//   (Gemma 3: every norm x * (1 + w) (ld_rmsnorm1p_bf16), the attention's and the MLP's outputs normalized
//   before their residual adds (post_attn_norm, post_mlp_norm), GELU-tanh's table in place of SiLU's, its
//   attention scale, and on windowed layers their own rope tables and attended slots (local_*); Gemma 2:
//   its attention scores soft-capped (softcap))
//   q    = rope(q); k, v -> cache slots slot0..         ld_rope_store
//   a    = attention of each row over its slots         ld_attend_rows
//   x    = bf16(x + a @ Wo.T)                           ld_qgemm, then one fp32 add rounded to bf16
//   h    = rmsnorm(x, mlp_norm)
//   g, u = h @ Wgate_up.T                               ld_qgemm
//   x    = bf16(x + bf16(silu(g) * u) @ Wdown.T)         silu from a table of torch's own bf16
//                                                       results (all 65536 inputs), the product
//                                                       rounded once, as torch's bf16 mul
// Run op by op from Python, the same calls made a 1-token forward of qwen2.5-coder-1.5b 56.2 ms
// instead of 43.4 on 2 cores (docs/lab-notes/benchmarks.md section 35).
#include <stdint.h>
#include <string.h>
#include <vector>
#include "bf16.h"
#include "ld_abi.h"
#include "ld_isa.h"  // LD_SIMD: the instruction-set path, decided there for every source
#define LD_LAYERS_AVX2 (LD_SIMD != 0)  // AVX2 instructions (on the AVX-512 path too)

extern "C" int ld_abi_version(void) { return LD_ABI_VERSION; }

extern "C" int64_t ld_abi_sizeof(const char* name) {
    if (!strcmp(name, "LdPart")) return sizeof(LdPart);
    if (!strcmp(name, "LdLinear")) return sizeof(LdLinear);
    if (!strcmp(name, "LdLayer")) return sizeof(LdLayer);
    if (!strcmp(name, "LdStack")) return sizeof(LdStack);
    return -1;
}

static int linear(const LdLinear& w, const uint16_t* x, int64_t T, uint16_t* y, int nthreads, void* work) {
    for (int64_t p = 0; p < w.n_parts; ++p) {
        const LdPart& a = w.parts[p];
        const int rc = ld_qgemm(x, T, w.k, w.k, a.codes, a.scales, a.zeros, a.dsup, a.zsup, (int)a.smode, (int)a.gps,
                                (int)a.bits, (int)a.offset, (int)a.group, a.n, a.bias, y + a.n0, w.padded, 0,
                                nthreads, work);
        if (rc) return rc;
    }
    return 0;
}

#if LD_LAYERS_AVX2
static inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// to_bf16 on 8 lanes (round to nearest even; a NaN keeps its sign and payload's top, made quiet)
static inline void store8(uint16_t* p, __m256 f) {
    const __m256i b = _mm256_castps_si256(f);
    const __m256i hi = _mm256_srli_epi32(b, 16);
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i v = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
#endif

// out[i] = bf16(a[i] + b[i]) for n values (torch's bf16 add: one fp32 sum, rounded); out may be a
static void add_rows(uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n) {
    int64_t i = 0;
#if LD_LAYERS_AVX2
    for (; i + 8 <= n; i += 8) store8(out + i, _mm256_add_ps(load8(a + i), load8(b + i)));
#endif
    for (; i < n; ++i) out[i] = to_bf16(bf16_val(a[i]) + bf16_val(b[i]));
}

// out[i] = bf16(silu(g[i]) * u[i]), silu(g) read from the table
static void silu_mul(const uint16_t* table, const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
    int64_t i = 0;
#if LD_LAYERS_AVX2
    for (; i + 8 <= n; i += 8) {
        // 4 bytes from table + 2 g: the entry in the low half (the table has 2 spare entries)
        const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(g + i)));
        const __m256i s = _mm256_i32gather_epi32((const int*)table, idx, 2);
        const __m256 sf = _mm256_castsi256_ps(_mm256_slli_epi32(s, 16));
        store8(out + i, _mm256_mul_ps(sf, load8(u + i)));
    }
#endif
    for (; i < n; ++i) out[i] = to_bf16(bf16_val(table[g[i]]) * bf16_val(u[i]));
}

// out[t][i] = bf16(silu(g[t][i]) * u[t][i]) for T rows of I values (row stride ld in g and u; out
// contiguous): torch's F.silu(g) * u on bf16 rows, for the op-by-op route (Block.mlp)
extern "C" int ld_silu_mul_bf16(const uint16_t* table, const uint16_t* g, const uint16_t* u, int64_t T, int64_t ld,
                                int64_t I, uint16_t* out) {
    if (T < 0 || I < 0 || ld < I) return -1;
    for (int64_t t = 0; t < T; ++t) silu_mul(table, g + t * ld, u + t * ld, out + t * I, I);
    return 0;
}

static int64_t out_width(const LdLayer& l) { return l.o.padded > l.down.padded ? l.o.padded : l.down.padded; }

// bf16 scratch values ld_decoder_layers needs for layer l and T rows
extern "C" int64_t ld_layers_scratch(const LdStack* s, const LdLayer* l, int64_t T) {
    return T * (s->hidden + l->qkv.padded + 2 * s->hq * s->d + out_width(*l) + l->gate_up.padded + s->inter);
}

// Layers which[0..n) (in that order) over T rows (any number: ld_qgemm runs them in passes of 64):
// x0 ([T][hidden] bf16) is the input, xs[j] ([n][T][hidden]) receives the output of layer
// which[j] (the residual stream after it).  cos/sin: [T][d] bf16; the new tokens' keys and values
// go to slots slot0..slot0+T-1 (or, with segments, each sequence's own slots); row t attends over
// slots idx[offsets[t] .. offsets[t+1]) (KVCache.attended_slots); scratch: `room` bf16 values
// (at least ld_layers_scratch of every layer run); work: ld_qgemm's buffer for every linear
// layer.  Returns 0, -100 for shapes that do not fit, or the first failing call's code.
extern "C" int ld_decoder_layers(const LdStack* s, const LdLayer* layers, const int64_t* which, int64_t n,
                                 const uint16_t* x0, uint16_t* xs, int64_t T, const uint16_t* cos, const uint16_t* sin,
                                 int64_t slot0,
                                 const int64_t* idx, const int64_t* offsets, uint16_t* scratch, int64_t room,
                                 void* work, int nthreads) {
    const int64_t H = s->hidden, I = s->inter, QD = s->hq * s->d;
    std::vector<int64_t> kv((size_t)(7 * (s->nseg > 0 ? s->nseg : 0)));
    auto norm = s->plus_one ? ld_rmsnorm1p_bf16 : ld_rmsnorm_bf16;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t li = which[j];
        const LdLayer& L = layers[li];
        if (L.qkv.k != H || L.o.k != QD || L.gate_up.k != H || L.down.k != I || L.o.padded < H
            || L.down.padded < H || L.gate_up.padded < 2 * I || L.qkv.padded < QD + 2 * s->hkv * s->d
            || ld_layers_scratch(s, &L, T) > room
            || (L.windowed && (s->nseg > 0 || !s->local_cos || !s->local_sin || !s->local_idx || !s->local_offsets)))
            return -100;
        const uint16_t* lcos = L.windowed ? s->local_cos : cos;
        const uint16_t* lsin = L.windowed ? s->local_sin : sin;
        const int64_t* lidx = L.windowed ? s->local_idx : idx;
        const int64_t* loff = L.windowed ? s->local_offsets : offsets;
        uint16_t* h = scratch;
        uint16_t* qkv = h + T * H;
        uint16_t* q = qkv + T * L.qkv.padded;
        uint16_t* att = q + T * QD;
        uint16_t* o = att + T * QD;
        uint16_t* gu = o + T * out_width(L);
        uint16_t* act = gu + T * L.gate_up.padded;
        const uint16_t* x_in = j ? xs + (j - 1) * T * H : x0;
        uint16_t* x = xs + j * T * H;
        int rc = norm(x_in, T, H, H, L.attn_norm, s->eps, h, H);
        if (!rc) rc = linear(L.qkv, h, T, qkv, nthreads, work);
        for (int64_t t = 0; !rc && L.q_norm && t < T; ++t) {
            uint16_t* row = qkv + t * L.qkv.padded;
            rc = norm(row, s->hq, s->d, s->d, L.q_norm, s->eps, row, s->d);
            if (!rc) rc = norm(row + QD, s->hkv, s->d, s->d, L.k_norm, s->eps, row + QD, s->d);
        }
        if (!rc && s->nseg > 0 && s->softcap > 0.f) {
            rc = -100;  // (the batched route has no soft cap: NativeCausalLM runs such a model's items one by one)
        } else if (!rc && s->nseg > 0) {
            for (size_t e = 0; e < kv.size(); ++e) kv[e] = s->seg_kv[e] + li * s->seg_kv_step[e];
            rc = ld_rope_attend_segments(qkv, T, L.qkv.padded, cos, sin, (int)s->nseg, s->seg_start, kv.data(), idx,
                                         offsets, (int)s->hq, (int)s->hkv, (int)s->d, 1, s->scale, q, att, nthreads);
        } else if (!rc) {
            rc = ld_rope_store(qkv, T, L.qkv.padded, lcos, lsin, (int)s->hq, (int)s->hkv, (int)s->d, 1, q,
                               s->k + li * s->k_layer, s->k_head, s->k_slot, s->v + li * s->v_layer, s->v_head,
                               s->v_slot, slot0);
            if (!rc)
                rc = ld_attend_rows(q, QD, s->d, s->k + li * s->k_layer, s->k_head, s->k_slot, s->v + li * s->v_layer,
                                    s->v_head, s->v_slot, lidx, loff, T, (int)s->hq, (int)s->hkv, (int)s->d, 1,
                                    s->scale, s->softcap, att, nthreads);
        }
        if (!rc) rc = linear(L.o, att, T, o, nthreads, work);
        if (!rc && L.post_attn_norm) rc = norm(o, T, H, L.o.padded, L.post_attn_norm, s->eps, o, L.o.padded);
        if (rc) return rc;
        for (int64_t t = 0; t < T; ++t) add_rows(x + t * H, x_in + t * H, o + t * L.o.padded, H);
        rc = norm(x, T, H, H, L.mlp_norm, s->eps, h, H);
        if (!rc) rc = linear(L.gate_up, h, T, gu, nthreads, work);
        if (!rc) rc = ld_silu_mul_bf16(s->silu, gu, gu + I, T, L.gate_up.padded, I, act);
        if (!rc) rc = linear(L.down, act, T, o, nthreads, work);
        if (!rc && L.post_mlp_norm) rc = norm(o, T, H, L.down.padded, L.post_mlp_norm, s->eps, o, L.down.padded);
        if (rc) return rc;
        for (int64_t t = 0; t < T; ++t) add_rows(x + t * H, x + t * H, o + t * L.down.padded, H);
    }
    return 0;
}
