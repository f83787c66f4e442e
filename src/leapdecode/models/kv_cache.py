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

KV-cache compression (``core/kv_policy.py``, lossy, off by default) adds three things, each
inert when unused:

* ``keep(slots)`` evicts committed tokens: per (layer, kv head) it keeps the given committed
  slots (the same count for every head, so ``length`` stays one number) and gathers them to
  the front, in the order given.  Pending tree nodes are never touched (nothing may be
  pending), so speculation works on a compressed cache as on a full one.
* ``pos_offset``: the number of committed tokens evicted so far.  A token appended later gets
  its true position (``length + pos_offset + depth``): keys are stored after rope, so a kept
  key needs no re-rotation and every query meets every key at their original distance.  These
  are the original positions, not StreamingLLM's positions within the cache: re-rotating the
  kept keys to contiguous in-cache positions would cost a pass over the whole cache per
  eviction, and the models leapdecode serves (Llama/Qwen2 with rope tables as long as their
  context) are never asked for a position beyond the context they were trained on, since a
  generation's true length is bounded by that context anyway.
* ``observer``: when set (a callable ``observer(layer, q, keys)``), the native decoder calls it
  after each layer's cache write with that forward's rope'd queries (``[B, heads, T, D]``) and
  the keys it attends over; the policies that score tokens by attention read the queries there.
  ``None`` (the default, a class attribute) costs one attribute test per layer.

