"""Executions through real VMs, on a service of their own (conftest.py says why): one module
per behaviour.

- test_results.py        rich results as MIME bundles, display updates, the result cap, datasci
- test_bash.py           bash: streaming, exit code, cwd and exports, stdin
- test_ladder.py         the timeout ladder, kernel and VM death, interrupt and restart
- test_output_limits.py  output caps and the host's memory under a flood
- test_files.py          files: 100 MB round trip, errors and limits, the sync SDK
- test_usage.py          each execution's wall time, CPU time and peak memory
"""
