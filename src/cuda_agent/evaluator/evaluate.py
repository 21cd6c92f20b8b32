"""The trusted evaluator: task + solution + device -> one `EvalResult`.

    static checks -> build (sandboxed, cached) -> candidate process: trials | profile -> verdicts
                  \\-> reference process (sandboxed, beside the build) --/          |
                                   baseline process (on a cache miss): compile | measure
                                   (overlaps verification; measures while nothing else does)

This module is the pipeline: it starts the processes (`processes`), hands them their
specs and reads their reports (`protocol`), schedules the device, and re-measures the
baselines when the device drifted. Deciding is the verdicts' job (`verdict`, `reward`).

Profiling follows verification in the same candidate process: candidate and eager are
timed interleaved there, torch.compile and eager in the trusted baseline process, whose
results are cached (see `speed` for how the two are combined).

Every candidate-touching step runs in its own sandboxed process; whatever the candidate
does (crash, hang, fork bomb, hostile file writes) ends as a verdict here, never as an
exception that escapes `evaluate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cuda_agent import sandbox
from cuda_agent.evaluator import (
    baselines,
    op_watch,
    processes,
    protocol,
    record,
    verdict,
    vouch,
    warm,
)
from cuda_agent.evaluator.baseline_measure import BaselineRun, baseline_key
from cuda_agent.evaluator.options import EvalOptions, resolve_device
from cuda_agent.evaluator.protocol import CandidateReport, CandidateSpec, ProfileSpec, RunLayout
from cuda_agent.evaluator.reward import reward
from cuda_agent.evaluator.solution import SINGLE_FILE, WORKSPACE, Solution
from cuda_agent.evaluator.solution_build import BuildOutcome, build_solution
from cuda_agent.evaluator.static_checks import check_solution
from cuda_agent.evaluator.verdict import Verdict
from cuda_agent.machine import usable_cores
from cuda_agent.tasks import Task, TaskError

__all__ = ["EvalOptions", "Evaluation", "evaluate", "prebuild", "prefetch_baselines", "resolve_device"]


class Evaluation:
    """One evaluation; `run()` returns the record."""

    def __init__(self, task: Task, solution: Solution, opts: EvalOptions) -> None:
        self.task, self.solution, self.opts = task, solution, opts
        self.device = resolve_device(opts.device)
        self.drift_bound = opts.drift(self.device)
        self.init_seed, self.seeds = opts.trial_seeds()
        self.kinds = opts.trial_distributions()  # each trial's input distribution
        self.skipped: dict[str, str] = {}  # trials the reference could not judge (its report)
        self.timing_sets: list[int] = []  # the trials whose inputs the timed calls use (its report)
        self.threads = opts.threads or usable_cores()
        self.files = RunLayout(processes.new_run_dir()).make()
        self.timings: dict[str, float] = {}
        self.t_start = time.perf_counter()
        self.marks: dict[str, float] = {}  # when each step of `_run` ended (s since its start)
        self.details: dict[str, Any] = {}  # facts for the record beside the verdict's
        self.spare: warm.Spare | None = None
        self.reference_run: sandbox.RunResult | None = None
        self.baseline: baselines.Baseline | None = None
        self.baseline_fresh = False  # measured by this evaluation, not read from the cache
        self.baseline_error: str | None = None
        self.baseline_runs: list[BaselineRun] = []
        self.gated = False  # the candidate's profile waits for a baseline measurement
        self.trials_right: dict[int, Any] = {}  # trial -> its report, found right before the profile
        self.vouched: vouch.VouchedRun | None = None  # the parent's timed batches of the candidate
        self.warm_baseline = opts.warm and (opts.warm_baseline if opts.warm_baseline is not None
                                            else self.device == "cuda")

    @property
    def work(self) -> Path:
        return self.files.work

    def result(self, v: Verdict) -> record.EvalResult:
        """The record of a verdict, with what this evaluation knows besides."""
        value = reward(self.opts.reward_name, v.correct, v.speedups, self.opts.threshold)
        fields: dict[str, Any] = {}
        if v.speed is not None:
            sp = v.speed
            fields = dict(times_us=sp.times_us, wall_times_us=sp.wall_times_us,
                          speedup_vs_eager=sp.speedup_vs_eager, speedup_vs_compile=sp.speedup_vs_compile,
                          wall_speedup_vs_eager=sp.wall_speedup_vs_eager,
                          wall_speedup_vs_compile=sp.wall_speedup_vs_compile)
        return record.EvalResult(
            status=v.status, message=v.message, rule=v.rule, correct=v.correct, trials_passed=v.trials_passed,
            reward=value, details=dict(v.details), flags=list(dict.fromkeys(v.flags)),
            task_id=self.task.id, task_name=self.task.name, device=self.device,
            seeds=[self.init_seed, *self.seeds], trials=len(self.seeds),
            trial_inputs=[{"trial": k + 1, "seed": seed, "distribution": kind, "skipped": self.skipped.get(str(k), "")}
                          for k, (seed, kind) in enumerate(zip(self.seeds, self.kinds, strict=True))],
            timings_s={k: round(t, 3) for k, t in self.timings.items()},
            solution_hash=self.solution.content_hash, solution_format=self.solution.format,
            sandboxed=self.opts.sandbox, reward_name=self.opts.reward_name, **fields)

    def mark(self, step: str) -> None:
        self.marks[step] = round(time.perf_counter() - self.t_start, 4)

    # -- spares ----------------------------------------------------------------------------

    def take_spare(self) -> None:
        """Run in a spare's directory, with its processes, when one is ready."""
        if not self.opts.warm:
            return
        spare = warm.POOL.take(processes.spare_key(self.opts, self.device, self.threads))
        if spare is not None:
            shutil.rmtree(self.files.work, ignore_errors=True)
            self.files, self.spare = RunLayout(spare.work), spare
        early = self.opts.early_spare if self.opts.early_spare is not None else self.device == "cuda"
        if early:
            # held before its device stage until this evaluation's measurements end (`run`)
            threading.Thread(target=self.offer_spare, daemon=True).start()

    def offer_spare(self) -> None:
        with contextlib.suppress(Exception):
            warm.POOL.offer(processes.spare_key(self.opts, self.device, self.threads),
                            lambda: processes.start_spare(self.opts, self.device, self.threads))

    def run_process(self, kind: str, timeout: float, job_reached: Callable[[], bool]) -> sandbox.RunResult:
        """Run the reference or candidate process (the spare's, given its job's timeout,
        when there is one) to its end; its spec must be in place."""
        from_spare = self.spare is not None and kind in self.spare.procs
        if from_spare:
            assert self.spare is not None
            proc = self.spare.procs.pop(kind)
            proc.deadline.set_in(timeout)
        else:
            proc = processes.start(kind, self.files, self.opts, self.device, self.threads, timeout)

        def cold() -> warm.Proc:
            return processes.start(kind, self.files, self.opts, self.device, self.threads, timeout)

        run, _, spare_failed = warm.wait_retrying(proc, from_spare, job_reached, cold)
        if kind == "candidate" and spare_failed:
            self.details["spare_failed"] = spare_failed
        elif kind == "candidate" and from_spare:
            self.details["warm_start"] = True
        return run

    # -- the reference and the candidate ---------------------------------------------------

    def start_reference(self) -> threading.Thread:
        f = self.files
        f.task_code.write_text(self.task.code)
        # After its trials it waits for the vouched batches' checked calls (`finish_reference`)
        # for as long as the candidate may run.
        serve_s = self.opts.run_timeout_s * 3
        protocol.ReferenceSpec(work=str(f.work), task_name=self.task.name, device=self.device, seeds=self.seeds,
                               init_seed=self.init_seed, serve_s=serve_s, distributions=self.kinds,
                               atol=self.opts.atol, rtol=self.opts.rtol).write(f.reference_spec)

        def go() -> None:
            t0 = time.perf_counter()
            self.reference_run = self.run_process("reference", self.opts.run_timeout_s + serve_s,
                                                  (f.private / protocol.STARTED).exists)
            self.timings["reference"] = time.perf_counter() - t0
            if not (f.shared / protocol.READY).exists() or not f.timing_sets.exists():
                # release a candidate waiting for its inputs, or for the timing sets (a
                # reference killed after its inputs)
                protocol.write_marker(f.shared / protocol.FAILED)

        th = threading.Thread(target=go, daemon=True)
        th.start()
        return th

    def reference_idle(self, ref: threading.Thread) -> bool:
        """The reference has ended, or finished its trials and waits (idle) for requests."""
        return not ref.is_alive() or self.files.reference_report.exists()

    def finish_reference(self, ref: threading.Thread) -> None:
        """Ask the reference for the vouched batches' checked calls (or for nothing), and
        wait for it to end."""
        calls = self.vouched.requests() if self.vouched is not None else []
        if calls and ref.is_alive():
            protocol.ExpectRequest(calls=calls).write(self.files.expect_request)
        else:
            protocol.write_marker(self.files.private / protocol.END)
        ref.join()

    def reference_outcome(self) -> protocol.ReferenceReport:
        report = protocol.ReferenceReport.read(self.files.reference_report, inside=self.files.work)
        run = self.reference_run
        if report is None or not report.ok:
            if report is not None:
                why = f"{report.error} in {report.phase}"
            elif run is not None and run.timed_out:
                why = f"timed out after {self.opts.run_timeout_s:g} s"
            else:
                why = (run.describe() if run else "did not run") + (
                    f": {run.stderr.strip()[-800:]}" if run and run.stderr.strip() else "")
            raise TaskError(f"task {self.task.name} failed to run its reference Model: {why}")
        return report

    def build(self) -> BuildOutcome:
        return build_solution(self.solution, self.opts, self.device, self.files.work)

    def run_candidate(self, extensions: list[protocol.Extension]) -> sandbox.RunResult:
        f = self.files
        for rel, text in self.solution.files.items():
            p = f.run / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        placed = []  # the built extensions, where the candidate's sandbox can read them
        for k, ext in enumerate(extensions):
            src = Path(ext.so_path)
            dst = f.extension_dir(k) / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(dst.parent, 0o755)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            placed.append(protocol.Extension(name=ext.name, so_path=str(dst)))
        watch_so = ""
        built_watch = op_watch.ensure_built(self.device)
        if built_watch is not None:
            dst = f.cin / "watch" / built_watch.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(dst.parent, 0o755)
            shutil.copy2(built_watch, dst)
            watch_so = str(dst)
        profile = None
        if self.opts.profile:
            f.candidate_task_code.write_text(self.task.code)
            os.chmod(f.candidate_task_code, 0o644)
            profile = ProfileSpec(protocol=dataclasses.asdict(self.opts.protocol),
                                  gate_timeout_s=self.opts.run_timeout_s)
        timeout = self.opts.run_timeout_s * (2 if self.gated else 1)
        t0 = time.perf_counter()
        ended = threading.Event()
        driver = None
        if profile is not None:
            # the parent's own batches, timed by its clock (see `vouch`)
            driver = threading.Thread(target=self.drive_vouched, args=(ended, time.monotonic() + timeout + 30),
                                      daemon=True)
            driver.start()
        try:
            # the spec last: a spare's job starts when it appears (the candidate waits for the
            # driver's end of the pipes, `vouch.OPEN_WAIT_S`, should it come late)
            CandidateSpec(work=str(f.work), device=self.device, trials=len(self.seeds), init_seed=self.init_seed,
                          format=self.solution.format, extensions=placed, threads=self.threads,
                          profile=profile, watch_so=watch_so).write(f.candidate_spec)
            run = self.run_process("candidate", timeout, f.progress.exists)
        finally:
            ended.set()
            if driver is not None:
                driver.join()
        self.timings["candidate"] = time.perf_counter() - t0
        return run

    def drive_vouched(self, ended: threading.Event, deadline: float) -> None:
        def one_output_bytes() -> int:
            report = protocol.ReferenceReport.read(self.files.reference_report, inside=self.files.work)
            return _structure_bytes(report.structures[0]) if report and report.structures else 0

        try:
            self.vouched = vouch.drive(self.files.cmd, self.files.reply, lambda: not ended.is_set(), self.device,
                                       one_output_bytes, deadline)
        except Exception as exc:  # the parent's side failed: said so, never raised
            self.vouched = vouch.VouchedRun(error=f"the parent could not run the timed batches: "
                                                  f"{type(exc).__name__}: {exc}")

    # -- baselines -------------------------------------------------------------------------

    def new_baseline_run(self, gated: bool) -> BaselineRun:
        run = BaselineRun(self.task, self.opts, self.device, self.threads, self.files.work, gated,
                          warm_spare=self.warm_baseline)
        self.baseline_runs.append(run)
        return run

    def plan_baseline(self) -> BaselineRun | None:
        """Use the cached baselines, or start measuring them (gated) beside verification."""
        if not self.opts.profile:
            return None
        cached = baselines.load(baseline_key(self.task, self.opts, self.device, self.threads)) \
            if self.opts.baseline_cache else None
        if cached is not None:
            self.baseline = cached  # (the candidate gets the device once its trials pass, `gate_on_trials`)
            return None
        self.gated = True
        return self.new_baseline_run(gated=True)

    def finish_baseline(self, run: BaselineRun) -> None:
        """Wait for `run` and keep its baselines (cached unless torch.compile failed)."""
        report = run.report()
        if report and report.ok and report.compile_error:
            # torch.compile failed: once more in a fresh process (the device is still the
            # baseline's), since a failure can be the process's, not the task's.
            first = report.compile_error
            run = self.new_baseline_run(gated=False)
            again = run.report()
            if again and again.ok:
                report = again
                report.compile_retried = first
        self.timings["baseline"] = sum(r.seconds for r in self.baseline_runs)
        for r in self.baseline_runs:
            self.details.update(r.details)
        if report is None or not report.ok or report.eager is None or report.compile is None:
            self.baseline_error = run.failure(report)
            return
        # A baseline whose torch.compile failed stands in eager for compile; it is used
        # for this evaluation but never cached, so a passing failure cannot inflate the
        # rewards of every later evaluation of the task.
        if self.opts.baseline_cache and not report.compile_error:
            self.baseline = baselines.store(baseline_key(self.task, self.opts, self.device, self.threads),
                                            report.eager, report.compile, extra=report.extra())
        else:
            self.baseline = baselines.Baseline(eager=report.eager, compile=report.compile, measured_at=time.time(),
                                               extra=report.extra())
        self.baseline_fresh = True

    def schedule_device(self, base: BaselineRun, cand: threading.Thread, ref: threading.Thread) -> None:
        """One measurement at a time: the baselines once they are compiled and nothing else
        runs on the device (verification done, reference done), then the candidate's profile."""
        free = self.files.out / protocol.DEVICE_FREE
        while not (base.compiled() and (not cand.is_alive() or free.exists()) and self.reference_idle(ref)):
            time.sleep(0.01)
        base.go()
        self.finish_baseline(base)
        self.gate_on_trials(ref, cand)

    def trial_plan(self) -> list[tuple[int, str]]:
        """Each trial's (seed, input distribution)."""
        return list(zip(self.seeds, self.kinds, strict=True))

    def gate_on_trials(self, ref: threading.Thread, cand: threading.Thread) -> None:
        """Give the candidate the device for its profile once its trials look right, and
        cancel the profile when one does not: an incorrect solution is answered without
        being timed. Here every trial's report is checked, and the first judged trial's
        outputs (read whole, not mapped: their writers still live), which is where a wrong
        kernel almost always shows; the other trials' files are compared at the end, mapped,
        as before. That trial is not compared again at the end while its report is
        unchanged (what the candidate wrote after its trials, it wrote; changing the file
        later gains it nothing)."""
        free = self.files.out / protocol.DEVICE_FREE
        while cand.is_alive() and not (free.exists() and self.reference_idle(ref)):
            time.sleep(0.01)
        if not cand.is_alive():
            return  # it ended without asking for the device: its verdict says why
        go = False
        try:
            reference = protocol.ReferenceReport.read(self.files.reference_report, inside=self.files.work)
            report = CandidateReport.read(self.files.candidate_report, inside=self.files.work)
            if reference is not None and reference.ok and report is not None and report.verified \
                    and len(report.trials) == len(self.seeds):
                plan = self.trial_plan()
                go = True
                judged = [k for k in range(len(report.trials)) if str(k) not in reference.skipped]
                for k in judged:
                    whole = k == judged[0]
                    if verdict.trial_verdict(report.trials[k], k, plan, reference, self.files, self.opts.atol,
                                             self.opts.rtol, mapped=False, outputs=whole) is not None:
                        go = False
                        break
                    if whole:
                        self.trials_right[k] = report.trials[k]
        except Exception:  # (whatever could not be read is judged at the end)
            go = False
        self.details["profile_gate"] = "go" if go else "cancelled: a trial failed or could not be checked"
        self.mark("trials checked")
        protocol.write_marker(self.files.gate / (protocol.GO if go else protocol.CANCEL))

    def remeasure_if_drifted(self, profile: protocol.ProfileReport) -> bool:
        """Cached baselines from a device that is not what it is now are measured again;
        True when they were."""
        assert self.baseline is not None
        probe_now_us = profile.probe["device"]["median_us"] if profile.probe else None
        if self.baseline_fresh or not baselines.drifted(self.baseline, profile.eager["device"]["median_us"],
                                                        probe_now_us, self.drift_bound):
            return False
        self.finish_baseline(self.new_baseline_run(gated=False))
        return True

    def io_bytes(self) -> int:
        """Bytes of one call's inputs and outputs (trial 1), the least traffic a call can have."""
        from cuda_agent.evaluator.tensors import tensors

        try:  # (mapped: only the sizes are read)
            ins = verdict.load_tensors(self.files.work, self.files.inputs(0))
            outs = verdict.load_tensors(self.files.work, self.files.expected(0))
        except Exception:
            return 0
        return sum(t.numel() * t.element_size() for _, t in [*tensors(ins), *tensors(outs)])

    def judge_speed(self, correct: Verdict, report: CandidateReport | None) -> Verdict:
        profile = report.profile if report else None
        if profile is None or self.baseline is None:
            return verdict.not_profiled(correct, self.baseline_error or "the candidate process was not given the device")
        self.timings["profile"] = profile.seconds
        wrong = verdict.timed_outputs_verdict(profile, self.files, self.timing_sets, self.opts.atol, self.opts.rtol) \
            or verdict.vouched_verdict(self.vouched, self.files, self.opts.atol, self.opts.rtol)
        if wrong is not None:
            wrong.trials_passed = correct.trials_passed
            return wrong
        remeasured = self.remeasure_if_drifted(profile)
        if remeasured and self.baseline_error:
            v = verdict.not_profiled(correct, self.baseline_error)
        else:
            assert self.vouched is not None
            v = verdict.speed_verdict(correct, profile, self.baseline, self.device,
                                      self.opts.protocol.target_rel_ci, self.drift_bound, self.io_bytes(),
                                      self.vouched.stats())
        if remeasured:
            v.flags.insert(0, record.FLAG_REMEASURED)
        if v.speed is None:
            return v
        base = self.baseline
        v.details.update({
            "threads": self.threads, "compile_mode": self.opts.compile_mode,
            "baseline": "measured" if self.baseline_fresh else "cached", "baseline_measured_at": base.measured_at,
            "kernels": {"candidate": profile.candidate.get("kernels", {}), "eager": profile.eager.get("kernels", {})},
            "compile_kernels": base.compile.get("kernels", {}), "candidate_measure_s": profile.measure_s,
            **({"baseline_measure_s": base.extra.get("measure_s")} if self.baseline_fresh else {}),
            **{k: base.extra[k] for k in ("compile_error", "compile_retried", "compile_traceback")
               if base.extra.get(k)}})
        return v

    # -- the pipeline ----------------------------------------------------------------------

    def static_violations(self) -> list[Any]:
        if not self.opts.static_checks:
            return []
        return check_solution(self.solution.files, device=self.device,
                              single_file=self.solution.format == SINGLE_FILE)

    def run(self) -> record.EvalResult:
        # Spares of this device started meanwhile (this evaluation's early one too) wait for
        # the end of this block before they touch the device.
        with warm.POOL.measuring(processes.device_key(self.opts, self.device)):
            return self._run()

    def _run(self) -> record.EvalResult:
        self.t_start = time.perf_counter()
        try:
            static = verdict.static_verdict(self.static_violations())
            self.mark("static checks")
            if static is not None:
                return self.result(static)
            # The verdict needs torch here (torch.load of outputs): import it while the
            # sandboxed processes run, instead of after them.
            threading.Thread(target=_import_torch, daemon=True).start()
            self.take_spare()
            ref_thread = self.start_reference()
            self.mark("reference started")
            t0 = time.perf_counter()
            built = self.build()
            self.timings["build"] = time.perf_counter() - t0
            self.mark("built")
            if not built.ok:
                self.finish_reference(ref_thread)
                self.reference_outcome()  # a broken task is reported as such, even here
                return self.result(Verdict(built.status, built.message, rule=built.rule,
                                           details={"build_cached": built.cached}))
            # The candidate starts while the reference still computes its outputs; it waits
            # only for the inputs. Its profile phase waits for the device to be free.
            base_run = self.plan_baseline()
            self.mark("baselines planned")
            cand: dict[str, sandbox.RunResult] = {}
            cand_thread = threading.Thread(target=lambda: cand.update(run=self.run_candidate(built.extensions)),
                                           daemon=True)
            cand_thread.start()
            if base_run is not None:
                self.schedule_device(base_run, cand_thread, ref_thread)
                self.mark("baselines measured")
            elif self.opts.profile:
                self.gate_on_trials(ref_thread, cand_thread)
            cand_thread.join()
            self.mark("candidate ended")
            self.finish_reference(ref_thread)
            self.mark("reference ended")
            reference = self.reference_outcome()
            self.skipped, self.timing_sets = reference.skipped, reference.timing_sets
            report = CandidateReport.read(self.files.candidate_report, inside=self.files.work)
            v = verdict.correctness_verdict(cand["run"], report, protocol.Progress.read(self.files.progress, inside=self.files.work),
                                            reference, self.files, self.trial_plan(),
                                            self.opts.atol, self.opts.rtol, self.opts.run_timeout_s,
                                            right=self.trials_right)
            self.mark("outputs checked")
            if v.correct and self.opts.profile:
                v = self.judge_speed(v, report)
                self.mark("speed judged")
            if v.status in (record.OK, record.INCORRECT) and report is not None:
                v = verdict.watch_verdict(report.watch, v)
            v.details.setdefault("build_cached", built.cached)
            v.details.setdefault("rebuilt", built.rebuilt)
            for k, value in self.details.items():
                v.details.setdefault(k, value)
            # when each phase of each process began (s since its start): where time goes
            if report is not None:
                v.details.setdefault("candidate_phases_s", report.phases_s)
            v.details.setdefault("reference_phases_s", reference.phases_s)
            v.details.setdefault("evaluator_phases_s", self.marks)
            return self.result(v)
        finally:
            self.timings["total"] = time.perf_counter() - self.t_start
            self.clean_up()

    def clean_up(self) -> None:
        """Processes no verdict waits for are ended, run directories removed, and the next
        evaluation's spares started (after this one's measurements)."""
        with contextlib.suppress(OSError):
            protocol.write_marker(self.files.private / protocol.END)  # a reference still waiting
        if self.spare is not None:
            for proc in self.spare.procs.values():  # not needed (a build failed): gone
                proc.kill()
                with contextlib.suppress(BaseException):
                    proc.wait()
        for run in self.baseline_runs:
            run.kill()  # a baseline no verdict waits for (the task failed)
        if not self.opts.keep_run_dir:
            shutil.rmtree(self.files.work, ignore_errors=True)
            for run in self.baseline_runs:
                shutil.rmtree(run.layout.base, ignore_errors=True)
        if self.warm_baseline:
            with contextlib.suppress(Exception):
                warm.POOL.offer(processes.baseline_spare_key(self.opts, self.device, self.threads),
                                lambda: processes.start_baseline_spare(self.opts, self.device, self.threads))
        if self.opts.warm:
            # the next evaluation's spare, unless it was started early (`take_spare`)
            self.offer_spare()


