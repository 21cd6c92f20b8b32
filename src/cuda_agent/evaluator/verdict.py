"""Verdicts: functions of what the pipeline measured (reports, output files, times) that
say whether a solution passed, and why not in words an agent can act on. They start no
process and change nothing; `evaluate` turns a `Verdict` into an `EvalResult`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuda_agent import sandbox
from cuda_agent.evaluator import distributions, record, rules, speed
from cuda_agent.evaluator.baselines import Baseline
from cuda_agent.evaluator.protocol import (
    CandidateReport,
    ProfileReport,
    Progress,
    ReferenceReport,
    RunLayout,
    TrialReport,
)
from cuda_agent.evaluator.reward import Speedups
from cuda_agent.evaluator.vouch import VouchedRun
from cuda_agent.files import open_inside


@dataclass
class Verdict:
    status: str
    message: str
    rule: str | None = None
    trials_passed: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    speed: speed.SpeedOutcome | None = None  # a profiled, correct solution's times

    @property
    def correct(self) -> bool:
        return self.status == record.OK

    @property
    def speedups(self) -> Speedups | None:
        if self.speed is None:
            return None
        return Speedups(vs_eager=self.speed.speedup_vs_eager, vs_compile=self.speed.speedup_vs_compile)


def static_verdict(violations: Sequence[Any]) -> Verdict | None:
    """The static checks' violations (`static_checks.Violation`), the most specific first."""
    if not violations:
        return None
    # "never calls the extension" is usually a consequence of another violation
    ordered = sorted(violations, key=lambda v: v.rule == rules.NO_EXTENSION)
    first = ordered[0]
    more = f" ({len(ordered) - 1} more)" if len(ordered) > 1 else ""
    status = record.COMPILE_ERROR if first.rule == rules.SYNTAX else record.REJECTED
    return Verdict(status, str(first) + more, rule=first.rule, details={"violations": [str(v) for v in ordered]})


def correctness_verdict(run: sandbox.RunResult, report: CandidateReport | None, progress: Progress | None,
                        reference: ReferenceReport, files: RunLayout, plan: list[tuple[int, str]], atol: float,
                        rtol: float, timeout_s: float, right: Mapping[int, TrialReport] | None = None) -> Verdict:
    """The candidate process's trials against the reference's outputs; `plan` is each
    trial's (seed, input distribution). `right`: trials already found right (before the
    profile), with the report they were found right with; not compared again while the
    final report says the same of them."""
    where = progress.where() if progress else "start-up"
    trials = len(plan)
    if run.limit == sandbox.MEMORY:
        return Verdict(record.RUNTIME_ERROR, f"the candidate process {run.describe()} during {where}: it used "
                       "more memory than a sandboxed process may (EvalOptions.memory_mb); allocate what the "
                       "task needs, not more.", details={"limit": run.limit})
    if run.limit == sandbox.PROCESSES:
        return Verdict(record.RUNTIME_ERROR, f"the candidate process {run.describe()} during {where}: it started "
                       "more processes and threads than a sandboxed process may; a kernel must not fork.",
                       details={"limit": run.limit})
    if run.timed_out:
        return Verdict(record.TIMEOUT, f"the candidate did not finish within {timeout_s:g} s (during {where}); "
                       "look for an infinite loop or a hung kernel.")
    if report is None:
        tail = run.stderr.strip()[-1500:]
        return Verdict(record.RUNTIME_ERROR, f"the candidate process {run.describe()} during {where}"
                       + (f"; stderr ends with:\n{tail}" if tail else "."),
                       details={"signal": run.signal, "returncode": run.returncode})
    if report.error == "runtime":
        return Verdict(record.RUNTIME_ERROR, report.message or "runtime error",
                       details={"traceback": report.traceback})
    if report.error in ("rejected", "incorrect"):
        status = record.REJECTED if report.error == "rejected" else record.INCORRECT
        return Verdict(status, report.message, rule=report.rule)
    passed = 0
    for k, trial in enumerate(report.trials):
        if str(k) in reference.skipped:
            continue  # the reference's task is not defined on these inputs (the record says so)
        if right and right.get(k) == trial:
            passed += 1
            continue
        failed = trial_verdict(trial, k, plan, reference, files, atol, rtol)
        if failed is not None:
            failed.trials_passed = passed
            return failed
        passed += 1
    judged = trials - len(reference.skipped)
    if not report.ok or len(report.trials) != trials or not run.ok:
        return Verdict(record.RUNTIME_ERROR, f"the candidate stopped after {len(report.trials)} of {trials} trials "
                       f"({run.describe()}).", trials_passed=passed)
    skipped = f", {len(reference.skipped)} skipped where the task's Model gives no finite answer" \
        if reference.skipped else ""
    message = f"correct on {passed} of {judged} trials{skipped} (atol {atol:g}, rtol {rtol:g})."
    flags = []
    if reference.barely_varies:
        flags.append(record.FLAG_BARELY_VARIES)
        kinds = [kind for k, (_, kind) in enumerate(plan) if kind != distributions.TASK and str(k) not in reference.skipped]
        message += (" The task's outputs hardly change across its own trials; the trials on other input "
                    f"distributions ({', '.join(kinds)}) decided." if kinds else " The task's outputs hardly "
                    "change across its own trials and no trial on other inputs could be judged: a constant "
                    "would have passed these trials, so read this verdict with care.")
    return Verdict(record.OK, message, trials_passed=passed, flags=flags)


