"""Device meshes and sharding for jaxhybrid (imports only `jaxhybrid.config` from the model package).

mesh             `make_mesh("data=1,expert=4,tensor=2")`, the `--mesh` flag
rules            logical axis names -> mesh axes; `state_shardings`, `cache_shardings`
expert_parallel  `make_expert_parallel_fn(mesh)`: dropless all-to-all expert dispatch in shard_map
checkpoint       Orbax save from one mesh, restore onto another (`save_state`, `restore_state`)
multihost        `initialize(...)`: jax.distributed from flags / environment, gloo on CPU
"""
