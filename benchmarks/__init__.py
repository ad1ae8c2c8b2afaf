"""Benchmarks: commands people run from the checkout (`python -m benchmarks.TOPIC.NAME`), none part of CI."""