def trial_verdict(trial: TrialReport, k: int, plan: list[tuple[int, str]], reference: ReferenceReport,
                   files: RunLayout, atol: float, rtol: float, mapped: bool = True,
                   outputs: bool = True) -> Verdict | None:
    """What is wrong with one trial (None: nothing). `mapped=False` while the processes
    that wrote its files may still live (see `load_tensors`); `outputs=False`: only what
    its report says, no file read."""

    from cuda_agent.evaluator.compare import compare_devices, compare_outputs

    seed, kind = plan[k] if k < len(plan) else (0, distributions.TASK)
    label = f"trial {trial.trial} of {len(plan)}" + (
        "" if kind == distributions.TASK else f" (inputs from {distributions.describe(kind)}, seed {seed})")

    def fail(status: str, message: str, rule: str | None = None, **details: Any) -> Verdict:
        return Verdict(status, f"{label}: {message}", rule=rule, details=details)

    if trial.guard:
        return fail(record.REJECTED, trial.guard[1], rule=trial.guard[0])
    if trial.exception is not None:
        return fail(record.RUNTIME_ERROR, f"ModelNew.forward raised {trial.exception}", traceback=trial.traceback)
    if trial.extension_calls == 0:
        return fail(record.REJECTED, "ModelNew.forward never called into the compiled extension; the work must "
                    "be done by your kernels.", rule=rules.NO_EXTENSION)
    if not trial.exact_types:
        return fail(record.REJECTED, f"outputs must be plain torch.Tensor objects, got {_types(trial.structure)}.",
                    rule=rules.OUTPUT_TYPE)
    if trial.aliases:
        return fail(record.REJECTED, f"{trial.aliases[0]}; outputs must be new tensors, not views of inputs.",
                    rule=rules.OUTPUT_ALIAS)
    if k < len(reference.structures):
        m = compare_devices(reference.structures[k], trial.structure)
        if m:
            return fail(record.INCORRECT, m.message, rule=m.rule)
    if not outputs:
        return None
    try:
        expected = _load(files, files.expected(k), mapped)
        got = _load(files, files.output(k), mapped)
    except Exception as exc:
        return fail(record.RUNTIME_ERROR, f"the candidate's outputs could not be read ({type(exc).__name__}: {exc}).")
    m = compare_outputs(expected, got, atol, rtol)
    if m:
        return fail(record.INCORRECT, m.message, rule=m.rule)
    try:
        mutated = _mutated(_load(files, files.inputs(k), mapped), _load(files, files.inputs_after(k), mapped))
    except Exception as exc:
        return fail(record.RUNTIME_ERROR, f"the inputs after the call could not be read ({type(exc).__name__}: {exc}).")
    if mutated:
        return fail(record.REJECTED, f"ModelNew changed its input {mutated}; inputs must be left "
                    "as they were.", rule=rules.INPUT_MUTATION)
    return None


