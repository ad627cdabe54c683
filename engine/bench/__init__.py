"""Benchmarks run by `kvpilot bench ...` (ratios measured side by side in one run).

May import anything of the engine and the kernels (they measure it); nothing outside the
benchmarks imports them (``tests/structure/test_layering.py``).
"""
