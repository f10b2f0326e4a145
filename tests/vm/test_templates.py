"""Templates through real builds and real VMs: a spec with a pip package, an apt package, a file,
an environment variable, a setup command and a preload becomes a sandbox that has them all; bad
specs fail naming the stage and the package and leave nothing; a cancelled build leaves nothing;
an unchanged spec is a cache hit; another key can neither see nor use it; the operator's spec
files are built at start for every key; the R built-in answers and plots; a template on the
next Debian release runs its newer Python.

Fixture graph (module scoped)::

    tpl_service ──> kit (a built custom template, deleted at the end)
"""

from __future__ import annotations

import asyncio
import json
import secrets
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypedDict

import aiohttp
import pytest

from kernelhost import AsyncSandbox, AsyncTemplate, ConflictError, TemplateBuildError, TemplateInfo
from kernelhost.client import InvalidRequestError, NotFoundError

from ..harness import Service, running_service

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1500)]

IMAGE_DIR = Path("/var/cache/kernelhost/images")


class Auth(TypedDict):
    url: str
    api_key: str


def auth(url: str, api_key: str) -> Auth:
    return {"url": url, "api_key": api_key}


#: failing builds: the spec, the stage it fails at, words its error must hold
BROKEN: list[tuple[dict[str, object], str, str]] = [
    (
        {"pip": ["tomli-ww-no-such-package"]},
        "pip",
        "no matching distribution for 'tomli-ww-no-such-package'",
    ),
    ({"apt": ["no-such-package-kh"]}, "apt", "no package named 'no-such-package-kh'"),
    ({"setup": ["true", "echo about to fail; exit 3"]}, "setup", "setup[1]"),
    ({"kernel": "julia-9"}, "kernel", "no kernelspec named 'julia-9'"),
]

OPERATOR_SPEC = """
name = "shared-tools"
description = "the operator's: every key may use it"
pip = ["tomli-w==1.2.0"]
"""


@pytest.fixture(scope="module")
def tpl_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    operator = tmp_path_factory.mktemp("operator-templates")
    (operator / "shared-tools.toml").write_text(OPERATOR_SPEC)
    with running_service(
        tmp_path_factory.mktemp("templates"),
        "vm-templates",
        KERNELHOST_TEMPLATE_DIR=str(operator),
        # two build VMs at once (one per core here), so the operator's build at start and the
        # failing builds below overlap; a key may queue all four failing builds
        KERNELHOST_TEMPLATE_BUILD_CONCURRENCY="2",
        KERNELHOST_MAX_TEMPLATE_BUILDS_PER_KEY=str(len(BROKEN)),
    ) as svc:
        yield svc


def _image_dirs(svc: Service) -> list[Path]:
    """Where a build could leave something: the image dir (templates' images are built there)."""
    return [Path(svc.env.get("KERNELHOST_IMAGE_DIR", str(IMAGE_DIR)))]


def _leftovers(svc: Service, name: str) -> list[str]:
    """Build directories, images and mounts a template's failed build may have left."""
    found: list[str] = []
    mounts = Path("/proc/mounts").read_text().splitlines()
    for image_dir in _image_dirs(svc):
        found += [p.name for p in image_dir.glob(f".build-{name}*")]
        found += [p.name for p in image_dir.glob(f"{name}@*")]
        found += [ln.split()[1] for ln in mounts if str(image_dir) in ln]
    hv = svc.hypervisor()
    try:
        found += [
            d.name for d in hv.domains() if d.metadata.get("role") == "template" and name in str(d.metadata)
        ]
    finally:
        hv.close()
    return found


@pytest.fixture(scope="module")
async def kit(tpl_service: Service, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TemplateInfo]:
    async for info in _kit(tpl_service, tmp_path_factory.mktemp("kit-src")):
        yield info


async def _kit(tpl_service: Service, src: Path) -> AsyncIterator[TemplateInfo]:
    """A custom template with one of everything; a nonce in its env makes it a real build."""
    (src / "greeting.txt").write_text("hello from the template\n")
    (src / "conf").mkdir()
    (src / "conf" / "app.ini").write_text("[app]\nmode = kit\n")
    spec = src / "kit.toml"
    spec.write_text(
        textwrap.dedent(
            f"""
            name = "kit"
            description = "one of everything"
            apt = ["jq"]
            pip = ["tomli-w==1.2.0"]
            preload = ["tomli_w"]
            setup = ["echo built > /opt/kit-setup.txt", "mkdir -p project && echo x > project/a"]
            files = ["greeting.txt", {{ src = "conf", dest = "/etc/kit" }}]
            [env]
            KIT_MODE = "on"
            KIT_RUN = "{secrets.token_hex(4)}"
            """
        )
    )
    stages: list[str] = []
    info = await AsyncTemplate.build(
        spec, url=tpl_service.url, api_key=tpl_service.api_key, on_stage=lambda s, d: stages.append(s)
    )
    assert info.state == "ready" and info.kind == "custom", info
    assert {"apt", "pip", "files", "setup", "kernel", "warm-up", "pack", "snapshot"} <= set(stages), stages
    info.raw["spec_file"] = str(spec)
    yield info
    for key in (tpl_service.api_key, tpl_service.other_key):
        for sbx in await AsyncSandbox.list(url=tpl_service.url, api_key=key):
            await (await AsyncSandbox.connect(sbx.id, url=tpl_service.url, api_key=key)).close()
    for t in await AsyncTemplate.list(url=tpl_service.url, api_key=tpl_service.api_key):
        if t.kind == "custom":
            await AsyncTemplate.delete(t.name, url=tpl_service.url, api_key=tpl_service.api_key)


