"""Where a static step's time goes on a GPU: the graph replay alone against the whole forward
(host work: plan, padding, copies), for 1 and 16 rows; then the kernels of one replay.

    python scripts/static_step_profile.py MODEL_DIR
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import leapdecode  # noqa: E402


def med(fn, n=30):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[3:]) * 1e3


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("model_dir", help="a model directory (scripts/gpu_check.py saves one with random weights)")
args = parser.parse_args()
lm = leapdecode.load(args.model_dir, device="cuda", dtype="bfloat16", backend="native", weights="bf16")
m = lm.model
m.static_steps = "graphs"
cache = m.new_cache(max_len=2048)
m.forward(torch.arange(300, 556, device="cuda")[None], cache, logits_for=slice(0, 0))
cache.commit()
for t in (1, 16):
    toks = torch.arange(300, 300 + t, device="cuda")[None]

    def whole():
        m.forward(toks, cache)
        cache.rollback()

    whole()
    g = next(v for k, v in cache.static.graphs.items() if k[0] == t)
    print(f"rows {t}: whole forward {med(whole):.3f} ms, replay alone {med(g.graph.replay):.3f} ms", flush=True)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

g = next(v for k, v in cache.static.graphs.items() if k[0] == 1)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        g.graph.replay()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
