"""Benchmark scripts (run as files, see each docstring) and the GPU validation package, benchmarks.gpu.

A regular package, so that `python -m benchmarks.gpu` finds this one before any installed
distribution that ships a top-level `benchmarks` package.
"""
