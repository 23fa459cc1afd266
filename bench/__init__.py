"""Benchmarks of shmhb.  Run ``python -m bench.board [--quick]``; see bench/README.md."""
