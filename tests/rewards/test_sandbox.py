"""The code sandbox and the code_tests reward: right/wrong/prefix scoring, and hostile programs (infinite
loop, fork bomb, 10 GB allocation, sockets, the host's secrets, huge files) contained and unscorable.

Limits are kept small (1 s of CPU, few processes): these tests share a small machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from posttrain.rewards import check_reward_signature, load_reward
from posttrain.rewards.code import code_reward, extract_code, normalize_output, parse_tests
from posttrain.rewards.sandbox import SandboxError, run_sandboxed, sandbox_isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

TIGHT = dict(cpu_seconds=1, wall_seconds=4, max_processes=6)
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}]

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def reward(**options):
    return code_reward(**{"cpu_seconds": 1, "wall_seconds": 4, "max_processes": 6, "max_workers": 2, **options})


def sandbox_processes() -> list[int]:
    """Host pids of every process started by the sandbox (launcher, init or program) still alive."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:
                continue
            if b"posttrain-sandbox" in cmdline and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


# ------------------------------------------------------------------------------------------- scoring


def test_correct_program_scores_one_and_wrong_zero():
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    completions = [f"Here you go:\n```python\n{ADD}```\n", wrong, ADD]
    assert reward()(prompts=["p"] * 3, completions=completions, tests=[ADD_TESTS] * 3) == [1.0, 0.0, 1.0]


def test_prefix_of_expected_output_fails():
    tests = [[{"input": "", "output": "1\n2\n3\n"}]] * 3
    completions = ["print(1)\nprint(2)", "print('1\\n2\\n3   \\n\\n')", "print('1\\n2\\n3\\n4')"]
    # a prefix fails, trailing spaces and blank lines are forgiven, extra lines are not
    assert reward()(prompts=["p"] * 3, completions=completions, tests=tests) == [0.0, 1.0, 0.0]


def test_fraction_passed_and_apps_style_tests():
    tests = [{"inputs": ["1 1\n", "2 2\n", "3 3\n", "4 4\n"], "outputs": ["2", "4", "7", "8"]}]
    assert reward()(prompts=["p"], completions=[ADD], tests=tests) == [0.75]


def test_assert_tests_count_each_assert():
    tests = "import math\nassert add(1, 2) == 3\nassert add(2, 2) == 5\nx = add(3, 4)\nassert x == 7\n"
    good = "def add(a, b):\n    return a + b\n"
    assert [len(parse_tests(tests))] == [3]
    hack = good + "import sys\nsys.exit(0)\n"  # exiting before the tests run must not pass them
    crash = "def add(a, b):\n    raise ValueError('no')\n"
    result = reward()(prompts=["p"] * 3, completions=[good, hack, crash], tests=[tests] * 3)
    assert result == [pytest.approx(2 / 3), 0.0, 0.0]


def test_runtime_error_is_a_wrong_answer_not_unscorable():
    assert reward()(prompts=["p"], completions=["print(3)\nraise ValueError"], tests=[ADD_TESTS[:1]]) == [0.0]


def test_rows_without_tests_are_unscorable_and_bad_tests_raise():
    assert reward()(prompts=["p"] * 2, completions=[ADD, ADD], tests=[None, []]) == [None, None]
    with pytest.raises(TypeError, match=r"tests\[0\]"):
        reward()(prompts=["p"], completions=[ADD], tests=[42])


def test_extract_code_and_normalize():
    text = "```text\nno\n```\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") == "print(4)"
    assert extract_code("```python\nprint(5)\n") == "print(5)\n"  # cut off before its closing fence
    assert normalize_output("a  \r\nb\n\n\n") == "a\nb"


def test_registered_builtin_with_options():
    fn = load_reward("code_tests:cpu_seconds=1,wall_seconds=4,max_workers=2")
    check_reward_signature(fn, "code_tests", columns=["tests"])
    assert fn.limits["cpu_seconds"] == 1
    assert fn(prompts=["p"], completions=[ADD], tests=[ADD_TESTS]) == [1.0]


def test_concurrent_batch_keeps_order():
    completions = [ADD, "print(0)", "while True: pass", ADD]
    result = reward(max_workers=3)(prompts=["p"] * 4, completions=completions, tests=[ADD_TESTS] * 4)
    assert result == [1.0, 0.0, None, 1.0]


def test_ordinary_programs_still_work():
    # processes, threads, temporary files and shared-memory semaphores stay usable within the limits
    program = (
        "import tempfile\nfrom multiprocessing import Pool\n"
        "if __name__ == '__main__':\n    with Pool(2) as pool:\n        print(pool.map(abs, [-1, -2]))\n"
        "    with tempfile.NamedTemporaryFile('w') as f:\n        print(f.write('hi'))\n"
    )
    result = run_sandboxed(program, cpu_seconds=2, wall_seconds=20)
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "[1, 2]\n2\n"), result.stderr


# ---------------------------------------------------------------------------------- hostile programs


