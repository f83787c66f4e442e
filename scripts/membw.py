"""Memory bandwidth as a decoder sees it: a matrix-vector product over a matrix far larger
than the caches (default 1.6 GB), median of several runs, in GB/s read.

    python scripts/membw.py [--gb 1.6] [--threads N]
"""

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.6)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = {"threads": a.threads, "matrix_gb": a.gb}
    for dt in (torch.float32, torch.bfloat16):
        elt = torch.tensor([], dtype=dt).element_size()
        cols = 4096
        rows = int(a.gb * 1e9 / (cols * elt))
        w = torch.randn(rows, cols, dtype=dt)
        x = torch.randn(1, cols, dtype=dt)
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t0)
        out[str(dt).replace("torch.", "") + "_GB_s"] = round(w.numel() * elt / sorted(times)[len(times) // 2] / 1e9, 2)
        del w
    print(json.dumps(out))


if __name__ == "__main__":
    main()
