"""Build times of cuda-agent's incremental build beside a force-rebuild as the released
agent_workdir's compile.sh does it (build dir deleted, `torch.utils.cpp_extension.load`).

    python benchmarks/build_times.py [--device cuda|cpu] [--solution DIR] [--repeats N]

Prints one table: cold build (empty cache, precompiled header created), cold build of a
new solution with a warm header cache, no-change rebuild (content-hash hit), one-file
edit rebuild, and the released-style force rebuild, each measured in this run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--solution", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sol = args.solution or REPO / "examples" / "solutions" / f"axpby_{args.device}"
    tmp = Path(tempfile.mkdtemp(prefix="build-bench-"))
    os.environ["CUDA_AGENT_CACHE"] = str(tmp / "cache")

    from cuda_agent.evaluator import build as B
    from cuda_agent.evaluator.solution import load_solution

    rows: list[tuple[str, list[float], str]] = []
    opts = B.BuildOptions(device=args.device)

    def build(work: Path, key: str) -> B.BuildResult:
        spec = B.workspace_extension(load_solution(work), args.device)
        res = B.build_extension(spec, opts, key)
        if not res.ok:
            raise SystemExit(f"build failed:\n{res.message}")
        return res

    work = tmp / "ws"
    shutil.copytree(sol, work)
    t0 = time.perf_counter()
    r = build(work, "first")
    rows.append(("cold: empty cache (incl. precompiled header)", [time.perf_counter() - t0], ",".join(r.rebuilt)))

    cold = []
    for i in range(args.repeats):
        w = tmp / f"ws{i}"
        shutil.copytree(sol, w)
        kernel = next(p for p in sorted((w / "kernels").iterdir()) if p.suffix in (".cu", ".cpp") and "binding" not in p.name)
        kernel.write_text(kernel.read_text() + f"\n// variant {i}\n")
        t0 = time.perf_counter()
        build(w, f"cold{i}")
        cold.append(time.perf_counter() - t0)
    rows.append(("cold: new solution, warm header cache", cold, ""))

    hit = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        r = build(work, "first")
        hit.append(time.perf_counter() - t0)
        assert r.cached
    rows.append(("unchanged solution (content-hash hit)", hit, ""))

    edit = []
    kernel = next(p for p in sorted((work / "kernels").iterdir()) if p.suffix in (".cu", ".cpp") and "binding" not in p.name)
    for i in range(args.repeats):
        kernel.write_text(kernel.read_text() + f"\n// edit {i}\n")
        t0 = time.perf_counter()
        r = build(work, "first")
        edit.append(time.perf_counter() - t0)
    rows.append((f"one-file edit ({kernel.name})", edit, ",".join(r.rebuilt)))

    # The released flow: delete the build dir, cpp_extension.load all sources, every time.
    released = []
    rel = tmp / "released"
    shutil.copytree(work, rel)
    shutil.copy(REPO / "src/cuda_agent/workspace/templates/binding.cpp", rel / "binding.cpp")
    shutil.copy(REPO / "src/cuda_agent/workspace/templates/binding_registry.h", rel / "binding_registry.h")
    script = textwrap.dedent(f"""
        import shutil, sys
        from pathlib import Path
        import torch.utils.cpp_extension as ce
        root = Path({str(rel)!r})
        build = root / "build" / "forced_compile"
        shutil.rmtree(build, ignore_errors=True); build.mkdir(parents=True)
        srcs = sorted(str(p) for p in [*root.glob("*.cpp"), *(root / "kernels").glob("*.cu"), *(root / "kernels").glob("*.cpp")])
        ce.load(name="cuda_extension", sources=srcs, build_directory=str(build), verbose=False,
                with_cuda={args.device == "cuda"}, extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--use_fast_math"])
    """)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", script], check=True, cwd=rel)
        released.append(time.perf_counter() - t0)
    rows.append(("released compile.sh style (force rebuild)", released, ""))

    print(f"\nbuild times, {args.device}, solution {sol.name}, {os.cpu_count()} cores (seconds)")
    print(f"{'case':48s} {'median':>8s} {'min':>8s} {'max':>8s}  n")
    for name, xs, note in rows:
        print(f"{name:48s} {statistics.median(xs):8.2f} {min(xs):8.2f} {max(xs):8.2f}  {len(xs)}  {note}")
    ratio = statistics.median(released) / statistics.median(edit)
    print(f"one-file rebuild is {ratio:.1f}x faster than the released force rebuild")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
