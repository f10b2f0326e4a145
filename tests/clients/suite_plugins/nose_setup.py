"""Calls a test module's nose-style ``setup()`` and ``teardown()`` functions, as pytest did
until 8.0 dropped its nose support. Suites written for pytest 7 (ipykernel 6.17's
``test_message_spec.py`` starts its kernel in ``setup()``) run unmodified under today's pytest;
nothing else of theirs changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def _nose_module_setup(request: pytest.FixtureRequest) -> Iterator[None]:
    module = request.module
    setup, teardown = getattr(module, "setup", None), getattr(module, "teardown", None)
    if callable(setup):
        setup()
    yield
    if callable(teardown):
        teardown()