async def test_a_sandbox_of_the_template_has_everything_it_names(
    tpl_service: Service, kit: TemplateInfo
) -> None:
    assert kit.resolved["pip"].get("tomli-w") == "1.2.0", kit.resolved
    assert "jq" in kit.resolved["apt"], kit.resolved
    async with AsyncSandbox(template="kit", url=tpl_service.url, api_key=tpl_service.api_key) as sbx:
        assert (await sbx.info()).template == "kit"
        first = await sbx.run_code("import sys; 'tomli_w' in sys.modules")
        assert first.text == "True", "the preload was not imported before the first cell"
        facts = await sbx.run_code(
            "import importlib.metadata, os, tomli_w\n"
            "(importlib.metadata.version('tomli_w'), os.environ['KIT_MODE'],"
            " open('/home/user/greeting.txt').read(), open('/etc/kit/app.ini').read().split()[-1],"
            " open('/opt/kit-setup.txt').read().strip())"
        )
        assert facts.text == "('1.2.0', 'on', 'hello from the template\\n', 'kit', 'built')", facts
        jq = await sbx.run_code("echo '{\"a\": 41}' | jq '.a + 1'; echo $KIT_MODE", language="bash")
        assert jq.stdout == "42\non\n", jq
        # what files and setup left in the home is the account user's (E2B's run as it)
        owners = await sbx.run_code(
            "stat -c '%U %n' /home/user /home/user/greeting.txt /home/user/project/a /opt/kit-setup.txt",
            language="bash",
        )
        assert owners.stdout.split("\n")[:4] == [
            "user /home/user",
            "user /home/user/greeting.txt",
            "user /home/user/project/a",
            "root /opt/kit-setup.txt",
        ], owners


async def test_an_unchanged_spec_is_a_cache_hit(tpl_service: Service, kit: TemplateInfo) -> None:
    t0 = time.monotonic()
    again = await AsyncTemplate.build(kit.raw["spec_file"], url=tpl_service.url, api_key=tpl_service.api_key)
    assert again.state == "ready" and again.build is not None
    assert again.build.state == "cached", again.build
    assert again.raw["image_key"] == kit.raw["image_key"]
    assert time.monotonic() - t0 < 30


async def test_another_key_can_neither_see_nor_use_it(tpl_service: Service, kit: TemplateInfo) -> None:
    other = auth(tpl_service.url, tpl_service.other_key)
    assert "kit" not in [t.name for t in await AsyncTemplate.list(**other)]
    with pytest.raises(NotFoundError):
        await AsyncTemplate.get("kit", **other)
    with pytest.raises(InvalidRequestError, match="unknown template 'kit'"):
        await AsyncSandbox.create(template="kit", **other)
    with pytest.raises(NotFoundError):
        await AsyncTemplate.delete("kit", **other)


async def test_a_template_in_use_cannot_be_deleted(tpl_service: Service, kit: TemplateInfo) -> None:
    mine = auth(tpl_service.url, tpl_service.api_key)
    async with AsyncSandbox(template="kit", **mine):
        with pytest.raises(ConflictError, match="used by 1 sandbox"):
            await AsyncTemplate.delete("kit", **mine)


@pytest.fixture(scope="module")
async def broken(tpl_service: Service) -> dict[str, str]:
    """The failing builds, started at once (they queue for the build slots); stage -> name."""
    names = {}
    for spec, stage, _ in BROKEN:
        name = f"broken-{stage}"
        started = await AsyncTemplate.build(
            {"name": name, **spec}, wait=False, url=tpl_service.url, api_key=tpl_service.api_key
        )
        assert started.build is not None, started
        names[stage] = name
    return names


