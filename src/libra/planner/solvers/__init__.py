"""Solvers: each takes (simulator, budget) and returns a state, or None when no state fits."""
