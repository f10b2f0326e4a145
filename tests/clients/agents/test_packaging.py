"""The packages as their users get them (issue 39 item 10), against the real service.

Python: the wheel and the source distribution built from this tree (``python -m build``, the
wheel from the sdist, so the sdist is complete), the wheel installed into a fresh virtualenv
with ``pip install --only-binary :all:`` (nothing may need a compiler or libvirt's headers:
libvirt-python, published as source only, must not be there), and README's quick start run with
that virtualenv's python, outside the checkout.

npm: ``npm pack`` (its ``prepack`` builds ``dist/``), the tarball installed into a fresh project
with ``--offline`` (the package has no runtime dependencies), each entry point imported, and the
js/README.md quick start, with a use of every adapter, type-checked by the package's own tsc
and run.

Each step's time is printed (``-s``), and the size of the client's install; the two tests
cost about a minute beside the shared service (the pip install about 10 s, tsc about 8 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from ...harness import REPO, Service

pytestmark = pytest.mark.clients

JS = REPO / "js"
#: what `pip install kernelhost` must not pull (the server extra's, and libvirt's binding above all)
SERVER_DISTRIBUTIONS = {"libvirt-python", "zstandard", "prometheus-client", "structlog", "msgpack"}


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    print(f"{time.monotonic() - started:6.1f}s  {' '.join(cmd)}")
    assert proc.returncode == 0, (
        f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def _clean_env(svc: Service, **more: str) -> dict[str, str]:
    """A user's shell: PATH and HOME, the service's address and key; nothing of this checkout."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "KERNELHOST_URL": svc.url,
        "KERNELHOST_API_KEY": svc.api_key,
        **more,
    }


def _readme_block(path: Path, pattern: str) -> str:
    found = re.search(pattern, path.read_text(), re.S)
    assert found, f"{path.name}: no block matching {pattern!r}"
    return found.group(1)


