"""Rollout workers: pull prompt groups, sample G completions, run the environment turns, publish groups."""
