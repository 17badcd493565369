"""Run untrusted Python (a completion's code) in a separate, limited process: `run_sandboxed`.

Linux only, standard library only. The layers, from the outside in (docs/rewards.md has the table of
what each one guarantees and when it is available):

- resource limits on the program's process (setrlimit): CPU seconds, address space, size of any one
  file written, number of processes (tasks) of its uid, open files, no core dumps; a wall-clock limit
  enforced from here by killing the whole process group;
- a scrubbed environment (nothing of os.environ is passed on) and `python -I -S -B` (no user site, no
  PYTHON* variables, no site-packages, no bytecode writes);
- on a root host, a uid of the run's own with no groups and no capabilities: the process count is that
  run's alone, and the host's files and processes are out of reach as for any stranger;
- namespaces (through a user namespace when not root): an empty network namespace (no interface is
  up, so nothing can be sent anywhere, 127.0.0.1 included), a PID namespace (the program sees only its
  own processes and all of them die with it), a mount namespace in which every mount is read-only but a
  size-bounded tmpfs that serves as scratch, /tmp, /var/tmp and /dev/shm, and a private /proc;
- inside the interpreter, an audit hook that refuses (and reports) sockets, exec/spawn, ctypes and
  signals to process groups, and a report when the process limit stops a fork or a thread.

The child side is `sandbox_child.py`, passed to the interpreter as source. It is started with
subprocess's own session and uid handling only, never a `preexec_fn`: Python documents that as unsafe
with threads, and rewards run in a thread pool inside a multi-threaded trainer.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from posttrain.errors import PosttrainError

# How a run ended. Only "ok" means the program finished on its own within every limit; every other
# status makes a code reward unscorable (the program's fate says nothing certain about its answer).
STATUSES = ("ok", "timeout", "memory", "file_size", "processes", "output_limit", "violation", "crashed", "killed")

_CHILD_SOURCE = (Path(__file__).with_name("sandbox_child.py")).read_text(encoding="utf-8")
_CHANNEL_LIMIT = 64 * 1024  # bytes kept from each report channel; the program could flood its own


class SandboxError(PosttrainError):
    """The sandbox itself could not be set up (not a verdict about the program): raised, never scored."""


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    `status` is one of STATUSES. `exit_code` is set when the program exited by itself, `signal` when a
    signal ended it. stdout/stderr are decoded as UTF-8 (bad bytes replaced) and cut at the bounds given
    to `run_sandboxed` (`*_truncated` then True). `violations` lists what the guard refused, as
    "kind: event" ("network: socket.connect"). `isolation` names the layers that were in force.
    `check_passed` is None without a check, else whether the check source ran to its end.
    """

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_seconds: float
    cpu_seconds: float | None
    violations: tuple[str, ...]
    isolation: tuple[str, ...]
    check_passed: bool | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_sandboxed(
    code: str,
    stdin: str = "",
    *,
    check: str | None = None,
    cpu_seconds: float = 5.0,
    wall_seconds: float = 10.0,
    memory_bytes: int = 512 * 2**20,
    file_bytes: int = 16 * 2**20,
    max_processes: int = 16,
    max_open_files: int = 64,
    scratch_bytes: int = 64 * 2**20,
    max_output_bytes: int = 2**20,
    max_stderr_bytes: int = 64 * 2**10,
    python: str | None = None,
    python_guard: bool = True,
    namespaces: bool = True,
) -> SandboxResult:
    """Run Python source `code` as a program in the sandbox, feeding it `stdin`.

    Limits: `cpu_seconds` of CPU (rounded up to whole seconds; SIGXCPU, then SIGKILL a second later),
    `wall_seconds` of wall-clock time for the whole run, `memory_bytes` of address space per process,
    `file_bytes` for any one file written, `max_processes` tasks (processes and threads, the program's
    own included), `max_open_files` descriptors, `scratch_bytes` for everything written (the scratch
    tmpfs, where mount namespaces work). stdout beyond `max_output_bytes` ends the run
    ("output_limit"); stderr beyond `max_stderr_bytes` is dropped.

    `check`: Python source run after `code` in the same `__main__` namespace (e.g. assert statements);
    `check_passed` says whether it ran to its end. `python`: the interpreter (default: this one's).
    `python_guard=False` / `namespaces=False` turn a layer off (for testing the others alone).

    Raises SandboxError when the sandbox cannot be set up; whatever the program does is a result.
    """
    _check_limits(
        cpu_seconds=cpu_seconds,
        wall_seconds=wall_seconds,
        memory_bytes=memory_bytes,
        file_bytes=file_bytes,
        max_processes=max_processes,
        max_open_files=max_open_files,
        scratch_bytes=scratch_bytes,
        max_output_bytes=max_output_bytes,
        max_stderr_bytes=max_stderr_bytes,
    )
    interpreter, expose = _interpreter(python or sys.executable)
    uid = _run_uid() if os.geteuid() == 0 else None
    nonce = secrets.token_hex(16)
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="posttrain-sandbox-"))  # compared with mount points
    fds: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    try:
        if uid is not None:  # where no mount namespace covers it with a tmpfs, the program writes here
            os.chown(scratch, uid, uid)
        payload = {"code": code, "check": check, "nonce": nonce, "host_names": _host_names()}
        code_fd = _memfd(json.dumps(payload).encode("utf-8"))
        supervisor_r, supervisor_w = os.pipe()
        runner_r, runner_w = os.pipe()
        fds += [code_fd, supervisor_r, supervisor_w, runner_r, runner_w]
        config = {
            "python": interpreter,
            "expose": expose if uid is not None else [],
            "scratch": scratch,
            "uid": uid,
            "scratch_bytes": scratch_bytes,
            "max_processes": max_processes,
            "guard": python_guard,
            "namespaces": namespaces,
            "source": _CHILD_SOURCE,
            "code_fd": code_fd,
            "supervisor_fd": supervisor_w,
            "runner_fd": runner_w,
            "limits": {
                "cpu_seconds": max(1, int(-(-cpu_seconds // 1))),
                "memory_bytes": memory_bytes,
                "file_bytes": file_bytes,
                "open_files": max_open_files,
            },
        }
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [interpreter, "-I", "-S", "-B", "-c", _CHILD_SOURCE, "launch", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,
                env=_scrubbed_env(scratch),
                pass_fds=(code_fd, supervisor_w, runner_w),
                start_new_session=True,  # its own process group: the wall-clock kill takes all of it
            )
        except OSError as error:
            raise SandboxError(f"sandbox: cannot start {interpreter}: {error}") from error
        for fd in (code_fd, supervisor_w, runner_w):  # the children hold these now
            os.close(fd)
            fds.remove(fd)
        streams = _exchange(
            proc,
            stdin.encode("utf-8"),
            supervisor_r,
            runner_r,
            start + wall_seconds,
            max_output_bytes,
            max_stderr_bytes,
        )
        wall = time.monotonic() - start
    finally:
        if proc is not None:
            _kill_all(proc, uid)
        for fd in fds:
            _close(fd)
        _remove_tree(scratch)
    return _verdict(streams, wall, nonce, cpu_seconds, check is not None, python_guard, uid is not None)


def _check_limits(**limits: float) -> None:
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise SandboxError(f"run_sandboxed: {name} must be a positive number, got {value!r}")


def _scrubbed_env(scratch: str) -> dict[str, str]:
    # Built from nothing: the host's variables (API keys, tokens, paths) are never passed on.
    # MALLOC_ARENA_MAX: glibc reserves 64 MiB of address space per thread arena, which would eat the
    # address-space limit of a program with a few threads without it using any memory.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": scratch,
        "TMPDIR": scratch,
        "MALLOC_ARENA_MAX": "2",
    }


# Host variables the standard library itself looks up (tempfile, getpass, shutil.get_terminal_size,
# locale, ...): a program asking for them is not after a secret, so they are not reported.
_HARMLESS_HOST_NAMES = frozenset(
    {
        "USER",
        "LOGNAME",
        "USERNAME",
        "LNAME",
        "HOME",
        "SHELL",
        "PWD",
        "OLDPWD",
        "TERM",
        "COLUMNS",
        "LINES",
        "TMPDIR",
        "TEMP",
        "TMP",
        "TZ",
        "LANG",
        "LANGUAGE",
        "LC_ALL",
        "LC_CTYPE",
        "LC_MESSAGES",
        "PATH",
        "NO_COLOR",
        "FORCE_COLOR",
        "TERM_PROGRAM",
        "HOSTNAME",
        "DISPLAY",
    }
)


def _host_names() -> dict:
    """Salted hashes of the host's environment variable names, for the guard's lookup report: the child
    learns which names are the host's without the names (or any value) reaching the program."""
    salt = secrets.token_hex(16)
    names = (name for name in os.environ if name not in _HARMLESS_HOST_NAMES and not name.startswith("LC_"))
    return {"salt": salt, "hashes": sorted(_name_hash(salt, name) for name in names)}


def _name_hash(salt: str, name: str) -> str:
    # the child computes the same (sandbox_child._watch_environment); it has no imports of ours
    return hashlib.sha256((salt + name).encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _run_uid() -> int:
    # A uid no account uses, fresh for each run: RLIMIT_NPROC then counts this run's processes only,
    # and a sweep by uid after the run finds exactly its leftovers.
    return 1_000_000_000 + secrets.randbelow(1_000_000_000)


def _memfd(data: bytes) -> int:
    # The code reaches the child through an anonymous file, not argv (visible in ps, size-limited) nor
    # the scratch directory (which the program could read back and which a tmpfs covers).
    fd = os.memfd_create("posttrain-sandbox-code")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@lru_cache(maxsize=8)
def _interpreter(python: str) -> tuple[str, list[list[str]]]:
    """(the interpreter's real path, [[install dir, its closed ancestor], ...]) — the install directories
    whose way down an unprivileged stranger cannot walk (the launcher makes them reachable)."""
    real = os.path.realpath(python)
    if not os.access(real, os.X_OK):
        raise SandboxError(f"sandbox: interpreter {python} is not executable")
    if real == os.path.realpath(sys.executable):
        prefix = sys.base_prefix
    else:
        probe = subprocess.run(
            [real, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin"},
        )
        prefix = probe.stdout.strip() or os.path.dirname(os.path.dirname(real))
    expose = []
    for path in sorted({os.path.realpath(prefix), os.path.dirname(real)}):
        closed = _closed_ancestor(path)
        if closed is not None and not any(path.startswith(p + "/") for p, _ in expose):
            expose.append([path, closed])
    return real, expose


def _closed_ancestor(path: str) -> str | None:
    """The highest proper ancestor of `path` that others may not search (no o+x), or None."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        ancestor = str(Path(*parts[:i]))
        try:
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                return ancestor
        except OSError:
            return None
    return None


@dataclass
class _Streams:
    stdout: bytearray
    stderr: bytearray
    supervisor: bytearray
    runner: bytearray
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    output_overflow: bool = False


def _exchange(
    proc: subprocess.Popen[bytes],
    data: bytes,
    supervisor_fd: int,
    runner_fd: int,
    deadline: float,
    max_output: int,
    max_stderr: int,
) -> _Streams:
    """Feed stdin and collect stdout, stderr and both report channels until they close and the launcher
    exits, or the deadline passes, or stdout overflows. Kills nothing: the caller does that."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    streams = _Streams(bytearray(), bytearray(), bytearray(), bytearray())
    sinks = {
        proc.stdout.fileno(): (streams.stdout, max_output, "stdout"),
        proc.stderr.fileno(): (streams.stderr, max_stderr, "stderr"),
        supervisor_fd: (streams.supervisor, _CHANNEL_LIMIT, None),
        runner_fd: (streams.runner, _CHANNEL_LIMIT, None),
    }
    selector = selectors.DefaultSelector()
    for fd in sinks:
        selector.register(fd, selectors.EVENT_READ)
    pending = memoryview(data)
    stdin_fd = proc.stdin.fileno()
    if pending:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    grace_end = None
    try:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                streams.timed_out = True
                return streams
            if grace_end is None and _exited(proc.pid):
                # Where namespaces end everything with the launcher the pipes close at once; elsewhere a
                # process the program left behind may hold them open: don't wait on it.
                grace_end = now + 0.2
            if grace_end is not None and now >= grace_end:
                return streams
            for key, _ in selector.select(min(deadline, grace_end or deadline, now + 0.05) - now):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the program stopped reading: the rest of its input is dropped
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                buffer, limit, name = sinks[fd]
                if not chunk:
                    selector.unregister(fd)
                    continue
                room = limit - len(buffer)
                buffer += chunk[: max(room, 0)]
                if len(chunk) > room:
                    if name == "stdout":
                        streams.stdout_truncated = streams.output_overflow = True
                        return streams
                    if name == "stderr":
                        streams.stderr_truncated = True
        # every pipe is closed; wait for the launcher without reaping it, so its process group id stays
        # reserved until the group has been killed (see _kill_all)
        while not _exited(proc.pid):
            if time.monotonic() >= deadline:
                streams.timed_out = True
                return streams
            time.sleep(0.002)
        return streams
    finally:
        selector.close()
        if not proc.stdin.closed:
            proc.stdin.close()


def _exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_all(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    """SIGKILL the launcher's process group (the launcher, the PID namespace's init and the program: the
    kernel then kills everything else in that namespace), then, on a root host, every process of the
    run's uid (leftovers that left the group where no PID namespace holds them), then reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the unreaped launcher keeps the group id from being reused
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        for _ in range(100):  # a fork bomb may still be forking while the sweep runs
            if not _kill_uid(uid):
                break
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _kill_uid(uid: int) -> int:
    killed = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed += 1
            except OSError:
                continue
    return killed


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    # The program may have left directories it made unreadable or unwritable (where it wrote to the host
    # directory itself); their owner, or root, can open them up again.
    os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


def _lines(buffer: bytearray) -> list[list[str]]:
    return [line.split(" ", 2) for line in buffer.decode("utf-8", "replace").splitlines() if line]


def _verdict(
    streams: _Streams, wall: float, nonce: str, cpu_limit: float, has_check: bool, guard: bool, dropped_uid: bool
) -> SandboxResult:
    supervisor, runner = _lines(streams.supervisor), _lines(streams.runner)
    for words in supervisor:
        if words[0] == "setup-error":
            message = " ".join(words[1:])
            if "Permission denied" in message and dropped_uid:
                message += (
                    " (on a root host the program runs as an unprivileged uid of its own: pass python= an "
                    "interpreter everyone may read, or run where mount namespaces work)"
                )
            raise SandboxError(f"sandbox setup failed: {message}")
    isolation = tuple(words[1] for words in supervisor if words[0] == "layer" and len(words) > 1)
    isolation += ("python-guard",) if guard else ()
    ending = next((words for words in supervisor if words[0] in ("exit", "signal") and len(words) == 3), None)
    exit_code = signum = cpu = None
    if ending is not None:
        value, cpu = int(ending[1]), float(ending[2])
        exit_code, signum = (value, None) if ending[0] == "exit" else (None, value)
    violations = tuple(dict.fromkeys(f"{w[1]}: {w[2]}" for w in runner if w[0] == "violation" and len(w) == 3))
    kinds = {v.split(":", 1)[0] for v in violations}
    memory = any(w[0] == "memory" for w in runner)
    passed = any(w == ["passed", nonce] for w in runner) if has_check else None

    if violations and kinds != {"processes"}:
        status = "violation"
    elif kinds == {"processes"}:
        status = "processes"
    elif memory:
        status = "memory"
    elif streams.timed_out:
        status = "timeout"
    elif streams.output_overflow:
        status = "output_limit"
    elif signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu is not None and cpu >= cpu_limit):
        status = "timeout"
    elif signum == signal.SIGXFSZ:
        status = "file_size"
    elif signum == signal.SIGKILL:
        status = "killed"
    elif signum is not None or ending is None:
        status = "crashed"  # a fatal signal, or the program's end was never reported
    else:
        status = "ok"
    return SandboxResult(
        status=status,
        exit_code=exit_code,
        signal=signum,
        stdout=streams.stdout.decode("utf-8", "replace"),
        stderr=streams.stderr.decode("utf-8", "replace"),
        stdout_truncated=streams.stdout_truncated,
        stderr_truncated=streams.stderr_truncated,
        wall_seconds=wall,
        cpu_seconds=cpu,
        violations=violations,
        isolation=isolation,
        check_passed=passed if status == "ok" else (False if has_check else None),
    )


def sandbox_isolation(python: str | None = None) -> tuple[str, ...]:
    """The isolation layers a run gets on this machine (runs a trivial program once per interpreter)."""
    return _isolation(python or sys.executable)


@lru_cache(maxsize=4)
def _isolation(python: str) -> tuple[str, ...]:
    return run_sandboxed("pass", python=python, wall_seconds=30).isolation
