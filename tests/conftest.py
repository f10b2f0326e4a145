"""Shared test configuration; tier fixtures live in tests/unit and tests/vm."""
