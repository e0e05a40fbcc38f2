"""What a client sees of a request's tokens: incremental detokenisation and stop strings."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass
class Event:
    """What the engine thread tells one request: new tokens, and whether (and why) it finished."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0
    error: str | None = None


def decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """tokenizer.decode, skipping special tokens where the tokenizer can."""
    try:
        params = inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        params = {}
    if "skip_special" in params:
        return lambda ids: tokenizer.decode(list(ids), skip_special=True)
    return lambda ids: tokenizer.decode(list(ids))


class Tracker:
    """One request's output: token ids, logprobs, the text (decoded incrementally, trimmed at a stop
    string), and what of it has been handed out already."""

    def __init__(self, decode: Callable[[Sequence[int]], str] | None, stop: Sequence[str]):
        self.decode = decode
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []  # every generated token (usage, logprobs)
        self.text_ids: list[int] = []  # those that make up the text (not a final stop / eos token)
        self.logprobs: list[float] = []
        self.text = ""
        self.sent = 0  # characters of text handed out
        self.sent_tokens = 0  # tokens whose logprobs were handed out
        self._prefix = 0  # detokeniser window: text_ids[_prefix:_read] were decoded last time
        self._read = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.engine_done = False  # the engine finished (or aborted) the request itself
        self.cached_tokens = 0
        self.error: str | None = None

    def _detok(self, final: bool = False) -> str:
        if self.decode is None:
            return ""
        prefix = self.decode(self.text_ids[self._prefix : self._read])
        full = self.decode(self.text_ids[self._prefix :])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix, self._read = self._read, len(self.text_ids)
        return full[len(prefix) :]

    def _add_text(self, new: str) -> bool:
        start = max(0, len(self.text) - self.hold)
        self.text += new
        if not self.stop or not new:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def feed(self, ev: Event) -> None:
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        if ev.error is not None:
            self.error = ev.error
        if self.finished:
            return
        n = len(ev.token_ids)
        for i, tok in enumerate(ev.token_ids):
            self.ids.append(int(tok))
            self.logprobs.append(float(ev.logprobs[i]) if i < len(ev.logprobs) else 0.0)
            if i == n - 1 and ev.finished and ev.finish_reason == "stop":
                break  # the end-of-sequence / stop token: counted, not shown
            self.text_ids.append(int(tok))
            if self._add_text(self._detok()):
                self.finished, self.finish_reason = True, "stop"
                return
        if ev.finished:
            self.engine_done = True
            self.finished, self.finish_reason = True, ev.finish_reason
            if self._read < len(self.text_ids) and self._add_text(self._detok(final=True)):
                self.finish_reason = "stop"

    def take_text(self) -> str:
        """Text not handed out yet; while running, the last `hold` characters stay back (a stop string
        may be starting there)."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def take_tokens(self) -> tuple[list[int], list[float]]:
        ids, lps = self.ids[self.sent_tokens :], self.logprobs[self.sent_tokens :]
        self.sent_tokens = len(self.ids)
        return ids, lps