def _structure_bytes(structure: Any) -> int:
    """Bytes of the tensors a `tensors.describe()` structure describes."""
    sizes = {"float64": 8, "int64": 8, "complex64": 8, "complex128": 16, "float32": 4, "int32": 4,
             "float16": 2, "bfloat16": 2, "int16": 2}
    if not isinstance(structure, dict):
        return 0
    if structure.get("kind") == "tensor":
        n = 1
        for d in structure.get("shape") or []:
            n *= int(d)
        return n * sizes.get(str(structure.get("dtype", "")).removeprefix("torch."), 1)
    items = structure.get("items")
    values = items.values() if isinstance(items, dict) else items if isinstance(items, list) else []
    return sum(_structure_bytes(x) for x in values)


def _import_torch() -> None:
    import torch  # noqa: F401


def evaluate(task: Task, solution: Solution, options: EvalOptions | None = None) -> record.EvalResult:
    """Evaluate one solution. Raises only for bad input (TaskError, SandboxUnavailable)."""
    opts = options or EvalOptions()
    if opts.sandbox:
        ok, why = sandbox.sandbox_available()
        if not ok:
            raise sandbox.SandboxUnavailable(why)
    ev = Evaluation(task, solution, opts)
    res = ev.run()
    res.timings_s = {k: round(v, 3) for k, v in ev.timings.items()}
    return res