@pytest.mark.timeout(600)
def test_the_wheel_installs_without_a_compiler_and_runs_the_quick_start(
    agents_service: Service, tmp_path: Path
) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)], REPO)
    version = (REPO / "VERSION").read_text().strip()
    wheel = dist / f"kernelhost-{version}-py3-none-any.whl"
    sdist = dist / f"kernelhost-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())
    with tarfile.open(sdist) as tar:
        names = {n.partition("/")[2] for n in tar.getnames()}
    assert {"VERSION", "CHANGELOG.md", "setup.cfg", "kernelhost/api/static/index.html"} <= names

    # a fresh virtualenv, filled by this pip (--python: its own would cost a copy of pip, 10 s)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    env = _clean_env(agents_service, PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [sys.executable, "-m", "pip", "--python", python]
    _run([*pip, "install", "-q", "--only-binary", ":all:", str(wheel)], tmp_path, env)
    listing = _run([*pip, "list", "--format=json"], tmp_path, env)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    print(f"the client's install: {size / 2**20:.1f} MiB in {site}")
    installed = {d["name"].lower().replace("_", "-") for d in json.loads(listing)}
    print("installed:", sorted(installed))
    assert "kernelhost" in installed
    assert not installed & SERVER_DISTRIBUTIONS, installed & SERVER_DISTRIBUTIONS

    quick_start = _readme_block(REPO / "README.md", r"\.venv/bin/python - <<'EOF'\n(.*?)\nEOF\n")
    where = "import kernelhost, sys; print('from', kernelhost.__file__, file=sys.stderr)\n"
    started = time.monotonic()
    proc = subprocess.run(
        [python, "-c", where + quick_start],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    print(f"{time.monotonic() - started:6.1f}s  README's quick start\n{proc.stdout}{proc.stderr}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from {venv}" in proc.stderr  # the installed wheel, not this checkout
    assert "area 12.56" in proc.stdout and "20" in proc.stdout, proc.stdout
    assert "ZeroDivisionError division by zero" in proc.stdout, proc.stdout

    serve = subprocess.run(
        [str(venv / "bin" / "kernelhost"), "serve"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert serve.returncode == 2 and "pip install 'kernelhost[server]'" in serve.stderr, serve.stderr


#: each entry point of package.json's "exports", imported by the installed package's name
ENTRY_POINTS_JS = """
for (const name of ['kernelhost', 'kernelhost/anthropic', 'kernelhost/openai-agents', 'kernelhost/ai-sdk']) {
  const mod = await import(name);
  console.log(name, Object.keys(mod).sort().join(','));
}
"""

#: every adapter used with its types, beside js/README.md's quick start (appended)
CONSUMER_TS = """\
import { KernelHostError, Sandbox } from 'kernelhost';
import { codeExecutionTool, handleCodeExecutionToolUse } from 'kernelhost/anthropic';
import { kernelhostCodeInterpreter } from 'kernelhost/openai-agents';
import { kernelhostRunCode } from 'kernelhost/ai-sdk';

const adapters: object[] = [codeExecutionTool(), kernelhostCodeInterpreter(), kernelhostRunCode()];
const answer: (typeof handleCodeExecutionToolUse) | undefined = handleCodeExecutionToolUse;
console.log('adapters', adapters.length, typeof answer, KernelHostError.name);
"""

TSCONFIG: dict[str, Any] = {
    "compilerOptions": {
        "target": "ES2022",
        "lib": ["ES2022"],
        "module": "NodeNext",
        "moduleResolution": "NodeNext",
        "types": ["node"],
        "strict": True,
        "skipLibCheck": False,
        "outDir": "out",
    },
    "files": ["consumer.ts"],
}


@pytest.mark.timeout(600)
def test_the_npm_tarball_installs_alone_and_type_checks(agents_service: Service, tmp_path: Path) -> None:
    npm = shutil.which("npm")
    tsc = JS / "node_modules" / ".bin" / "tsc"
    assert npm and tsc.is_file(), "npm and js/node_modules are needed: run 'make js-deps'"
    package = json.loads((JS / "package.json").read_text())
    assert package["version"] == (REPO / "VERSION").read_text().strip()
    assert not package.get("dependencies"), "the npm package has no runtime dependencies"
    _run([npm, "pack", "--silent", "--pack-destination", str(tmp_path)], JS)
    tarball = tmp_path / f"kernelhost-{package['version']}.tgz"
    assert tarball.is_file(), sorted(p.name for p in tmp_path.iterdir())

    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text('{"name": "consumer", "private": true, "type": "module"}\n')
    npm_env = {**_clean_env(agents_service), "NO_COLOR": "1"}
    _run([npm, "install", "--offline", "--no-audit", "--no-fund", str(tarball)], project, npm_env)
    assert sorted(p.name for p in (project / "node_modules").iterdir() if not p.name.startswith(".")) == [
        "kernelhost"
    ]
    (project / "entry-points.mjs").write_text(ENTRY_POINTS_JS)
    out = _run(["node", "entry-points.mjs"], project, npm_env)
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [
        "kernelhost",
        "kernelhost/anthropic",
        "kernelhost/openai-agents",
        "kernelhost/ai-sdk",
    ], out
    assert all(len(line.split()) == 2 for line in lines) and "Sandbox" in out, out

    quick_start = _readme_block(JS / "README.md", r"```ts\n(import \{ Sandbox \} from 'kernelhost';\n.*?)```")
    body = quick_start.replace("import { Sandbox } from 'kernelhost';\n", "")
    (project / "consumer.ts").write_text(CONSUMER_TS + body)
    options = {**TSCONFIG["compilerOptions"], "typeRoots": [str(JS / "node_modules" / "@types")]}
    (project / "tsconfig.json").write_text(json.dumps({**TSCONFIG, "compilerOptions": options}, indent=2))
    _run([str(tsc), "-p", "."], project, npm_env)
    out = _run(["node", "out/consumer.js"], project, npm_env, timeout=180)
    assert "adapters 3 function KernelHostError" in out and "hi" in out and "42" in out, out
