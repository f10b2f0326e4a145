"""The npm package (``js/``): its tests, run by node's test runner against the real service.

``npm test`` builds the package and its tests with tsc (the build type-checks the tests' use of
``ai``'s ``tool()``, ``@openai/agents``' ``tool()`` and ``@anthropic-ai/sdk``) and runs them with
``node --test``: ``ai``'s MockLanguageModelV4 through ``generateText``, ``@openai/agents`` with
its ScriptedModel, and the Anthropic helper in the SDK's loop, all on real sandboxes. The
dependencies come from the lockfile (``make js-deps`` runs ``npm ci``). ``test/e2b.test.ts``
drives E2B's own ``@e2b/code-interpreter`` against the service's E2B surface.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from ...harness import REPO, Service
from .conftest import e2b_env

pytestmark = pytest.mark.clients

JS = REPO / "js"
#: The whole npm run: two tsc builds and the node tests (about 20 s here with a warm pool).
NPM_TIMEOUT = 480


@pytest.mark.timeout(NPM_TIMEOUT + 60)
def test_npm_package_against_the_service(agents_service: Service) -> None:
    npm = shutil.which("npm")
    assert npm, "npm is not installed: run scripts/install-deps.sh (make deps)"
    assert (JS / "node_modules" / ".package-lock.json").is_file(), (
        "js/node_modules is missing: run 'make js-deps' (npm ci from js/package-lock.json)"
    )
    env = {
        **os.environ,
        "KERNELHOST_URL": agents_service.url,
        "KERNELHOST_API_KEY": agents_service.api_key,
        # E2B's JS SDK (js/test/e2b.test.ts), configured as its users do
        **e2b_env(agents_service),
        "NO_COLOR": "1",
    }
    proc = subprocess.run(
        [npm, "test"], cwd=JS, env=env, capture_output=True, text=True, timeout=NPM_TIMEOUT, check=False
    )
    output = proc.stdout + proc.stderr
    print(output)  # shown by pytest on failure, and with -s
    assert proc.returncode == 0, f"npm test failed (exit {proc.returncode}):\n{output[-6000:]}"
    passed = re.search(r"^ℹ pass (\d+)$", output, re.M)
    failed = re.search(r"^ℹ fail (\d+)$", output, re.M)
    assert passed and failed, output[-3000:]
    assert int(failed.group(1)) == 0 and int(passed.group(1)) >= 20, output[-3000:]
