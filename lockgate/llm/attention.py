"""The boundary between the engine and the model: flat tensors that describe one step.

The runner (`llm/runner.py`) builds an `AttentionMetadata` from scheduled sequences; the
model (`llm/models/`) reads it to write new keys and values into the paged KV cache and to
attend over each sequence's blocks. Neither side sees the other's types.

Shapes (T = tokens scheduled this step, S = sequences this step):
- input_ids, positions: [T] int64, sequences laid end to end, each sequence's tokens in order
- slot_mapping: [T] int64, block_id * block_size + offset where each new token's K/V goes
- query_start_loc: [S + 1] int64, cumulative query lengths (query_start_loc[0] == 0)
- seq_lens: [S] int64, context length of each sequence after this step's tokens
- block_tables: [S, max_blocks] int64, each sequence's block ids, padded with 0
- logits_indices: [N] int64, indices into T whose hidden states need logits
  (the last token of each sequence that finishes its prompt or decodes, and each draft token
  a decode verifies after it: speculative decoding runs those sequences with 1 + k queries)

The KV cache of one layer is a pair of tensors [num_blocks, block_size, n_kv_heads, head_dim].

The second half of this module is the paged attention itself: `plan_attention` turns the
metadata into per-step index tensors once, and `paged_attention` runs one layer with them.
Decoding sequences are attended in batched SDPA calls over keys padded to the longest context
of the batch; when contexts differ widely, the plan splits them (by length) into a few
batches whenever that saves at least `MIN_PADDING_SAVED` padded key positions per split.
Prompts and chunks are attended one SDPA call each (a chunk after a context over its gathered
blocks, with a mask), or all at once by the prefill kernel (`prefill_kernel.py`), in place.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockgate.errors import BadRequest
from lockgate.llm.decode_kernel import DecodeKernel
from lockgate.llm.prefill_kernel import PrefillKernel, PrefillSegments

MIN_PADDING_SAVED = 512  # key positions a split of the decode batch must save (~ one call)
MAX_DECODE_BATCHES = 4


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies of the small per-sequence vectors, to avoid tensor->list syncs in Python loops.
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)


KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)


@dataclass(slots=True)
class DecodeBatch:
    """Sequences whose query is one token, attended in one batched SDPA call."""

    token_idx: torch.Tensor | None  # [Sd] rows of T; None when every token decodes, in order
    block_ids: torch.Tensor  # [Sd * nb] each sequence's blocks, trimmed to the longest context
    num_blocks: int  # nb
    key_len: int  # keys attended per sequence: nb * block_size, or the common length
    mask: torch.Tensor | None  # [Sd, 1, 1, key_len] True where a key position is < seq_len;
    # None when every sequence has key_len keys, or when the kernel attends (it needs none)
    tables: torch.Tensor  # [Sd, nb] the same blocks, a row per sequence (contiguous)
    seq_lens: torch.Tensor  # [Sd] int64 context length of each sequence


@dataclass(slots=True)
class PrefillSegment:
    """One sequence whose query is several tokens: a whole prompt or one chunk of it."""

    start: int  # first row in T
    end: int  # one past the last row in T
    context_len: int  # tokens already in the cache before this chunk
    seq_len: int  # context_len + query length
    block_ids: torch.Tensor  # [nb] blocks holding positions 0..seq_len-1
    mask: torch.Tensor | None  # [q, seq_len] offset-causal; None when context_len == 0 or
    # when the prefill kernel attends (it needs none)


@dataclass(slots=True)
class AttentionPlan:
    """Index tensors derived once per step from `AttentionMetadata`, shared by every layer."""

    num_tokens: int
    block_size: int
    decodes: list[DecodeBatch]  # sequences with one query token, grouped by context length
    prefills: list[PrefillSegment]
    # attends the decodes in place (`decode_kernel.py`); chosen at load for the model's shapes
    kernel: DecodeKernel | None = None
    # attends every prefill segment in place, in one call (`prefill_kernel.py`), when set
    prefill_kernel: PrefillKernel | None = None
    segments: PrefillSegments | None = None  # the prefills, as the prefill kernel reads them


def plan_attention(
    meta: AttentionMetadata,
    kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> AttentionPlan:
    """Check the metadata and split the step into decode batches and prefill segments. With
    `kernel`, the decodes are one batch: the kernel reads each context as long as it is, so
    grouping by length saves nothing. With `prefill_kernel`, the segments need no masks."""
    _check_metadata(meta)
    starts = [0]
    for q in meta.query_lens_list:
        starts.append(starts[-1] + q)
    decode_rows = [i for i, q in enumerate(meta.query_lens_list) if q == 1]
    prefill_rows = [i for i, q in enumerate(meta.query_lens_list) if q > 1]
    masked = prefill_kernel is None
    prefills = [_prefill_segment(meta, i, starts[i], masked) for i in prefill_rows]
    if kernel is not None:
        groups = [decode_rows] if decode_rows else []
    else:
        groups = _group_by_length(meta, decode_rows)
    decodes = [_decode_batch(meta, rows, starts, kernel is None) for rows in groups]
    segments = None
    if prefill_kernel is not None and prefills:
        segments = _prefill_segments(meta, prefill_rows, prefills)
    return AttentionPlan(
        starts[-1], meta.block_size, decodes, prefills, kernel, prefill_kernel, segments
    )


def _group_by_length(meta: AttentionMetadata, rows: list[int]) -> list[list[int]]:
    """Decode rows in groups of similar context length, keeping the original order when one
    group is best (padding of a group = its size times its longest context)."""
    if not rows:
        return []
    order = sorted(rows, key=lambda i: meta.seq_lens_list[i])
    lens = [meta.seq_lens_list[i] for i in order]  # ascending
    cuts = [len(order)]  # group boundaries, from the end
    while len(cuts) < MAX_DECODE_BATCHES:
        cut = _best_split(lens[: cuts[-1]])
        if cut is None:
            break
        cuts.append(cut)
    if len(cuts) == 1:
        return [rows]
    bounds = [0, *reversed(cuts)]
    return [order[a:b] for a, b in itertools.pairwise(bounds)]


def _best_split(lens: list[int]) -> int | None:
    """The cut i of ascending `lens` into [:i] and [i:] that saves the most padding, if it
    saves at least MIN_PADDING_SAVED key positions."""
    n, whole = len(lens), len(lens) * lens[-1]
    best, best_cost = None, whole - MIN_PADDING_SAVED
    for i in range(1, n):
        cost = i * lens[i - 1] + (n - i) * lens[-1]
        if cost <= best_cost:
            best, best_cost = i, cost
    return best


def _check_metadata(meta: AttentionMetadata) -> None:
    if len(meta.query_lens_list) != len(meta.seq_lens_list):
        raise BadRequest("attention metadata: query_lens_list and seq_lens_list differ in length")
    if meta.block_size <= 0:
        raise BadRequest(f"attention metadata: block_size must be > 0, got {meta.block_size}")
    if meta.slot_mapping.shape[0] != meta.num_tokens:
        raise BadRequest(
            f"attention metadata: {meta.slot_mapping.shape[0]} slots for {meta.num_tokens} tokens"
        )
    max_context = meta.block_tables.shape[1] * meta.block_size if meta.num_seqs else 0
    for q, s in zip(meta.query_lens_list, meta.seq_lens_list, strict=True):
        if q <= 0 or s < q:
            raise BadRequest(f"attention metadata: query length {q} with sequence length {s}")
        if s > max_context:
            raise BadRequest(f"attention metadata: sequence length {s} exceeds its block table")


def _decode_batch(
    meta: AttentionMetadata, rows: list[int], starts: list[int], masked: bool = True
) -> DecodeBatch:
    """`masked`: build the mask SDPA needs over keys padded to the longest context."""
    seq_lens = [meta.seq_lens_list[i] for i in rows]
    longest = max(seq_lens)
    num_blocks = -(-longest // meta.block_size)
    everything = rows == list(range(meta.num_seqs))
    tables = meta.block_tables[:, :num_blocks]
    if not everything:
        tables = tables.index_select(0, torch.tensor(rows, dtype=torch.long))
    tables = tables.contiguous()  # read by the kernel in every layer
    token_idx = None if everything else torch.tensor([starts[i] for i in rows], dtype=torch.long)
    lens = torch.tensor(seq_lens, dtype=torch.long)
    block_ids = tables.reshape(-1)
    if min(seq_lens) == longest or not masked:  # contexts equal (slice the keys), or kernel
        return DecodeBatch(token_idx, block_ids, num_blocks, longest, None, tables, lens)
    key_pos = torch.arange(num_blocks * meta.block_size)
    mask = key_pos[None, :] < lens[:, None]  # [Sd, L]
    length = num_blocks * meta.block_size
    return DecodeBatch(token_idx, block_ids, num_blocks, length, mask[:, None, None], tables, lens)


def _prefill_segment(
    meta: AttentionMetadata, i: int, start: int, masked: bool = True
) -> PrefillSegment:
    """`masked`: build the offset-causal mask SDPA needs for a chunk after a context."""
    q, s = meta.query_lens_list[i], meta.seq_lens_list[i]
    context = s - q
    block_ids = meta.block_tables[i, : -(-s // meta.block_size)].contiguous()
    mask = None
    if context and masked:
        # query i sits at position context + i and sees keys 0..context + i
        mask = torch.arange(s)[None, :] <= (torch.arange(q) + context)[:, None]  # [q, s]
    return PrefillSegment(start, start + q, context, s, block_ids, mask)


def _prefill_segments(
    meta: AttentionMetadata, rows: list[int], prefills: list[PrefillSegment]
) -> PrefillSegments:
    """The prefill rows' segments as the kernel reads them, tables trimmed to the longest."""
    width = -(-max(seg.seq_len for seg in prefills) // meta.block_size)
    tables = meta.block_tables[:, :width]
    if len(rows) != meta.num_seqs:
        tables = tables.index_select(0, torch.tensor(rows, dtype=torch.long))
    return PrefillSegments.of(
        [seg.start for seg in prefills],
        [seg.end - seg.start for seg in prefills],
        [seg.context_len for seg in prefills],
        tables,
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store this step's keys and values ([T, kvh, d]) at their slots in one layer's cache."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Attention of this step's queries over each sequence's cached context.

    q: [T, nh, d]; k, v: [T, kvh, d], already written to the cache. Returns [T, nh * d].
    """
    decodes = plan.decodes
    kernel = plan.kernel
    if len(decodes) == 1 and not plan.prefills and decodes[0].token_idx is None:
        return _attend_decode(q, k_cache, v_cache, decodes[0], plan.block_size, kernel)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for batch in decodes:
        rows = batch.token_idx
        assert rows is not None
        query = q.index_select(0, rows)
        dec = _attend_decode(query, k_cache, v_cache, batch, plan.block_size, kernel)
        out.index_copy_(0, rows, dec)
    if plan.prefill_kernel is not None and plan.segments is not None:
        # in place: every segment's rows of out in one call, no gather, no mask
        plan.prefill_kernel(q, k_cache, v_cache, plan.segments, out)
        return out
    for seg in plan.prefills:
        out[seg.start : seg.end] = _attend_prefill(q, k, v, k_cache, v_cache, seg)
    return out


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, kvh, d], block_ids [n] -> [n * block_size, kvh, d]."""
    nb, bs, kvh, d = cache.shape
    return cache.view(nb, bs * kvh * d).index_select(0, block_ids).view(-1, kvh, d)


def _attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    bs: int,
    kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    if kernel is not None:  # in place: no gather, no padding, no mask
        return kernel(q, k_cache, v_cache, batch.tables, batch.seq_lens)
    # q: [Sd, nh, d]; grouped-query heads become query rows of their KV head: [Sd, kvh, g, d]
    sd, nh, d = q.shape
    kvh = k_cache.shape[2]
    length = batch.num_blocks * bs
    keys = gather_blocks(k_cache, batch.block_ids).view(sd, length, kvh, d)
    values = gather_blocks(v_cache, batch.block_ids).view(sd, length, kvh, d)
    keys = keys[:, : batch.key_len].transpose(1, 2)  # [Sd, kvh, L, d]
    values = values[:, : batch.key_len].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(sd, kvh, nh // kvh, d), keys, values, batch.mask)
    return out.reshape(sd, nh * d)


def _attend_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
) -> torch.Tensor:
    # 4-D inputs throughout: SDPA's fused CPU kernels take [B, heads, len, d] only
    nh, d = q.shape[1], q.shape[2]
    query = q[seg.start : seg.end].transpose(0, 1)[None]  # [1, nh, q, d]
    if seg.mask is None:
        # a whole prompt: its keys are exactly this step's, causal from position 0
        keys = k[seg.start : seg.end].transpose(0, 1)[None]  # [1, kvh, q, d]
        values = v[seg.start : seg.end].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
    else:
        keys = gather_blocks(k_cache, seg.block_ids)[: seg.seq_len].transpose(0, 1)[None]
        values = gather_blocks(v_cache, seg.block_ids)[: seg.seq_len].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(query, keys, values, seg.mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(-1, nh * d)  # [q, nh * d]
