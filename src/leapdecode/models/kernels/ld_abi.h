// The kernel library's ABI, declared once: every function the library exports and every struct they
// take.  Each kernel source includes this header, so the compiler checks every definition against it,
// and models/kernel_abi.py derives the Python binding (ctypes argument types and structures) from this
// text at load, so nothing is written twice.  Change anything here: raise LD_ABI_VERSION (the binding
// refuses a library whose ld_abi_version() differs).
//
// Written in the small subset kernel_abi.py reads: structs of plain members, prototypes of one line each
// or continued over lines up to the ";", types int, int64_t, float, void, pointers, and the structs here.
#pragma once
#include <stdint.h>

#define LD_ABI_VERSION 2

#ifdef __cplusplus
extern "C" {
#endif

// One packed weight part, as ld_qgemm takes it (models/qkernel.py QPart.pointers), its rows'
// bias (or null) and its first output column.
struct LdPart {
    const uint8_t* codes;
    const void* scales;
    const void* zeros;
    const void* dsup;
    const void* zsup;
    const float* bias;
    int64_t smode, gps, bits, offset, group, n, n0;
};

// A QLinear: its parts side by side in rows of `padded` outputs; k inputs.
struct LdLinear {
    const LdPart* parts;
    int64_t n_parts, k, padded;
};

struct LdLayer {
    LdLinear qkv, o, gate_up, down;
    const uint16_t* attn_norm;
    const uint16_t* mlp_norm;
    const uint16_t* q_norm;  // [d] each, or null: no per-head norm of q and k
    const uint16_t* k_norm;
    const uint16_t* post_attn_norm;  // [hidden] each, or null (Gemma 3's norms of the attention's and MLP's outputs)
    const uint16_t* post_mlp_norm;
    int64_t windowed;  // 1: a sliding-window layer (the stack's local_* rope tables and slots)
};

// What every layer shares, and this call's cache: layer l's keys of head h, slot i at
// k + l * k_layer + h * k_head + i * k_slot (bf16 elements), the same for values.  Or, with
// nseg > 0, the rows of nseg sequences side by side (a batched forward: NativeCausalLM.forward_batch),
// rows seg_start[s] .. seg_start[s+1]-1 being sequence s's, each on its own cache: for layer l,
// ld_rope_attend_segments's table kv[7 s + e] = seg_kv[7 s + e] + l * seg_kv_step[7 s + e].
struct LdStack {
    int64_t hidden, inter, hq, hkv, d;
    float eps, scale;
    const uint16_t* silu;  // silu(bf16 x) for every bit pattern x, as torch rounds it (65536 + 2 entries)
    uint16_t* k;
    int64_t k_layer, k_head, k_slot;
    uint16_t* v;
    int64_t v_layer, v_head, v_slot;
    int64_t nseg;
    const int64_t* seg_start;
    const int64_t* seg_kv;
    const int64_t* seg_kv_step;
    int64_t plus_one;  // every norm x * (1 + w) (Gemma)
    const uint16_t* local_cos;  // the windowed layers' rope tables [T][d] and attended slots (as cos, idx, offsets)
    const uint16_t* local_sin;
    const int64_t* local_idx;
    const int64_t* local_offsets;
    float softcap;  // 0, or the cap of the attention's scores (Gemma 2)
};

// the ABI's version (LD_ABI_VERSION), the SIMD path compiled in (1: AVX512-VNNI, 2: AVX2, 3: AVX2 with
// AVX-VNNI, 0: portable),
// whether products of several rows take AMX tiles (1: an AMX build on a CPU and kernel that allow
// them), and sizeof a struct above by name (-1: none such), for the binding's checks
int ld_abi_version(void);
int ld_simd(void);
int ld_amx(void);
int64_t ld_abi_sizeof(const char* name);

// qgemm.cpp: block-quantized products and dequantization
int64_t ld_work_bytes(int64_t K, int group);
int ld_qgemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes, const void* scales,
             const void* zeros, const void* dsup, const void* zsup, int smode, int gps, int bits, int offset, int group,
             int64_t N, const float* bias, void* y, int64_t ldy, int out_fp32, int nthreads, void* work);
int ld_qdequant(const uint8_t* codes, const void* scales, const void* zeros, const void* dsup, const void* zsup,
                int smode, int gps, int bits, int offset, int group, int64_t N, int64_t K, float* out, int nthreads);
int ld_qdequant_bf16(const uint8_t* codes, const void* scales, const void* zeros, const void* dsup, const void* zsup,
                     int smode, int gps, int bits, int offset, int group, int64_t N, int64_t K, uint16_t* out,
                     int nthreads);

// attention.cpp: the invariant attention, norms and rope
int ld_attend_rows(const void* q, int64_t q_row, int64_t q_head, const void* k, int64_t k_head, int64_t k_slot,
                   const void* v, int64_t v_head, int64_t v_slot, const int64_t* idx, const int64_t* offsets, int64_t T,
                   int Hq, int Hkv, int D, int dtype, float scale, float softcap, void* out, int nthreads);
int ld_rmsnorm_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, float eps, uint16_t* y,
                    int64_t ldy);
int ld_rmsnorm1p_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, float eps, uint16_t* y,
                      int64_t ldy);
int ld_rope_store(const void* qkv, int64_t T, int64_t ld, const void* cos, const void* sin, int Hq, int Hkv, int D,
                  int dtype, void* q_out, void* k, int64_t k_head, int64_t k_slot, void* v, int64_t v_head,
                  int64_t v_slot, int64_t slot0);
int ld_rope_attend_segments(const void* qkv, int64_t N, int64_t ld, const void* cos, const void* sin, int nseg,
                            const int64_t* seg_start, const int64_t* kv, const int64_t* idx, const int64_t* offsets,
                            int Hq, int Hkv, int D, int dtype, float scale, void* q_tmp, void* out, int nthreads);

// layers.cpp: a decoder's layers in one call
int ld_silu_mul_bf16(const uint16_t* table, const uint16_t* g, const uint16_t* u, int64_t T, int64_t ld, int64_t I,
                     uint16_t* out);
int64_t ld_layers_scratch(const LdStack* s, const LdLayer* l, int64_t T);
int ld_decoder_layers(const LdStack* s, const LdLayer* layers, const int64_t* which, int64_t n, const uint16_t* x0,
                      uint16_t* xs, int64_t T, const uint16_t* cos, const uint16_t* sin, int64_t slot0,
                      const int64_t* idx, const int64_t* offsets, uint16_t* scratch, int64_t room, void* work,
                      int nthreads);

#ifdef __cplusplus
}
#endif
