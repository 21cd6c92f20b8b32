"""How the parent's vouched batches agree with the in-process device time, for correct solutions.

    python benchmarks/vouch_agreement.py [--device cuda|cpu] [--repeats 2]

Evaluates (with profiling) the correct solutions of the GPU suite (`tests/gpu/cases_cuda.py`:
axpby, relu, linear+relu through cuBLAS, a load_inline softmax, a fused elementwise chain,
the linear+relu at 2048 x 4096 -> 4096: a millisecond of GEMM)
on CUDA, or the axpby example on the CPU, and prints for each evaluation the in-process
device time per call, the parent's vouched work per call, the host allowance and the floor
it gives (`speed._vouch`), the headroom (in-process time / floor: below 1 is flagged
`in-process-time-not-vouched` and the floor counts), the protocol's own cost per call
and the speedups. A correct solution should never be flagged; a forged time is flagged
when it falls under the floor, so the smaller the headroom of correct solutions, the less
a forgery gains.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

from cuda_agent.evaluator import record as R  # noqa: E402
from cuda_agent.evaluator.evaluate import EvalOptions, evaluate  # noqa: E402
from cuda_agent.evaluator.solution import load_solution  # noqa: E402
from cuda_agent.tasks import load_task_file  # noqa: E402


def cases(device: str, tmp: Path) -> list[tuple[str, Path, dict[str, str]]]:
    if device == "cpu":
        sol = REPO / "examples" / "solutions" / "axpby_cpu"
        files = {str(p.relative_to(sol)): p.read_text() for p in sol.rglob("*") if p.is_file()}
        return [("axpby", REPO / "examples" / "tasks" / "axpby.py", files)]
    from gpu import cases_cuda as C

    return [("axpby", C.AXPBY_TASK, C.AXPBY), ("relu", C.RELU_TASK, C.RELU),
            ("linear_relu_cublas", C.LINEAR_RELU_TASK, C.LINEAR_RELU),
            ("softmax_load_inline", C.SOFTMAX_TASK, {"model_new.py": C.SOFTMAX_SINGLE_FILE}),
            ("chain_fused", C.CHAIN_TASK, C.chain(passes=1)),
            ("linear_relu_large", C.linear_relu_large_task(tmp), C.LINEAR_RELU)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    flagged = 0
    headroom: list[float] = []
    with tempfile.TemporaryDirectory(prefix="vouch-agreement-") as tmp:
        for name, task, files in cases(args.device, Path(tmp)):
            root = Path(tmp) / name
            for rel, text in files.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(text)
            target = root / "model_new.py" if len(files) == 1 else root
            for r in range(args.repeats):
                res = evaluate(load_task_file(task), load_solution(target),
                               EvalOptions(device=args.device, profile=True))
                v = res.details.get("vouched")
                if res.status != "ok" or not isinstance(v, dict):
                    print(f"{name:22s} #{r + 1}: {res.status} {res.rule} {res.message[:200]}")
                    continue
                room = v["in_process_us"] / v["floor_us"] if v["floor_us"] > 0 else float("inf")
                headroom.append(room)
                flagged += R.FLAG_UNVOUCHED in res.flags
                protocol = v["per_call_us"]["protocol"] or [0.0]
                print(f"{name:22s} #{r + 1}: in-process {v['in_process_us']:9.2f} us  vouched work "
                      f"{v['work_us']['candidate']:9.2f} (eager {v['work_us']['eager']:.2f}, compile "
                      f"{v['work_us']['compile']:.2f})  host allowance {v['host_allowance_us']:7.2f}  floor "
                      f"{v['floor_us']:9.2f}  headroom {room:6.2f}  protocol {min(protocol):7.1f} us/call  "
                      f"x{v['calls_per_batch']}  speedup {res.speedup_vs_eager} / {res.speedup_vs_compile} "
                      f"(in-process {v['in_process']['speedup_vs_eager']} / "
                      f"{v['in_process']['speedup_vs_compile']})  flags {res.flags}", flush=True)
    finite = [h for h in headroom if h != float("inf")]
    print(f"\n{len(headroom)} evaluations, {flagged} flagged in-process-time-not-vouched; headroom "
          f"(in-process / floor) min {min(finite, default=float('nan')):.2f} median "
          f"{statistics.median(finite) if finite else float('nan'):.2f}, {len(headroom) - len(finite)} with no floor "
          "(the call is shorter than the host allowance)")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
