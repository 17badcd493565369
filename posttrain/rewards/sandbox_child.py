"""The child side of the code sandbox. Standard library only: it runs as `python -I -S -B -c <this source>`.

Two roles, picked by argv[1]:

launch <config json>
    Runs first, as the host user. Enters new namespaces (network, PID, mount, IPC, UTS; through a user
    namespace when not root), builds the filesystem view (a size-bounded tmpfs as scratch and /tmp,
    everything else read-only, a private /proc), then forks the program's process, which sets the
    resource limits, drops privileges and execs the interpreter again in the `run` role. The launcher
    (or, with a PID namespace, the namespace's init) reaps the program and reports on the supervisor
    channel: `layer <name>` for each isolation layer in force, then `exit <code> <cpu seconds>` or
    `signal <n> <cpu seconds>`, or `setup-error <message>`. The program never holds that channel.

run <config json>
    The program's process. Reads the code from a memfd (and closes it), installs the Python guard (an
    audit hook), then executes the code as `__main__`; in check mode executes the check source in the
    same namespace afterwards. Reports on the runner channel: `violation <kind> <event>`, `memory`,
    and `passed <nonce>` after a check that ran to its end. The program shares this process and could
    write to that channel too, so the parent only ever lets it make a run worse: a violation or memory
    report makes the run unscorable; `passed` needs the nonce, which exists only in this process's memory.

Every layer is best effort in here; the parent reads which ones are in force from the `layer` lines.
"""

import builtins
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# statvfs f_flag bits that a read-only bind remount must keep (the kernel refuses to clear locked ones);
# they equal the MS_ bits except relatime.
_KEEP_FLAGS = ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, 1024), (2048, 2048), (4096, 1 << 21))
AF_UNIX = 1

_libc = None


def _c():
    """libc through ctypes, imported by the launcher only: the program's runner never loads ctypes."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    import ctypes

    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_c().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


class Channel:
    """Line-oriented reports on an inherited pipe; a closed pipe is ignored (the parent decides)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, *words) -> None:
        line = " ".join(str(w).replace("\n", " ") for w in words) + "\n"
        try:
            os.write(self.fd, line.encode("utf-8", "replace"))
        except OSError:
            pass


# ----------------------------------------------------------------------------------------------- launch


def launch(cfg: dict) -> None:
    channel = Channel(cfg["supervisor_fd"])
    try:
        layers = _enter_namespaces(cfg)
        if "pidns" in layers:
            # The first child in a new PID namespace is its init: when init exits, the kernel kills every
            # process left in the namespace, whatever session or process group it moved to.
            init = os.fork()
            if init != 0:
                os.close(cfg["supervisor_fd"])
                os.waitpid(init, 0)
                os._exit(0)
        _init(cfg, channel, layers)
    except BaseException as error:  # a broken setup, not the program's doing: the parent raises it
        channel.send("setup-error", f"{type(error).__name__}: {error}")
    os._exit(0)


def _enter_namespaces(cfg: dict) -> list:
    """unshare() with as many namespaces as the kernel allows. Root needs no user namespace (and must not
    use one: a user namespace mapping root keeps root's power over host files); anyone else needs one."""
    if not cfg["namespaces"]:
        return []
    root = os.geteuid() == 0
    base = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    attempts = [
        (base | CLONE_NEWPID, ["netns", "mountns", "pidns"]),
        (base, ["netns", "mountns"]),
        (CLONE_NEWNET, ["netns"]),
    ]
    uid, gid = os.getuid(), os.getgid()
    for flags, layers in attempts:
        if _c().unshare(flags if root else flags | CLONE_NEWUSER) == 0:
            if not root:
                # Identity maps: the program keeps the host uid (so files it creates have an owner) and,
                # being non-root in its namespace, loses every capability at its execve.
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write(f"{uid} {uid} 1")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"{gid} {gid} 1")
                layers = ["userns"] + layers
            return layers
    return []


