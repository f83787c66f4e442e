"""Static, preallocated KV cache that understands token trees.

The cache holds two regions:

* committed tokens, slots ``[0, length)``: the accepted sequence;
* pending tokens, slots ``[length, length + n_pending)``: nodes of a token tree
  appended by one or more forwards since the last commit.  Each pending node has
  a parent among the pending nodes (or ``-1``: it follows the committed
  sequence), so its position is ``length + depth`` and it attends to the
  committed tokens plus its own ancestors.

``commit(path)`` keeps a root-to-node chain of pending nodes and drops the rest.
Only the kept nodes' keys/values move (to slots ``length .. length+len(path)``);
a chain that is already in place (the usual case for a linear draft) copies
nothing.  ``rollback`` is just dropping pending nodes: no copy at all.

The tensors have a batch (slot) dimension (``[layers, batch, kv_heads, max_len,
head_dim]``).  Tree bookkeeping is per cache: all rows of one cache share one tree
shape.  ``split_slots()`` turns a cache of ``batch`` rows into ``batch`` one-row
caches over the same storage, each with its own length and tree: independent
sequences in one allocation (the runner hands one slot to each generation in
flight; a batched scheduler can run several slots in one forward).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_pending: int = 256,
    ) -> None:
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.length = 0
        self.max_pending = max_pending
        self._parents: list[int] = []
        self._depths: list[int] = []
        # ancestor-or-self relation among pending nodes, on the cache's device
        self._anc = torch.zeros(max_pending, max_pending, dtype=torch.bool, device=device)

    def split_slots(self) -> list["KVCache"]:
        """One-row caches over this cache's storage, one per batch row (views, no copy)."""
        out = []
        for i in range(self.batch_size):
            c = KVCache.__new__(KVCache)
            c.k, c.v = self.k[:, i : i + 1], self.v[:, i : i + 1]
            c.max_len, c.batch_size, c.device = self.max_len, 1, self.device
            c.length, c.max_pending = 0, self.max_pending
            c._parents, c._depths = [], []
            c._anc = torch.zeros_like(self._anc)
            out.append(c)
        return out

    # ----------------------------------------------------------------- queries
    @property
    def n_pending(self) -> int:
        return len(self._parents)

    @property
    def total(self) -> int:
        """Committed plus pending slots in use."""
        return self.length + len(self._parents)

    def room(self) -> int:
        return self.max_len - self.total

    # -------------------------------------------------------------- appending
    def plan_append(
        self, parents: list[int] | None, n_new: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Register ``n_new`` pending nodes and return (positions, attention mask).

        ``parents[i]`` indexes the *pending* nodes (earlier ones, or new ones that
        come before ``i``); ``-1`` attaches to the committed sequence.  ``None``
        means a chain continuing the last pending node (or the committed end).
        The mask is ``[n_new, total_after]`` bool (True = may attend), or
        ``None`` when plain causal attention over everything is exact (a chain
        with no branching pending tokens), which lets attention skip the mask.
        """
        if n_new < 1:
            raise ValueError("append needs at least one token")
        start = self.n_pending
        if self.total + n_new > self.max_len:
            raise ValueError(
                f"KV cache full: {self.total} + {n_new} tokens > capacity {self.max_len}"
            )
        if start + n_new > self.max_pending:
            raise ValueError(
                f"too many pending tree nodes: {start + n_new} > {self.max_pending}"
            )
        chain = parents is None
        if chain:
            parents = [start + i - 1 if start + i > 0 else -1 for i in range(n_new)]
            # a plain chain after a plain chain of pending tokens is causal
            chain = all(p == i - 1 for i, p in enumerate(self._parents))
        elif len(parents) != n_new:
            raise ValueError(f"{len(parents)} parents for {n_new} tokens")
        for i, p in enumerate(parents):  # validate all before registering any
            if not -1 <= p < start + i:
                raise ValueError(f"parent {p} of pending node {start + i} is not an earlier node")
        for p in parents:
            self._parents.append(p)
            self._depths.append(0 if p < 0 else self._depths[p] + 1)
        # ancestor rows of the new nodes, built on CPU then moved in one copy
        anc = torch.zeros(n_new, start + n_new, dtype=torch.bool)
        old = self._anc[:start, :start].cpu() if start else None
        for i, p in enumerate(parents):
            node = start + i
            if p >= 0:
                if p < start:
                    anc[i, :start] = old[p]
                else:
                    anc[i] = anc[p - start]
            anc[i, node] = True
        self._anc[start : start + n_new, : start + n_new] = anc.to(self.device)
        positions = torch.tensor(
            [self.length + d for d in self._depths[start:]], dtype=torch.long, device=self.device
        )
        if chain:
            return positions, None
        mask = torch.ones(n_new, self.total, dtype=torch.bool, device=self.device)
        mask[:, self.length :] = self._anc[start : start + n_new, : start + n_new]
        return positions, mask

    def attended_slots(self, n_new: int) -> list[torch.Tensor]:
        """For each of the newest ``n_new`` pending nodes, the slots it attends to, in cache
        order: the committed prefix, then its pending ancestors from the root down, itself last
        (``[n]`` long tensors on the cache's device).  Same nodes, same slots: whether a node is
        appended alone or inside a tree, its list is the same."""
        start = self.n_pending - n_new
        if not 0 <= start < self.n_pending:
            raise ValueError(f"{n_new} new nodes, but {self.n_pending} pending")
        prefix = list(range(self.length))
        out = []
        for node in range(start, self.n_pending):
            chain, j = [], node
            while j >= 0:
                chain.append(self.length + j)
                j = self._parents[j]
            out.append(torch.tensor(prefix + chain[::-1], dtype=torch.long, device=self.device))
        return out

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the newest ``T`` pending keys/values of one layer (``[B, H, T, D]``).

        Must follow ``plan_append`` for the same ``T``.  Returns views of all
        slots in use, for attention.
        """
        t = k.shape[2]
        end = self.total
        self.k[layer, :, :, end - t : end] = k
        self.v[layer, :, :, end - t : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def committed_slice(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of committed slots ``[start, stop)``, all layers."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"slots [{start}, {stop}) are not committed (length {self.length})")
        return self.k[:, :, :, start:stop].clone(), self.v[:, :, :, start:stop].clone()

    def append_committed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append keys and values (``[layers, batch, kv_heads, n, head_dim]``, e.g. from
        ``committed_slice``) as committed tokens; nothing may be pending."""
        n = k.shape[3]
        if self.n_pending:
            raise ValueError("cannot append committed tokens while tree nodes are pending")
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {n} tokens > capacity {self.max_len}")
        self.k[:, :, :, self.length : self.length + n] = k
        self.v[:, :, :, self.length : self.length + n] = v
        self.length += n

    # ------------------------------------------------------ commit / rollback
    def commit(self, path: list[int] | None = None) -> None:
        """Keep pending nodes ``path`` (a chain from a root) and drop all others.

        ``None`` keeps every pending node, which must then form a chain.
        """
        n = self.n_pending
        if path is None:
            path = list(range(n))
        prev = -1
        for node in path:
            if not 0 <= node < n or self._parents[node] != prev:
                raise ValueError(f"commit path {path} is not a chain of pending nodes")
            prev = node
        src = [self.length + node for node in path]
        dst = list(range(self.length, self.length + len(path)))
        if src != dst:
            moved = [(s, d) for s, d in zip(src, dst) if s != d]
            s_idx = torch.tensor([s for s, _ in moved], device=self.device)
            d_idx = torch.tensor([d for _, d in moved], device=self.device)
            # index_select first: sources may overlap destinations
            self.k.index_copy_(3, d_idx, self.k.index_select(3, s_idx))
            self.v.index_copy_(3, d_idx, self.v.index_select(3, s_idx))
        self.length += len(path)
        self._clear_pending()

    def rollback(self) -> None:
        """Drop every pending node."""
        self._clear_pending()

    def truncate(self, length: int) -> None:
        """Forget committed tokens from ``length`` on (e.g. to re-run a suffix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
        self._clear_pending()

    def reset(self) -> None:
        self.length = 0
        self._clear_pending()

    def _clear_pending(self) -> None:
        self._parents.clear()
        self._depths.clear()
