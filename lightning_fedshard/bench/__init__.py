"""Benchmarks: one module per reported table (``python -m lightning_fedshard.bench NAME``)."""
