"""Per-row token sampling for the serving engine's decode batch.

One jitted `sample` call handles a whole [B, V] batch in which every row carries its own temperature, top-k,
top-p and PRNG key, so greedy and sampled requests share one compiled program. Keys come from `request_key`
(seed, step), which makes a request's tokens depend only on its own seed, step and logits, never on which
other requests happen to share the batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from serve.engine.speculative import Speculation, SpeculationError

# Seeds become a uint32 PRNG seed; a wider seed would be silently truncated by jax.random.key without x64.
SEED_LIMIT = 2**32


class SamplingError(ValueError):
    """Invalid sampling parameters; the message names the offending field."""


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops.

    temperature 0 means greedy (argmax); top_k 0 and top_p 1 turn those filters off. seed None means the
    engine assigns one from its own counter, so a run is still reproducible for a given engine and request
    order.
    Seeds are limited to [0, 2**32) because that is the width jax.random.key uses without x64.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    speculative: Speculation | None = None  # how it drafts tokens (None: the engine's default)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingError naming the first invalid field; vocab_size enables the vocabulary bounds."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise SamplingError(f"top_k must be <= vocab_size {vocab_size}, got {self.top_k}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise SamplingError(f"seed must be None or an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, tuple | list):
            raise SamplingError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise SamplingError(f"stop_token_ids entries must be ints in {bound}, got {tok!r}")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise SamplingError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.logprobs, bool | np.bool_):
            raise SamplingError(f"logprobs must be a bool, got {self.logprobs!r}")
        if self.speculative is not None:
            if not isinstance(self.speculative, Speculation):
                raise SamplingError(f"speculative must be a Speculation, got {self.speculative!r}")
            try:
                self.speculative.validate()
            except SpeculationError as exc:
                raise SamplingError(str(exc)) from None


def request_key(seed: int | jax.Array, step: int | jax.Array) -> jax.Array:
    """The typed PRNG key for a request's `step`-th generated token: fold_in(key(seed), step).

    Works on Python ints and on (traced) uint32 scalars alike, with identical results for seeds in [0, 2**32).
    """
    return jax.random.fold_in(jax.random.key(seed), step)


@jax.jit
def _batch_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    return jax.vmap(request_key)(seeds, steps)


def batch_arrays(
    params: Sequence[SamplingParams | None], seeds: Sequence[int], steps: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, jax.Array]:
    """Per-row (temperature [B] f32, top_k [B] int32, top_p [B] f32, keys [B]) for `sample`.

    None rows are inactive slots and get greedy defaults (their key is still built from seeds/steps).
    Seeds must already be resolved by the engine (no None) and lie in [0, 2**32).
    """
    if not len(params) == len(seeds) == len(steps):
        raise ValueError(
            f"params, seeds and steps differ in length: {len(params)}, {len(seeds)}, {len(steps)}"
        )
    temperature = np.array([0.0 if p is None else p.temperature for p in params], np.float32)
    top_k = np.array([0 if p is None else p.top_k for p in params], np.int32)
    top_p = np.array([1.0 if p is None else p.top_p for p in params], np.float32)
    seeds_np = np.asarray(seeds, np.int64).reshape(-1)
    steps_np = np.asarray(steps, np.int64).reshape(-1)
    if np.any((seeds_np < 0) | (seeds_np >= SEED_LIMIT)):
        raise ValueError("seeds must lie in [0, 2**32)")
    if np.any((steps_np < 0) | (steps_np >= 2**32)):
        raise ValueError("steps must lie in [0, 2**32)")
    # Host arrays go to the programs as they are: a jitted call transfers them for less than jnp.asarray
    # does, and this runs once a step while the device computes.
    keys = _batch_keys(seeds_np.astype(np.uint32), steps_np.astype(np.uint32))
    return temperature, top_k, top_p, keys


def _sorted_filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One row under top-k / top-p filters: (descending order of ids, logits in that order with the
    filtered-out ones at -inf): sort, keep the top_k, then the nucleus."""
    vocab = scaled.shape[-1]
    # Work in descending order; the stable sort keeps lower ids first among equal logits.
    order = jnp.argsort(-scaled, stable=True)
    sorted_logits = scaled[order]
    rank = jnp.arange(vocab, dtype=jnp.int32)

    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)

    # Nucleus over the top-k survivors: keep a token while the mass strictly above it is still < top_p.
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs
    keep = (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def _draw_filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, key: jax.Array) -> jax.Array:
    """One row's draw under top-k / top-p filters."""
    order, sorted_logits = _sorted_filtered(scaled, top_k, top_p)
    return order[jax.random.categorical(key, sorted_logits)].astype(jnp.int32)


def _filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """One row's logits under top-k / top-p filters, in id order (-inf where filtered out)."""
    order, sorted_logits = _sorted_filtered(scaled, top_k, top_p)
    return jnp.full_like(scaled, -jnp.inf).at[order].set(sorted_logits)


