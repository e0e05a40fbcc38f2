"""Disk tier of the prefix store: restart hits, visibility after the save, crash leftovers, budgets."""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from faults import block_reads
from flax import nnx
from oracles import FullPass, assert_matches_full_pass

from jaxhybrid.cache import kda_state_bytes
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.engine.records import Ledger
from serve.engine.sampling import SamplingParams
from serve.prefix.accounts import TierCounts
from serve.prefix.disk import LOCK, MANIFEST, DiskReads, DiskTier, StoreLocked
from serve.prefix.store import PrefixStore, PrefixStoreConfig

BS = 8


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


def engine(model, prefix=None, **kw):
    args = dict(max_slots=2, block_size=BS, prefill_chunk=32, max_model_len=512)  # as test_prefix_store
    args.update(kw)
    return Engine(model, EngineConfig(prefix=prefix, **args))


@pytest.fixture(scope="module")
def full_pass(model):
    return FullPass(model)


def greedy(n=4):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)


def tokens(rng, n):
    return rng.integers(3, 512, n).tolist()


def one_per_prompt(store_dir, **kw):
    """A checkpoint at each prompt end only: one disk entry per prompt, found by its position."""
    return PrefixStoreConfig(
        checkpoint_interval=1024, sequence_end_checkpoints=False, store_dir=str(store_dir), **kw
    )


def entries(store_dir) -> dict[int, Path]:
    """position -> committed entry directory."""
    out = {}
    for ns in Path(store_dir).iterdir():
        for d in ns.iterdir():
            if (d / MANIFEST).exists():
                out[json.loads((d / MANIFEST).read_text())["position"]] = d
    return out


def ids(results):
    return [r.token_ids for r in results]


def test_restart_serves_hits_from_disk_with_identical_output(model, full_pass, tmp_path):
    rng = np.random.default_rng(1)
    prompts = [tokens(rng, n) for n in (21, 37, 16)]  # partial, partial, block-aligned ends
    extended = [p + tokens(rng, 6) for p in prompts]
    again = [p + tokens(rng, 3) for p in prompts]
    cfg = PrefixStoreConfig(checkpoint_interval=16, store_dir=str(tmp_path))
    a = engine(model, cfg)
    a.generate(prompts, greedy())
    a.flush()
    la = a.ledger().prefix
    assert la.disk_files.pending == 0 and la.disk.save_errors == 0
    assert Ledger.from_json(a.ledger().to_json()) == a.ledger()  # a real store's, across the boundary
    # write-through: everything the memory tiers got is on disk, each with the KV of its whole prefix
    assert la.checkpoints.disk == la.memory.saves == la.disk.saves > 0
    assert la.checkpoint_bytes.disk > la.checkpoint_bytes.device

    # by kind (interval 16 of each prompt and 32, the prompt ends 21 and 37, the sequence ends 24, 40, 19), in
    # memory and on disk, where the manifests keep the kinds' plain strings
    per_tier = lambda ledger, tier: {k: getattr(v, tier) for k, v in ledger.checkpoints_by_kind.items()}
    kinds = {"interval": 4, "prompt_end": 2, "sequence_end": 3, "junction": 0}
    assert per_tier(la, "device") == per_tier(la, "disk") == kinds
    manifests = [json.loads(m.read_text()) for m in tmp_path.glob(f"*/*/{MANIFEST}")]
    assert {k: sum(m["kind"] == k for m in manifests) for k in kinds} == kinds
    nbytes = la.checkpoint_bytes_by_kind
    assert sum(v.device for v in nbytes.values()) == la.checkpoint_bytes.device
    assert sum(v.disk for v in nbytes.values()) == la.checkpoint_bytes.disk

    b = engine(model, cfg)  # a restart: nothing in memory, the store directory indexed
    lb = b.ledger().prefix
    assert lb.checkpoints == TierCounts(disk=la.checkpoints.disk)
    assert per_tier(lb, "disk") == kinds and lb.checkpoint_bytes_by_kind == {
        k: dataclasses.replace(v, device=0) for k, v in nbytes.items()
    }
    got = b.generate(extended, greedy())
    assert ids(got) == ids(engine(model, None).generate(extended, greedy()))
    for prompt, res in zip(extended, got, strict=True):  # resumed from states read back from disk
        assert_matches_full_pass(full_pass, prompt, res.token_ids, res.logprobs)
    assert [(r.stats["prefix_hit_tokens"], r.stats["recomputed_tokens"]) for r in got] == [
        (len(p), 0) for p in prompts
    ]
    lb = b.ledger().prefix
    assert lb.disk.restores == 3 and lb.disk.restore_errors == 0 and lb.disk.restore_time_s > 0
    # a disk hit is promoted to memory (and its blocks to the pool): the next hit reads nothing from disk
    got = b.generate(again, greedy())
    assert [r.stats["prefix_hit_tokens"] for r in got] == [len(p) for p in prompts]
    assert b.ledger().prefix.disk.restores == 3 and b.ledger().prefix.memory.restores == 6


