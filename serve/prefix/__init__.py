"""The prefix store: reuse of shared prompt prefixes (KV blocks + KDA state checkpoints) behind a narrow
interface, its placement/eviction policies, and the Orbax disk tier."""
