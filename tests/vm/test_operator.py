"""What an operator sees: ``/metrics`` moving with real work, the ``kernelhost`` CLI run as
subprocesses, and the web console in headless Chromium (screenshot: results/console.png), all
against the one session service (``service`` in conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernelhost import AsyncSandbox, Sandbox

from ..harness import REPO, Service

pytestmark = pytest.mark.vm

RESULTS = REPO / "results"


def scrape(service: Service) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(service.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name`` over every series whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


async def test_metrics_move_when_work_is_done(client_env: Service) -> None:
    before = scrape(client_env)
    sbx = await AsyncSandbox.create(template="python")
    try:
        during = scrape(client_env)
        assert total(during, "kernelhost_sandboxes", state="running") >= 1
        assert total(during, "kernelhost_vms") >= 1
        ok = await sbx.run_code("print('x' * 1000)")
        assert ok.status == "ok"
        slow = await sbx.run_code("import time; time.sleep(60)", timeout=1)
        assert slow.status == "timeout" and slow.recovery == "interrupted"
    finally:
        await sbx.close()
    after = scrape(client_env)
    moved = {
        name: total(after, name, **labels) - total(before, name, **labels)
        for name, labels in [
            ("kernelhost_sandbox_create_seconds_count", {"template": "python"}),
            ("kernelhost_execute_seconds_count", {"language": "python"}),
            ("kernelhost_executions_total", {"status": "ok"}),
            ("kernelhost_execution_timeouts_total", {"rung": "interrupted"}),
            ("kernelhost_relayed_bytes_total", {"kind": "execute", "direction": "out"}),
        ]
    }
    assert moved["kernelhost_sandbox_create_seconds_count"] == 1, moved
    assert moved["kernelhost_execute_seconds_count"] == 2, moved
    assert moved["kernelhost_executions_total"] == 1, moved
    assert moved["kernelhost_execution_timeouts_total"] == 1, moved
    assert moved["kernelhost_relayed_bytes_total"] > 1000, moved
    hits_and_misses = (
        total(after, "kernelhost_pool_hits_total")
        + total(after, "kernelhost_pool_misses_total")
        - total(before, "kernelhost_pool_hits_total")
        - total(before, "kernelhost_pool_misses_total")
    )
    assert hits_and_misses == 1


# -- the CLI, as subprocesses ------------------------------------------------------------------


def cli(
    service: Service, *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {**service.env, "KERNELHOST_URL": service.url, "KERNELHOST_API_KEY": service.api_key}
    return subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def ids(service: Service) -> set[str]:
    done = cli(service, "ls", "-q")
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_run_streams_output_and_deletes_its_sandbox(service: Service, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import time\nprint('first', flush=True)\ntime.sleep(3)\nprint('second')\n6 * 7\n")
    before = ids(service)
    env = {**service.env, "KERNELHOST_URL": service.url, "KERNELHOST_API_KEY": service.api_key}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelhost.cli", "run", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the line arrives (bounded by the wait below)
        seen_at = time.monotonic()
        rest, err = proc.communicate(timeout=120)
        ended_at = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert first == "first\n" and rest == "second\n42\n"
    assert ended_at - seen_at > 2, "the first line came only at the end: output was not streamed"
    assert ids(service) == before  # the sandbox was deleted


def test_run_fails_with_the_error_on_stderr(service: Service) -> None:
    done = cli(service, "run", "-", stdin="print('before')\n1 / 0\n")
    assert done.returncode == 1
    assert done.stdout == "before\n"
    assert "ZeroDivisionError" in done.stderr
    timed_out = cli(service, "run", "--timeout", "1", "-", stdin="import time; time.sleep(60)")
    assert timed_out.returncode == 1 and "status timeout" in timed_out.stderr


def test_exec_keeps_the_sandbox_and_rm_deletes_it(client_env: Service) -> None:
    service = client_env
    sbx = Sandbox(template="python")
    try:
        sbx.run_code("x = 41")
        done = cli(service, "exec", sbx.id, "print(x + 1)")
        assert done.returncode == 0 and done.stdout == "42\n", done.stderr
        assert cli(service, "exec", sbx.id, "undefined_name").returncode == 1
        bash = cli(service, "exec", "--language", "bash", sbx.id, "echo hi; (exit 3)")
        assert bash.returncode == 1 and bash.stdout == "hi\n"
        listing = cli(service, "ls")
        assert listing.returncode == 0 and sbx.id in listing.stdout
        assert listing.stdout.splitlines()[0].split()[:3] == ["ID", "TEMPLATE", "STATE"]
        assert sbx.id in ids(service)
        removed = cli(service, "rm", sbx.id)
        assert removed.returncode == 0 and removed.stdout.strip() == sbx.id
        assert sbx.id not in ids(service)
        again = cli(service, "rm", sbx.id)
        assert again.returncode == 1 and sbx.id in again.stderr
        assert cli(service, "exec", sbx.id, "1").returncode == 1
    finally:
        sbx.close()  # already gone: a 404 counts as closed


def test_cli_without_a_key_says_how_to_get_one(service: Service) -> None:
    env = {k: v for k, v in service.env.items() if k != "KERNELHOST_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", "ls", "--url", service.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2 and "KERNELHOST_API_KEY" in done.stderr


def test_doctor_checks_the_host(service: Service) -> None:
    done = cli(service, "doctor", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in ("qemu", "libvirt", "images", "acceleration", "vm memory tmpfs", "service"):
        assert any(
            line.split(maxsplit=1)[1].startswith(name + ":")
            for line in lines
            if line[:4] in ("ok  ", "warn", "FAIL")
        ), (name, done.stdout)
    assert f"ok   service: {service.url} answers" in done.stdout
    broken = subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**service.env, "KERNELHOST_IMAGE_DIR": str(service.state_dir / "no-images")},
    )
    assert broken.returncode == 1
    assert "FAIL images" in broken.stdout and "make image" in broken.stdout


# -- the web console, in headless Chromium -------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# as root, without a GPU, and without the background traffic this machine's closed network refuses
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PATIENCE_MS = 180_000  # a first datasci create may be a cold boot under TCG


@pytest.mark.timeout(600)
async def test_console_runs_a_printing_and_a_plotting_cell(service: Service) -> None:
    # make test installs both; a missing one is a failure to fix, never a silent skip
    import playwright.async_api as playwright

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install chromium (make deps)"
    RESULTS.mkdir(exist_ok=True)
    shot = RESULTS / "console.png"
    shot.unlink(missing_ok=True)
    before = ids(service)
    async with playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = await browser.new_page(viewport={"width": 1100, "height": 900})
            page.set_default_timeout(PATIENCE_MS)
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(str(exc)))
            page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
            await page.goto(f"{service.url}/#key={service.api_key}")
            await page.wait_for_function("location.hash === ''")  # the key left the address bar
            await page.locator("#status", has_text="connected").wait_for()
            await page.select_option("#template", "python-datasci")
            await page.click("#create button")
            panel = page.locator("section.panel:not([hidden])")
            cell = panel.locator(".cell").nth(0)
            await cell.locator("textarea").fill("print('hello', 'console', 6 * 7)\nx = 5")
            await cell.locator("textarea").press("Shift+Enter")
            await cell.locator(".cell-output pre.stdout", has_text="hello console 42").wait_for()
            plot = panel.locator(".cell").nth(1)
            await plot.locator("textarea").fill(
                "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2, x])\nplt.title('console')"
            )
            await plot.locator("button.run").click()
            image = plot.locator(".cell-output img")
            await image.wait_for()
            assert await image.evaluate("img => img.complete && img.naturalWidth > 100")
            await panel.locator("button.add").click()
            failing = panel.locator(".cell").nth(2)
            await failing.locator("textarea").fill("1 / 0")
            await failing.locator("button.run").click()
            await failing.locator("pre.error", has_text="ZeroDivisionError").wait_for()
            # fork into a new tab: the child has x
            await panel.locator("button.fork").click()
            await page.locator("nav#tabs button").nth(1).wait_for()
            child = page.locator("section.panel:not([hidden])")
            await child.locator(".toolbar", has_text="fork of").wait_for()
            await child.locator(".cell textarea").first.fill("print(x * 2)")
            await child.locator(".cell button.run").first.click()
            await child.locator(".cell-output pre.stdout", has_text="10").wait_for()
            await page.locator("nav#tabs button").nth(0).click()
            await page.screenshot(path=str(shot), full_page=True)
            opened = ids(service) - before
            assert len(opened) == 2, opened
            for remaining in (1, 0):  # delete both from the page
                await page.locator("section.panel:not([hidden]) button.delete").click()
                await playwright.expect(page.locator("section.panel")).to_have_count(remaining)
            assert ids(service) == before
            # a link carrying another key does not swap it in silently: it is only offered
            await page.goto(f"{service.url}/#key={service.other_key}")
            await page.reload()
            await page.locator("#status", has_text="different API key").wait_for()
            assert await page.evaluate("sessionStorage.getItem('kernelhost-key')") == service.api_key
            assert await page.input_value("#key") == service.other_key
            assert not problems, problems
        finally:
            await browser.close()
            left = ids(service) - before
            if left:  # a failure above: delete what the page created
                cli(service, "rm", *left)
    assert shot.stat().st_size > 10_000
