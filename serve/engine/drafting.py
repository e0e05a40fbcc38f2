"""Drafts from a smaller model with the target's vocabulary (`--speculative draft:DIR`).

The draft model has pools of its own (KDA states by slot, latent KV addressed through the target's block
tables: the same block ids in a pool of its own), and its cache only ever holds real tokens. To draft k
tokens for a request whose target has computed n tokens and sampled the next, it first runs the tokens its
cache lacks (the sampled one, and the drafts the target accepted last step) as one prefill-like chunk, whose
last logits give the first draft, then k - 1 greedy steps in one program (one program for each of
`draft_lengths`: a k between two runs the longer one's steps, cut) that carries its KDA states through the
steps without writing them back: so nothing is rolled back, the next step starts from real tokens again.
The KV those k - 1 steps write lies beyond the request's length (a position without a block writes into the
scratch block), where the next catch-up writes over it. Drafts are greedy (a point mass), which the target's
rejection sampling takes for any temperature.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.cache import KDAPoolRows
from jaxhybrid.model import HybridLM
from serve.engine.config import EngineShape
from serve.engine.runner import Runner, row_caches
from serve.engine.speculative import draft_lengths


@dataclasses.dataclass
class _View:
    """A request as the draft model's runner sees it: the target's tokens, slot and blocks, and the
    positions the draft's own cache holds (`num_computed`)."""

    tokens: list[int]
    slot: int
    blocks: list[int]
    num_computed: int


@dataclasses.dataclass(frozen=True)
class _Progress:
    request: str
    computed: int
    blocks: tuple[int, ...]


@functools.lru_cache(maxsize=8)
def _ahead(graphdef: Any, layer_types: tuple[str, ...], steps: int) -> Any:
    """The jitted run-ahead: `steps` greedy tokens after `tokens` [B, 1], KDA states carried, not written."""

    def ahead(params, kda_pools, mla_pools, tokens, slot_ids, block_tables, start, num_valid):
        cache = row_caches(layer_types, kda_pools, mla_pools, slot_ids, block_tables, start)
        # the scan carries the rows' own KDA states (a cache of one structure from step to step)
        cache = tuple(c.gathered() if isinstance(c, KDAPoolRows) else c for c in cache)
        model = nnx.merge(graphdef, params)

        def step(carry, _):
            token, cache = carry
            logits, cache = model.forward_cached(token, cache, num_valid)
            token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
            return (token, cache), token[:, 0]

        (_, cache), out = jax.lax.scan(step, (tokens, cache), None, length=steps)
        mla = tuple(c.pool for kind, c in zip(layer_types, cache, strict=True) if kind != "kda")
        return jnp.swapaxes(out, 0, 1), mla

    return jax.jit(ahead, donate_argnums=(2,))


class DraftRunner(Runner):
    """The draft model's pools and programs: the runner's, and the run-ahead of greedy steps."""

    def __init__(self, model: HybridLM, shape: EngineShape):
        super().__init__(model, shape)
        self._ahead_shapes: set[tuple[int, int]] = set()  # (steps, table width) of every run-ahead run

    def programs_run(self) -> int:
        """Programs run so far (each compiled or loaded when first run): the model programs and the
        run-ahead at each shape."""
        return len(self.compiled_programs()) + len(self._ahead_shapes)

    def run_ahead(self, view: _View, first: int, steps: int) -> list[int]:
        """`steps` greedy tokens after `first` (at position view.num_computed), leaving the KDA pools as they
        were."""
        # room for the steps, within the widest table (what does not fit is written to the scratch block)
        need = min(
            math.ceil((view.num_computed + steps) / self.shape.block_size), self.shape.table_buckets[-1]
        )
        width = self.shape.table_width(need)
        self._ahead_shapes.add((steps, width))
        table = np.zeros((1, width), np.int32)
        table[0, : min(len(view.blocks), width)] = view.blocks[:width]
        kda, mla = self._split_pools()
        fn = _ahead(self.graphdef, self.model_config.layer_types, steps)
        host = ([[first]], [view.slot], table, [view.num_computed], [1])
        out, mla = fn(self.params, kda, mla, *(jnp.asarray(np.asarray(a, np.int32)) for a in host))
        self._set_pools(kda, mla)
        return [int(t) for t in np.asarray(out)[0]]


class DraftModel:
    """A `DraftSource` running a smaller model beside the target (see the module doc). `shape`: the target
    engine's (the same slots, block size and block ids)."""

    def __init__(self, model: HybridLM, shape: EngineShape):
        self.runner = DraftRunner(model, shape)
        self.shape = shape
        self._progress: dict[int, _Progress] = {}  # by slot: what the draft's cache holds for its request

    def programs_run(self) -> int:
        """Programs of its own run so far (`DraftSource`)."""
        return self.runner.programs_run()

    def held_bytes(self) -> int:
        """Bytes the draft model holds: its weights and its pools."""
        arrays = jax.tree.leaves((self.runner.params, self.runner.pools))
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays)

    def propose(self, req: Any, k: int) -> list[int]:
        view = self._catch_up_view(req)
        logits = None
        while view.num_computed < len(view.tokens):
            n = min(len(view.tokens) - view.num_computed, self.shape.prefill_chunk)
            logits = self.runner.prefill_rows([view], [n])
            view.num_computed += n
        self._progress[req.slot] = _Progress(req.id, view.num_computed, self._held(view))
        first = int(np.asarray(jnp.argmax(logits[0])))
        if k == 1:
            return [first]
        # the shortest of the lengths with a program that holds k: each drafted token costs a step of it
        length = min(n for n in draft_lengths(self.shape.speculative_tokens) if n >= k)
        ahead = self.runner.run_ahead(view, first, length - 1)
        return [first, *ahead[: k - 1]]

    def _catch_up_view(self, req: Any) -> _View:
        """The request as the draft sees it, from where its cache still holds the request's tokens (the same
        request in the slot, no more tokens than the target has, on the same blocks), else from nothing."""
        tokens = req.tokens[: req.num_computed + 1]
        view = _View(tokens, req.slot, list(req.blocks), 0)
        held = self._progress.get(req.slot)
        if (
            held is not None
            and held.request == req.id
            and held.computed <= len(tokens)
            and held.blocks == self._held(dataclasses.replace(view, num_computed=held.computed))
        ):
            view.num_computed = held.computed
        else:
            self.runner.reset_slot(req.slot)
        return view

    def _held(self, view: _View) -> tuple[int, ...]:
        return tuple(view.blocks[: math.ceil(view.num_computed / self.shape.block_size)])
