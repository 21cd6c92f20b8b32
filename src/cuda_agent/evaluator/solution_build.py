"""Building a solution's extension(s): the workspace's `kernels/`, or the sources a
single-file solution passes to `load_inline` (found by running it, sandboxed, with a
recorder in place of `load_inline`: `inline_capture`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent import sandbox
from cuda_agent.evaluator import build, processes, record, rules
from cuda_agent.evaluator.options import EvalOptions
from cuda_agent.evaluator.protocol import CaptureReport, Extension
from cuda_agent.evaluator.solution import SINGLE_FILE, Solution


@dataclass
class BuildOutcome:
    ok: bool
    extensions: list[Extension] = field(default_factory=list)
    message: str = ""
    status: str = record.COMPILE_ERROR
    rule: str | None = None
    cached: bool = True
    rebuilt: list[str] = field(default_factory=list)


def build_solution(solution: Solution, opts: EvalOptions, device: str, scratch: Path) -> BuildOutcome:
    """Build every extension of `solution` into the content-hash cache (`build`).
    `scratch` is a directory the inline capture may use."""
    bopts = build.BuildOptions(
        device=device, timeout_s=opts.build_timeout_s, arch=opts.arch, gpu_index=opts.gpu_index,
        jobs=opts.jobs, sandbox=processes.sandbox_config(opts, opts.build_timeout_s, device),
    )
    key = opts.build_key or solution.origin
    if solution.format == SINGLE_FILE:
        specs = capture_inline(solution, opts, device, scratch)
        if isinstance(specs, BuildOutcome):
            return specs
    else:
        specs = [build.workspace_extension(solution, device)]
    outcome = BuildOutcome(ok=True)
    for spec in specs:
        res = build.build_extension(spec, bopts, key)
        outcome.cached &= res.cached
        outcome.rebuilt += res.rebuilt
        if not res.ok:
            status = record.TIMEOUT if res.timed_out else record.COMPILE_ERROR
            return BuildOutcome(ok=False, message=res.message, status=status, cached=False)
        outcome.extensions.append(Extension(name=spec.name, so_path=str(res.so_path)))
    return outcome


def capture_inline(solution: Solution, opts: EvalOptions, device: str,
                   scratch: Path) -> list[build.ExtensionSpec] | BuildOutcome:
    """The extensions a single-file solution builds with `load_inline`, or why none."""
    d = scratch / "capture"
    d.mkdir()
    (d / "model_new.py").write_text(solution.model_new)
    out = d / "calls.json"
    run = sandbox.run(
        [sys.executable, "-m", "cuda_agent.evaluator.inline_capture", str(d), str(out)],
        cwd=d, writable=[d], env=processes.python_env(device),
        config=processes.sandbox_config(opts, opts.run_timeout_s, "cpu"), preload=processes.preload(processes.PRELOAD, device),
    )
    report = CaptureReport.read(out, inside=scratch)  # (written where model_new.py ran)
    if run.timed_out:
        return BuildOutcome(ok=False, status=record.TIMEOUT,
                            message=f"importing model_new.py timed out after {opts.run_timeout_s:g} s")
    if report is None:
        return BuildOutcome(ok=False, status=record.RUNTIME_ERROR,
                            message=f"importing model_new.py to find its load_inline call {run.describe()}")
    if not report.ok and not report.calls:
        return BuildOutcome(ok=False, status=record.RUNTIME_ERROR,
                            message=f"model_new.py failed before calling load_inline: {report.error}")
    if not report.calls:
        return BuildOutcome(ok=False, status=record.REJECTED, rule=rules.NO_EXTENSION,
                            message="model_new.py never calls load_inline, so it builds no extension.")
    return [build.inline_extension(c, device) for c in report.calls]
