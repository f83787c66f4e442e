"""``ssd``: Self Speculative Decoding, exact with respect to ``stepwise`` (one token per step).

"Self Speculative Decoding for Diffusion Large Language Models" (Gao et al., 2025).  The model is
its own drafter: one forward predicts every masked position, and the stepwise order of the
block's masked positions (most confident first) with their greedy tokens is a draft of the next
``max_draft`` stepwise steps.  The draft is verified in a single batched forward over a
hierarchical chain of nodes, node ``k`` being the canvas with the first ``k`` draft tokens
committed: draft ``k`` (k >= 1) is accepted when the stepwise choice at node ``k`` (computed from
that node's own logits) is the same position with the same token, and acceptance stops at the
first mismatch.  The first draft token is always right (it is the stepwise choice at the current
canvas), so each forward commits at least one token, and the accepted node's logits, already
computed, give the next draft.  The output is stepwise decoding's, token for token, in fewer
forwards.  (The paper's code was not public when this was written; this follows its description:
self-drafting over multiple positions, hierarchical verification in one forward, lossless.)

Exactness needs each node's logits to be the bits a stepwise forward of that canvas gives:
``rowwise`` (default) runs the batch row by row; with ``rowwise=False`` it is one batched call,
exact only where the network's batched forward is batch-invariant.
"""

from __future__ import annotations


from .common import Canvas, Counter, Greedy, ranked_masked
from .configs import SsdConfig


def decode(canvas: Canvas, fwd: Counter, cfg: SsdConfig, stats: dict | None = None) -> None:
    pred = Greedy.of(fwd.predict(canvas.x)[0], canvas.mask_id)
    accepted_hist: list[int] = []
    for start, end in canvas.blocks():
        if canvas.done():
            break
        while True:
            order = ranked_masked(pred.confidence, canvas.masked(start, end))
            if order.numel() == 0:
                break
            draft = order[: cfg.max_draft]
            nodes = canvas.x.unsqueeze(0).repeat(draft.numel(), 1)
            for k in range(draft.numel()):  # node k holds drafts 0..k
                nodes[k:, draft[k]] = pred.tokens[draft[k]]
            # a node that completes the answer needs no logits
            live = [k for k in range(nodes.shape[0]) if not canvas.done(nodes[k])]
            logits = fwd.predict(nodes[live], rowwise=cfg.rowwise) if live else None
            node_pred = {k: Greedy.of(logits[i], canvas.mask_id) for i, k in enumerate(live)}
            m = 0  # drafts accepted beyond the first
            while m + 1 < draft.numel() and m in node_pred:
                p = node_pred[m]
                choice = ranked_masked(p.confidence, canvas.masked(start, end, nodes[m]))[0]
                nxt = draft[m + 1]
                if int(choice) != int(nxt) or int(p.tokens[choice]) != int(pred.tokens[nxt]):
                    break
                m += 1
            canvas.x = nodes[m]
            accepted_hist.append(m + 1)
            if m not in node_pred:  # the answer is complete
                break
            pred = node_pred[m]
    if stats is not None:
        stats["accepted_per_forward"] = accepted_hist
