"""The offline placement's dynamic program (`serve.prefix.placement`) against brute force over every set of
prefixes that fits the budget."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.prefix.placement import place


def payment(queries, kept):
    """Sum over queries of (overlap depth - depth of the deepest kept prefix at or above it on its path)."""
    total = 0
    for prompt, q in queries:
        total += q - max((d for d in range(1, q + 1) if tuple(prompt[:d]) in kept), default=0)
    return total


def brute_force(queries, budget, cost_of):
    prefixes = {tuple(p[:d]) for p, q in queries for d in range(1, q + 1)}
    best = payment(queries, set())
    for k in range(1, len(prefixes) + 1):
        fits = False
        for kept in itertools.combinations(sorted(prefixes), k):
            if sum(cost_of(len(x)) for x in kept) <= budget:
                fits = True
                best = min(best, payment(queries, set(kept)))
        if not fits:
            break
    return best


workloads = st.lists(
    st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=6), st.integers(0, 6)), min_size=1, max_size=6
).map(lambda qs: [(np.asarray(p, np.int32), min(q, len(p))) for p, q in qs])


@settings(max_examples=150, deadline=None)
@given(workloads, st.integers(0, 4), st.sampled_from([(3, 3), (3, 4), (2, 5)]), st.sampled_from([1, 2, 4]))
def test_the_program_finds_the_least_payment_within_the_budget(queries, states, costs, block):
    state, partial = costs
    budget = states * state
    cost_of = lambda depth: partial if depth % block else state  # noqa: E731
    placement = place(queries, budget, state, partial, block)
    best = brute_force(queries, budget, cost_of)
    assert placement.cost == best
    kept = set()
    for prompt, _ in queries:
        kept |= {tuple(prompt[:d]) for d in placement.positions(prompt)}
    assert sum(cost_of(len(x)) for x in kept) <= budget
    assert payment(queries, kept) == best
    for prompt, _ in queries:
        for d in range(len(prompt) + 1):
            assert placement.holds(prompt, d) == (d in placement.positions(prompt))
