"""jaxhybrid: Kimi Linear hybrid (KDA + MLA + MoE) language models in JAX / Flax NNX."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so `import jaxhybrid` stays light: `jaxhybrid.load_pretrained(path, dtype=..., shardings=...)`.
    if name == "load_pretrained":
        from jaxhybrid.weights import load_pretrained

        return load_pretrained
    raise AttributeError(f"module 'jaxhybrid' has no attribute {name!r}")
