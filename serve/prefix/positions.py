"""Where the prefix store checkpoints a sequence (the store's decisions; `serve.prefix.writer` takes the
checkpoints): every `interval` tokens (with the adaptive policy the interval the budgets afford, and the
junctions where a prompt leaves what is cached or what a running request shares), at prompt and sequence
ends, or, with an offline placement, at its positions and nowhere else. A prefill chunk ends on the next such
position (`chunk_limit`), so the state there exists to be copied."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from serve.prefix import junctions
from serve.prefix.lookup import Hit
from serve.prefix.types import CheckpointKind, CheckpointSource, Sequence_
from serve.prefix.writer import CheckpointWriter


class CheckpointPositions:
    """The checkpoint policy of one store. `interval`: the spacing (the finest one with `adaptive`);
    `states`: how many states the memory budgets hold (what the adaptive spacing is fitted to);
    `prompt_end` / `sequence_end`: checkpoints there too; `placement`: an offline placement
    (`serve.prefix.placement.Placement`) that replaces the policy; `writer`: takes the checkpoints decided."""

    def __init__(
        self,
        *,
        interval: int,
        adaptive: bool,
        states: float,
        block_size: int,
        prompt_end: bool,
        sequence_end: bool,
        placement: Any,
        writer: CheckpointWriter,
    ):
        self.interval, self.adaptive, self.states, self.block_size = interval, adaptive, states, block_size
        self.prompt_end, self.sequence_end, self.placement = prompt_end, sequence_end, placement
        self.writer = writer

    def chunk_limit(self, seq: Sequence_) -> int:
        """Tokens a prefill of `seq` may compute before its next checkpoint position (an interval multiple,
        or a junction the adaptive policy cut it at)."""
        position, interval = seq.num_computed, self.spacing(seq)
        limit = (position // interval + 1) * interval - position
        for cut in seq.cuts:
            if cut > position:
                limit = min(limit, cut - position)
        return limit

    def spacing(self, seq: Sequence_) -> int:
        """The interval `seq` is checkpointed at: `interval`, or with the adaptive policy
        `junctions.adaptive_interval` (what the budgets afford, at that spacing or coarser)."""
        if not self.adaptive:
            return self.interval
        return junctions.adaptive_interval(self.interval, self.states, len(seq.prompt))

    def on_computed(self, seq: Sequence_, source: CheckpointSource, logits: Any = None) -> None:
        """After `seq` computed up to seq.num_computed: checkpoints due there (interval multiples and the
        prompt end, where the next-token `logits` are kept so an identical prompt needs no prefill; with the
        adaptive policy also junctions, and its full blocks are indexed as they are computed, so a prompt
        that shares them finds where it leaves them)."""
        pos = seq.num_computed
        if self.placement is not None:
            self._on_placed(seq, source, logits)
            return
        at_prompt_end = self.prompt_end and pos == len(seq.prompt)
        keep = logits if at_prompt_end else None
        if self.adaptive and (pos <= len(seq.prompt) or pos % self.block_size == 0):
            self.writer.index_blocks(seq)  # also where a checkpoint is due: its blocks' tails find junctions
        if pos % self.spacing(seq) == 0:
            self.writer.write(seq, source, CheckpointKind.INTERVAL, logits=keep)
        elif at_prompt_end:
            self.writer.write(seq, source, CheckpointKind.PROMPT_END, logits=keep)
        elif pos in seq.cuts:
            self.writer.write(seq, source, CheckpointKind.JUNCTION)
        seq.cuts.discard(pos)

    def _on_placed(self, seq: Sequence_, source: CheckpointSource, logits: Any) -> None:
        """With an offline placement: a checkpoint where it places one (cut in the prompt at admission,
        tested in the answer), keeping the logits at a prompt end."""
        pos, end, placement = seq.num_computed, len(seq.prompt), self.placement
        if pos in seq.cuts or (pos > end and placement.at(pos) and placement.holds(seq.tokens, pos)):
            kind = CheckpointKind.PROMPT_END if pos == end else CheckpointKind.JUNCTION
            self.writer.write(seq, source, kind, logits=logits if pos == end else None)
        seq.cuts.discard(pos)

    def on_finished(self, seq: Sequence_, source: CheckpointSource) -> None:
        """A sequence ended normally: index its blocks, and keep its end state (sequence-end checkpoints)."""
        self.writer.write(seq, source, CheckpointKind.SEQUENCE_END, save_state=self.sequence_end)

    # --- the adaptive policy's junctions -----------------------------------------------------------------
    def junction(self, seq: Sequence_, hit: Hit) -> int | None:
        """Where `seq` leaves the KV the store holds beyond the state it resumes from (the adaptive policy
        checkpoints it there, so the next prompt that leaves at the same point resumes there); None if
        nowhere or not adaptive. With an offline placement, its positions in the prompt are cut instead."""
        if self.placement is not None:
            seq.cuts.update(p for p in self.placement.positions(seq.prompt) if p > hit.hit)
            return None
        if not self.adaptive or hit.matched <= hit.hit or hit.matched >= len(seq.prompt):
            return None
        return hit.matched

    def shared_prefix(self, seq: Sequence_, computing: list[Sequence_]) -> tuple[Sequence_, int] | None:
        """The running request `seq` should wait for (in-batch sharing, adaptive policy or an offline
        placement, at its deepest position in the shared part), and where:
        `serve.prefix.junctions.shared_prefix`."""
        placement = self.placement
        if not self.adaptive and placement is None:
            return None
        found = junctions.shared_prefix(seq, computing, self.block_size, self.prompt_end)
        if found is None or placement is None:
            return found
        point = placement.wait_point(seq.prompt, found[1], found[0].num_computed)
        return None if point is None else (found[0], point)

    def expect(self, waiting: Iterable[Sequence_], computing: list[Sequence_]) -> None:
        """Queued requests are known future lookups (adaptive policy): a running request still computing a
        prefix one of them shares is cut at the end of that prefix (`shared_prefix`), so its state is kept
        there even when the queued one is admitted only after it has passed that point."""
        if self.adaptive:
            for seq in waiting:
                found = self.shared_prefix(seq, computing)
                if found is not None:
                    found[0].cuts.add(found[1])
