"""The simulator and what it serves: the engine's own step loop over a runner that computes nothing
(`engine`, `runner`), the analytic cost model its clock and `bench throughput` count with (`cost`), and the
seeded prefix-reuse workloads (`workloads`) with their replay and lower bound (`replay`). Benchmarks and
tests import it; it imports nothing of theirs."""
