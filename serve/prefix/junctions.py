"""The adaptive checkpoint policy's junctions: where a prompt leaves a prefix that other requests share (found
by plain token comparison for requests being computed, by the block index and its tails for what is cached),
and the indexing that lets the next prompt find them."""

from __future__ import annotations

from typing import Any

from serve.prefix.types import Sequence_

INTERVAL_SHARE = 6  # chosen on the chat, docqa and agentic workloads of `bench prefix --simulate`


def adaptive_interval(finest: int, states: float, prompt_len: int) -> int:
    """The adaptive policy's interval for a prompt: `finest` doubled until the prompt's interval checkpoints
    take at most 1 / INTERVAL_SHARE of the `states` the budgets hold. They are speculative (most are never
    resumed from), and at a finer spacing than the budget affords they crowd out the ones that are: the
    result is then the same whichever finer spacing is given."""
    interval = finest
    while prompt_len > states / INTERVAL_SHARE * interval and interval < 1 << 30:
        interval *= 2
    return interval


def common_prefix(a: list[int], b: list[int], step: int = 1024) -> int:
    """Length of the longest common prefix of two token lists (compared a slice at a time)."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


def shared_prefix(
    seq: Sequence_, computing: list[Sequence_], block_size: int, prompt_end_logits: bool
) -> tuple[Sequence_, int] | None:
    """The request in `computing` (running, still prefilling its prompt) whose prompt shares the longest
    prefix with `seq`'s, at least a block, that it has not computed yet: (it, the shared length; one short of
    `seq`'s prompt unless the two prompts are the same and `prompt_end_logits`, the prompt end keeping its
    logits). `seq` can wait for that request's checkpoint there instead of computing the prefix again."""
    best, prompt = None, seq.prompt
    for other in computing:
        if other.cache_salt != seq.cache_salt or other.num_computed >= len(other.prompt):
            continue
        shared = common_prefix(prompt, other.prompt)
        identical = shared == len(prompt) == len(other.prompt) and prompt_end_logits
        shared = shared if identical else min(shared, len(prompt) - 1)  # else one token makes the logits
        if shared >= block_size and other.num_computed < shared and (best is None or shared > best[1]):
            best = (other, shared)
    return best


def index_blocks(seq: Sequence_, hasher: Any, blocks: Any, tails: Any) -> None:
    """Index `seq`'s full blocks computed since the last call (`BlockIndex`), and remember each block's
    tokens as a tail of the one before it (`TailIndex`), so a prompt leaving this sequence inside a block
    finds the exact token. The chain hashes are kept on the sequence (`seq.chain`): a sequence of L tokens
    hashes each of its blocks once, not its whole chain at every block boundary."""
    bs, start = hasher.block_size, seq.indexed_blocks
    nb = seq.num_computed // bs
    if nb <= start:
        return
    tokens = seq.tokens
    chain = hasher.extend(seq.chain, tokens, seq.cache_salt, nb)
    blocks.register(chain, seq.blocks[start:nb], first=start + 1, tokens=tokens)
    for i in range(start, nb):
        tails.add(chain[i], tuple(tokens[i * bs : (i + 1) * bs]))
    seq.indexed_blocks = nb
