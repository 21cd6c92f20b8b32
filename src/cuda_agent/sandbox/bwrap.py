"""The bubblewrap command line: what of the host a sandboxed command sees (the read-only
system and Python paths, the caller's writable and read-only binds, the GPU's device nodes)
and the clean environment it gets."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.sandbox.config import DEFAULT_PATH, MIB, SandboxConfig

SYSTEM_DIRS = ("/usr", "/etc", "/opt")
_SYSTEM_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_NVIDIA_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
# Host paths that may never be made writable (they would be chowned when root).
_NEVER_WRITABLE = ("/", "/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib64", "/boot",
                   "/dev", "/proc", "/sys", "/var", "/root", "/home", "/tmp", "/run")


@dataclass(frozen=True)
class Features:
    """What the bwrap at hand supports (from its --help)."""

    size: bool  # --size for --tmpfs
    disable_userns: bool


def abs_path(p: Path | str) -> Path:
    return Path(os.path.abspath(os.fspath(p)))


def is_under(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def check_writable(p: Path) -> None:
    """Refuse to hand system directories to the sandbox (as root they would be chowned)."""
    no_subtree = [Path(x) for x in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/boot",
                                    "/dev", "/proc", "/sys")]
    no_subtree += [Path(x) for x in {sys.prefix, sys.base_prefix, sys.exec_prefix}]
    no_exact = [Path(x) for x in _NEVER_WRITABLE] + [Path(os.path.expanduser("~")), Path("/dev/shm")]
    for cand in (p, Path(os.path.realpath(p))):
        if Path("/dev/shm") in cand.parents:  # a directory in the host's tmpfs (see paths.runs_root)
            continue
        if any(cand == x or cand in x.parents for x in no_exact + no_subtree) or any(
            is_under(cand, x) for x in no_subtree
        ):
            raise ValueError(f"refusing to make {p} writable in the sandbox (a system path)")


def _system_binds() -> list[list[str]]:
    out: list[list[str]] = []
    for d in _SYSTEM_TOP_LINKS:
        if os.path.islink(d):
            out.append(["--symlink", os.readlink(d), d])
        elif os.path.isdir(d):
            out.append(["--ro-bind", d, d])
    for d in SYSTEM_DIRS:
        if os.path.isdir(d):
            out.append(["--ro-bind", d, d])
    return out


def python_paths() -> list[Path]:
    """sys.prefix & co, the interpreter's directory and every existing sys.path entry
    (with their real paths), minus those already under a bound system directory."""
    cands: list[str] = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    if sys.executable:
        cands += [os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    cands += [p for p in sys.path if p]
    home = os.path.expanduser("~")
    # Never a whole temp directory (a script run from /tmp puts it on sys.path): it would
    # cover the sandbox's private /tmp with the host's, and the paths bound beneath it.
    temps = {os.path.realpath(d) for d in ("/tmp", "/var/tmp", tempfile.gettempdir())}
    paths: set[Path] = set()
    for c in cands:
        if not os.path.isabs(c) or not os.path.exists(c):
            continue
        for q in {os.path.normpath(c), os.path.realpath(c)}:
            if q in ("/", home) or os.path.realpath(q) in temps or q.startswith(("/proc", "/dev", "/sys")):
                continue
            paths.add(Path(q))
    covered = [Path(d) for d in SYSTEM_DIRS] + [Path(d) for d in _SYSTEM_TOP_LINKS
                                                 if os.path.isdir(d) and not os.path.islink(d)]
    keep: list[Path] = []
    for p in sorted(paths, key=lambda x: (len(x.parts), str(x))):
        if any(is_under(p, c) for c in covered + keep):
            continue
        keep.append(p)
    return keep


def gpu_nodes(gpu_index: int, dev_dir: Path) -> list[Path]:
    names = [f"nvidia{gpu_index}", *_NVIDIA_SHARED_NODES]
    return [dev_dir / n for n in names if os.path.exists(dev_dir / n)]


def gpu_uuid(gpu_index: int, proc_gpus: Path = _NVIDIA_PROC_GPUS) -> str | None:
    """The UUID of the GPU whose device minor is `gpu_index`, from the driver's procfs."""
    try:
        entries = sorted(proc_gpus.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            text = (entry / "information").read_text(errors="replace")
        except OSError:
            continue
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        if fields.get("device minor") == str(gpu_index) and fields.get("gpu uuid", "").startswith("GPU-"):
            return fields["gpu uuid"]
    return None


def build_env(env: Mapping[str, str] | None, config: SandboxConfig, home: str, tmp: str) -> dict[str, str]:
    path_dirs = []
    if sys.executable:
        path_dirs.append(os.path.dirname(sys.executable))
    if os.path.isdir("/usr/local/cuda/bin"):
        path_dirs.append("/usr/local/cuda/bin")
    path_dirs += DEFAULT_PATH.split(":")
    out = {
        "PATH": ":".join(dict.fromkeys(path_dirs)),
        "HOME": home,
        "TMPDIR": tmp,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    out.update({str(k): str(v) for k, v in (env or {}).items()})
    if config.gpu_index is not None:
        out.update({
            "CUDA_VISIBLE_DEVICES": gpu_uuid(config.gpu_index) or "0",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            # Keep NVLink multicast off (a single-GPU evaluation never needs it).
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        })
    return out


def bwrap_args(
    *,
    bwrap: str,
    cwd: Path,
    writable: Sequence[Path],
    readonly: Sequence[tuple[Path, Path]],
    config: SandboxConfig,
    features: Features,
    dev_dir: Path = Path("/dev"),
    unprivileged: bool,
) -> list[str]:
    """The bwrap part of the command line, up to and including `--`."""
    args = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if unprivileged:  # bwrap makes a user namespace: let nothing inside make another
        args += ["--unshare-user"]
        if features.disable_userns:
            args += ["--disable-userns"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(config.tmp_size_mb * MIB)] if features.size else []
    args += [*size, "--perms", "1777", "--tmpfs", "/tmp"]
    args += [*size, "--perms", "1777", "--tmpfs", "/dev/shm"]

    binds: list[list[str]] = _system_binds()
    binds += [["--ro-bind", str(p), str(p)] for p in python_paths()]
    if config.gpu_index is not None:
        binds += [["--dev-bind", str(n), f"/dev/{n.name}"] for n in gpu_nodes(config.gpu_index, dev_dir)]
        if os.path.isdir("/sys"):
            binds.append(["--ro-bind", "/sys", "/sys"])
    binds += [["--bind", str(p), str(p)] for p in writable]
    binds += [["--ro-bind", str(src), str(dst)] for src, dst in readonly]

    # bwrap makes missing parents of mount points mode 0700, which an unprivileged uid
    # cannot enter: create those that live only in the sandbox's own root as 0755.
    host_backed = [Path(b[2]) for b in binds if b[0] != "--symlink"]
    made: set[Path] = {Path("/"), Path("/tmp"), Path("/dev"), Path("/proc"), Path("/dev/shm")}
    for b in binds:
        dst = Path(b[2])
        for parent in reversed(dst.parents):
            if parent in made or any(is_under(parent, h) for h in host_backed if h != dst):
                continue
            made.add(parent)
            args += ["--perms", "0755", "--dir", str(parent)]
        args += b
    args += ["--chdir", str(cwd), "--"]
    return args

