"""Speculative decoding by prompt lookup (n-gram): draft tokens copied from the sequence itself.

When an output copies its input (editing, summarising, quoting, code changes), the tokens that
follow a sequence's last few tokens are often those that followed the same tokens earlier in
its prompt or output. `NgramProposer` finds the latest earlier occurrence of the sequence's
longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens and proposes the
`num_speculative_tokens` tokens that followed it (fewer where the sequence ends first).

The scheduler gives those drafts to the decode step, which computes the sequence's last token
and its drafts in one forward pass and samples the target model at each of the k + 1
positions, exactly as it would sample the next token (penalties and seeds count the drafts
before a position as generated). `num_accepted` keeps the longest prefix of drafts that the
target sampled too; the engine appends them and the target's token after them (the bonus).

A draft is one fixed token, so this is the rejection-sampling rule of speculative decoding
with a point-mass draft distribution: draft d is kept with probability p(d), and a rejected
position holds a token drawn from p without d, renormalised, so every token follows the target
distribution. Greedy rows give the tokens they give without speculation, as do seeded rows
(their random numbers depend on the token's index only).

Pure Python over token lists; tensors stay in the runner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class NgramProposer:
    """Drafts by prompt lookup; the settings are `EngineConfig`'s of the same names."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """At most `min(num_speculative_tokens, max_drafts)` tokens that followed the latest
        earlier occurrence of the longest suffix of `token_ids` that occurs earlier; [] when
        no suffix of at least `prompt_lookup_min` tokens does."""
        k = min(self.num_speculative_tokens, max_drafts)
        if k <= 0 or len(token_ids) <= self.prompt_lookup_min:
            return []
        end = _longest_earlier_match(token_ids, self.prompt_lookup_min, self.prompt_lookup_max)
        return [] if end is None else token_ids[end : end + k]


def _longest_earlier_match(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The index just past the latest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens, or None. Occurrences may overlap the suffix itself."""
    last = len(tokens) - 1
    limit = min(max_n, last)  # an occurrence ending at j < last has at most j + 1 <= last tokens
    best_end, best_n = None, min_n - 1
    for j in reversed(_positions(tokens, tokens[last], last)):  # latest first
        n = 1
        while n < limit and n <= j and tokens[j - n] == tokens[last - n]:
            n += 1
        if n > best_n:
            best_end, best_n = j + 1, n
            if n == limit:
                break
    return best_end


def _positions(tokens: list[int], value: int, end: int) -> list[int]:
    """Indices i < end with tokens[i] == value, ascending (list.index scans in C)."""
    found: list[int] = []
    i = -1
    while True:
        try:
            i = tokens.index(value, i + 1, end)
        except ValueError:
            return found
        found.append(i)


def num_accepted(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """Drafts kept: the longest prefix of the drafts equal to the tokens the target sampled at
    the same positions (`sampled_token_ids` holds one more: the target's after the last draft)."""
    n = 0
    while n < len(draft_token_ids) and draft_token_ids[n] == sampled_token_ids[n]:
        n += 1
    return n


@dataclass(slots=True)
class SpeculationStats:
    """Counters of the drafts verified since the engine started."""

    num_verifications: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_drafts: int, accepted: int) -> None:
        self.num_verifications += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
