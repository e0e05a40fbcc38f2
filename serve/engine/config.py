"""Engine settings (`EngineConfig`, what a user chooses) and the shape they resolve to for a model
(`EngineShape`: pool sizes, byte counts, the static program shapes), shared by scheduler and runner."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxhybrid.cache import kda_state_bytes
from jaxhybrid.config import ModelConfig
from serve.engine.speculative import Speculation
from serve.prefix.store import PrefixStoreConfig

SCAN_MODES = ("auto", "off", "prefill", "all")
AUTO_SCAN_MIN_GROUPS = 4  # "auto" scans every program of a model with at least this many repeated groups
# Short prefill chunks of different requests run together in one call (`prefill_rows`): one call over several
# short prompts uses the matmul better than one call each. Such a call has one of two lengths and the
# block table of PACK_MAX_CONTEXT tokens, so packing adds two programs, and it is for short prompts only: a
# chunk packs while it fits the longer length and its sequence PACK_MAX_CONTEXT tokens. Longer chunks run
# alone, where one row already uses the matmul well.
PACK_LENGTHS = (32, 128)
PACK_MAX_CONTEXT = 256
# The narrowest block table holds this many tokens: a short request (a prompt of a few tokens, tens generated)
# then runs one prefill and one decode program whatever its length, not one decode program per power of two
# of its blocks. Reading up to 64 tokens of padding (scratch blocks, masked) costs a decode step little.
MIN_TABLE_TOKENS = 64


def scan_mode(setting: str, groups: int) -> str:
    """What `EngineConfig.scan_layers` means for a model whose layers hold `groups` repeated groups (0: none
    to scan): "auto" is "all" for deep models (compile time independent of depth: Kimi K3's 92 layers) and
    "off" for shallow ones (a scan saves them little compile time and costs XLA:CPU weight copies)."""
    if groups < 2:
        return "off"
    if setting == "auto":
        return "all" if groups >= AUTO_SCAN_MIN_GROUPS else "off"
    return setting


@dataclasses.dataclass
class EngineConfig:
    """Engine shape. Either `num_blocks` or `kv_memory_bytes` sizes the KV pool (default: room for every
    slot at `max_model_len`)."""

    max_slots: int = 4
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    prefill_chunk: int = 512  # 512-token chunks reach about half the matmul rate on small (128: a third)
    # The most prefill chunks (short ones of short sequences, from different requests: `EngineShape.packs`)
    # one program call runs as its rows; 1 runs every chunk alone. Capped at max_slots.
    prefill_rows: int = 4
    max_model_len: int | None = None
    max_batched_tokens: int | None = None
    kv_dtype: str = "float32"
    seed: int = 0
    # Run the repeated layer groups (K K K M) as a scan (`jaxhybrid.scan`: compile time independent of depth):
    # "auto" (every program of a model with at least AUTO_SCAN_MIN_GROUPS groups, none otherwise), "off",
    # "prefill" (prefill programs; decode unrolled) or "all". See `scan_mode`.
    scan_layers: str = "auto"
    # A program a step needs and nobody compiled yet: compile it quickly (XLA's lowest optimization level)
    # and its optimized form in the background, which replaces it; a short prompt chunk whose prefill program
    # is not ready runs through the one-row decode program meanwhile. The server turns it on (a first request
    # waits seconds, not tens of seconds); off, every program is compiled optimized where it is first needed.
    tiered_compile: bool = False
    # Speculative decoding: the default of requests that do not say (`SamplingParams.speculative`); its
    # num_tokens is also the most any request may draft a step (the verify program's length - 1).
    speculative: Speculation = dataclasses.field(default_factory=Speculation)
    prefix: PrefixStoreConfig | None = dataclasses.field(default_factory=PrefixStoreConfig)

    def validate(self) -> None:
        for name in ("max_slots", "block_size", "prefill_chunk", "prefill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"engine setting '{name}' must be a positive integer, got {value!r}")
        for name in ("num_blocks", "kv_memory_bytes", "max_model_len", "max_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"engine setting '{name}' must be a positive integer or unset, got {value!r}"
                )
        if self.scan_layers not in SCAN_MODES:
            raise ValueError(
                f"engine setting 'scan_layers' must be one of {SCAN_MODES}, got {self.scan_layers!r}"
            )
        self.speculative.validate()
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("set either num_blocks or kv_memory_bytes, not both")


def engine_default(name: str) -> Any:
    """The default of EngineConfig's field `name`. The flags of `serve`, `generate` and the benchmarks take
    their defaults from here, so that a benchmark measures what `serve` runs unless a flag says otherwise."""
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def prefill_buckets(prefill_chunk: int, smallest: int = 16) -> tuple[int, ...]:
    """Static prefill lengths: powers of two from `smallest` up to, and including, `prefill_chunk`."""
    sizes = [s for s in (2**i for i in range(4, 31)) if smallest <= s < prefill_chunk]
    return (*sizes, prefill_chunk)


def decode_buckets(slots: int) -> tuple[int, ...]:
    """Decode program rows: powers of four below `slots`, then `slots`. One running request runs one row;
    padding rows skip the experts, so a coarse ladder costs little and compiles few programs."""
    return (*(b for b in (4**i for i in range(16)) if b < slots), slots)


def table_buckets(max_blocks: int, smallest: int = 1) -> tuple[int, ...]:
    """Static block-table widths: `smallest`, the powers of two above it and below `max_blocks`, then
    `max_blocks` itself (`smallest` is capped at `max_blocks`)."""
    smallest = min(smallest, max_blocks)
    powers = (w for w in (2**i for i in range(31)) if smallest < w < max_blocks)
    return tuple(dict.fromkeys((smallest, *powers, max_blocks)))


@dataclasses.dataclass(frozen=True, order=True)
class ProgramShape:
    """One static shape of the model program: `rows` sequences of `length` tokens each, with block tables
    `width` entries wide. A decode step is (decode rows, 1, width); a prefill chunk (1, bucket, width), or
    (prefill_rows, bucket, width) for short chunks of several requests run together."""

    rows: int
    length: int
    width: int
    verify: bool = False  # rows of a last sampled token and its drafted tokens (the `verify` program)

    @property
    def is_decode(self) -> bool:
        return self.length == 1 and not self.verify


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What an EngineConfig means for one model: every size the scheduler and the runner share."""

    slots: int
    block_size: int
    num_blocks: int
    prefill_chunk: int
    max_model_len: int
    max_batched_tokens: int
    kv_dtype: jnp.dtype
    block_bytes: int  # latent KV of one block over all MLA layers
    state_bytes: int  # KDA states of one slot over all KDA layers
    checkpoint_bytes: int  # those states as a prefix-store checkpoint keeps them (`checkpoint_dtype`)
    buckets: tuple[int, ...]  # prefill program lengths
    table_buckets: tuple[int, ...]  # block-table widths: a step reads what its longest sequence holds
    decode_buckets: tuple[int, ...]  # decode program rows: the running requests, not every slot
    prefill_rows: int = 1  # rows of a packed prefill call (EngineConfig.prefill_rows, at most the slots)
    pack_lengths: tuple[int, ...] = ()  # its lengths (PACK_LENGTHS up to the prefill chunk)
    scan_layers: str = "auto"  # which programs scan the repeated layer groups (`scan_mode`)
    tiered_compile: bool = False  # EngineConfig.tiered_compile
    speculative_tokens: int = 4  # the most drafted tokens a verify step carries per row
    speculates: bool = False  # requests speculate unless they say otherwise (the warm-up compiles `verify`)
    checkpoint_dtype: str = "float32"  # PrefixStoreConfig.checkpoint_dtype

    def decode_rows(self, running: int) -> int:
        return next(b for b in self.decode_buckets if b >= running)

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def table_width(self, blocks: int) -> int:
        return next(w for w in self.table_buckets if w >= blocks)

    def bucket(self, tokens: int) -> int:
        """The prefill program length for a chunk of `tokens`."""
        return next(b for b in self.buckets if b >= tokens)

    @property
    def pack_width(self) -> int:
        """The block table of a packed prefill call: room for PACK_MAX_CONTEXT tokens."""
        return self.table_width(min(math.ceil(PACK_MAX_CONTEXT / self.block_size), self.table_buckets[-1]))

    def packs(self, tokens: int, blocks: int) -> bool:
        """Whether a prefill chunk of `tokens` of a request holding `blocks` may share a call with other
        requests' chunks (a short chunk of a short sequence)."""
        return (
            self.prefill_rows > 1
            and 0 < tokens <= self.pack_lengths[-1]
            and self.table_width(blocks) <= self.pack_width
        )

    def packed(self, tokens: int) -> ProgramShape:
        """The program of a packed call whose longest chunk has `tokens`."""
        length = next(n for n in self.pack_lengths if n >= tokens)
        return ProgramShape(self.prefill_rows, length, self.pack_width)

    def decode_programs(self) -> list[ProgramShape]:
        """Every decode program the engine can run, narrow tables (short contexts) first."""
        return [ProgramShape(rows, 1, w) for w in self.table_buckets for rows in self.decode_buckets]

    def verify_programs(self) -> list[ProgramShape]:
        """Every verify program (a decode step whose rows carry drafts), narrow tables first."""
        length = self.speculative_tokens + 1
        return [
            ProgramShape(rows, length, w, verify=True)
            for w in self.table_buckets
            for rows in self.decode_buckets
        ]

    def prefill_programs(self) -> list[ProgramShape]:
        """Every prefill program the engine can run, narrow tables first. A chunk of bucket b holds more
        tokens than the bucket below, so it needs at least that many blocks (narrower tables never occur).
        Then the packed calls' programs (`packed`)."""
        out = []
        for w in self.table_buckets:
            for i, b in enumerate(self.buckets):
                need = math.ceil((self.buckets[i - 1] + 1 if i else 1) / self.block_size)
                if need <= self.table_buckets[-1] and w >= self.table_width(need):
                    out.append(ProgramShape(1, b, w))
        if self.prefill_rows > 1:
            out += [self.packed(n) for n in self.pack_lengths]
        return out

    @classmethod
    def resolve(cls, config: EngineConfig, model: ModelConfig) -> EngineShape:
        config.validate()
        max_model_len = config.max_model_len or min(model.max_position_embeddings, 4096)
        kv_dtype = jnp.dtype(config.kv_dtype)
        checkpoint_dtype = config.prefix.checkpoint_dtype if config.prefix is not None else "float32"
        block_bytes = config.block_size * model.latent_dim * kv_dtype.itemsize * model.num_mla_layers
        per_seq = math.ceil(max_model_len / config.block_size)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif config.kv_memory_bytes is not None:
            num_blocks = config.kv_memory_bytes // max(block_bytes, 1)
        else:
            num_blocks = config.max_slots * per_seq + 1
        if num_blocks < 2:
            raise ValueError(
                f"the KV budget gives {num_blocks} blocks of {block_bytes} bytes; need at least 2"
            )
        return cls(
            slots=config.max_slots,
            block_size=config.block_size,
            num_blocks=num_blocks,
            prefill_chunk=config.prefill_chunk,
            max_model_len=max_model_len,
            max_batched_tokens=config.max_batched_tokens or (config.prefill_chunk + config.max_slots),
            kv_dtype=kv_dtype,
            block_bytes=block_bytes,
            state_bytes=kda_state_bytes(model, kv_dtype)["total"],
            checkpoint_bytes=kda_state_bytes(model, kv_dtype, checkpoint_dtype)["total"],
            buckets=prefill_buckets(config.prefill_chunk),
            table_buckets=table_buckets(per_seq, math.ceil(MIN_TABLE_TOKENS / config.block_size)),
            decode_buckets=decode_buckets(config.max_slots),
            prefill_rows=min(config.prefill_rows, config.max_slots),
            pack_lengths=tuple(sorted({min(n, config.prefill_chunk) for n in PACK_LENGTHS})),
            scan_layers=config.scan_layers,
            tiered_compile=config.tiered_compile,
            speculative_tokens=config.speculative.num_tokens,
            speculates=config.speculative.enabled,
            checkpoint_dtype=checkpoint_dtype,
        )