def _scaled(x: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(greedy rows [B], logits [B, V] shifted to a maximum of 0 and divided by the temperature: shifted
    first so a tiny temperature cannot overflow to inf; greedy rows are divided by 1)."""
    is_greedy = temperature <= 0
    safe_t = jnp.where(is_greedy, 1.0, temperature)
    return is_greedy, (x - jnp.max(x, axis=-1, keepdims=True)) / safe_t[:, None]


def _needs_filter(is_greedy: jax.Array, top_k: jax.Array, top_p: jax.Array, vocab: int) -> jax.Array:
    return ~is_greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))


def _argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first maximum: the lowest id on ties; the first NaN where there is
    one) as plain reductions, a maximum and then the least id that holds it, which XLA:CPU runs faster than
    argmax's (value, id) pairs."""
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == jnp.max(x, axis=-1, keepdims=True))
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sample` for rows that are all greedy: (argmax ids [B] int32, their logprobs [B] f32). Cheap enough to
    run inside every model program, where `sample`'s PRNG and sorts would add a third of a second to each
    compile. The logprob is log_softmax's arithmetic at the chosen id only."""
    x = logits.astype(jnp.float32)
    token = _argmax(x)
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    return token, jnp.take_along_axis(shifted, token[:, None], axis=-1, mode="clip")[:, 0] - lse


def sample(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row of a decode batch.

    logits [B, V] (any float dtype); temperature [B] f32 (0 = greedy); top_k [B] int32 (0 = off);
    top_p [B] f32; keys [B] typed PRNG keys. Sampled rows scale by 1/temperature in fp32, keep the top_k
    largest, then the smallest nucleus with cumulative probability >= top_p (at least the top token), and draw
    with the row's key.
    Returns (token ids [B] int32, logprob [B] f32 of each token under log_softmax(logits) in fp32, i.e. the
    model's distribution before temperature and filtering). Jittable; all per-row settings are traced arrays.
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    logp = jax.nn.log_softmax(x, axis=-1)
    greedy_id = _argmax(x)

    is_greedy, scaled = _scaled(x, temperature)
    plain = jax.lax.cond(
        jnp.any(~is_greedy),
        lambda: jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32),
        lambda: greedy_id,
    )

    # Only rows with a filter need the vocabulary sort (the costliest part of sampling): greedy rows, idle
    # slots and plain sampling skip it, and a batch without filtered rows does not run it at all. Each row's
    # draw depends on its own settings and key only, never on the rest of the batch.
    filtered = _needs_filter(is_greedy, top_k, top_p, vocab)
    drawn = jax.lax.cond(
        jnp.any(filtered),
        lambda: jnp.where(filtered, jax.vmap(_draw_filtered)(scaled, top_k, top_p, keys), plain),
        lambda: plain,
    )
    token = jnp.where(is_greedy, greedy_id, drawn)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def verify(
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative sampling of drafted tokens: which of them the model accepts, and the token after them.

    logits [B, T, V] at a row's T positions (position i follows the row's i-th drafted token; position 0
    the last sampled one); drafts [B, T-1] int32; num_drafts [B] (the rest of a row is padding);
    temperature, top_k, top_p, keys [B*T] (row-major over positions; the key of position i is the one `sample`
    would use for that step). A draft is a point mass (prompt lookup): position i's draft d is accepted with
    the probability p(d) the row's filtered, tempered distribution gives it (greedy: d == argmax), else the
    token there is drawn from p with d removed, renormalised; after the last accepted draft of a row that
    accepted all, the token is `sample`'s draw with that position's key. Each position's token then has
    exactly the distribution `sample` would give it (Leviathan et al., 2023). Returns (tokens [B, T]: the
    accepted drafts, then the drawn token, the rest meaningless; their logprobs [B, T] under the model's own
    distribution, as `sample`'s; accepted [B] int32)."""
    B, T, V = logits.shape
    x = logits.reshape(B * T, V).astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    d = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1).reshape(B * T)
    has = (jnp.arange(T)[None, :] < num_drafts[:, None]).reshape(B * T)

    def all_greedy() -> tuple[jax.Array, jax.Array, jax.Array]:
        # every position's token is its argmax: a draft stands where it is that token
        token, logp = greedy(x)
        return token, logp, has & (d == token)

    def any_sampled() -> tuple[jax.Array, jax.Array, jax.Array]:
        return _verify_sampled(x, d, has, temperature, top_k, top_p, keys)

    # a step of greedy rows (the common case) skips the PRNG, the filters and the vocabulary's second pass
    token, logp, ok = jax.lax.cond(jnp.all(temperature <= 0), all_greedy, any_sampled)
    accepted = jnp.sum(jnp.cumprod(ok.reshape(B, T).astype(jnp.int32), axis=1), axis=1)
    return token.reshape(B, T), logp.reshape(B, T), accepted.astype(jnp.int32)


def _verify_sampled(
    x: jax.Array,
    d: jax.Array,
    has: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`verify` where a row samples: (token, its logprob, whether the draft stands) per position of x
    [B*T, V] (fp32), drafts d and `has` (a drafted token there) [B*T]."""
    V = x.shape[-1]
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    plain, _ = sample(x, temperature, top_k, top_p, keys)
    is_greedy, scaled = _scaled(x, temperature)
    greedy_id = _argmax(x)
    sampled = has & ~is_greedy
    filtered = _needs_filter(is_greedy, top_k, top_p, V)
    target = jax.lax.cond(
        jnp.any(filtered & sampled),
        lambda: jnp.where(filtered[:, None], jax.vmap(_filtered)(scaled, top_k, top_p), scaled),
        lambda: scaled,
    )
    p_draft = jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(target, axis=-1), d[:, None], axis=-1)[:, 0])
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    ok = has & jnp.where(is_greedy, d == greedy_id, uniform < p_draft)

    def residual() -> jax.Array:
        without = jnp.where(jnp.arange(V)[None, :] == d[:, None], -jnp.inf, target)
        redraw = jax.vmap(lambda k, row: jax.random.categorical(jax.random.fold_in(k, 2), row))(keys, without)
        return redraw.astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampled & ~ok), residual, lambda: greedy_id)
    after_draft = jnp.where(is_greedy, greedy_id, drawn)
    token = jnp.where(ok, d, jnp.where(has, after_draft, plain))
    logp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), token[:, None], axis=-1)[:, 0]
    return token, logp, ok
