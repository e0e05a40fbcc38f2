"""`jaxhybrid.ops.stacks.set_rows`: rows of a pool set by their slots, in place through the CPU kernel,
against numpy's indexed assignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.ops.native import set_rows_kernel
from jaxhybrid.ops.stacks import set_rows, set_rows_reference


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_set_rows_writes_each_row_over_its_slot(monkeypatch, kernel: bool) -> None:
    """Rows in any order over their slots of a [S, ...] pool, every other slot bit for bit as it was; the
    kernel ran where there is one; donated, the kernel writes the pool's own buffer and takes no values of
    the wrong shape."""
    import jaxhybrid.ops.native as native

    if not kernel:
        monkeypatch.setattr(native, "set_rows_kernel", lambda: None)
    elif set_rows_kernel() is None:
        pytest.skip("no C++ compiler here")
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((6, 3, 4)).astype(np.float32)
    rows = np.array([4, 0, 2], np.int32)
    values = rng.standard_normal((3, 3, 4)).astype(np.float32)
    want = pool.copy()
    want[rows] = values
    fn = jax.jit(lambda p, r, v: set_rows(p, r, v))  # a trace of its own: jit caches by function
    got = fn(jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(got), want)
    args = (jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(set_rows_reference(*args)), want)
    assert ("jaxhybrid_set_rows_pool" in fn.lower(*args).as_text()) == kernel
    donated = jax.jit(lambda p, r, v: set_rows(p, r, v), donate_argnums=(0,))
    before = jnp.asarray(pool)
    pointer = before.unsafe_buffer_pointer()
    after = donated(before, *args[1:])
    np.testing.assert_array_equal(np.asarray(after), want)
    if kernel:
        assert after.unsafe_buffer_pointer() == pointer  # written in place, not into a copy
        with pytest.raises(ValueError, match="values"):
            set_rows(jnp.asarray(pool), jnp.asarray(rows), jnp.asarray(values[:2]))