def test_a_save_is_visible_only_after_it_completed_and_decoding_does_not_wait(model, tmp_path, monkeypatch):
    release = threading.Event()
    save = DiskTier._write

    def slow_save(self, meta, payload):
        assert release.wait(60)
        return save(self, meta, payload)

    monkeypatch.setattr(DiskTier, "_write", slow_save)
    rng = np.random.default_rng(2)
    prompts = [tokens(rng, n) for n in (19, 26, 33)]
    cfg = one_per_prompt(tmp_path, disk_max_pending=2)
    a = engine(model, cfg)
    try:
        a.generate(prompts, greedy())  # finishes while every save is blocked
        ledger = a.ledger().prefix
        assert ledger.checkpoints.disk == 0 and ledger.disk_files.pending == 2
        assert ledger.disk.skipped == 1 and ledger.disk_files.pending_bytes > 0
        a.step()  # polls: still nothing finished
        assert a.ledger().prefix.checkpoints.disk == 0
        assert engine(model, cfg).ledger().prefix.checkpoints.disk == 0  # nothing committed for a restart
        # the same prompt now: no disk hit (invisible), but the memory tier has it
        r = a.generate([prompts[0] + [5, 6]], greedy(1))[0]
        assert r.stats["prefix_hit_tokens"] == len(prompts[0]) and a.ledger().prefix.disk.restores == 0
    finally:
        release.set()
    a.flush()
    ledger = a.ledger().prefix
    assert ledger.disk_files.pending == 0 and ledger.checkpoints.disk == ledger.disk.saves >= 2
    assert engine(model, cfg).ledger().prefix.checkpoints.disk == ledger.checkpoints.disk


