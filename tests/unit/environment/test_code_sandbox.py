"""The code environment runs untrusted programs in a sandbox that contains every abuse and survives it."""

import os
import socket

import pytest
from needs import require

from services.environment.envs.code import CodeEnvironment, extract_program
from services.environment.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=5, cpu_s=5, memory_mb=256, max_processes=8, max_file_mb=1, max_open_files=32)
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
CORRECT = "def add(a, b):\n    return a + b\n"


def answer(program: str) -> list[dict]:
    return [{"role": "user", "content": "Write add(a, b)."},
            {"role": "assistant", "content": f"Here you go:\n```python\n{program}```\nDone."}]


def score(program: str, tests: str = TESTS, limits: SandboxLimits = LIMITS):
    env = CodeEnvironment(limits)
    return env.step([answer(program)], [{"tests": tests}], return_extracted_answer=True)[0]


def assert_still_healthy():
    """The calling process can still run a correct program in a fresh sandbox."""
    assert run_python(CORRECT, TESTS, LIMITS).passed


def test_correct_solution_passes():
    result = score(CORRECT)
    assert (result.reward, result.error, result.terminated) == (1.0, "", True)
    assert result.observation == "Environment: tests passed"
    assert result.answer == CORRECT


def test_failing_assert_is_a_wrong_answer_not_an_error():
    result = score("def add(a, b):\n    return a - b\n")
    assert (result.reward, result.error) == (0.0, "")
    assert "AssertionError" in result.observation


def test_tests_may_be_a_list_of_asserts():
    env = CodeEnvironment(LIMITS)
    result = env.step([answer(CORRECT)], [{"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}])[0]
    assert result.reward == 1.0


def test_fork_bomb_is_contained():
    result = score("import os\nwhile True:\n    os.fork()\n")
    assert (result.reward, result.error) == (0.0, "processes")
    assert_still_healthy()


def test_memory_bomb_is_contained():
    result = score("hog = []\nwhile True:\n    hog.append(bytearray(10**7))\n")
    assert (result.reward, result.error) == (0.0, "memory")
    assert_still_healthy()


def test_infinite_loop_is_killed_at_the_deadline():
    result = score("while True:\n    pass\n", limits=SandboxLimits(wall_s=1, cpu_s=5, memory_mb=256))
    assert (result.reward, result.error) == (0.0, "timeout")
    assert_still_healthy()


@pytest.fixture
def loopback_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


def assert_never_connected(server):
    with pytest.raises(BlockingIOError):
        server.accept()


def test_network_connect_is_refused(loopback_server):
    port = loopback_server.getsockname()[1]
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n" + CORRECT
    result = score(program)
    assert (result.reward, result.error) == (0.0, "network")
    assert_never_connected(loopback_server)


def test_network_attempt_fails_even_when_the_program_swallows_the_error(loopback_server):
    port = loopback_server.getsockname()[1]
    program = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n" \
              "except Exception:\n    pass\n" + CORRECT
    result = score(program)
    assert (result.reward, result.error) == (0.0, "network")
    assert_never_connected(loopback_server)


def test_kernel_blocks_network_when_the_socket_guard_is_bypassed(loopback_server):
    port = loopback_server.getsockname()[1]
    real_socket = "[c for c in socket.socket.__mro__ if c.__module__ == '_socket'][0]"  # the C class
    program = f"import socket\ns = {real_socket}(socket.AF_INET, socket.SOCK_STREAM)\n" \
              f"s.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n"
    outcome = run_python(program, "", LIMITS)
    require(outcome.network_isolated, "no network namespace here; only the socket guard applies")
    assert (outcome.passed, outcome.error) == (False, "network")
    assert_never_connected(loopback_server)


def test_write_outside_the_work_dir_is_refused(tmp_path):
    target = tmp_path / "outside.txt"
    result = score(f"open({str(target)!r}, 'w').write('pwned')\n" + CORRECT)
    assert (result.reward, result.error) == (0.0, "filesystem")
    assert not target.exists()
    assert_still_healthy()


def test_os_level_write_outside_the_work_dir_is_refused(tmp_path):
    target = tmp_path / "outside.txt"
    program = f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n"
    assert run_python(program, "", LIMITS).error == "filesystem"
    assert not target.exists()


def test_writes_inside_the_work_dir_are_allowed():
    program = "with open('scratch.txt', 'w') as f:\n    f.write('hi')\n" \
              "assert open('scratch.txt').read() == 'hi'\n"
    assert run_python(program, "", LIMITS).passed


def test_huge_output_hits_the_file_size_limit():
    outcome = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 10000)\n", "", LIMITS)
    assert (outcome.passed, outcome.error) == (False, "file size")


def test_exiting_early_with_status_zero_is_not_a_pass():
    result = score("import os\nos._exit(0)\n")
    assert (result.reward, result.error) == (0.0, "exit code 0")


def test_exit_before_the_tests_is_not_a_pass():
    result = score("import sys\nsys.exit(3)\n")
    assert (result.reward, result.error) == (0.0, "exit code 3")


def test_printed_fake_verdict_is_not_a_pass():
    program = 'import os, json\nfor fd in range(3, 32):\n    try:\n' \
              '        os.write(fd, json.dumps({"passed": True, "error": ""}).encode() + b"\\n")\n' \
              '    except OSError:\n        pass\nos._exit(0)\n'
    assert score(program).reward == 0.0


def test_stdout_and_stderr_tails_come_back():
    outcome = run_python("print('hello')\nimport sys\nprint('oops', file=sys.stderr)\n", "", LIMITS)
    assert outcome.passed
    assert (outcome.stdout, outcome.stderr) == ("hello\n", "oops\n")


def test_missing_code_block_fails_with_an_error():
    env = CodeEnvironment(LIMITS)
    result = env.step([[{"role": "assistant", "content": "I would rather not."}]], [{"tests": TESTS}])[0]
    assert (result.reward, result.error) == (0.0, "no code block")


def test_bad_metadata_fails_only_that_episode():
    env = CodeEnvironment(LIMITS)
    bad, good = env.step([answer(CORRECT), answer(CORRECT)], [{}, {"tests": TESTS}])
    assert bad.reward == 0.0 and "tests" in bad.error
    assert (good.reward, good.error) == (1.0, "")


def test_program_comes_from_the_last_fenced_block_or_code_tag():
    assert extract_program("```python\na = 1\n```\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_program("```py\nc = 3\n```") == "c = 3\n"
    assert extract_program("<code>d = 4</code> and <code>e = 5</code>") == "e = 5"
    assert extract_program("print('no block')") is None


def test_sandbox_leaves_this_process_unchanged():
    pid, cwd = os.getpid(), os.getcwd()
    score("import os\nos.chdir('/')\n" + CORRECT)
    assert (os.getpid(), os.getcwd()) == (pid, cwd)
