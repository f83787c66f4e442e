// The int8 multiply-add peak of each instruction the kernel's products use, and the memory bandwidth,
// measured on this machine (scripts/row_cost.py compiles it with -O3 and runs it, and reports each
// variant's products against them).  Every test runs on `threads` OpenMP threads at once, each on its
// own registers (independent chains, so throughput and not latency is measured), and prints one JSON
// object: multiply-adds a second (a product of one int8 activation and one code byte, summed) and
// bytes a second.
//   vnni512   vpdpbusd zmm: 64 multiply-adds an instruction (the avx512-vnni and amx variants)
//   vnni256   vpdpbusd ymm (AVX-VNNI, VEX): 32 (AVX2 CPUs since Alder Lake / Zen 5; no variant uses it yet)
//   avx2      vpmaddubsw ymm + vpaddw: 32 (the avx2 variant's inner step; it also widens every 8 quads)
//   amx       tdpbsud 16 x 16 x 64: 16384 (the amx variant)
//   read      streaming loads of a buffer far larger than the caches (bytes read a second)
//   copy      memcpy of such a buffer (bytes read plus bytes written a second, as STREAM counts them)
// Usage: isa_peak THREADS FLAGS...   (FLAGS: the tests to run: vnni512 vnni256 avx2 amx read copy)
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static const long ITERS = 20000000;  // instructions' loop trips a thread (each trip: 8 instructions)

static volatile int sink;

// The passes' best time (of 3) of BODY run by every thread at once (id: the thread's number).  A macro,
// not a lambda: the code inherits its function's target attribute (the instruction set it may use).
#define TIMED(threads, result, ...)                          \
    do {                                                     \
        double best_ = 1e30;                                 \
        for (int pass_ = 0; pass_ < 3; ++pass_) {            \
            double t0_ = omp_get_wtime();                    \
            _Pragma("omp parallel num_threads(threads)")     \
            {                                                \
                const int id = omp_get_thread_num();         \
                __VA_ARGS__                                  \
            }                                                \
            double t_ = omp_get_wtime() - t0_;               \
            if (t_ < best_) best_ = t_;                      \
        }                                                    \
        result = best_;                                      \
    } while (0)

// Eight independent chains a[i] = STEP(a[i], b, c) of one vector type V, ITERS / 4 trips a thread (so the
// instruction's throughput, not its latency; unrolled, the chains live in registers), kept alive by `sink`.
#define CHAINS(V, SET8, SET32, STEP)                                            \
    {                                                                           \
        V a[8], b = SET8(3 + id), c = SET8(5);                                  \
        for (int i = 0; i < 8; ++i) a[i] = SET32(i);                            \
        for (long n = 0; n < ITERS / 4; ++n) {                                  \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) a[i] = STEP(a[i], b, c); \
        }                                                                       \
        int s = 0;                                                              \
        for (int i = 0; i < 8; ++i) {                                           \
            int32_t v[sizeof(V) / 4];                                           \
            memcpy(v, &a[i], sizeof(V));                                        \
            s += v[0];                                                          \
        }                                                                       \
        sink = s;                                                               \
    }

// the avx2 variant's step; the empty asm tells the compiler b changed, so that it computes each vpmaddubsw
// (of loop-invariant operands it would hoist it out of the loop and time vpaddw alone; it emits nothing)
#define MADDUBS_ADD(a, b, c)                                                  \
    ({                                                                        \
        const __m256i sum_ = _mm256_add_epi16(a, _mm256_maddubs_epi16(b, c)); \
        asm("" : "+x"(b));                                                    \
        sum_;                                                                 \
    })

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni512(int threads) {
    double t;
    TIMED(threads, t, CHAINS(__m512i, _mm512_set1_epi8, _mm512_set1_epi32, _mm512_dpbusd_epi32));
    return 64.0 * 8 * (ITERS / 4) * threads / t;
}

__attribute__((target("avxvnni"))) static double vnni256(int threads) {
    double t;
    TIMED(threads, t, CHAINS(__m256i, _mm256_set1_epi8, _mm256_set1_epi32, _mm256_dpbusd_avx_epi32));
    return 32.0 * 8 * (ITERS / 4) * threads / t;
}

__attribute__((target("avx2"))) static double avx2(int threads) {
    double t;
    TIMED(threads, t, CHAINS(__m256i, _mm256_set1_epi8, _mm256_set1_epi32, MADDUBS_ADD));
    return 32.0 * 8 * (ITERS / 4) * threads / t;
}

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

alignas(64) static int8_t tiles_in[2][1024];

__attribute__((target("amx-tile,amx-int8"))) static double amx(int threads) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;  // Linux refuses the tiles' state
    const long iters = ITERS / 16;
    double t;
    TIMED(threads, t, {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
        _tile_loadconfig(&cfg);
        _tile_loadd(4, tiles_in[0], 64);
        _tile_loadd(5, tiles_in[1], 64);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (long n = 0; n < iters; ++n) {
            _tile_dpbsud(0, 4, 5);
            _tile_dpbsud(1, 4, 5);
            _tile_dpbsud(2, 4, 5);
            _tile_dpbsud(3, 4, 5);
        }
        alignas(64) int32_t out[256];
        _tile_stored(0, out, 64);
        sink = out[id];
        _tile_release();
    });
    return 16384.0 * 4 * iters * threads / t;
}

static const size_t BYTES = (size_t)1 << 30;  // 1 GiB: far beyond any cache

__attribute__((target("avx2"))) static double read_bw(int threads, uint8_t* buf) {
    double t;
    TIMED(threads, t, {
        const size_t part = BYTES / threads;
        const uint8_t* p = buf + id * part;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t o = 0; o < part; o += 128) {
            a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i*)(p + o)));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i*)(p + o + 32)));
            a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i*)(p + o + 64)));
            a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i*)(p + o + 96)));
        }
        alignas(32) int v[8];
        _mm256_store_si256((__m256i*)v, _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
        sink = v[0];
    });
    return (double)BYTES / t;
}

static double copy_bw(int threads, uint8_t* buf) {
    const size_t half = BYTES / 2;
    double t;
    TIMED(threads, t, {
        const size_t part = half / threads;
        memcpy(buf + half + id * part, buf + id * part, part);
    });
    return 2.0 * half / t;  // read + written
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: isa_peak THREADS TEST...\n");
        return 2;
    }
    const int threads = atoi(argv[1]);
    uint8_t* buf = nullptr;
    printf("{\"threads\": %d", threads);
    for (int i = 2; i < argc; ++i) {
        const char* name = argv[i];
        double v = -1;
        if (!strcmp(name, "vnni512")) v = vnni512(threads);
        else if (!strcmp(name, "vnni256")) v = vnni256(threads);
        else if (!strcmp(name, "avx2")) v = avx2(threads);
        else if (!strcmp(name, "amx")) v = amx(threads);
        else if (!strcmp(name, "read") || !strcmp(name, "copy")) {
            if (!buf) {
                buf = (uint8_t*)aligned_alloc(64, BYTES);
                memset(buf, 1, BYTES);
            }
            v = !strcmp(name, "read") ? read_bw(threads, buf) : copy_bw(threads, buf);
        } else {
            fprintf(stderr, "isa_peak: unknown test %s\n", name);
            return 2;
        }
        printf(", \"%s\": %.4g", name, v);
        fflush(stdout);
    }
    printf("}\n");
    free(buf);
    return 0;
}