def timed_outputs_verdict(profile: ProfileReport, files: RunLayout, timing_sets: list[int], atol: float,
                          rtol: float) -> Verdict | None:
    """Timed calls must have computed the right answer, not replayed an earlier one; one
    is checked on each input set they rotated through (`timing_sets`: the reference's)."""

    from cuda_agent.evaluator.compare import compare_outputs

    missing = sorted(set(timing_sets) - set(profile.timed_outputs))
    if missing:
        return Verdict(record.INCORRECT, f"the check calls made while timing returned no output for trial "
                       f"{missing[0] + 1}'s inputs.", rule=rules.TIMED_OUTPUT)
    for k in sorted(set(profile.timed_outputs) & set(timing_sets)):
        try:
            expected = _load(files, files.expected(k))
            got = _load(files, files.timed_output(k))
        except Exception as exc:
            return Verdict(record.RUNTIME_ERROR, f"the outputs of the timed calls could not be read "
                           f"({type(exc).__name__}: {exc}).")
        m = compare_outputs(expected, got, atol, rtol)
        if m:
            return Verdict(record.INCORRECT, f"a timed call on trial {k + 1}'s inputs returned a wrong result "
                           f"({m.message}); every call must compute its output from its inputs (no caching of "
                           "earlier results).", rule=rules.TIMED_OUTPUT)
    return None


def vouched_verdict(run: VouchedRun | None, files: RunLayout, atol: float, rtol: float) -> Verdict | None:
    """The parent's timed batches: they ran to the end, and every checked call's output is
    the one committed right after the call and the reference's for its inputs."""

    from cuda_agent.evaluator.compare import compare_outputs
    from cuda_agent.evaluator.vouch import commit_hash

    if run is None or run.error or not run.timed():
        why = run.error if run is not None and run.error else "the timed batches did not run"
        return Verdict(record.RUNTIME_ERROR, f"{why}; the evaluator times the calls itself, in batches it sends "
                       "after the trials, and the candidate process must answer them until told to stop.",
                       rule=rules.VOUCHED)
    unchecked = 0
    for batch in run.batches:
        for i in batch.revealed:
            where = f"timed call {i + 1} of {batch.n} in batch {batch.b + 1}"
            if not files.vouched_expected(batch.b, i).exists():
                unchecked += 1  # the task's own Model failed on these inputs
                continue
            try:
                got = _load(files, files.vouched_output(batch.b, i))
                expected = _load(files, files.vouched_expected(batch.b, i))
            except Exception as exc:
                return Verdict(record.RUNTIME_ERROR, f"the output of {where} could not be read "
                               f"({type(exc).__name__}: {exc}).", rule=rules.VOUCHED)
            if int(commit_hash(got, batch.key, "cpu")) != batch.hashes[i]:
                return Verdict(record.INCORRECT, f"the output of {where} changed after the call returned (it is "
                               "not what the call had returned); forward must return its finished results, with "
                               "no work left running.", rule=rules.TIMED_OUTPUT)
            m = compare_outputs(expected, got, atol, rtol)
            if m:
                return Verdict(record.INCORRECT, f"{where} returned a wrong result ({m.message}); every call must "
                               "compute its output from its own inputs.", rule=rules.TIMED_OUTPUT)
    return None


def watch_verdict(phases: dict[str, Any], v: Verdict) -> Verdict:
    """The op watch's counts (`op_watch`): torch compute anywhere in the candidate's
    process rejects, whatever the outputs and times were."""
    from cuda_agent.evaluator.op_watch import judge

    broken = judge(phases)
    if broken is None:
        return v
    return Verdict(record.REJECTED, broken[1], rule=rules.TORCH_COMPUTE, trials_passed=v.trials_passed,
                   details={**v.details, "watch": phases})


