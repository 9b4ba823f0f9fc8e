"""The sandbox: results per test, failure messages, a program's output, no network, killed at the timeout."""

import socket

import pytest

from composer_serverless.environments.sandbox import (
    ProgramResult,
    network_namespace_available,
    run_program,
    run_tests,
)


@pytest.fixture
def listener():
    """A real TCP server on loopback that a sandboxed program would reach if it had any network."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def test_each_test_is_reported_with_its_failure_message():
    result = run_tests(
        "def double(x):\n    return 2 * x\n",
        ["assert double(2) == 4", "assert double(3) == 7, 'double(3) should be 7'", "assert double(1) == 3"],
        timeout_s=30,
    )
    assert [t.passed for t in result.tests] == [True, False, False]
    assert result.tests[1].error == "AssertionError: double(3) should be 7"
    assert result.tests[2].error == "AssertionError"
    assert result.passed_fraction == pytest.approx(1 / 3)
    assert (
        result.first_failure()
        == "assert double(3) == 7, 'double(3) should be 7' -> AssertionError: double(3) should be 7"
    )


def test_code_that_does_not_run_fails_every_test_with_its_error():
    result = run_tests("def f(:\n", ["assert True", "assert True"], timeout_s=30)
    assert result.passed_fraction == 0
    assert all(t.error.startswith("the code failed: SyntaxError") for t in result.tests)


@pytest.mark.parametrize("namespace", [False, True], ids=["audit-hook", "audit-hook+netns"])
def test_a_solution_cannot_connect_to_a_listening_socket(listener, namespace):
    if namespace and not network_namespace_available():
        pytest.skip("unprivileged network namespaces are not available here")
    code = (
        "import socket\n"
        "def reach():\n"
        f"    socket.create_connection(('127.0.0.1', {listener}), timeout=5)\n"
        "    return True\n"
    )
    result = run_tests(code, ["assert reach()"], timeout_s=30, network_namespace=namespace)
    assert not result.tests[0].passed
    assert "PermissionError: sandbox: socket." in result.tests[0].error


def test_the_network_namespace_has_no_interface_but_loopback():
    """The second layer on its own: what the child sees of the network when the namespace is on."""
    if not network_namespace_available():
        pytest.skip("unprivileged network namespaces are not available here")
    code = (
        "interfaces = sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:])\n"
    )
    result = run_tests(
        code, ["assert interfaces == ['lo'], interfaces"], timeout_s=30, network_namespace=True
    )
    assert result.tests[0].passed, result.tests[0].error


def test_starting_a_process_is_refused():
    result = run_tests("import os\nos.system('echo escaped')\n", ["assert True"], timeout_s=30)
    assert "PermissionError: sandbox: os.system is not allowed" in result.tests[0].error


def test_an_endless_loop_is_killed_at_the_timeout():
    result = run_tests("while True:\n    pass\n", ["assert True"], timeout_s=1)
    assert result.timed_out
    assert result.tests == ()
    assert result.passed_fraction == 0
    assert result.first_failure() == "timed out after 1s"


def test_a_program_that_exits_early_scores_nothing():
    result = run_tests("import os\nos._exit(0)\n", ["assert True"], timeout_s=30)
    assert result.passed_fraction == 0
    assert result.first_failure().startswith("the program did not finish")


def test_output_without_a_final_newline_does_not_hide_the_report():
    result = run_tests(
        "print('no newline', end='')\ndef f():\n    return 1\n", ["assert f() == 1"], timeout_s=30
    )
    assert result.passed_fraction == 1


def test_a_program_shows_its_output_and_the_last_line_of_its_traceback():
    result = run_program(
        "import sys\nprint('out', end='')\nprint('err', file=sys.stderr)\n1 / 0\n", timeout_s=30
    )
    assert result.stdout == "out"
    assert result.stderr == (
        "err\nTraceback (most recent call last):\n"
        '  File "<solution>", line 4, in <module>\n'
        "    1 / 0\n"
        "    ~~^~~\n"
        "ZeroDivisionError: division by zero\n"
    )
    assert result.error == "ZeroDivisionError: division by zero" and not result.timed_out


def test_a_program_that_exits_0_ran_to_its_end_and_one_that_loops_is_killed():
    assert run_program("print('done')\nexit(0)\n", timeout_s=30) == ProgramResult("done\n", "", None)
    assert run_program("exit(3)\n", timeout_s=30).error == "SystemExit: 3"
    looped = run_program("print('spin', flush=True)\nwhile True:\n    pass\n", timeout_s=1)
    assert looped.timed_out and looped.error == "timed out after 1s" and looped.stdout.startswith("spin")
