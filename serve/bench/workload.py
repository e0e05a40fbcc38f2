"""The workload of `jaxhybrid bench serve`: the prompts (seeded synthetic token ids, or a JSONL file) and
when each request is sent (Poisson or evenly spaced arrivals at a request rate, or all at once)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path

import numpy as np

FIRST_ID = 3  # synthetic prompts avoid the ids tokenizers reserve (padding, BOS, EOS)


class WorkloadError(ValueError):
    """A workload that cannot be built (bad flags or dataset); printed as one line, exit status 2."""


class Arrivals(enum.Enum):
    POISSON = "poisson"  # exponential gaps with mean 1 / rate
    FIXED = "fixed"  # one request every 1 / rate seconds


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request: a prompt (token ids, or text the server tokenizes) and the tokens to generate."""

    prompt: list[int] | str
    max_tokens: int

    @property
    def prompt_tokens(self) -> int | None:
        """Prompt length in tokens, when known without the server's tokenizer."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


def synthetic(
    num: int, input_len: int, output_len: int, vocab: int, shared_prefix_len: int = 0, seed: int = 0
) -> list[BenchRequest]:
    """`num` prompts of `input_len` random token ids in [FIRST_ID, vocab), the first `shared_prefix_len` of
    them the same for every prompt, each asking for `output_len` tokens."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise WorkloadError("--num-prompts, --input-len and --output-len must be at least 1")
    if not 0 <= shared_prefix_len <= input_len:
        raise WorkloadError(
            f"--shared-prefix-len must be in [0, --input-len={input_len}], got {shared_prefix_len}"
        )
    if vocab <= FIRST_ID:
        raise WorkloadError(f"the server's vocabulary ({vocab} ids) is too small for synthetic prompts")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(FIRST_ID, vocab, shared_prefix_len).tolist()
    return [
        BenchRequest(
            prefix + rng.integers(FIRST_ID, vocab, input_len - shared_prefix_len).tolist(), output_len
        )
        for _ in range(num)
    ]


def read_dataset(path: str, num: int, default_output_len: int) -> list[BenchRequest]:
    """The first `num` requests of a JSONL file of `{"prompt": text or [ids], "max_tokens": n}` (max_tokens
    optional: `default_output_len`); fewer lines than `num` are cycled through."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"no such dataset file: {path}")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{i}: not JSON ({exc.msg})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise WorkloadError(f"{path}:{i}: needs a 'prompt': a non-empty string or list of token ids")
        max_tokens = row.get("max_tokens", default_output_len)
        if type(max_tokens) is not int or max_tokens < 1:
            raise WorkloadError(f"{path}:{i}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        out.append(BenchRequest(prompt, max_tokens))
    if not out:
        raise WorkloadError(f"{path} holds no requests")
    return [out[i % len(out)] for i in range(num)]


def arrival_times(num: int, rate: float, arrivals: Arrivals, seed: int = 0) -> list[float]:
    """Send times in seconds from the start, non-decreasing, the first at 0; all 0 when `rate` is inf."""
    if not rate > 0:
        raise WorkloadError(f"--request-rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    if arrivals is Arrivals.FIXED:
        gaps = np.full(num, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def parse_rates(text: str) -> list[float]:
    """`--request-rate 2,8,inf` -> [2.0, 8.0, inf] (each > 0), in the order given."""
    rates = []
    for item in text.split(","):
        try:
            rate = float(item.strip())
        except ValueError:
            raise WorkloadError(f"--request-rate takes numbers or inf, got {item!r}") from None
        if not rate > 0:
            raise WorkloadError(f"--request-rate must be > 0 (or inf), got {item!r}")
        rates.append(rate)
    return rates
