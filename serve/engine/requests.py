"""A request's life in the engine: its typed state, what one step produced for it, its final result, and the
checks a request must pass before it is queued."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

from serve.engine.sampling import SamplingError, SamplingParams
from serve.engine.speculative import RowDrafting, SpeculationStats

MAX_SALT_CHARS = 256  # a salt enters every block hash of its request: keep it short


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"  # queued for a slot (or for its prefix to be read from disk)
    RUNNING = "running"  # holds a slot and blocks
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token (or EOS)
    LENGTH = "length"  # max_tokens or the context
    ABORT = "abort"  # cancelled (client gone, shutdown)
    ERROR = "error"  # the engine failed while serving it


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the problem. Nothing was changed."""


def check_cache_salt(salt: object) -> None:
    """Raise RequestError unless `salt` is None or a non-empty string of at most MAX_SALT_CHARS characters
    that UTF-8 can encode (a lone surrogate cannot)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise RequestError("cache_salt must be a non-empty string")
    if len(salt) > MAX_SALT_CHARS:
        raise RequestError(f"cache_salt must be at most {MAX_SALT_CHARS} characters, got {len(salt)}")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("cache_salt must be valid Unicode text (it holds a lone surrogate)") from None


def check_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    vocab: int,
    max_model_len: int,
    block_size: int,
    usable_blocks: int,
) -> list[int]:
    """The prompt as ints, or RequestError naming what an engine with this vocabulary, context, block
    size and pool cannot serve."""
    try:
        prompt = [int(t) for t in prompt_ids]
    except (TypeError, ValueError) as exc:
        raise RequestError(f"prompt must be a list of integer token ids: {exc}") from None
    if any(isinstance(t, bool) or not float(t).is_integer() for t in prompt_ids):
        raise RequestError("prompt must be a list of integer token ids")
    if not prompt:
        raise RequestError("prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    try:
        params.validate(vocab)
    except SamplingError as exc:
        raise RequestError(str(exc)) from None
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"the context of {max_model_len} tokens"
        )
    need = math.ceil(total / block_size)
    if need > usable_blocks:
        raise RequestError(f"the request needs {need} KV blocks but the pool has {usable_blocks}")
    return prompt


@dataclasses.dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    cache_salt: str | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    order: int = -1  # admission order (newer = larger); a readmitted request gets a new one
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_tokens: int = 0
    preemptions: int = 0
    stored_logits: Any = None  # next-token logits restored with a full prefix hit (nothing left to prefill)
    prefix_hit_tokens: int = 0
    recomputed_tokens: int = 0
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    load: Any = None  # the prefix store's read of this request's prefix from disk, while it waits for it
    cuts: set[int] = dataclasses.field(default_factory=set)  # junctions it checkpoints at (adaptive policy)
    checkpoint_base: bytes | None = None  # the prefix store's last checkpoint on its path
    chain: list[bytes] = dataclasses.field(default_factory=list)  # its block hashes so far (prefix store)
    indexed_blocks: int = 0  # its blocks the prefix store has indexed since it got them
    drafting: RowDrafting | None = None  # how many tokens it may draft (None: it does not speculate)
    speculation: SpeculationStats = dataclasses.field(default_factory=SpeculationStats)
    ngrams: Any = None  # its prompt-lookup index (`serve.engine.speculative.NgramIndex`), once it drafts

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        """Tokens whose KV/state is not in the cache yet."""
        return len(self.prompt) + len(self.generated) - self.num_computed

    @property
    def running(self) -> bool:
        return self.status is RequestStatus.RUNNING

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stats(self) -> dict[str, Any]:
        return {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": len(self.generated),
            "prefill_tokens_computed": self.prefill_tokens,
            "prefill_time_s": self.prefill_time,
            "decode_time_s": self.decode_time,
            "time_to_first_token_s": None
            if self.first_token_time is None
            else self.first_token_time - self.arrival,
            "total_time_s": None if self.finish_time is None else self.finish_time - self.arrival,
            "preemptions": self.preemptions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "finish_reason": None if self.finish_reason is None else str(self.finish_reason),
            "error": self.error,
            "drafted_tokens": self.speculation.drafted,
            "accepted_tokens": self.speculation.accepted,
        }


def stop_tokens(params: SamplingParams, eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end a request with these settings (its stop tokens, and EOS unless ignored)."""
    eos = () if params.ignore_eos or eos_token_id is None else (eos_token_id,)
    return frozenset((*params.stop_token_ids, *eos))


def stop_reason(
    req: Request, token: int, eos_token_id: int | None, max_model_len: int
) -> FinishReason | None:
    """Why `req` ends after `token` was appended to it (a stop token or EOS, its max_tokens or the
    context), or None: it goes on. The engine and the simulator (`serve.sim.engine`) share it."""
    p = req.params
    if token in stop_tokens(p, eos_token_id):
        return FinishReason.STOP
    if len(req.generated) >= p.max_tokens or len(req.prompt) + len(req.generated) >= max_model_len:
        return FinishReason.LENGTH
    return None


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request (the streaming unit)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int = 0  # prompt tokens reused from the prefix store
    error: str | None = None  # set with finish_reason "error": the engine failed this request


@dataclasses.dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class QueueState:
    """How busy the engine is (what admission control looks at)."""

    running: int
    waiting: int
    free_slots: int
