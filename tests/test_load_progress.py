"""Loading shows progress: log lines when stderr is not a terminal, a bar when it is, nothing for a quick
load (`jaxhybrid.weights.progress`)."""

import time

from tqdm.auto import tqdm

from jaxhybrid.weights import progress
from jaxhybrid.weights.progress import LogProgress, load_progress

MIB = 2**20


def messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "jaxhybrid.weights"]


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_quick_load_says_nothing(caplog):
    caplog.set_level("INFO", logger="jaxhybrid.weights")
    with LogProgress(100 * MIB, "loading m", delay_s=60) as bar:
        bar.update(100 * MIB)
    assert messages(caplog) == []


def test_a_slow_load_logs_its_bytes_then_done(caplog):
    caplog.set_level("INFO", logger="jaxhybrid.weights")
    bar = LogProgress(100 * MIB, "loading m", delay_s=0, every_s=600)
    bar.update(50 * MIB)
    bar.set_postfix_str("3/8 tensors")
    with bar:
        wait_for(lambda: messages(caplog))
        bar.update(50 * MIB)
    lines = messages(caplog)
    assert lines[0].startswith("loading m: 50% (50.0 MiB of 100.0 MiB), 3/8 tensors, ")
    assert len(lines) == 2 and lines[1].startswith("loading m: done, 100.0 MiB in ")


def test_which_reporter(monkeypatch):
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False, raising=False)
    assert isinstance(load_progress(1, "x", None), LogProgress)  # not a terminal: log lines
    assert isinstance(load_progress(1, "x", True, stepwise=False), LogProgress)  # one restore call
    quiet = load_progress(1, "x", False)
    assert isinstance(quiet, tqdm) and quiet.disable
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    bar = load_progress(1, "x", None)
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()


def test_the_shipped_model_load_reports_progress(caplog, monkeypatch):
    """An Orbax load through `load_pretrained` (as `serve` does it, progress=None) logs its lines when it
    takes longer than the delay (made 0 here)."""
    from jaxhybrid.assets import shipped_model_dir
    from jaxhybrid.weights import load_pretrained

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    caplog.set_level("INFO", logger="jaxhybrid.weights")
    load_pretrained(shipped_model_dir(), progress=None)
    lines = messages(caplog)
    assert lines and lines[-1].startswith("loading stdlib-small: done, ")
