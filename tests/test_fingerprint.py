"""The prefix store's model fingerprint covers every weight byte without copying large or sharded weights to
the host, and a store never serves another model's states. Oracles: models that differ in one element, by
seed, dtype or config; the bytes the digest pass moves to the host; the digest recomputed by hand in NumPy;
the device pass for the small weights digested on the host."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.prefix import fingerprint
from serve.prefix.fingerprint import _host_leaf_digest, _leaf_digest, model_fingerprint, weights_digest


@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny")


def tiny(cfg, seed=0, dtype=jnp.float32):
    return HybridLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype)


def test_same_weights_same_fingerprint_any_change_another(cfg):
    a = tiny(cfg)
    fp = model_fingerprint(a)
    assert model_fingerprint(tiny(cfg)) == fp  # random weights from the same seed and config
    assert model_fingerprint(tiny(cfg, seed=1)) != fp
    assert model_fingerprint(tiny(cfg, dtype=jnp.bfloat16)) != fp
    assert model_fingerprint(tiny(dataclasses.replace(cfg, rms_norm_eps=3e-6))) != fp


@pytest.mark.parametrize("where", ["middle_row", "last_element", "first_element"])
def test_one_changed_element_in_the_middle_of_a_weight_changes_it(cfg, where):
    """A fine-tune that edits one middle row (or one element anywhere) must not reuse the other's KV."""
    a, b = tiny(cfg), tiny(cfg)
    state = nnx.state(b, nnx.Param)
    flat = nnx.to_flat_state(state)
    path, var = max(flat, key=lambda pv: pv[1].get_value().size)  # the largest weight (routed experts)
    value = np.array(var.get_value())
    rows = value.reshape(-1, value.shape[-1])
    if where == "middle_row":
        rows[rows.shape[0] // 2] = np.nextafter(rows[rows.shape[0] // 2], np.float32(np.inf))  # one ulp
    elif where == "last_element":
        rows[-1, -1] += 1e-3
    else:
        rows[0, 0] = -rows[0, 0]
    var.set_value(jnp.asarray(rows.reshape(value.shape)))
    nnx.update(b, nnx.from_flat_state(flat))

    def value_of(model):
        return np.asarray(dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))[path].get_value())

    assert np.sum(value_of(a) != value_of(b)) == 1 or where == "middle_row"
    assert np.any(value_of(a) != value_of(b))
    assert model_fingerprint(a) != model_fingerprint(b)


def test_the_digest_is_the_stated_sum_and_only_eight_bytes_per_weight_reach_the_host(cfg):
    x = jax.random.normal(jax.random.key(0), (37, 11), jnp.float32)
    words = np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint32)).reshape(-1).astype(np.uint64)
    i = np.arange(words.size, dtype=np.uint64)

    def mix(a, b):  # the same integer hash in NumPy, modulo 2^32
        m = 0xFFFFFFFF
        v = (i * a + b) & m
        v ^= v >> 16
        v = (v * 0x7FEB352D) & m
        v ^= v >> 15
        return v | 1

    lane1 = int(np.sum((words * mix(0x9E3779B1, 0x85EBCA77)) & 0xFFFFFFFF) & 0xFFFFFFFF)
    lane2 = int(np.sum(((words ^ 0xA5A5A5A5) * mix(0xC2B2AE3D, 0x27D4EB2F)) & 0xFFFFFFFF) & 0xFFFFFFFF)
    assert [int(v) for v in np.asarray(_leaf_digest(x))] == [lane1, lane2]
    names, digests = weights_digest(tiny(cfg))
    assert digests.shape == (len(names), 2) and digests.dtype == np.uint32
    assert all(":" in n for n in names)  # name:shape:dtype of every parameter


def test_a_sharded_model_has_the_fingerprint_of_the_unsharded_one(cfg):
    from sharding.mesh import make_mesh
    from sharding.placement import shard_model

    a = tiny(cfg)
    fp = model_fingerprint(a)
    mesh = make_mesh("data=2,expert=2,tensor=2")
    b = shard_model(tiny(cfg), mesh)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(b)))
    assert model_fingerprint(b) == fp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.bool_])
def test_the_host_digest_of_a_small_weight_is_the_device_digest_bit_for_bit(dtype):
    x = jax.random.normal(jax.random.key(1), (3, 257, 5), jnp.float32) * 100
    x = (x > 0) if dtype == jnp.bool_ else x.astype(dtype)
    assert np.array_equal(_host_leaf_digest(np.asarray(x)), np.asarray(_leaf_digest(x)))


def test_a_model_digested_on_the_host_has_the_device_passs_fingerprint(cfg, monkeypatch):
    model = tiny(cfg, dtype=jnp.bfloat16)
    fp = model_fingerprint(model)
    calls = []
    monkeypatch.setattr(fingerprint, "_host_leaf_digest", lambda x: calls.append(x) or _host_leaf_digest(x))
    assert model_fingerprint(model) == fp and calls  # the small weights went through the host path
    monkeypatch.setattr(fingerprint, "HOST_DIGEST_BYTES", -1)  # every weight on the device
    calls.clear()
    assert model_fingerprint(model) == fp and not calls
