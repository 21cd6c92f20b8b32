"""Jobs started by a fork server (torch imported once, each job forked into a sandbox
bwrap made for it) are confined exactly as exec'd ones: the same uid drop, capabilities,
namespaces, files, descriptors, environment and limits, with the real bwrap."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from cuda_agent import sandbox as sb
from cuda_agent.sandbox import forkserver
from cuda_agent.sandbox.bwrap import build_env
from cuda_agent.sandbox.limits import RunCgroup

AVAILABLE, REASON = sb.sandbox_available()
pytestmark = pytest.mark.skipif(not AVAILABLE or os.geteuid() != 0,
                                reason="fork servers serve sandboxed runs as root" if AVAILABLE else REASON)
PRELOAD = ("torch",)

REPORT = """
import json, os, socket, sys
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
def readable(p):
    try:
        open(p).read()
        return True
    except OSError:
        return False
def net():
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=2)
        return True
    except OSError:
        return False
def signal_pid(pid):
    try:
        os.kill(pid, 9)
        return "sent"
    except OSError as e:
        return e.__class__.__name__
open("written.txt", "w").write("ok")
print(json.dumps({
    "preloaded": "torch" in sys.modules, "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "caps": {k: int(status[k].strip(), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
    "no_new_privs": status["NoNewPrivs"].strip(), "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "hostname": os.uname().nodename,
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")), "env": dict(os.environ), "argv": sys.argv[1:],
    "cwd": os.getcwd(), "secret": readable(sys.argv[1]), "net": net(), "server": signal_pid(int(sys.argv[2])),
    "threads": __import__("torch").get_num_threads() if "torch" in sys.modules else None,
}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    os.chmod(d, 0o755)
    return d


def job(work: Path, module: str, body: str, *args: str, preload: tuple[str, ...] = PRELOAD,
        **config: object) -> sb.RunResult:
    (work / f"{module}.py").write_text(textwrap.dedent(body))
    return sb.run([sys.executable, "-m", module, *args], cwd=work, writable=[work], preload=preload,
                  env={"OMP_NUM_THREADS": "2"}, config=sb.SandboxConfig(**config))  # type: ignore[arg-type]


def server_pid() -> int:
    servers = [s for s in forkserver._servers.values() if isinstance(s, forkserver.Server)]
    assert servers, forkserver._servers
    return servers[0]._proc.pid


def test_a_forked_job_is_confined_as_an_execd_one(work: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host only")
    job(work, "warm", "print('up')")  # the server is up
    forked = job(work, "report", REPORT, str(secret), str(server_pid()))
    execd = job(work, "report", REPORT, str(secret), str(server_pid()), preload=())
    assert forked.returncode == execd.returncode == 3 and forked.sandboxed, (forked, execd)
    assert forked.stderr.strip() == execd.stderr.strip() == "to stderr"
    f, e = json.loads(forked.stdout), json.loads(execd.stdout)
    assert f["preloaded"] and not e["preloaded"]  # the first came from the server
    for r in (f, e):
        assert r["uid"] == r["gid"] and r["uid"] >= 1 << 20 and r["groups"] == []  # a run's own uid
        assert r["caps"] == dict.fromkeys(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), 0)
        assert r["no_new_privs"] == "1" and r["hostname"] == "sandbox" and r["sid"] in (1, r["pid"])  # a session of its own
        assert max(r["pids"]) <= 3 and r["ppid"] in (0, 1), r["pids"]  # its own PID namespace
        assert r["fds"] == [0, 1, 2, 3]  # (3: the listing's own)
        assert not r["secret"] and not r["net"] and r["server"] == "ProcessLookupError"
        assert r["cwd"] == str(work) and r["argv"] == [str(secret), str(server_pid())]
        assert r["threads"] in (None, 2)
    assert f["env"] == e["env"]
    assert (work / "written.txt").read_text() == "ok"
    assert forkserver._servers and all(isinstance(s, forkserver.Server) and s.alive()
                                       for s in forkserver._servers.values())


def test_a_forked_job_is_stopped_at_its_limits(work: Path) -> None:
    res = job(work, "hang", "import time\nprint('started', flush=True)\ntime.sleep(600)", timeout_s=3)
    assert res.timed_out and res.returncode is None and "started" in res.stdout and res.duration_s < 20
    res = job(work, "crash", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert res.signal == signal.SIGSEGV and res.returncode == -signal.SIGSEGV
    bomb = """
    import os, time
    print(os.getuid(), flush=True)
    for _ in range(400):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    """
    res = job(work, "bomb", bomb, max_processes=32, timeout_s=60)
    assert not res.ok and res.duration_s < 30, res
    if sb.sandbox_available()[0] and res.limit is not None:
        assert res.limit == sb.PROCESSES
    uid = int(res.stdout.split()[0])
    leftover = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]
    assert not leftover, leftover  # nothing of the run outlives it


def _uid_of(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return -1


def test_a_server_that_cannot_start_leaves_runs_execd(work: Path) -> None:
    res = job(work, "report", REPORT, "/nonexistent", "1", preload=("no_such_module_here",))
    assert res.returncode == 3 and not json.loads(res.stdout)["preloaded"], res
    why = [v for v in forkserver._servers.values() if isinstance(v, str)]
    assert any("no_such_module_here" in w for w in why), forkserver._servers


@pytest.mark.skipif(not RunCgroup.available("memory"), reason="no memory cgroup here")
def test_a_forked_job_is_killed_at_its_memory_limit(work: Path) -> None:
    hog = "import time\nx = bytearray(600 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\ntime.sleep(30)"
    res = job(work, "hog", hog, memory_mb=200, timeout_s=60)
    assert res.limit == sb.MEMORY and not res.ok and res.duration_s < 30, res


@pytest.mark.parametrize("modules", ["PRELOAD", "BASELINE_PRELOAD"])
def test_the_evaluators_servers_start(modules: str) -> None:
    # Their imports start no thread and no CUDA: otherwise every evaluation would quietly
    # be exec'd again, seconds slower.
    from cuda_agent.evaluator import processes

    env = build_env(processes.python_env("cpu", 2), sb.SandboxConfig(), "/tmp", "/tmp")
    server = forkserver.server_for(env, getattr(processes, modules))
    assert server is not None and server.alive(), forkserver._servers


CALLER = """
import sys, time
from pathlib import Path
from cuda_agent import sandbox as sb
from cuda_agent.sandbox import forkserver
work = Path(sys.argv[1])
def run(module):
    return sb.run([sys.executable, "-m", module], cwd=work, writable=[work], preload=("torch",))
run("warm")
server = [s for s in forkserver._servers.values() if isinstance(s, forkserver.Server)][0]
(work / "server.txt").write_text(str(server._proc.pid))
run("nap")
"""


def test_nothing_outlives_a_caller_that_dies(work: Path) -> None:
    import subprocess
    import time

    (work / "warm.py").write_text("print('up')")
    (work / "nap.py").write_text("import os, time\nopen('uid.txt', 'w').write(str(os.getuid()))\ntime.sleep(600)")
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(work)])
    try:
        end = time.monotonic() + 120
        while not (work / "uid.txt").exists() and time.monotonic() < end and caller.poll() is None:
            time.sleep(0.05)
        uid, server = int((work / "uid.txt").read_text()), int((work / "server.txt").read_text())
    finally:
        caller.kill()
        caller.wait()
    end = time.monotonic() + 15
    while time.monotonic() < end:
        left = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]
        if not left and not os.path.exists(f"/proc/{server}"):
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: the run's {left}, the server {os.path.exists(f'/proc/{server}')}")
