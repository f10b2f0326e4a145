"""One version number for both packages (issue 39 item 11): the Python distribution reads
``VERSION`` (setup.cfg's ``version = file: VERSION``); the npm package's package.json and its
lockfile must say the same, and CHANGELOG.md must have a section for it."""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _version() -> str:
    version = (REPO / "VERSION").read_text().strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"VERSION: {version!r} is not MAJOR.MINOR.PATCH"
    return version


def test_the_python_distribution_reads_version() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["metadata"]["version"] == "file: VERSION"
    assert "VERSION" in (REPO / "MANIFEST.in").read_text().split()  # the sdist can build again


def test_the_npm_package_has_the_same_version() -> None:
    version = _version()
    package = json.loads((REPO / "js" / "package.json").read_text())
    lock = json.loads((REPO / "js" / "package-lock.json").read_text())
    assert package["version"] == version, "js/package.json: bump it with VERSION"
    assert lock["version"] == lock["packages"][""]["version"] == version, (
        "js/package-lock.json: run 'npm install --package-lock-only' in js/"
    )


def test_the_changelog_has_a_section_for_the_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert f"\n## [{_version()}]" in text, f"CHANGELOG.md: no '## [{_version()}]' section"
