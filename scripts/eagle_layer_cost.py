"""What one EAGLE draft-layer call costs right after a target forward (the weights then come from
memory, as in decoding), on the torch route (``DraftKV``) and the kernels' route
(``KernelDraftKV``), for the bundled EAGLE-3 head of qwen2.5-coder-1.5b on int8 and int4 weights
(docs/benchmarks.md section 36): one new decided position after 200 committed ones (``feed``),
then a tree level of 4 nodes (``level``); median and min ms of ``--rounds`` rounds, and the
largest difference between the two routes' outputs (of the 200-row feed that builds the context,
and of the timed calls).

    python scripts/eagle_layer_cost.py [--rounds 30]
"""

import argparse
import statistics
import time

import torch

import leapdecode
from leapdecode.models.kv_cache import KVCache
from leapdecode.proposers.heads.common import quantized_copy
from leapdecode.proposers.heads.eagle import DraftKV, KernelDraftKV
from leapdecode.proposers.heads.store import load_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    loaded = leapdecode.load("qwen2.5-coder-1.5b")
    model, cfg = loaded.model, loaded.model.cfg
    head = load_head(("eagle3", "eagle"), loaded, None)[0]
    dtype, cpu, hidden = next(head.parameters()).dtype, torch.device("cpu"), cfg.hidden_size
    cache = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 2048, dtype=torch.bfloat16)
    times: dict = {}
    diffs: dict = {}
    torch.manual_seed(0)
    with torch.inference_mode():
        model.forward(torch.randint(0, 1000, (1, 200)), cache, logits_for=slice(-1, None))
        cache.commit()
        for kind in ("int8", "int4"):
            net = quantized_copy(head, kind)
            feats, emb = torch.randn(201, hidden).to(dtype), (torch.randn(201, hidden) * 0.02).to(dtype)
            routes = {"torch": DraftKV(net, dtype, cpu), "kernel": KernelDraftKV.of(net, dtype, cpu)}
            first = [kv.feed(feats[:200], emb[:200], torch.arange(200)) for kv in routes.values()]
            diffs[kind, "feed, 200 rows"] = float((first[0].float() - first[1].float()).abs().max())
            for _ in range(a.rounds):
                outs = {}
                for name, kv in routes.items():
                    model.forward(torch.tensor([[5]]), cache)  # evicts the head's weights from the caches
                    cache.rollback()
                    t0 = time.perf_counter()
                    o1 = kv.feed(feats[200:], emb[200:], torch.tensor([200]))
                    t1 = time.perf_counter()
                    o2 = kv.level(feats[:4], emb[:4], torch.tensor([201] * 4), [[0], [1], [2], [3]])
                    t2 = time.perf_counter()
                    kv.drop_pending()
                    times.setdefault((kind, name, "feed, 1 row"), []).append(t1 - t0)
                    times.setdefault((kind, name, "level, 4 rows"), []).append(t2 - t1)
                    outs[name] = (o1, o2)
                    if isinstance(kv, KernelDraftKV):  # take the fed position back: every round alike
                        kv.n -= 1
                    else:
                        kv.k, kv.v = kv.k[:, :-1], kv.v[:, :-1]
                diffs[kind, "timed calls"] = max(diffs.get((kind, "timed calls"), 0.0),
                                                 *(float((x.float() - y.float()).abs().max())
                                                   for x, y in zip(outs["torch"], outs["kernel"])))
    print("| head weights | route | call | median ms | min ms |")
    print("|---|---|---|---:|---:|")
    for (kind, route, call), v in times.items():
        print(f"| {kind} | {route} | {call} | {statistics.median(v) * 1e3:.2f} | {min(v) * 1e3:.2f} |")
    for (kind, calls), v in diffs.items():
        print(f"{kind}, {calls}: largest |kernel - torch| output difference {v:.4g}")


if __name__ == "__main__":
    main()
