"""Package data: `stdlib-small/`, the small model `jaxhybrid generate` and `jaxhybrid serve` use when given no
model (stdlib-small trained on the Python standard library's source: docs/training.md, "The shipped
model")."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "stdlib-small"


def shipped_model_dir() -> Path | None:
    """The shipped model directory (config.json, tokenizer.json, params/), or None when not installed."""
    ok = (SHIPPED_DIR / "config.json").exists() and (SHIPPED_DIR / "params").is_dir()
    return SHIPPED_DIR if ok else None
