"""pytest plugins loaded (``-p``) into the runs of other projects' suites (suite_support.py)."""