def _init(cfg: dict, channel: Channel, layers: list) -> None:
    workdir = cfg["scratch"]
    if "mountns" in layers:
        made, workdir = _build_filesystem(cfg, "pidns" in layers)
        layers = layers + made
        os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    for layer in layers:
        channel.send("layer", layer)
    nproc = _process_limit(cfg, layers)
    program = os.fork()
    if program == 0:
        try:
            _exec_program(cfg, nproc, workdir, channel)
        except BaseException as error:
            channel.send("setup-error", f"program start: {type(error).__name__}: {error}")
        os._exit(127)
    while True:  # reap everything (orphans are re-parented to init) until the program itself is done
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return
        if pid == program:
            cpu = f"{usage.ru_utime + usage.ru_stime:.3f}"
            if os.WIFSIGNALED(status):
                channel.send("signal", os.WTERMSIG(status), cpu)
            else:
                channel.send("exit", os.WEXITSTATUS(status), cpu)
            return


def _build_filesystem(cfg: dict, private_proc: bool) -> tuple:
    """The program's view of the filesystem, in this mount namespace only: a fresh tmpfs of `scratch_bytes`
    mounted over scratch and bound over /tmp, /var/tmp and /dev/shm (the only writable places, sharing one
    size bound); every other mount remounted read-only; /proc showing this PID namespace only.
    Returns the layers made and the working directory (/tmp, which is that tmpfs). A step the kernel
    refuses leaves the layers before it in place; the parent sees which ones are."""
    made = []
    workdir = scratch = cfg["scratch"]
    os.umask(0o022)
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here may propagate back to the host
        owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['scratch_bytes']},mode=0700{owner}")
        made.append("scratch-tmpfs")
        _expose(cfg["expose"], scratch)
        if _remount_readonly(skip=scratch):
            made.append("readonly-fs")
    except OSError:
        return made, workdir
    if private_proc:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            made.append("private-proc")
        except OSError:
            pass  # e.g. a /proc with masked entries cannot be mounted again inside a user namespace
    targets = [p for p in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(p) and not os.path.islink(p)]
    # a target above the scratch path hides that path once bound: bind it last, and work there
    targets.sort(key=lambda p: scratch.startswith(p + "/"))
    for path in targets:
        try:
            _mount(scratch, path, None, MS_BIND)
        except OSError:
            continue
        if scratch.startswith(path + "/"):
            workdir = path
    return made, workdir


def _expose(paths: list, scratch: str) -> None:
    """Make each path (the interpreter's install) reachable by the unprivileged program when one of its
    ancestors is not (e.g. a Python under /root, mode 0700): bind the path aside, cover the closed
    ancestor with an empty tmpfs, recreate the way down and bind the path back. Everything else under
    that ancestor stays hidden."""
    if not paths:
        return
    holds = []
    for i, (path, closed) in enumerate(paths):
        hold = os.path.join(scratch, f".expose-{i}")
        os.mkdir(hold)
        _mount(path, hold, None, MS_BIND | MS_REC)
        holds.append((path, closed, hold))
    covered = set()
    for path, closed, hold in holds:
        if closed not in covered:
            _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
            covered.add(closed)
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(hold, path, None, MS_BIND | MS_REC)
        _check(_c().umount2(os.fsencode(hold), MNT_DETACH), f"umount {hold}")
        os.rmdir(hold)