def test_crash_leftovers_are_ignored_and_everything_else_hits(model, full_pass, tmp_path):
    rng = np.random.default_rng(3)
    lengths = (17, 22, 27, 30, 35)
    prompts = [tokens(rng, n) for n in lengths]
    extended = [p + tokens(rng, 5) for p in prompts]
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    a.generate(prompts, greedy())
    a.flush()
    found = entries(tmp_path)
    assert sorted(found) == list(lengths)

    def largest(d):
        return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)

    # 17: crash while Orbax wrote the data (committed copy, a file cut short)
    f = largest(found[17])
    os.truncate(f, f.stat().st_size // 2)
    # 22: crash after Orbax committed, before the manifest was written
    (found[22] / MANIFEST).unlink()
    # 27: crash before Orbax committed: only the temporary directory exists, one file missing
    tmp = found[27].with_name(found[27].name + ".orbax-checkpoint-tmp")
    found[27].rename(tmp)
    (tmp / MANIFEST).unlink()
    largest(tmp).unlink()
    # 30: same size, damaged bytes: passes the index, caught by the checksums when restored
    f = largest(found[30])
    raw = bytearray(f.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])  # always a change (zeros may not be)
    f.write_bytes(bytes(raw))
    # noise: a half-written manifest under another key, an empty entry, a stray file
    bad = found[35].with_name("ab" * 32)
    shutil.copytree(found[35], bad)
    (bad / MANIFEST).write_text((found[35] / MANIFEST).read_text()[:100])
    (found[35].parent / ("cd" * 32)).mkdir()
    (found[35].parent / "stray.txt").write_text("x")

    b = engine(model, cfg)
    ledger = b.ledger().prefix
    assert ledger.checkpoints.disk == 2 and ledger.disk_files.ignored == 6  # 30 and 35 indexed
    # the leftovers are collected at open: a crash-looping server does not grow the directory
    left = sorted(p.name for p in found[35].parent.iterdir())
    assert left == sorted([LOCK, found[30].name, found[35].name]) and ledger.disk.collected == 6
    got = b.generate(extended, greedy())
    assert ids(got) == ids(engine(model, None).generate(extended, greedy()))
    for prompt, res in zip(extended, got, strict=True):  # resumed from states read back from disk
        assert_matches_full_pass(full_pass, prompt, res.token_ids, res.logprobs)
    assert [r.stats["prefix_hit_tokens"] for r in got] == [0, 0, 0, 0, 35]
    ledger = b.ledger().prefix
    assert ledger.disk.restores == 1 and ledger.disk.restore_errors == 1
    # serving the damaged prompts again writes them anew over the leftovers
    b.generate(prompts[:4], greedy())
    b.flush()
    c = engine(model, cfg)
    assert [r.stats["prefix_hit_tokens"] for r in c.generate(extended, greedy(1))] == list(lengths)


def test_other_models_and_layouts_never_match(model, tmp_path):
    rng = np.random.default_rng(4)
    prompt = tokens(rng, 29)
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    a.generate([prompt], greedy())
    a.flush()
    other = HybridLM(load_config("tiny"), rngs=nnx.Rngs(1), dtype=jnp.float32)  # other weights
    b = engine(other, cfg)
    assert b.ledger().prefix.checkpoints.disk == 0
    got = b.generate([prompt + [7, 8]], greedy())[0]
    assert got.stats["prefix_hit_tokens"] == 0
    assert got.token_ids == engine(other, None).generate([prompt + [7, 8]], greedy())[0].token_ids
    shape = dict(block_size=BS, block_bytes=a.shape.block_bytes, state_bytes=a.shape.state_bytes)

    def store(layout):
        fp = a.store.fingerprint
        return PrefixStore(cfg, **shape, fingerprint=fp, allocator=a.allocator, layout=layout)

    for layout in ("bs8-bfloat16", "bs16-float32"):  # another KV dtype or block size: another namespace
        assert not store(layout).disk.entries
    assert len(store("bs8-float32").disk.entries) == 1


def test_budgets_demote_then_drop_and_disk_keeps_serving(model, tmp_path):
    state = kda_state_bytes(model.config, jnp.float32)["total"]
    disk_bytes = 150_000
    cfg = PrefixStoreConfig(
        checkpoint_interval=BS,
        device_bytes=2 * state,
        host_bytes=3 * state,
        store_dir=str(tmp_path),
        disk_bytes=disk_bytes,
    )
    eng = engine(model, cfg)
    ref = engine(model, None)
    rng = np.random.default_rng(5)
    system = tokens(rng, 21)
    chats = [system + tokens(rng, n) for n in (4, 9, 13)]
    for _ in range(3):
        got = eng.generate(chats, greedy())
        assert ids(got) == ids(ref.generate(chats, greedy()))
        eng.flush()
        ledger = eng.ledger().prefix
        assert ledger.checkpoint_bytes.device <= cfg.device_bytes
        assert ledger.checkpoint_bytes.host <= cfg.host_bytes
        assert ledger.checkpoint_bytes.disk <= disk_bytes
        on_disk = sum(p.stat().st_size for p in Path(tmp_path).rglob("*") if p.is_file() and p.name != LOCK)
        assert on_disk == ledger.checkpoint_bytes.disk  # dropped entries are gone from the disk
        chats = [c + tokens(rng, 6) for c in chats]
    ledger = eng.ledger().prefix
    assert ledger.memory.demotions > 0 and ledger.memory.dropped_checkpoints > 0 and ledger.disk.dropped > 0
    assert ledger.disk.restores > 0  # dropped from memory, served from disk


