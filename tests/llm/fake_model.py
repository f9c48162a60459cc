"""A tiny deterministic causal LM over the paged KV cache, for engine and runner tests.

It stores each token id as its "key" and its position as its "value". The next token after
position p is a function of the whole context read back from the cache through the block
table, so a wrong slot_mapping, block table, prefix-cache hit or recompute changes the output
(or trips the position check).
"""

from __future__ import annotations

import torch

from lockgate.llm.attention import AttentionMetadata, KVCache

VOCAB = 101


def next_token(context: list[int]) -> int:
    """The token the fake model predicts after `context` (pure Python reference)."""
    acc = sum(t * (j + 1) for j, t in enumerate(context))
    return (acc + 7 * len(context)) % VOCAB


class FakeModel:
    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size
        self.num_forward_calls = 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCache,
    ) -> torch.Tensor:
        self.num_forward_calls += 1
        k_cache, v_cache = kv_caches[0]  # [num_blocks, block_size, 1, 1]
        k_cache.view(-1).index_copy_(0, meta.slot_mapping, input_ids.float())
        v_cache.view(-1).index_copy_(0, meta.slot_mapping, positions.float())
        hidden = torch.empty(input_ids.shape[0], 1)  # [T, 1]
        starts = meta.query_start_loc.tolist()
        for i, (q, s) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
            blocks = meta.block_tables[i, : -(-s // meta.block_size)]
            keys = k_cache[blocks].reshape(-1)[:s]  # [s] token ids of the context
            stored_pos = v_cache[blocks].reshape(-1)[:s]
            if not torch.equal(stored_pos, torch.arange(s, dtype=torch.float32)):
                raise AssertionError(f"sequence {i}: cache positions {stored_pos.tolist()}")
            hidden[starts[i] : starts[i] + q, 0] = self.predict(keys, q)
        return hidden

    def predict(self, keys: torch.Tensor, q: int) -> torch.Tensor:
        """The next token after each of the last `q` prefixes of the context `keys` ([s] token
        ids read back from the cache): [q] floats."""
        s = keys.shape[0]
        weights = torch.arange(1, s + 1, dtype=torch.float64)
        acc = torch.cumsum(keys.double() * weights, 0)  # [s]
        lengths = torch.arange(1, s + 1, dtype=torch.float64)
        preds = torch.remainder(acc + 7 * lengths, self.vocab_size)  # [s]
        return preds[s - q :].float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, 1] -> [N, V], peaked at the predicted token, falling off with distance
        vocab = torch.arange(self.vocab_size, dtype=torch.float32)
        distance = torch.remainder(vocab[None, :] - hidden, self.vocab_size)  # [N, V]
        return -0.5 * torch.minimum(distance, self.vocab_size - distance)


class LetterDecoder:
    """Token t is the letter chr(97 + t % 26)."""

    def add(self, token_id: int) -> str:
        return chr(97 + token_id % 26)

    def flush(self) -> str:
        return ""


def allocate_kv_cache(num_blocks: int, block_size: int) -> KVCache:
    shape = (num_blocks, block_size, 1, 1)
    return [(torch.full(shape, -1.0), torch.full(shape, -1.0))]