def _mount_points() -> list:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            field = line.split()[4]
            # mountinfo escapes space, tab, newline and backslash as octal
            points.append(field.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace"))
    return points


def _remount_readonly(skip: str) -> bool:
    """Bind-remount every mount read-only (keeping its other flags); True when "/" itself succeeded."""
    root_done = False
    for point in _mount_points():
        if point == skip or point.startswith(skip + "/"):
            continue
        try:
            f_flag = os.statvfs(point).f_flag
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY
            for st, ms in _KEEP_FLAGS:
                if f_flag & st:
                    flags |= ms
            _mount(None, point, None, flags)
            root_done = root_done or point == "/"
        except OSError:
            continue  # an overmounted or special mount: skip it, "/" decides the layer
    return root_done


def _process_limit(cfg: dict, layers: list) -> int:
    """RLIMIT_NPROC counts the tasks of the real uid. A uid of its own (root host): the program's tasks
    only. In a user namespace the count is per namespace and already holds the launcher (and init).
    Otherwise the host user's other tasks count too, so they are added (racy, but the best there is)."""
    limit = cfg["max_processes"]
    if cfg["uid"] is not None:
        return limit
    if "userns" in layers:
        return limit + (2 if "pidns" in layers else 1)
    return limit + _count_tasks(os.getuid())


def _count_tasks(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 0").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _exec_program(cfg: dict, nproc: int, workdir: str, channel: Channel) -> None:
    import fcntl

    # The runner finds its code on fd 3 and its channel on fd 4; the supervisor channel moves to fd 5,
    # closed by the exec, so the program never holds it. Every other descriptor is closed.
    moved = [fcntl.fcntl(cfg[key], fcntl.F_DUPFD_CLOEXEC, 10) for key in ("code_fd", "runner_fd", "supervisor_fd")]
    for target, fd in enumerate(moved, start=3):
        os.dup2(fd, target, inheritable=target != 5)
    channel.fd = 5
    os.closerange(6, os.sysconf("SC_OPEN_MAX"))
    limits = cfg["limits"]
    cpu = limits["cpu_seconds"]
    # soft limit: SIGXCPU; the hard limit one second later is a SIGKILL that cannot be handled away
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    uid = cfg["uid"]
    if uid is not None:  # a root host: become a uid of this run's own, with no groups and no capabilities
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.chdir(workdir)
    os.umask(0o077)
    # last: the address-space limit would also bound this launcher code if set earlier
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    runner = {"code_fd": 3, "runner_fd": 4, "guard": cfg["guard"]}
    os.execve(
        cfg["python"],
        [
            cfg["python"],
            "-I",
            "-S",
            "-B",
            "-X",
            "utf8",
            "-c",
            cfg["source"],
            "run",
            json.dumps(runner),
            "posttrain-sandbox",
        ],
        dict(os.environ),
    )


# -------------------------------------------------------------------------------------------------- run

# audit events (sys.addaudithook) the guard refuses, by kind; "ctypes.*" events are all refused too
_BLOCKED_EVENTS = {
    "socket.connect": "network",
    "socket.bind": "network",
    "socket.sendto": "network",
    "socket.sendmsg": "network",
    "socket.getaddrinfo": "network",
    "socket.gethostbyname": "network",
    "socket.gethostbyaddr": "network",
    "socket.getnameinfo": "network",
    "socket.sethostname": "network",
    "os.exec": "exec",
    "os.posix_spawn": "exec",
    "os.spawn": "exec",
    "os.system": "exec",
    "subprocess.Popen": "exec",
    "os.killpg": "signal",
}


def run(cfg: dict) -> None:
    channel = Channel(cfg["runner_fd"])
    with os.fdopen(cfg["code_fd"], "rb") as f:  # closing it leaves the code (and nonce) in memory only
        payload = json.loads(f.read().decode("utf-8"))
    nonce, check, host_names = payload["nonce"], payload["check"], payload["host_names"]
    # Python ignores SIGXFSZ at startup (a too-big write then raises OSError the program may swallow);
    # the default action makes "file too large" a visible end of the run.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    _guard_process_limit(channel)
    if cfg["guard"]:
        _install_guard(channel)
        _watch_environment(channel, host_names)
    del host_names
    import linecache
    import traceback
    import types

    module = types.ModuleType("__main__")  # the program's own __main__, not this runner's globals
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    sys.argv = ["solution.py"]
    sources = [("solution.py", payload["code"])] + ([("tests.py", check)] if check is not None else [])
    del payload
    for name, text in sources:  # lets tracebacks on stderr quote the program's lines
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    try:
        for name, text in sources:
            exec(compile(text, name, "exec"), module.__dict__)
        if check is not None:
            channel.send("passed", nonce)
    except MemoryError:
        channel.send("memory")
        os.write(2, b"MemoryError\n")
        os._exit(1)
    except SystemExit:
        raise
    except BaseException:
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next)  # from the program's frame on, not this runner's
        sys.exit(1)


def _guard_process_limit(channel: Channel) -> None:
    """Report when the process limit stops a fork or a thread: the program then ran out of the sandbox's
    room, which makes the run unscorable, even if it catches the error. The limit itself is the kernel's."""
    import _thread

    real_fork, real_thread = os.fork, _thread.start_new_thread

    def fork():
        try:
            return real_fork()
        except BlockingIOError:
            channel.send("violation", "processes", "os.fork")
            raise

    def start_new_thread(*args, **kwargs):
        try:
            return real_thread(*args, **kwargs)
        except RuntimeError:
            channel.send("violation", "processes", "thread")
            raise

    os.fork = fork
    _thread.start_new_thread = start_new_thread


def _install_guard(channel: Channel) -> None:
    """An audit hook: the C implementations of sockets, exec/spawn and ctypes call it before acting, and
    it cannot be removed from Python. It refuses (PermissionError) and reports. It is a detector, not a
    wall: code that corrupts memory gets past it; the namespaces are the wall."""
    blocked = _BLOCKED_EVENTS

    def hook(event, args):
        kind = blocked.get(event)
        if kind is None:
            if event.startswith("ctypes."):
                kind = "ctypes"
            elif event == "socket.__new__" and len(args) > 1 and args[1] != AF_UNIX:
                kind = "network"
            elif event == "os.kill" and args and isinstance(args[0], int) and args[0] <= 0:
                kind = "signal"  # signalling a whole process group or every process
            else:
                return
        channel.send("violation", kind, event)
        raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(hook)


def _watch_environment(channel: Channel, host_names: dict) -> None:
    """Report a program that looks up one of the host's environment variables (os.environ[...],
    os.getenv, `in os.environ`, os.path.expandvars; str or bytes): it is after the host's secrets, so
    the run becomes unscorable; the lookup answers as for an unset variable (the value was never passed
    on). `host_names` holds a salt and salted hashes of the host's variable names (never the names),
    minus the harmless ones the standard library itself reads (sandbox._HARMLESS_HOST_NAMES). Opening
    another process's /proc/<pid>/environ is reported too. Listing the (scrubbed) environment stays allowed."""
    import hashlib
    import re

    salt, probes = host_names["salt"], set(host_names["hashes"])

    def is_host_name(key) -> bool:
        name = os.fsdecode(key) if isinstance(key, (str, bytes)) else ""
        return hashlib.sha256((salt + name).encode("utf-8", "surrogateescape")).hexdigest()[:32] in probes

    def watched(mapping) -> None:
        class WatchedEnviron(type(mapping)):
            def __getitem__(self, key):
                try:
                    return super().__getitem__(key)
                except KeyError:
                    if is_host_name(key):
                        channel.send("violation", "environment", "host variable lookup")
                    raise

        mapping.__class__ = WatchedEnviron

    watched(os.environ)
    watched(os.environb)
    own = {str(os.getpid()), "self", "thread-self"}
    environ_path = re.compile(r"^/proc/([^/]+)/(?:task/[^/]+/)?environ$")

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = os.fsdecode(args[0])
            match = environ_path.match(os.path.normpath(path))
            if match and match.group(1) not in own:
                channel.send("violation", "environment", "open /proc/<pid>/environ")
                raise PermissionError(f"sandbox: reading {path} is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "launch":
        launch(cfg)
    elif role == "run":
        run(cfg)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
