"""Benchmarks for the swarm client: convergence, slow links, join and churn (issue 6).

Each module is one command, run from a checkout as ``python -m benchmarks.<name>``.
They are measurements, not tests: only their ``--smoke`` versions run in CI.
"""
