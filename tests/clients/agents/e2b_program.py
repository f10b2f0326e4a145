"""A program written for E2B, as its docs show one: nothing in it knows kernelhost. It is run
with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at the service, and prints what it
saw as one JSON line (tests/clients/agents/test_e2b.py)."""

import json

from e2b_code_interpreter import Sandbox

with Sandbox.create() as sandbox:
    sandbox.run_code("x = 41")
    execution = sandbox.run_code("x += 1; print('hello'); x")
    sandbox.files.write("/home/user/data.txt", "written by E2B code")
    read_back = sandbox.files.read("/home/user/data.txt")
    result = sandbox.commands.run("cat data.txt | wc -c && echo $HOME")
    print(
        json.dumps(
            {
                "id": sandbox.sandbox_id,
                "text": execution.text,
                "stdout": execution.logs.stdout,
                "read": read_back,
                "command": result.stdout,
                "exit_code": result.exit_code,
                "running": sandbox.is_running(),
            }
        )
    )
