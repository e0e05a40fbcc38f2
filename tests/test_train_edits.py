"""Edit documents (`jaxhybrid.train.edits`) and fine-tuning with them (`train --init DIR --edit-share F`)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import subprocess_xla_flags

from jaxhybrid.train import data as D
from jaxhybrid.train import edits as E

REPO = Path(__file__).resolve().parent.parent

SOURCE = '''
import os


def short(a):
    return a


class Box:
    def put(self, item, *, count=1):
        """Put `count` copies of item."""
        for _ in range(count):
            self.items.append(item)
        return len(self.items)


async def fetch(url, timeout):
    data = await get(url, timeout=timeout)
    # the url is not logged
    return data
'''


def test_functions_are_the_clean_blocks_of_three_lines_or_more() -> None:
    found = E.functions(SOURCE)
    assert [f.code.splitlines()[0] for f in found] == [
        "def put(self, item, *, count=1):",
        "async def fetch(url, timeout):",
    ]
    assert found[0].args == ("item", "count") and found[1].args == ("url", "timeout")
    assert found[0].code.splitlines()[-1] == "    return len(self.items)"  # dedented by the method's indent
    assert E.functions("def broken(:\n") == []


def _after(doc: str) -> tuple[str, str]:
    """(the function as first shown, the function as written again) of a document."""
    first, second = doc.split("\n\n# ", 1)
    return first.split(":\n", 1)[1], second.split(":\n", 1)[1].rstrip("\n")


@pytest.mark.parametrize("index", range(12))
def test_an_edit_document_repeats_the_function_or_renames_one_argument(index: int) -> None:
    code = f"def f{index}(alpha, beta):\n    total = alpha + beta\n    return total * {index}"
    fn = E.functions(code)[0]
    doc = E.edit_document(fn)
    assert doc == E.edit_document(fn)  # a pure function of the code
    shown, again = _after(doc)
    assert shown == code
    if doc.startswith(E.unchanged_prompt(code)):
        assert again == code
        return
    old = doc.split("`")[1]
    new = doc.split("`")[3]
    assert old in fn.args and new not in code
    assert again.replace(new, old) == code and again != code  # the rename and nothing else
    renamed = ast.parse(again).body[0]
    assert new in [a.arg for a in renamed.args.args]


def test_the_three_kinds_each_appear() -> None:
    docs = [
        E.edit_document(E.Function(f"def g{i}(first, second):\n    x = 1\n    return x", ("first", "second")))
        for i in range(30)
    ]
    unchanged = sum("unchanged:" in d for d in docs)
    renamed = sum("renamed to" in d for d in docs)
    before_after = sum(d.startswith("# Before:") for d in docs)
    assert unchanged + renamed + before_after == 30 and min(unchanged, renamed, before_after) > 0


def test_edit_rows_start_at_a_document_and_hold_whole_documents() -> None:
    docs = [np.arange(100 * i, 100 * i + n, dtype=np.int32) for i, n in enumerate((5, 9, 3, 12))]
    rows = E.edit_rows(docs, 6, 15, seed=3, step=7)
    assert rows.shape == (6, 16) and rows.dtype == np.int32
    assert np.array_equal(rows, E.edit_rows(docs, 6, 15, seed=3, step=7))
    assert not np.array_equal(rows, E.edit_rows(docs, 6, 15, seed=3, step=8))
    starts = {int(d[0]) for d in docs}
    for row in rows:
        at = 0
        while at < len(row):  # walk the row document by document
            assert int(row[at]) in starts
            doc = docs[int(row[at]) // 100]
            piece = row[at : at + len(doc)]
            assert np.array_equal(piece, doc[: len(piece)])
            at += len(doc)
    assert [D.share_rows(8, s) for s in (0.0, 0.01, 0.5, 1.0)] == [0, 1, 4, 8]


def test_fine_tuning_starts_from_the_model_and_learns_its_edit_documents(tmp_path: Path) -> None:
    """`train --init` on tiny: with a learning rate of ~0 the exported weights are the initial model's (a
    fresh start would not be), its config and tokenizer carry over, and the log reports edit documents of
    both splits with their validation loss (copy documents in the same batches); bad settings are errors,
    not tracebacks."""
    from flax import nnx

    from jaxhybrid.config import load_config
    from jaxhybrid.model import HybridLM
    from jaxhybrid.weights import load_pretrained, save_orbax

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        body = "\n\n".join(
            f"def f{i}_{j}(value, other):\n    total = value + other\n    return total * {j}\n"
            for j in range(6)
        )
        (corpus / f"m{i:02d}.py").write_text(body)
    init = save_orbax(HybridLM(load_config("tiny"), rngs=nnx.Rngs(5)), tmp_path / "init")

    def train(out: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "serve.cli", "train", "--init", str(init), "--data", str(corpus)]
        cmd += ["--out", str(tmp_path / out), "--steps", "2", "--batch-size", "4", "--seq-len", "192"]
        cmd += ["--val-every", "2", "--val-batches", "1", "--save-every", "2", "--val-fraction", "0.2"]
        cmd += ["--warmup-steps", "1", "--no-progress", *extra]
        env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags()}
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    done = train("run", "--lr", "1e-12", "--edit-share", "0.5", "--copy-share", "0.25", "--bias-rate", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log["settings"]["copy_share"] == 0.25
    assert log["init"] == str(init) and log["config"] == "tiny"
    assert log["corpus"]["edit_documents"]["train"] > 0 and log["corpus"]["edit_documents"]["val"] > 0
    assert np.isfinite(log["final_val_edit_loss"])
    before = load_pretrained(init, progress=False)
    after = load_pretrained(tmp_path / "run" / "model", progress=False)
    for a, b in zip(jax.tree.leaves(nnx.state(before)), jax.tree.leaves(nnx.state(after)), strict=True):
        # lr 1e-12, 2 steps: Adam moves a parameter by about lr a step (|m| / sqrt(v) ~ 1), 2e-12 in all,
        # five orders under this tolerance; a run that trained at another rate moves them by percents
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    fresh = jax.tree.leaves(nnx.state(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0))))
    assert any(
        not np.allclose(np.asarray(a), np.asarray(b))
        for a, b in zip(fresh, jax.tree.leaves(nnx.state(after)), strict=True)
    )

    bad = train("bad", "--edit-share", "1.5")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --edit-share"), bad.stderr[-500:]
    missing = train("missing", "--init", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "not a model directory" in missing.stderr, missing.stderr[-500:]