def speed_verdict(correct: Verdict, profile: ProfileReport, base: Baseline, device: str, target_rel_ci: float,
                  drift_bound: float, io_bytes: int, vouched: dict[str, Any] | None = None) -> Verdict:
    """Speedups of a correct candidate against the baselines, or the rule its times break."""
    flags: list[str] = list(correct.flags)
    compile_note = ""
    if base.extra.get("compile_error"):
        flags.append(record.FLAG_COMPILE_FAILED)
        compile_note = (f" torch.compile failed on this task ({str(base.extra['compile_error'])[:200]}), "
                        "so its baseline is eager.")
    elif base.extra.get("compile_matches_eager") is False:
        flags.append(record.FLAG_COMPILE_DIFFERS)
    sp = speed.judge(profile.candidate, profile.eager, base.eager, base.compile, device, target_rel_ci, drift_bound,
                     io_bytes=io_bytes, bandwidth_gbps=float(base.extra.get("copy_gbps") or 0.0),
                     probe_now=profile.probe, probe_base=base.extra.get("probe"), vouched=vouched,
                     vouched_base=base.extra.get("vouched"))
    flags += sp.flags
    details = {**correct.details, **sp.details}
    if sp.rejected:
        return Verdict(record.REJECTED, sp.rejected[1], rule=sp.rejected[0], trials_passed=correct.trials_passed,
                       details=details, flags=flags, speed=sp)
    what = "device time" if device == "cuda" else "time"
    return Verdict(record.OK, f"{correct.message} {what}: {sp.speedup_vs_eager:.3f}x eager, "
                   f"{sp.speedup_vs_compile:.3f}x torch.compile.{compile_note}",
                   trials_passed=correct.trials_passed, details=details, flags=flags, speed=sp)


def not_profiled(correct: Verdict, why: str) -> Verdict:
    return Verdict(record.OK, f"{correct.message} Not profiled: {why}.", trials_passed=correct.trials_passed,
                   details=correct.details, flags=[*correct.flags, record.FLAG_NOT_PROFILED])


def _mutated(before: Any, after: Any) -> str:
    """The first input the call changed (by value, NaN equal to NaN), or ""."""
    import torch

    from cuda_agent.evaluator.tensors import tensors

    pairs = list(zip(tensors(before, "input"), tensors(after, "input"), strict=False))
    if len(pairs) != len(list(tensors(before, "input"))):
        return "(its inputs' structure)"
    for (path, a), (_, b) in pairs:
        # the same bytes (a value written back unchanged is no mutation; any other write is)
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):
            return path
    return ""


def _load(files: RunLayout, path: Path, mapped: bool = True) -> Any:
    """Tensors from a file of the run directory, never through a link the writer made."""
    return load_tensors(files.work, path, mapped)


def load_tensors(root: Path, path: Path, mapped: bool = True) -> Any:
    """Tensors from a file below `root` (opened by `open_inside`), mapped rather than read
    when torch.save wrote it (the pages are read as they are compared: a large trial's
    files are not copied into memory first). `mapped` only for files whose writer has
    ended: a mapped file truncated meanwhile would fault (SIGBUS, in the trusted process);
    a file read while its writer lives is read whole, and a change meanwhile at worst
    makes it unreadable."""
    import torch

    with open_inside(root, path) as fh:
        if mapped:
            try:  # the file opened safely, mapped through its descriptor (never the path again)
                return torch.load(f"/proc/self/fd/{fh.fileno()}", weights_only=True, mmap=True)
            except Exception:  # not a zip-format file, or no /proc: read it as it is
                fh.seek(0)
        return torch.load(fh, weights_only=True)


def _types(structure: Any) -> str:
    found: list[str] = []

    def walk(s: Any) -> None:
        if isinstance(s, dict):
            if s.get("kind") in ("tensor", "other") and not s.get("exact", False):
                found.append(str(s.get("type")))
            items = s.get("items")
            if isinstance(items, list):
                for x in items:
                    walk(x)
            elif isinstance(items, dict):
                for x in items.values():
                    walk(x)

    walk(structure)
    return ", ".join(found[:3]) or "an unexpected object"
