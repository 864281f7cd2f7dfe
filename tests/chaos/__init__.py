"""Chaos tests: real processes, faults, a hostile participant; see ``tests/chaos/driver.py``."""
