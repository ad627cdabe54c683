"""Benchmarks run by `kvpilot bench ...` (ratios measured side by side in one run)."""
