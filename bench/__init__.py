"""Benchmarks: each script prints a table and writes its JSON results under var/bench/."""