def test_infinite_loop_is_unscorable_and_stopped():
    start = time.monotonic()
    result = run_sandboxed("while True:\n    pass\n", **TIGHT)
    assert result.status == "timeout"
    assert time.monotonic() - start < TIGHT["wall_seconds"] + 5  # the limit held (with room for a loaded host)
    assert reward()(prompts=["p"], completions=["while True: pass"], tests=[ADD_TESTS]) == [None]
    sleeper = run_sandboxed("import time\ntime.sleep(60)", cpu_seconds=1, wall_seconds=1)
    assert sleeper.status == "timeout"  # no CPU used: the wall-clock limit ends it


def test_fork_bomb_is_contained_and_leaves_no_process():
    before = sandbox_processes()
    responsive: list[str] = []

    def meanwhile() -> None:  # the host keeps working while the bomb runs
        time.sleep(0.5)
        responsive.append(run_sandboxed("print('alive')", wall_seconds=30).stdout)

    other = threading.Thread(target=meanwhile)
    other.start()
    # through the reward, so the run's end is also checked to make the sample unscorable
    scores = reward(wall_seconds=1.5, max_processes=4)(prompts=["p"], completions=[FORK_BOMB], tests=[ADD_TESTS[:1]])
    other.join()
    assert scores == [None]
    assert responsive == ["alive\n"]
    assert sandbox_processes() == before == []
    result = run_sandboxed(FORK_BOMB, cpu_seconds=1, wall_seconds=1, max_processes=3)
    assert result.status in ("processes", "timeout") and sandbox_processes() == []


def test_processes_that_leave_the_group_do_not_survive():
    escape = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
        "        time.sleep(60)\n        os._exit(0)\nprint('left')\n"
    )
    result = run_sandboxed(escape, **TIGHT)
    assert result.stdout == "left\n"
    assert sandbox_processes() == []


def test_ten_gigabyte_allocation_is_unscorable():
    result = run_sandboxed("x = bytearray(10 * 2**30)\nprint(len(x))", memory_bytes=256 * 2**20, **TIGHT)
    assert result.status == "memory"
    assert reward(memory_mb=256)(prompts=["p"], completions=["x = [0] * (10**10)"], tests=[ADD_TESTS[:1]]) == [None]


@pytest.mark.parametrize("address", [("127.0.0.1", 22), ("1.1.1.1", 80)])
def test_socket_connect_is_refused_and_unscorable(address):
    program = f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect({address!r})\nprint('connected')\n"
    result = run_sandboxed(program, **TIGHT)
    assert result.status == "violation" and "connected" not in result.stdout
    assert any(v.startswith("network:") for v in result.violations)
    caught = "try:\n" + "".join(f"    {line}\n" for line in program.splitlines()) + "except OSError:\n    print(3)\n"
    # swallowing the refusal does not make the run count
    assert reward()(prompts=["p"], completions=[caught], tests=[ADD_TESTS[:1]]) == [None]


def test_network_namespace_blocks_what_the_guard_does_not_see():
    if "netns" not in sandbox_isolation():
        pytest.skip("no network namespace on this machine: only the Python guard stands")
    program = (
        "import socket\nfor address in [('127.0.0.1', 22), ('1.1.1.1', 80)]:\n"
        "    s = socket.socket()\n    s.settimeout(2)\n    try:\n        s.connect(address)\n"
        "        print('connected')\n    except OSError as error:\n        print(error.errno)\n"
    )
    result = run_sandboxed(program, python_guard=False, **TIGHT)
    assert result.status == "ok"
    assert "connected" not in result.stdout and result.stdout.split() == ["101", "101"]  # ENETUNREACH


def test_host_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SECRET", "x")
    program = """
import os
print(sorted(os.environ))
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found.append(b"POSTTRAIN_SECRET" in f.read())
        except OSError:
            pass
print(any(found))
"""
    result = run_sandboxed(program, **TIGHT)
    assert result.status in ("ok", "violation") and result.stdout.split("\n")[1] == "False"
    assert "POSTTRAIN_SECRET" not in result.stdout


@pytest.mark.parametrize(
    "probe",
    [
        "os.environ['POSTTRAIN_SECRET']",
        "os.getenv('POSTTRAIN_SECRET')",
        "'POSTTRAIN_SECRET' in os.environ",
        "os.environb.get(b'POSTTRAIN_SECRET')",
        "os.path.expandvars('$POSTTRAIN_SECRET')",
    ],
)
def test_looking_up_a_host_secret_is_unscorable(monkeypatch, probe):
    monkeypatch.setenv("POSTTRAIN_SECRET", "x")
    result = run_sandboxed(f"import os\ntry:\n    print({probe})\nexcept KeyError:\n    print('unset')\n", **TIGHT)
    assert result.status == "violation" and result.violations == ("environment: host variable lookup",)
    assert "x" not in result.stdout.split()
    leak = f"import os\nprint({probe})"
    assert reward()(prompts=["p"], completions=[leak], tests=[[{"input": "", "output": "x"}]]) == [None]


