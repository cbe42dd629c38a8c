"""Benchmarks: `python -m bench.<name>` from the repository root; each prints a table and writes JSON under
`bench/results/` (results and machines in BENCHMARKS.md)."""
