"""What moving a trial's tensors between an evaluation's processes costs, and whether two
sandboxes can share GPU memory (the question behind a GPU-resident data path).

    python benchmarks/data_path_probe.py [--mib 366]

1. Rates on this machine for one tensor of `--mib` MiB: get_inputs' torch.randn on the CPU
   and on the GPU, torch.save / torch.load (disk cache dir and /dev/shm), a pageable
   device-to-host and host-to-device copy, torch.allclose on the CPU and on the GPU.
2. CUDA IPC across sandboxes: an exporter process in one sandbox allocates a tensor and
   writes its allocation's IPC handle (the driver API, cuIpcGetMemHandle) to a directory
   both sandboxes bind; an importer in another sandbox (its own PID, IPC and mount
   namespaces) opens it (cuIpcOpenMemHandle) and checks the values. Prints whether it
   worked and what the driver said.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD = r'''
import ctypes, json, sys, time, os
from pathlib import Path
import torch
role, mine, other = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
cu = ctypes.CDLL("libcuda.so.1")
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
def check(rc, what):
    if rc != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUresult {rc} {name.value}")
torch.cuda.init()
torch.empty(1, device="cuda")  # the primary context, current on this thread for the driver calls
n = 1 << 24
if role == "export":
    t = torch.arange(n, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr())), "cuMemGetAddressRange")
    h = Handle()
    check(cu.cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
    (mine / "handle.json").write_text(json.dumps({"handle": bytes(h.reserved).hex(), "offset": t.data_ptr() - base.value,
                                                   "pid": os.getpid()}))
    deadline = time.time() + 60
    while not (other / "imported").exists() and time.time() < deadline:
        time.sleep(0.01)
    print("export: importer said", (other / "imported").read_text() if (other / "imported").exists() else "nothing")
else:
    deadline = time.time() + 60
    while not (other / "handle.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    info = json.loads((other / "handle.json").read_text())
    h = Handle()
    raw = bytes.fromhex(info["handle"])
    ctypes.memmove(ctypes.byref(h), raw, 64)
    ptr = ctypes.c_uint64()
    t0 = time.perf_counter()
    opener = getattr(cu, "cuIpcOpenMemHandle_v2", None) or cu.cuIpcOpenMemHandle
    try:
        check(opener(ctypes.byref(ptr), h, ctypes.c_uint(1)), "cuIpcOpenMemHandle")
        class View:
            __cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr.value + info["offset"], True), "version": 3}
        v = torch.as_tensor(View(), device="cuda")
        ok = bool(torch.equal(v, torch.arange(n, device="cuda", dtype=torch.float32)))
        msg = f"opened in {time.perf_counter() - t0:.4f} s, values equal: {ok}, exporter pid there {info['pid']}, mine {os.getpid()}"
    except Exception as exc:
        msg = f"failed: {exc}"
    (mine / "imported").write_text(msg)
    print("import:", msg)
'''


def rates(mib: int) -> dict[str, float]:
    import torch

    n = mib * 2**20 // 4
    out: dict[str, float] = {}

    def timed(name: str, fn) -> object:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        r = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out[name] = round(time.perf_counter() - t0, 4)
        return r

    x = timed("randn on the CPU", lambda: torch.randn(n))
    timed("randn on the GPU", lambda: torch.randn(n, device="cuda"))
    for where in (Path(tempfile.gettempdir()), Path("/dev/shm")):
        p = where / "probe.pt"
        timed(f"torch.save to {where}", lambda p=p: torch.save(x, p))
        timed(f"torch.load from {where}", lambda p=p: torch.load(p, weights_only=True))
        timed(f"torch.load mmap from {where}", lambda p=p: torch.load(p, weights_only=True, mmap=True).sum())
        p.unlink()
    g = timed("host-to-device (pageable)", lambda: x.to("cuda"))
    timed("device-to-host (pageable)", lambda: g.to("cpu"))
    y = x.clone()
    timed("allclose on the CPU", lambda: torch.allclose(x, y))
    gy = y.to("cuda")
    timed("allclose on the GPU", lambda: torch.allclose(g, gy))
    return out


def ipc() -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from cuda_agent import sandbox

    root = Path(tempfile.mkdtemp(prefix="ipc-probe-"))
    dirs = {r: root / r for r in ("export", "import")}  # each writes its own, reads the other's
    for d in (root, *dirs.values()):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)
    script = root / "child.py"
    script.write_text(CHILD)
    os.chmod(script, 0o644)
    results: dict[str, object] = {}

    def go(role: str) -> None:
        other = dirs["import" if role == "export" else "export"]
        results[role] = sandbox.run([sys.executable, str(script), role, str(dirs[role]), str(other)], cwd=dirs[role],
                                    writable=[dirs[role]], readonly=[other, script],
                                    config=sandbox.SandboxConfig(timeout_s=90, gpu_index=0))

    th = [threading.Thread(target=go, args=(r,)) for r in ("export", "import")]
    for t in th:
        t.start()
    for t in th:
        t.join()
    lines = []
    for role in ("export", "import"):
        r = results[role]
        lines.append(f"{role}: rc {r.returncode} {r.stdout.strip()[-400:]} {r.stderr.strip()[-600:]}")  # type: ignore[attr-defined]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=366)
    args = ap.parse_args()
    for line in ipc():
        print(line, flush=True)
    print(json.dumps(rates(args.mib), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