def test_reading_another_process_environment_is_unscorable():
    program = "import os\nopen(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
    result = run_sandboxed(program, **TIGHT)
    assert result.status == "violation" and result.violations == ("environment: open /proc/<pid>/environ",)
    own = "import os\nprint(len(open('/proc/self/environ', 'rb').read()) > 0)\n"
    assert run_sandboxed(own, **TIGHT).status == "ok"


def test_unset_or_harmless_variables_are_not_violations(monkeypatch):
    monkeypatch.setenv("USER", "someone")
    program = (
        "import os, tempfile, shutil, getpass\nprint(os.getenv('NOT_SET_ANYWHERE_XYZ'), os.environ.get('USER'))\n"
        "print(shutil.get_terminal_size().columns > 0, bool(tempfile.gettempdir()))\n"
    )
    result = run_sandboxed(program, **TIGHT)
    assert result.status == "ok" and result.violations == ()
    assert result.stdout.split() == ["None", "None", "True", "True"]


def test_huge_file_is_limited():
    program = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)\n"
    result = run_sandboxed(program, file_bytes=4 * 2**20, **TIGHT)
    assert result.status == "file_size"
    assert reward(file_mb=4)(prompts=["p"], completions=[program], tests=[ADD_TESTS[:1]]) == [None]


def test_writes_stay_inside_the_sandbox():
    if "scratch-tmpfs" not in sandbox_isolation():
        pytest.skip("no mount namespace here: the program writes to the host's scratch directory")
    name = f"/var/tmp/posttrain-escape-{os.getpid()}"
    program = f"open({name!r}, 'w').write('x')\nopen('/etc/posttrain-escape', 'w')\n"
    result = run_sandboxed(program, **TIGHT)
    assert "Read-only file system" in result.stderr and result.exit_code == 1
    assert not os.path.exists(name) and not os.path.exists("/etc/posttrain-escape")
    many = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n"  # 100 MiB in 1 MiB files
    assert "No space left on device" in run_sandboxed(many, scratch_bytes=16 * 2**20, **TIGHT).stderr


def test_flooding_stdout_ends_the_run():
    result = run_sandboxed("while True:\n    print('x' * 1000)", max_output_bytes=100_000, **TIGHT)
    assert result.status == "output_limit" and len(result.stdout) <= 100_000


@pytest.mark.parametrize(
    "program",
    [
        "import subprocess\nsubprocess.run(['ls'])",
        "import ctypes\nctypes.CDLL(None)",
        "import os, signal\nos.kill(-1, signal.SIGKILL)",
    ],
)
def test_exec_ctypes_and_mass_signals_are_violations(program):
    assert run_sandboxed(program, **TIGHT).status == "violation"


def test_scratch_directory_is_private_and_removed(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    program = (
        "import os\nopen('note.txt', 'w').write('hi')\nos.mkdir('d')\nos.chmod('d', 0)\nprint(sorted(os.listdir('.')))"
    )
    result = run_sandboxed(program, **TIGHT)
    assert result.status == "ok" and result.stdout == "['d', 'note.txt']\n"
    assert list(tmp_path.iterdir()) == []


def test_bad_limits_raise():
    with pytest.raises(SandboxError, match="cpu_seconds"):
        run_sandboxed("pass", cpu_seconds=0)


def test_unprivileged_user_gets_the_same_containment():
    """Where the suite runs as root, run the sandbox as an ordinary user too (the user-namespace path)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root (to become another user) and a system python3")
    sandbox_file = Path(__file__).parents[2] / "posttrain" / "rewards" / "sandbox.py"
    # posttrain itself (and torch) may not be importable by that python: load the stdlib-only module alone
    source = f"""
import importlib.util, sys, types
errors = types.ModuleType("posttrain.errors")
errors.PosttrainError = Exception
sys.modules.update({{"posttrain": types.ModuleType("posttrain"), "posttrain.errors": errors}})
spec = importlib.util.spec_from_file_location(
    "sandbox", {str(sandbox_file)!r})
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
limits = dict(cpu_seconds=1, wall_seconds=1, max_processes=3)
# the benign program gets the suite's usual 4 s (TIGHT): the user-namespace setup alone can pass 1 s on a loaded host
print(sandbox.run_sandboxed("print(6 * 7)", **dict(limits, wall_seconds=4)).stdout.strip())
print(sandbox.run_sandboxed({FORK_BOMB!r}, **limits).status)
print(sandbox.run_sandboxed("import socket; socket.create_connection(('1.1.1.1', 80))", **limits).status)
print(sandbox.run_sandboxed("bytearray(10 * 2**30)", **limits).status)
"""
    done = subprocess.run(
        [python, "-I", "-c", source],
        capture_output=True,
        text=True,
        timeout=60,
        user=54321,
        group=54321,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    if "Permission denied" in done.stderr and "sandbox.py" in done.stderr:
        pytest.skip("the repository is not readable by an unprivileged user here")
    assert done.returncode == 0, done.stderr
    hello, bomb, network, memory = done.stdout.split()
    assert (hello, network, memory) == ("42", "violation", "memory") and bomb in ("processes", "timeout")
    assert sandbox_processes() == []
