"""Samples to (rank, slot): the sample stream, the balancers (per-step totals, lockstep slots, packed rows) and
the step layout they produce."""