@pytest.mark.parametrize(("spec", "stage", "words"), BROKEN)
async def test_a_failing_build_names_the_stage_and_leaves_nothing(
    tpl_service: Service, broken: dict[str, str], spec: dict[str, object], stage: str, words: str
) -> None:
    name = broken[stage]
    with pytest.raises(TemplateBuildError) as failed:
        await AsyncTemplate.wait(name, url=tpl_service.url, api_key=tpl_service.api_key)
    assert failed.value.stage == stage and words in str(failed.value), str(failed.value)
    if stage == "setup":
        assert "exit code 3" in str(failed.value)
    info = await AsyncTemplate.get(name, url=tpl_service.url, api_key=tpl_service.api_key)
    assert info.state == "failed" and words in (info.error or "")
    assert _leftovers(tpl_service, name) == []
    await AsyncTemplate.delete(name, url=tpl_service.url, api_key=tpl_service.api_key)


async def test_a_cancelled_build_leaves_nothing(tpl_service: Service) -> None:
    mine = auth(tpl_service.url, tpl_service.api_key)
    started = await AsyncTemplate.build({"name": "slow", "setup": ["sleep 300"]}, wait=False, **mine)
    assert started.build is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        events = [e async for e in AsyncTemplate.logs("slow", started.build.id, **mine)]
        if any(e.get("stage") == "setup" for e in events):
            break
        await asyncio.sleep(1)
    else:
        raise AssertionError(f"the build never reached its setup stage: {events[-5:]}")
    await asyncio.sleep(1)
    cancelled = await AsyncTemplate.cancel("slow", **mine)
    assert cancelled.state == "cancelled", cancelled
    assert _leftovers(tpl_service, "slow") == []
    with pytest.raises(ConflictError, match="no successful build"):
        await AsyncSandbox.create(template="slow", **mine)
    await AsyncTemplate.delete("slow", **mine)


async def test_the_operators_template_is_built_at_start_for_every_key(tpl_service: Service) -> None:
    for key in (tpl_service.api_key, tpl_service.other_key):
        info = await AsyncTemplate.wait("shared-tools", url=tpl_service.url, api_key=key)
        assert info.kind == "operator" and info.state == "ready", info
    async with AsyncSandbox(
        template="shared-tools", url=tpl_service.url, api_key=tpl_service.other_key
    ) as sbx:
        assert (await sbx.run_code("import tomli_w; tomli_w.dumps({'a': 1})")).text == "'a = 1\\n'"
    with pytest.raises(ConflictError, match="not this key's"):
        await AsyncTemplate.delete("shared-tools", url=tpl_service.url, api_key=tpl_service.api_key)
    # /healthz (no key) names the operator's and the built-ins with their state
    async with aiohttp.ClientSession() as http, http.get(f"{tpl_service.url}/healthz") as r:
        states = (await r.json())["template_states"]
    assert states["states"]["shared-tools"] == "ready" and states["states"]["python"] == "ready", states
    assert "kit" not in states["states"], states  # a key's own templates are only counted


async def test_the_r_builtin_computes_and_plots(tpl_service: Service) -> None:
    async with AsyncSandbox(template="r", url=tpl_service.url, api_key=tpl_service.api_key) as sbx:
        # IRkernel shows a value as display data (text, HTML, Markdown, LaTeX), not as a result
        mean = await sbx.run_code("x <- 1:10; mean(x)")
        assert mean.error is None and [r.text for r in mean.results] == ["[1] 5.5"], mean
        plot = await sbx.run_code("plot(x, x^2, main = 'squares')")
        assert plot.error is None, plot.error
        assert any("image/png" in r.data for r in plot.results), [list(r.data) for r in plot.results]
        kept = await sbx.run_code("sum(x)")
        assert [r.text for r in kept.results] == ["[1] 55"]  # state persists between calls
        failed = await sbx.run_code("stop('boom')")
        assert failed.error is not None and "boom" in failed.error.value


async def test_a_template_on_the_next_release_runs_its_newer_python(tpl_service: Service) -> None:
    mine = auth(tpl_service.url, tpl_service.api_key)
    info = await AsyncTemplate.build({"name": "next", "base": "debian:trixie", "pip": ["tomli-w"]}, **mine)
    assert info.state == "ready", info
    try:
        async with AsyncSandbox(template="next", **mine) as sbx:
            version = await sbx.run_code("import sys, tomli_w; sys.version_info[:2]")
            assert version.text == "(3, 13)", version
            release = await sbx.run_code("grep VERSION_CODENAME /etc/os-release", language="bash")
            assert release.stdout.strip() == "VERSION_CODENAME=trixie"
    finally:
        await AsyncTemplate.delete("next", **mine)


def test_the_builds_log_is_kept_as_json_lines(tpl_service: Service, kit: TemplateInfo) -> None:
    assert kit.build is not None
    log = tpl_service.state_dir / "template-builds" / f"{kit.build.id}.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1].get("state") == "succeeded"
    assert any("log" in e for e in events) and any(e.get("stage") == "pip" for e in events)
