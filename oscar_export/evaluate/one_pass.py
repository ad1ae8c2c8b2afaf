"""One forward per sequence with the stored values of a chunked run.

A chunk's queries read the sink, the recent window and the chunk itself at fp16, and the body as
the codes the cache holds. Which positions are body depends only on where the query's chunk starts,
and a position's stored value only on its own K/V (KIVI: on its block), so a whole sequence can be
attended in one forward with the same stored values as feeding it chunk by chunk: the evaluation
runs one forward per sequence instead of one per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import OscarInputError
from ..hf_cache import route_attention


@dataclass
class SequenceKV:
    """A cache's view of a whole sequence: queries in the space it attends in, the fp16 value of every
    position (`window`) and, where the cache quantizes, the value its body holds (`body`, [Hkv, T, D])."""

    q: torch.Tensor
    window: dict[str, torch.Tensor]
    body: dict[str, torch.Tensor] | None = None
    sink: int = 0
    unrotate: Callable[[torch.Tensor], torch.Tensor] = lambda out: out


def one_pass_attention(seq: SequenceKV, body_end: torch.Tensor, scaling: float, block: int = 512) -> torch.Tensor:
    """Causal GQA attention [Hq, T, D] where query p reads position t from the body when
    sink <= t < body_end[p], else its fp16 value. Per block of queries, positions whose choice varies
    inside the block appear twice (fp16 and body), each masked to the queries that read it."""
    q, k, v = seq.q, seq.window["k"], seq.window["v"]
    tokens = q.shape[1]
    if seq.body is None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scaling,
                                              enable_gqa=True)[0]
    out = torch.empty_like(q)
    for a in range(0, tokens, block):
        b = min(a + block, tokens)
        ends = body_end[a:b]
        # Positions sink..lo-1 are body for every query here; none reads past b - 1.
        lo, hi = min(int(ends.min()), b), min(int(ends.max()), b)
        s = min(seq.sink, lo)
        keys = [torch.cat([x[:, :s], seq.body[kind][:, s:lo], x[:, lo:b], seq.body[kind][:, lo:hi]], 1)
                for kind, x in (("k", k), ("v", v))]
        pos = torch.arange(b)
        query = torch.arange(a, b)[:, None]
        allowed = pos[None, :] <= query  # causal
        allowed[:, lo:] &= pos[None, lo:] >= ends[:, None]  # fp16 copies of the varying positions
        extra = (pos[None, lo:hi] < ends[:, None]) & (pos[None, lo:hi] <= query)
        mask = torch.cat([allowed, extra], 1)
        out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], keys[0][None], keys[1][None], attn_mask=mask,
                                                     scale=scaling, enable_gqa=True)[0]
    return out


class OnePass:
    """route_attention target: each layer's attention over the whole sequence at once, equal to feeding
    the sequence to `cache` in the chunks `bounds` (first chunk bounds[0])."""

    def __init__(self, cache, bounds: list[tuple[int, int]]):
        self.cache, self.bounds = cache, bounds
        self.tokens = bounds[-1][1]
        self.body_end = torch.zeros(self.tokens, dtype=torch.long)
        if hasattr(cache, "body_end"):
            for n0, n1 in bounds:
                self.body_end[n0:n1] = cache.body_end(n0)

    def attend(self, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
        if q.shape[1] != self.tokens:
            raise OscarInputError(f"q has {q.shape[1]} tokens: expected the whole sequence of {self.tokens}")
        seq = self.cache.sequence(layer, q, k, v, self.bounds[0][1])
        scale = self.cache.head_dim**-0.5 if scaling is None else scaling
        return seq.unrotate(one_pass_attention(seq, self.body_end, scale))


def chunk_bounds(total: int, chunk: int, first: int | None = None) -> list[tuple[int, int]]:
    """[(n0, n1)] covering 0..total: a first chunk of `first` tokens (default `chunk`), then `chunk` each."""
    if chunk <= 0 or (first is not None and first <= 0):
        raise OscarInputError(f"chunk={chunk}, first chunk={first}: expected positive token counts")
    bounds, n0 = [], 0
    step = first or chunk
    while n0 < total:
        n1 = min(n0 + step, total)
        bounds.append((n0, n1))
        n0, step = n1, chunk
    return bounds


@torch.no_grad()
def one_pass_logits(model, ids: torch.Tensor, cache, chunk: int, first: int | None = None,
                    keep_last: int | None = None) -> torch.Tensor:
    """Logits [T, V] of 1-D `ids` (of the last `keep_last` positions only, when given), attended through
    `cache` as when fed to it in chunks of `chunk` tokens after a first chunk of `first`, in one forward."""
    ids = ids.reshape(-1)
    n = ids.shape[0]
    kwargs = {} if keep_last is None else {"logits_to_keep": keep_last}
    with route_attention(model, OnePass(cache, chunk_bounds(n, chunk, first))):
        out = model(input_ids=ids[None], position_ids=torch.arange(n)[None], use_cache=False, **kwargs)
    return out.logits[0].float()
