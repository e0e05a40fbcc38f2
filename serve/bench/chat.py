"""The chat workload and its replay, now in `serve.bench.workloads` (beside the other families); kept so the
existing imports work."""

from serve.bench.workloads import CHECKPOINT_KEYS, LEDGER_KEYS, ChatWorkload, Replay, Server, replay

__all__ = ["CHECKPOINT_KEYS", "LEDGER_KEYS", "ChatWorkload", "Replay", "Server", "replay"]
