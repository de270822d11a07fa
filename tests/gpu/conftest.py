"""The GPU check's tests: each carries the `gpu` marker, so the normal suite (`-m "not gpu"`) deselects it;
run alone, each skips with its reason where the machine lacks what it needs (gpu_env.py), and reports one JSON
line when tests/gpu/run.py runs it (gpu_report.py). test_runner.py, the runner's own test, runs everywhere.
"""

import gpu_env  # noqa: F401 (puts the test helpers on sys.path)
from gpu_report import figures, pytest_runtest_makereport  # noqa: F401 (the fixture and the report hook)
