"""The prefix store's ledger (`serve.prefix.accounts.PrefixLedger`) and the engine's (`Ledger`) cross the
process boundary as the flat object /health, /metrics and the benchmarks read: `from_json(to_json(x)) == x`
without a store, with one, and with a disk tier, and the flat names are the ones listed here (a renamed field
shows). No model: the ledgers are built by hand, every number distinct."""

import json

import pytest

from benchmarks.route import merge_ledgers
from serve.engine.records import Ledger
from serve.prefix.accounts import DiskFiles, PrefixLedger, TierCounts
from serve.prefix.stats import DiskStats, LookupStats, MemoryStats
from serve.prefix.types import CheckpointKind

HOLDINGS = [
    "cached_kv_blocks",
    "cached_kv_bytes",
    "checkpoint_bytes",
    "checkpoints",
    "checkpoints_by_kind",
    "checkpoint_bytes_by_kind",
]
STORE = [
    "lookups",
    "hits",
    "hit_tokens",
    "recomputed_tokens",
    "saves",
    "save_time_s",
    "restores",
    "restore_time_s",
    "demotions",
    "dropped_checkpoints",
    "evicted_blocks",
]
DISK = [
    "disk_saves",
    "disk_save_time_s",
    "disk_restores",
    "disk_restore_time_s",
    "disk_dropped",
    "disk_skipped",
    "disk_save_errors",
    "disk_restore_errors",
    "disk_collected",
    "disk_full",
]
DISK_FILES = ["disk_pending", "disk_pending_bytes", "disk_ignored", "store_dir"]


def tiers(n: int, disk: bool) -> TierCounts:
    return TierCounts(n, n + 1, n + 2 if disk else 0)


def ledger(disk: bool, last_error: str | None = None) -> PrefixLedger:
    """A store's ledger (with a disk tier: `disk`) with every number distinct."""
    kinds = list(CheckpointKind)
    return PrefixLedger(
        checkpoints=tiers(1, disk),
        checkpoint_bytes=tiers(1000, disk),
        checkpoints_by_kind={k: tiers(10 * i, disk) for i, k in enumerate(kinds)},
        checkpoint_bytes_by_kind={k: tiers(10_000 * (i + 1), disk) for i, k in enumerate(kinds)},
        cached_kv_blocks=7,
        cached_kv_bytes=7 * 512,
        checkpoint_interval=64,
        lookup=LookupStats(5, 4, 300, 12),
        memory=MemoryStats(9, 0.25, 6, 0.125, 3, 2, 8),
        disk=DiskStats(11, 1.5, 3, 0.75, 1, 2, 4, 5, 6, 1, last_error) if disk else None,
        disk_files=DiskFiles(2, 4096, 3, "/tmp/store/ns") if disk else None,
    )


CASES = {
    "no store": PrefixLedger(),
    "memory tiers": ledger(disk=False),
    "disk tier": ledger(disk=True),
    "disk tier with an error": ledger(disk=True, last_error="No space left on device"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_prefix_ledger_survives_its_json(case):
    x = CASES[case]
    assert PrefixLedger.from_json(x.to_json()) == x
    assert PrefixLedger.from_json(json.loads(json.dumps(x.to_json()))) == x  # what crosses a process


@pytest.mark.parametrize("case", CASES)
def test_an_engine_ledger_survives_its_json(case):
    for loading in (None, 3):
        x = Ledger(4096, 2048, case != "no store", CASES[case], loading)
        assert Ledger.from_json(json.loads(json.dumps(x.to_json()))) == x


def test_the_flat_names_are_the_boundarys():
    names = {case: list(x.to_json()) for case, x in CASES.items()}
    assert names == {
        "no store": HOLDINGS,
        "memory tiers": [*HOLDINGS, *STORE, "checkpoint_interval"],
        "disk tier": [*HOLDINGS, *STORE, *DISK, "checkpoint_interval", *DISK_FILES],
        "disk tier with an error": [
            *HOLDINGS,
            *STORE,
            *DISK,
            "disk_last_error",
            "checkpoint_interval",
            *DISK_FILES,
        ],
    }
    flat = CASES["disk tier with an error"].to_json()
    assert flat["checkpoints"] == {"device": 1, "host": 2, "disk": 3}
    assert list(flat["checkpoints_by_kind"]) == ["interval", "prompt_end", "sequence_end", "junction"]
    assert flat["checkpoints_by_kind"]["junction"] == {"device": 30, "host": 31, "disk": 32}
    assert (flat["hits"], flat["evicted_blocks"], flat["disk_restores"], flat["disk_pending"]) == (4, 8, 3, 2)
    assert flat["disk_last_error"] == "No space left on device" and flat["store_dir"] == "/tmp/store/ns"
    engine = Ledger(4096, 2048, True, CASES["disk tier"], 0).to_json()
    assert list(engine) == [
        "live_kv_bytes",
        "live_state_bytes",
        "prefix_cache",
        *names["disk tier"],
        "disk_loading",
    ]


def test_replicas_ledgers_summed_read_back():
    """`bench route` adds its replicas' ledgers up on the boundary's names and reads the sum back."""
    a, b = ledger(disk=True), ledger(disk=True, last_error="EIO")
    summed = Ledger.from_json(merge_ledgers([Ledger(1, 2, True, x, 0).to_json() for x in (a, b)])).prefix
    assert summed.checkpoints == TierCounts(2, 4, 6)
    assert summed.checkpoints_by_kind[CheckpointKind.JUNCTION] == TierCounts(60, 62, 64)
    assert summed.lookup.hits == 8 and summed.disk.restores == 6 and summed.disk.last_error == "EIO"


def test_an_unknown_name_is_an_error():
    with pytest.raises(ValueError, match="hitz"):
        PrefixLedger.from_json({**ledger(disk=False).to_json(), "hitz": 1})
