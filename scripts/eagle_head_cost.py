"""Time one EAGLE (or EAGLE-3) head forward of qwen2.5-coder-1.5b's trained head (1 row, 200 keys of context),
in its float weights and on the int8 kernel, with a torch profiler table of each
(docs/benchmarks.md section 20).

    python scripts/eagle_head_cost.py
"""
import time

import torch
from leapdecode.proposers.heads.store import load_head
from leapdecode.proposers.heads.common import int8_copy
import leapdecode
t = leapdecode.load("qwen2.5-coder-1.5b")
head = load_head(("eagle3", "eagle"), t, None)[0]  # the store's or the bundled head
print(type(head), next(head.parameters()).dtype)
h8 = int8_copy(head)
H = 1536
f = torch.randn(1, H, dtype=torch.bfloat16); e = torch.randn(1, H, dtype=torch.bfloat16)
pk = torch.randn(12, 200, 128, dtype=torch.bfloat16)
pos = torch.tensor([200]); mask = torch.ones(1, 201, dtype=torch.bool)
for name, m in (("bf16", head), ("int8", h8)):
    with torch.inference_mode():
        for _ in range(5): m(f, e, pos, pk, pk, mask)
        t0 = time.perf_counter()
        for _ in range(50): m(f, e, pos, pk, pk, mask)
        print(name, (time.perf_counter() - t0) / 50 * 1e3, "ms")
        with torch.profiler.profile() as prof:
            for _ in range(20): m(f, e, pos, pk, pk, mask)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