def test_a_second_process_on_the_store_directory_gets_a_clear_error(model, tmp_path):
    cfg = one_per_prompt(tmp_path)
    ns_dir = engine(model, cfg).store.disk.dir  # this process holds the namespace now
    holder = (
        "import sys, time; from serve.prefix.disk import DiskTier, StoreLocked\n"
        "try:\n    DiskTier(sys.argv[1], sys.argv[2], b'x', 8, 1 << 20, 4, 1 << 20)\n"
        "except StoreLocked as exc:\n    print('LOCKED', exc); sys.exit(3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", holder, str(ns_dir.parent), ns_dir.name], capture_output=True, text=True
    )
    assert (
        out.returncode == 3 and "in use by another process" in out.stdout and str(os.getpid()) in out.stdout
    )
    # and the other way round: a process holding it, then this process
    other = tmp_path / "other"
    hold = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from serve.prefix.disk import DiskTier\n"
            "DiskTier(sys.argv[1], 'ns', b'x', 8, 1 << 20, 4, 1 << 20); print('held', flush=True); "
            "time.sleep(60)",
            str(other),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hold.stdout.readline().strip() == "held"
        with pytest.raises(StoreLocked, match=f"pid {hold.pid}"):
            DiskTier(other, "ns", b"x", 8, 1 << 20, 4, 1 << 20)
    finally:
        hold.kill()
        hold.wait()
    DiskTier(other, "ns", b"x", 8, 1 << 20, 4, 1 << 20).close()  # free again once the holder died


def test_a_full_disk_stops_writing_warns_once_and_keeps_serving(model, tmp_path, monkeypatch, caplog):
    import serve.prefix.disk as pd

    usage = shutil.disk_usage

    def nearly_full(path):
        real = usage(path)
        return type(real)(real.total, real.total - 1000, 1000)

    monkeypatch.setattr(pd.shutil, "disk_usage", nearly_full)
    rng = np.random.default_rng(7)
    prompts = [tokens(rng, n) for n in (19, 26)]
    eng = engine(model, one_per_prompt(tmp_path))
    with caplog.at_level(logging.WARNING, logger="jaxhybrid.prefix"):
        got = eng.generate(prompts, greedy())
        eng.flush()
        eng.generate([tokens(rng, 23)], greedy())  # within the retry delay: not even tried
        eng.flush()
    assert ids(got) == ids(engine(model, None).generate(prompts, greedy()))
    ledger = eng.ledger().prefix
    assert ledger.checkpoints.disk == 0 and ledger.disk.full >= 1 and ledger.disk.skipped >= 1
    assert len([r for r in caplog.records if "disk is full" in r.message]) == 1
    assert [p.name for p in eng.store.disk.dir.iterdir()] == [LOCK]  # no half-written save left behind
    hit = eng.generate([prompts[0] + [5, 6]], greedy(1))[0]  # memory still serves the prefix
    assert hit.stats["prefix_hit_tokens"] == len(prompts[0])
    monkeypatch.setattr(pd.shutil, "disk_usage", usage)
    monkeypatch.setattr(eng.store.disk.space, "until", 0.0)  # the retry delay is over, space is back
    eng.generate([tokens(rng, 21)], greedy())
    eng.flush()
    assert eng.ledger().prefix.checkpoints.disk == 1