def prefetch_baselines(task: Task, options: EvalOptions | None = None) -> str:
    """Measure and cache the task's baselines now, as its first profiled evaluation with
    these options would (same cache key), so that evaluation finds them: a long-lived
    evaluator does this when it meets a new task (the agent's service at the start of an
    episode, while the agent reads the task). Returns "cached" (there already), "measured",
    "off" (no profiling or no cache in these options) or "failed: why" (the evaluation
    that follows measures them again and reports what it finds)."""
    opts = options or EvalOptions()
    if not opts.profile or not opts.baseline_cache:
        return "off"
    if opts.sandbox:
        ok, why = sandbox.sandbox_available()
        if not ok:
            return f"failed: {why}"
    ev = Evaluation(task, Solution(files={"model_new.py": ""}, format=WORKSPACE, origin="(baselines)"), opts)
    with warm.POOL.measuring(processes.device_key(opts, ev.device)):
        try:
            if baselines.load(baseline_key(task, opts, ev.device, ev.threads)) is not None:
                return "cached"
            ev.finish_baseline(ev.new_baseline_run(gated=False))
            if ev.baseline_error:
                return f"failed: {ev.baseline_error}"
            if ev.baseline and ev.baseline.extra.get("compile_error"):
                return "failed: torch.compile failed on this task (eager stands in; nothing cached)"
            return "measured"
        finally:
            ev.clean_up()


def prebuild(task: Task, solution: Solution, options: EvalOptions | None = None) -> record.EvalResult | None:
    """The static checks and the build alone, into the content-hash cache, so that a later
    `evaluate` of the same files finds them built (CPU work, done ahead of the GPU work by
    a build pool). None when it built; otherwise the record `evaluate` would give (the
    rejection or the compile error), made without starting a process on the device."""
    opts = options or EvalOptions()
    ev = Evaluation(task, solution, opts)
    try:
        v = verdict.static_verdict(ev.static_violations())
        if v is None:
            t0 = time.perf_counter()
            built = ev.build()
            ev.timings["build"] = time.perf_counter() - t0
            if built.ok:
                return None
            v = Verdict(built.status, built.message, rule=built.rule, details={"build_cached": built.cached})
        ev.timings["total"] = time.perf_counter() - ev.t_start
        return ev.result(v)
    finally:
        shutil.rmtree(ev.work, ignore_errors=True)
