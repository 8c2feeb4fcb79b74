"""Benchmarks: ``python -m lowbit.bench <suite>``. See harness.py for how
things are timed and how the hardware floors are measured."""