``Int8KVCache`` stores keys and values as int8 with one scale per (token, head) (symmetric
absmax: ``scale = max|x| / 127``), dequantized for attention: 1 byte per element plus 4 bytes
of scale per head and token, about half of bf16.
"""

from __future__ import annotations

import torch


class KVCache:
    observer = None  # observer(layer, q, keys) after each layer's write (see the module docstring)
    pos_offset = 0  # committed tokens evicted so far (``keep``): true position = slot + pos_offset
    static = None  # the forwards captured over this cache's storage (``models/static_step.StaticSteps``)

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
        self._allocate((n_layers, batch_size, n_kv_heads, max_len, head_dim), dtype, device)
        self.max_len = max_len
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.length = 0
        self.max_pending = max_pending
        self._parents: list[int] = []
        self._depths: list[int] = []
        # ancestor-or-self relation among pending nodes, on the cache's device
        self._anc = torch.zeros(max_pending, max_pending, dtype=torch.bool, device=device)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def _storage(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds per-slot data (slot dimension 3): moved together."""
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's storage (all slots, in use or not)."""
        return sum(t.numel() * t.element_size() for t in self._storage())

    @property
    def bytes_per_slot(self) -> int:
        return self.nbytes // self.max_len

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
        base = self.length + self.pos_offset  # the true position of the first pending slot
        positions = torch.tensor(
            [base + d for d in self._depths[start:]], dtype=torch.long, device=self.device
        )
        if chain:
            return positions, None
        mask = torch.ones(n_new, self.total, dtype=torch.bool, device=self.device)
        mask[:, self.length :] = self._anc[start : start + n_new, : start + n_new]
        return positions, mask

    def ancestors(self, n_new: int) -> torch.Tensor:
        """For each of the newest ``n_new`` pending nodes, which pending nodes it attends to (its
        ancestors and itself): ``[n_new, n_pending]`` bool on the cache's device."""
        n = self.n_pending
        return self._anc[n - n_new : n, :n]

    def attended_slots(self, n_new: int, window: int | None = None) -> list[torch.Tensor]:
        """For each of the newest ``n_new`` pending nodes, the slots it attends to, in cache
        order: the committed prefix, then its pending ancestors from the root down, itself last
        (``[n]`` long tensors on the cache's device).  Same nodes, same slots: whether a node is
        appended alone or inside a tree, its list is the same.  ``window``: only the slots of the
        last ``window`` positions up to the node's own (a sliding-window layer's)."""
        start = self.n_pending - n_new
        if not 0 <= start < self.n_pending:
            raise ValueError(f"{n_new} new nodes, but {self.n_pending} pending")
        if window is not None and self.pos_offset:
            raise ValueError("a sliding window needs a cache whose slots are the positions (no KV-cache policy)")
        out = []
        for node in range(start, self.n_pending):
            chain, j = [], node
            while j >= 0:
                chain.append(self.length + j)
                j = self._parents[j]
            first = 0 if window is None else self.length + self._depths[node] - window + 1  # oldest position seen
            prefix = list(range(max(first, 0), self.length))
            chain = [c for c in chain if window is None or self.length + self._depths[c - self.length] >= first]
            out.append(torch.tensor(prefix + chain[::-1], dtype=torch.long, device=self.device))
        return out

    def slot_positions(self) -> torch.Tensor:
        """The position of every slot in use (committed, then pending: its depth after the committed ones)."""
        base = self.length + self.pos_offset
        return torch.cat([torch.arange(self.length, device=self.device) + self.pos_offset,
                          torch.tensor(self._depths, dtype=torch.long, device=self.device) + base])

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
            for t in self._storage():
                t.index_copy_(3, d_idx, t.index_select(3, s_idx))
        self.length += len(path)
        self._clear_pending()

    def reserve_pending(self, n: int) -> None:
        """Room for at least ``n`` pending nodes at once (grows the ancestor table, an ``n x n``
        bool matrix; nothing pending is lost).  A search that keeps many hypotheses as pending
        tree nodes asks for its tree's size here."""
        if n <= self.max_pending:
            return
        anc = torch.zeros(n, n, dtype=torch.bool, device=self.device)
        m = self.n_pending
        anc[:m, :m] = self._anc[:m, :m]
        self._anc = anc
        self.max_pending = n

    def prune_pending(self, slots: list[int], commit: int = 0) -> list[int]:
        """Keep the pending nodes ``slots`` (ascending pending indices, closed under parents: a
        kept node's parent is kept, or it is a root) and drop every other one; the first ``commit``
        kept nodes, a chain from a root of which every other kept node descends, become committed
        tokens.  The kept nodes' keys and values move down, in order, to the slots after the
        committed ones (nodes already in place copy nothing); the rest keep their tree: parents
        renumbered (a child of the last committed node becomes a root), depths shortened by
        ``commit``, so every token keeps its position and attends to the same keys in the same
        order as before.  Returns, for each old pending index, its new pending index (-1: dropped
        or committed)."""
        n = self.n_pending
        slots = list(slots)
        if any(not 0 <= s < n for s in slots) or any(a >= b for a, b in zip(slots, slots[1:])):
            raise ValueError(f"slots to keep must be ascending pending indices < {n}, got {slots}")
        if not 0 <= commit <= len(slots):
            raise ValueError(f"cannot commit {commit} of {len(slots)} kept nodes")
        kept = set(slots)
        for s in slots:
            p = self._parents[s]
            if p >= 0 and p not in kept:
                raise ValueError(f"kept pending node {s} has a dropped parent {p}")
        prev = -1
        for s in slots[:commit]:
            if self._parents[s] != prev:
                raise ValueError(f"the first {commit} kept nodes {slots[:commit]} are not a chain from a root")
            prev = s
        mapping = [-1] * n
        rest = slots[commit:]
        for j, s in enumerate(rest):
            mapping[s] = j
        if commit:
            for s in rest:  # every remaining node must descend from the committed chain's end
                j = s
                while j >= 0 and j != prev:
                    j = self._parents[j]
                if j != prev:
                    raise ValueError(f"kept pending node {s} does not descend from the committed chain")
        src = [self.length + s for s in slots]
        dst = list(range(self.length, self.length + len(slots)))
        if src != dst:
            moved = [(a, b) for a, b in zip(src, dst) if a != b]
            s_idx = torch.tensor([a for a, _ in moved], device=self.device)
            d_idx = torch.tensor([b for _, b in moved], device=self.device)
            for t in self._storage():  # index_select first: sources may overlap destinations
                t.index_copy_(3, d_idx, t.index_select(3, s_idx))
        parents = [-1 if self._parents[s] == prev or self._parents[s] < 0 else mapping[self._parents[s]]
                   for s in rest]
        depths = [self._depths[s] - commit for s in rest]
        if rest:
            idx = torch.tensor(rest, device=self.device)
            anc = self._anc.index_select(0, idx).index_select(1, idx)
            self._anc[: len(rest), : len(rest)] = anc
        self.length += commit
        self._parents[:] = parents
        self._depths[:] = depths
        return mapping

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
        if self.observer is not None or self.pos_offset:
            self.observer = None
            self.pos_offset = 0

    # ------------------------------------------------------------ compression
    def layer_kv(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, end)`` of one layer (``[B, H, n, D]``; default: the
        committed slots), as attention sees them."""
        end = self.length if end is None else end
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def keep(self, slots: torch.Tensor) -> None:
        """Evict committed tokens: keep, per (layer, kv head), the committed slots ``slots``
        (``[layers, kv_heads, n]``, or ``[n]`` for the same slots everywhere; long, on the
        cache's device) and gather them to slots ``[0, n)`` in the order given.  Nothing may be
        pending.  ``pos_offset`` grows by the number evicted, so later tokens keep their true
        positions."""
        if self.n_pending:
            raise ValueError("cannot evict while tree nodes are pending")
        storage = self._storage()
        layers, _, heads = storage[0].shape[:3]
        if slots.dim() == 1:
            slots = slots.view(1, 1, -1).expand(layers, heads, -1)
        n = slots.shape[-1]
        if slots.shape != (layers, heads, n):
            raise ValueError(f"slots of shape {tuple(slots.shape)}; want [{layers}, {heads}, n] or [n]")
        if n > self.length or (n and (int(slots.min()) < 0 or int(slots.max()) >= self.length)):
            raise ValueError(f"slots to keep must be {n} <= {self.length} committed slots")
        b = storage[0].shape[1]
        for t in storage:
            idx = slots[:, None, :, :, None].expand(layers, b, heads, n, t.shape[4])
            t[:, :, :, :n] = t[:, :, :, : self.length].gather(3, idx)
        self.pos_offset += self.length - n
        self.length = n

    def _clear_pending(self) -> None:
        self._parents.clear()
        self._depths.clear()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dimension: ``(q, scale)`` with ``x ~ q * scale``,
    ``scale = max|x| / 127`` (fp32, last dimension 1); an all-zero row gets scale 1."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8KVCache(KVCache):
    """A ``KVCache`` whose keys and values are stored as int8 with an fp32 scale per (token, kv
    head), dequantized to the model's dtype for attention (lossy: the round-trip error of an
    element is at most half its row's scale, ``max|x| / 254``).  Batch size 1 only (the runner
    hands out one-row caches); ``k``/``v`` do not exist here: read ``layer_kv``."""

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype = dtype
        self.kq = torch.zeros(shape, dtype=torch.int8, device=device)
        self.vq = torch.zeros(shape, dtype=torch.int8, device=device)
        self.ks = torch.ones(shape[:-1] + (1,), dtype=torch.float32, device=device)
        self.vs = torch.ones(shape[:-1] + (1,), dtype=torch.float32, device=device)

    def _storage(self) -> tuple[torch.Tensor, ...]:
        return self.kq, self.vq, self.ks, self.vs

    def split_slots(self) -> list["KVCache"]:
        raise NotImplementedError("an int8 KV cache has one row; acquire one per sequence")

    def _dequantized(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = (self.kq[layer, :, :, :end].float() * self.ks[layer, :, :, :end]).to(self.dtype)
        v = (self.vq[layer, :, :, :end].float() * self.vs[layer, :, :, :end]).to(self.dtype)
        return k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        end = self.total
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int8(v)
        self.kq[layer, :, :, end - t : end] = kq
        self.ks[layer, :, :, end - t : end] = ks
        self.vq[layer, :, :, end - t : end] = vq
        self.vs[layer, :, :, end - t : end] = vs
        return self._dequantized(layer, end)

    def layer_kv(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dequantized(layer, self.length if end is None else end)

    def committed_slice(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"slots [{start}, {stop}) are not committed (length {self.length})")
        ks = [self._dequantized(layer, stop) for layer in range(self.kq.shape[0])]
        k = torch.stack([a[:, :, start:] for a, _ in ks])
        v = torch.stack([b[:, :, start:] for _, b in ks])
        return k, v

    def append_committed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[3]
        if self.n_pending:
            raise ValueError("cannot append committed tokens while tree nodes are pending")
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {n} tokens > capacity {self.max_len}")
        s = slice(self.length, self.length + n)
        self.kq[:, :, :, s], self.ks[:, :, :, s] = quantize_int8(k)
        self.vq[:, :, :, s], self.vs[:, :, :, s] = quantize_int8(v)
        self.length += n


CACHE_KINDS = {"plain": KVCache, "int8": Int8KVCache}


def cache_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          kind: str = "plain") -> int:
    """Bytes one token takes in a cache of ``kind`` (all layers, keys and values)."""
    if kind == "int8":
        return n_layers * 2 * n_kv_heads * (head_dim + 4)
    return n_layers * 2 * n_kv_heads * head_dim * dtype.itemsize
