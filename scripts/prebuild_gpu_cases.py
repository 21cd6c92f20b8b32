"""Build every CUDA solution of the GPU tests into the build cache, several at a time, so
that the tests (run after it with CUDA_AGENT_TEST_CACHE set to the same folder) spend
their time on the GPU rather than one compile after another.

    CUDA_AGENT_CACHE=DIR python3 scripts/prebuild_gpu_cases.py [--jobs N] [NAME...]

Also usable where no GPU is present (TORCH_CUDA_ARCH_LIST=9.0 names the target) to check
that every case compiles. Prints one line per case; exit status 1 if any failed to build.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # as pytest imports the test packages (gpu, evaluator)


def cases() -> dict[str, tuple[Path, dict[str, str]]]:
    from gpu import cases_cuda as C

    out = {
        "axpby": (C.AXPBY_TASK, C.AXPBY),
        "relu": (C.RELU_TASK, C.RELU),
        "linear_relu": (C.LINEAR_RELU_TASK, C.LINEAR_RELU),
        "softmax_load_inline": (C.SOFTMAX_TASK, {"model_new.py": C.SOFTMAX_SINGLE_FILE}),
        "chain": (C.CHAIN_TASK, C.chain(passes=1)),
        "late_side_stream": (C.AXPBY_TASK, C.LATE_SIDE_STREAM),
        "host_compute": (C.AXPBY_TASK, C.HOST_COMPUTE),
        "functional_fallback": (C.AXPBY_TASK, C.F_FALLBACK),
    }
    out.update({f"cheat_{k}": (C.AXPBY_TASK, v[0]) for k, v in C.CHEATS.items()})
    return out


def build_one(name: str) -> tuple[str, bool, float, str]:
    from cuda_agent.evaluator.evaluate import EvalOptions, Evaluation
    from cuda_agent.evaluator.solution import load_solution
    from cuda_agent.tasks import load_task_file

    task, files = cases()[name]
    root = Path(tempfile.mkdtemp(prefix=f"prebuild-{name}-"))
    try:
        for rel, text in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        target = root / "model_new.py" if len(files) == 1 else root
        t0 = time.perf_counter()
        ev = Evaluation(load_task_file(task), load_solution(target), EvalOptions(device="cuda", static_checks=False))
        try:
            b = ev.build()
        finally:
            shutil.rmtree(ev.work, ignore_errors=True)
        return name, b.ok, time.perf_counter() - t0, "" if b.ok else str(getattr(b, "message", b))[:2000]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    names = args.names or list(cases())
    # The first build makes the precompiled header that the others reuse.
    first, rest = names[0], names[1:]
    results = [build_one(first)]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results += list(pool.map(build_one, rest))
    for name, ok, secs, msg in results:
        print(f"{name:28s} {'ok' if ok else 'FAILED':6s} {secs:6.1f} s  {msg}", flush=True)
    return 0 if all(ok for _, ok, _, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