def test_a_request_waiting_for_its_prefix_from_disk_stalls_nobody(model, tmp_path, monkeypatch):
    rng = np.random.default_rng(8)
    stored = tokens(rng, 29)
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    a.generate([stored], greedy())
    a.flush()
    a.store.disk.close()  # a restart: this process lets go of the directory
    release = block_reads(monkeypatch)
    b = engine(model, cfg)
    other = tokens(rng, 11)
    waiting = b.add_request(stored + [9, 10], greedy())
    busy = b.add_request(other, greedy(8))
    for _ in range(12):  # the other request is served to the end while the read is blocked
        b.step()
    assert b.requests[busy].finish_reason == "length" and b.requests[waiting].generated == []
    assert b.ledger().disk_loading == 1
    release.set()
    deadline = time.monotonic() + 60
    while b.has_unfinished():
        assert time.monotonic() < deadline
        b.step()
    got = b.result(waiting)
    assert got.stats["prefix_hit_tokens"] == len(stored)
    ref = engine(model, None).generate([stored + [9, 10], other], [greedy(), greedy(8)])
    assert [got.token_ids, b.result(busy).token_ids] == ids(ref)


def test_a_transient_error_keeps_the_entry_and_it_is_retried(model, tmp_path, monkeypatch, caplog):
    """Issue 27.3: an entry that cannot be read for a reason that may pass (EIO on its manifest at open, EIO
    while restoring it) is skipped and logged, never removed; once readable it is indexed and hits."""
    import errno

    import serve.prefix.disk as pd

    rng = np.random.default_rng(11)
    prompts = [tokens(rng, 17), tokens(rng, 22)]
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    a.generate(prompts, greedy(1))
    a.close()
    found = entries(tmp_path)
    target = found[17]
    read_text = Path.read_text

    def eio(self, *args, **kw):
        if self.name == MANIFEST and self.parent == target:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return read_text(self, *args, **kw)

    monkeypatch.setattr(Path, "read_text", eio)
    monkeypatch.setattr(pd, "RETRY_S", 0.0, raising=False)
    with caplog.at_level(logging.WARNING, logger="jaxhybrid.prefix"):
        b = engine(model, cfg)
    assert b.ledger().prefix.checkpoints.disk == 1 and (target / MANIFEST).exists()
    assert any("will retry" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(Path, "read_text", read_text)  # the disk is back
    b.store.poll()
    assert b.ledger().prefix.checkpoints.disk == 2
    # a read that fails with EIO: served from scratch, the entry stays and serves the next request
    read_arrays = DiskReads._read
    failures = []

    def flaky(self, entry):
        if not failures:
            failures.append(entry.position)
            raise OSError(errno.EIO, "Input/output error")
        return read_arrays(self, entry)

    monkeypatch.setattr(DiskReads, "_read", flaky)
    extended = prompts[0] + tokens(rng, 3)
    first = b.generate([extended], greedy(2))[0]
    assert failures == [17] and first.stats["prefix_hit_tokens"] == 0
    assert b.ledger().prefix.checkpoints.disk == 2 and (target / MANIFEST).exists()
    again = b.generate([extended], greedy(2))[0]
    assert again.token_ids == first.token_ids
    b.close()
    c = engine(model, cfg)  # a fresh engine (no memory tier): the disk entry itself hits
    assert c.generate([extended], greedy(2))[0].stats["prefix_hit_tokens"] == 17
    c.close()


def test_close_releases_the_lock_and_the_threads_even_when_the_last_poll_raises(model, tmp_path, monkeypatch):
    """Issue 27.3: a failure while flushing at close still lets go of the namespace (another store can
    open it) and of the tier's executors."""
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    disk = a.store.disk

    def broken(*args, **kw):
        raise RuntimeError("injected: the last poll failed")

    monkeypatch.setattr(disk, "poll", broken)
    with pytest.raises(RuntimeError, match="injected"):
        a.close()
    for executor in (disk._worker, disk.reads._pool):  # shut down: they take no more work
        with pytest.raises(RuntimeError, match="shutdown"):
            executor.submit(print)
    out = subprocess.run(  # another process can take the namespace's lock now
        [sys.executable, "-c", LOCK_TAKER, str(disk.dir)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


LOCK_TAKER = """
import sys
from pathlib import Path
from serve.prefix import files
files.lock(Path(sys.argv[1]))
"""


def test_a_request_reading_its_prefix_counts_as_waiting_and_an_abort_ends_it_at_once(
    model, tmp_path, monkeypatch
):
    """Issue 27.4: a request waiting for its prefix from disk counts toward the waiting queue (the server's
    429 limit); aborted, it leaves the engine at once, and its read's result is discarded when the read
    ends (the entry is no longer held)."""
    rng = np.random.default_rng(9)
    stored = tokens(rng, 29)
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    a.generate([stored], greedy())
    a.close()
    release = block_reads(monkeypatch)
    b = engine(model, cfg)
    rid = b.add_request(stored + [9, 10], greedy())
    b.step()
    assert b.ledger().disk_loading == 1 and b.queue_state().waiting == 1
    b.abort(rid)
    assert not b.has_unfinished() and b.queue_state().waiting == 0
    release.set()
    deadline = time.monotonic() + 60
    while any(e.holders for e in b.store.disk.entries.values()):
        assert time.monotonic() < deadline, "the abandoned read is never finished"
        b.step()
        time.sleep(0.01)
    assert b.ledger().prefix.checkpoints.disk == 1
    b.close()


def test_a_request_that_preempts_itself_at_admission_keeps_its_disk_read(model, tmp_path, monkeypatch):
    """Issue 27.2: a request whose prefix was read from disk is admitted, then preempts itself for the blocks
    its restore needs (the fit check counted the hit's own cached blocks as evictable; attaching pins them);
    it keeps what was read and is admitted with it once blocks are free: the entry is read once. Oracle: the
    same requests without the store."""
    rng = np.random.default_rng(10)
    stored = tokens(rng, 29)  # 3 full blocks + 5
    cfg = one_per_prompt(tmp_path)
    a = engine(model, cfg)
    a.generate([stored], greedy())
    a.close()
    reads = []
    read = DiskReads._read

    def counting(self, entry):
        reads.append(entry.position)
        return read(self, entry)

    monkeypatch.setattr(DiskReads, "_read", counting)
    b = engine(model, cfg, num_blocks=20)  # 19 usable blocks
    b.generate([stored[:16] + tokens(rng, 5)], greedy(1))  # caches the stored prompt's first 2 blocks
    assert b.ledger().prefix.cached_kv_blocks == 2 and reads == []
    holder = tokens(rng, 16 * BS + 1)
    h = b.add_request(holder, greedy(7))  # 17 blocks, the rest of the pool, for as long as it runs
    while b.requests[h].pending > 1:
        b.step()
    x = b.add_request(stored + [9, 10], greedy())
    b.step()  # a disk hit: its read starts
    deadline = time.monotonic() + 60
    while not (events := b.observe()).loaded:
        assert time.monotonic() < deadline, "the read never ends"
        time.sleep(0.01)
    b.step(events)  # read: admitted, it needs 2 blocks beyond the 2 cached ones it pins, and none is free
    assert b.requests[x].preemptions == 1 and b.requests[h].running and reads == [29]
    while b.has_unfinished():
        b.step()
    assert reads == [29] and b.ledger().prefix.disk.restores == 1
    got = [b.result(h).token_ids, b.result(x).token_ids]
    assert b.result(x).stats["prefix_hit_tokens"] == len(stored)
    ref = engine(model, None, num_blocks=20).generate([holder, stored + [9, 10]], [greedy(7), greedy()])
    assert got == ids(ref)
    b.close()
