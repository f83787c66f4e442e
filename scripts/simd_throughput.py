"""How many AVX2 vector instructions per cycle this machine retires: independent chains of
``vpmaddubsw`` (the block kernel's int8 products on AVX2), ``vpaddw`` (its int16 sums), the two
interleaved, and ``vfmadd231ps``, timed against a dependent scalar-add loop that measures the
clock.  A virtual machine whose cores share their vector units with other guests shows it here
(a Zen 4 core retires up to 4 vector integer adds and 2 multiply-adds per cycle).  Compiles a
small C++ program with the system compiler (g++) into a temporary directory.

    python scripts/simd_throughput.py --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <chrono>
#include <stdio.h>
static double ns_of(void (*f)(long), long n) {
    auto t0 = std::chrono::steady_clock::now();
    f(n);
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
}
#define CLOBBER : : : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
    "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define EIGHT(op) op " %%ymm15,%%ymm0,%%ymm0\n\t" op " %%ymm15,%%ymm1,%%ymm1\n\t" op " %%ymm15,%%ymm2,%%ymm2\n\t" \
    op " %%ymm15,%%ymm3,%%ymm3\n\t" op " %%ymm15,%%ymm4,%%ymm4\n\t" op " %%ymm15,%%ymm5,%%ymm5\n\t"            \
    op " %%ymm15,%%ymm6,%%ymm6\n\t" op " %%ymm15,%%ymm7,%%ymm7\n\t"
static void clock_loop(long n) { long x = 0; for (long i = 0; i < n; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x)); }
static void maddubs(long n) { for (long i = 0; i < n; ++i) asm volatile(EIGHT("vpmaddubsw") CLOBBER); }
static void paddw(long n) { for (long i = 0; i < n; ++i) asm volatile(EIGHT("vpaddw") CLOBBER); }
static void fma(long n) { for (long i = 0; i < n; ++i) asm volatile(EIGHT("vfmadd231ps") CLOBBER); }
static void mixed(long n) {
    for (long i = 0; i < n; ++i)
        asm volatile("vpmaddubsw %%ymm15,%%ymm0,%%ymm8\n\tvpaddw %%ymm8,%%ymm1,%%ymm1\n\t"
                     "vpmaddubsw %%ymm15,%%ymm2,%%ymm9\n\tvpaddw %%ymm9,%%ymm3,%%ymm3\n\t"
                     "vpmaddubsw %%ymm15,%%ymm4,%%ymm10\n\tvpaddw %%ymm10,%%ymm5,%%ymm5\n\t"
                     "vpmaddubsw %%ymm15,%%ymm6,%%ymm11\n\tvpaddw %%ymm11,%%ymm7,%%ymm7\n\t" CLOBBER);
}
int main() {
    const long n = 50000000;
    const double ghz = 4.0 * n / ns_of(clock_loop, n);
    printf("clock %.2f GHz\n", ghz);
    struct { const char* name; void (*f)(long); } tests[] = {
        {"vpmaddubsw", maddubs}, {"vpaddw", paddw}, {"vpmaddubsw + vpaddw", mixed}, {"vfmadd231ps", fma}};
    for (auto& t : tests) printf("%s: %.2f per cycle\n", t.name, 8.0 * n / ns_of(t.f, n) / ghz);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "simd.cpp", Path(d) / "simd"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-mavx2", "-mfma", str(src), "-o", str(exe)], check=True)
        for r in range(a.rounds):
            print(f"round {r + 1}:", subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
                  .strip().replace("\n", "; "))


if __name__ == "__main__":
    main()
