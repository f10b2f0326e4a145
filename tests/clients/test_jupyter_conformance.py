"""``jupyter_kernel_test``, the Jupyter project's kernel conformance suite, against kernelhost's
kernels as a new user runs them: kernelspecs installed by ``kernelhost kernelspec install``,
started by jupyter_client through the kernelhost provisioner, one VM per template. Every
optional sample is filled in, so no Python test is skipped; for R, the two tests of behaviour
IRkernel does not have (values as execute_result, history requests) are the only skips."""

from __future__ import annotations

import subprocess
import sys
import unittest
from pathlib import Path
from typing import Any

import jupyter_kernel_test as jkt
import pytest

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

jkt.TIMEOUT = 120  # a reply under software emulation, on a shared machine


class PythonSamples(jkt.KernelTests):  # type: ignore[misc]  # the package has no types
    __test__ = False  # run by _run against a kernelhost kernel, not collected by pytest as is
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "print?"
    code_generate_error = "raise"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "range", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"


class RSamples(jkt.KernelTests):  # type: ignore[misc]
    """IRkernel's samples. Debian's IRkernel (1.3) shows a cell's value as display_data, never
    as an execute_result, and answers no history_request: the suite's execute_result and
    history tests have nothing to check there."""

    __test__ = False
    language_name = "R"
    file_extension = ".r"
    code_hello_world = 'print("hello, world")'
    code_stderr = 'message("test")'
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["fun()", "1 + 2", "a <- 1", "print(1)"]
    incomplete_code_samples = ["fun(", "1 + ", "a <- ", "print("]
    invalid_code_samples = ["fun())", "1 +)", "a <-)"]
    code_page_something = "?cat"
    code_generate_error = 'stop("Error")'
    code_display_data = [
        {"code": "plot(iris)", "mime": "image/png"},
        {"code": "1 + 2", "mime": "text/plain"},  # a value, as IRkernel shows it
    ]
    code_inspect_sample = "print"
    code_clear_output = "IRdisplay::clear_output()"


def _install(env: dict[str, str], template: str) -> str:
    """The kernelspec of ``template``, installed by the real command next to the fixture's."""
    if template != "python":  # the fixture installed kernelhost-python already
        prefix = Path(env["JUPYTER_PATH"]).parents[1]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kernelhost.cli",
                "kernelspec",
                "install",
                "--template",
                template,
                "--prefix",
                str(prefix),
            ],
            env=env,
            check=True,
            timeout=60,
            capture_output=True,
        )
    return f"kernelhost-{template}"


def _run(samples: type[jkt.KernelTests], kernel: str) -> unittest.TestResult:
    case: Any = type(f"{samples.__name__}_{kernel}", (samples,), {"kernel_name": kernel})
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    return result


def _problems(result: unittest.TestResult) -> list[str]:
    return [f"{test}: {trace[-2000:]}" for test, trace in [*result.failures, *result.errors]]


@pytest.mark.parametrize("template", ["python", "python-datasci"])
def test_python_kernels_pass_the_conformance_suite_with_nothing_skipped(
    jupyter_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    for key, value in jupyter_env.items():
        monkeypatch.setenv(key, value)
    result = _run(PythonSamples, _install(jupyter_env, template))
    assert not _problems(result), "\n\n".join(_problems(result))
    assert result.skipped == [], result.skipped
    assert result.testsRun >= 12  # every test of KernelTests


def test_the_r_kernel_passes_the_conformance_suite(
    jupyter_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in jupyter_env.items():
        monkeypatch.setenv(key, value)
    result = _run(RSamples, _install(jupyter_env, "r"))
    assert not _problems(result), "\n\n".join(_problems(result))
    skipped = {str(test).split()[0]: why for test, why in result.skipped}
    assert skipped == {
        "test_execute_result": "No code execute result",
        "test_history": "No code execute result",
    }, skipped
