"""Spares: reference and candidate processes started ahead of their evaluation (CPU)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from cuda_agent.evaluator import processes, protocol, warm
from cuda_agent.evaluator.options import EvalOptions
from cuda_agent.evaluator.protocol import RunLayout
from cuda_agent.machine import usable_cores

from . import cases as C
from .test_evaluate_cpu import run


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    p = warm.Pool()
    monkeypatch.setattr(warm, "POOL", p)
    yield p
    p.close()


def wait_ready(pool: warm.Pool, timeout: float = 60.0) -> warm.Spare:
    """The spare left by the last evaluation, once both its processes wait for a job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spare = next(iter(pool._spares.values()), None)
        if spare is not None and spare.ready():
            return spare
        time.sleep(0.05)
    raise AssertionError("no spare was started")


def test_the_next_evaluation_runs_in_the_spare_with_the_same_verdicts(tmp_path: Path, pool: warm.Pool) -> None:
    first = run(tmp_path / "a", C.AXPBY_TASK, C.axpby(), warm=True)
    assert first.status == "ok" and "warm_start" not in first.details, first.message
    spare = wait_ready(pool)
    assert all(p.alive() for p in spare.procs.values())
    second = run(tmp_path / "b", C.AXPBY_TASK, C.axpby(), warm=True)
    assert second.status == "ok" and second.details.get("warm_start") is True, (second.message, second.details)
    assert pool.taken == 1 and "warmed up ahead (s)" in second.details["candidate_phases_s"]
    assert not spare.work.exists()  # used once, then gone
    # wrong answers, crashes and hangs in a spare end as they do in a fresh process
    wait_ready(pool)
    wrong = run(tmp_path / "c", C.AXPBY_TASK, C.axpby(C.forward("return cuda_extension.axpby(b, a, self.alpha)")),
                warm=True)
    assert wrong.status == "incorrect" and wrong.details.get("warm_start") is True, wrong.message
    wait_ready(pool)
    crash = run(tmp_path / "d", C.AXPBY_TASK, C.axpby(C.forward("import os\nos._exit(3)")), warm=True,
                static_checks=False)
    assert crash.status == "runtime_error" and "code 3" in crash.message, crash.message
    wait_ready(pool)
    t0 = time.monotonic()
    hang = run(tmp_path / "e", C.AXPBY_TASK, C.axpby(C.forward("while True:\n    pass")), warm=True,
               static_checks=False, run_timeout_s=8.0)
    assert hang.status == "timeout" and time.monotonic() - t0 < 40, hang.message  # the job's timeout, not the spare's


def test_a_spare_that_dies_before_its_job_is_replaced_by_a_fresh_process(tmp_path: Path, pool: warm.Pool) -> None:
    opts = EvalOptions(device="cpu", profile=False)
    threads = usable_cores()
    spare = processes.start_spare(opts, "cpu", threads)
    for kind in ("reference", "candidate"):  # replaced by processes that die without reading a job
        spare.procs[kind].kill()
        spare.procs[kind].wait()
        argv, kw = processes.command(kind, RunLayout(spare.work), opts, "cpu", threads)
        spare.procs[kind] = warm.Proc([sys.executable, "-c", "import time; time.sleep(1.5)"], **kw, timeout_s=60)
    pool._spares[processes.spare_key(opts, "cpu", threads)] = spare
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(), warm=True)
    assert res.status == "ok", res.message
    assert "spare_failed" in res.details and "warm_start" not in res.details and pool.taken == 1


def test_idle_spares_exit_and_close_kills_the_rest(monkeypatch: pytest.MonkeyPatch, pool: warm.Pool) -> None:
    monkeypatch.setattr(warm, "IDLE_S", 2.0)
    opts = EvalOptions(device="cpu")
    key = processes.spare_key(opts, "cpu", 1)
    pool.offer(key, lambda: processes.start_spare(opts, "cpu", 1))
    spare = pool._spares[key]
    deadline = time.monotonic() + 60
    while any(p.alive() for p in spare.procs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.alive() for p in spare.procs.values())  # nobody came: both exited by themselves
    assert all(p.wait().returncode == 0 for p in spare.procs.values())
    assert pool.take(key) is None  # and it is not handed out
    monkeypatch.setattr(warm, "IDLE_S", 900.0)
    pool.offer(key, lambda: processes.start_spare(opts, "cpu", 1))
    live = pool._spares[key]
    pool.close()
    assert not any(p.alive() for p in live.procs.values()) and not live.work.exists()
    pool.offer(key, lambda: processes.start_spare(opts, "cpu", 1))  # a closed pool starts nothing
    assert key not in pool._spares


def test_a_profiled_evaluation_in_a_spare(tmp_path: Path, pool: warm.Pool) -> None:
    from .test_profile_cpu import FAST

    first = run(tmp_path / "a", C.AXPBY_TASK, C.axpby(), warm=True, profile=True, protocol=FAST)
    assert first.status == "ok", first.message
    wait_ready(pool)
    res = run(tmp_path / "b", C.AXPBY_TASK, C.axpby(), warm=True, profile=True, protocol=FAST)
    assert res.status == "ok" and res.details.get("warm_start") is True, res.message
    assert res.times_us["candidate"]["median_us"] > 0 and res.reward in (1.0, 2.0, 3.0)


def wait_for(pool: warm.Pool, key: object, timeout: float = 90.0) -> warm.Spare:
    assert pool.wait_ready(key, timeout), f"no spare for {key} became ready"
    return pool._spares[key]


def test_baselines_measured_in_a_spare_baseline_process(tmp_path: Path, pool: warm.Pool) -> None:
    """A task whose baselines are measured takes the spare baseline process; one that dies
    before its job is replaced by a fresh process; each evaluation leaves a new spare."""
    from .test_profile_cpu import FAST

    kw = dict(warm=True, warm_baseline=True, profile=True, protocol=FAST, baseline_cache=False)
    first = run(tmp_path / "a", C.AXPBY_TASK, C.axpby(), **{**kw, "profile": False})  # leaves the spares
    assert first.status == "ok" and "baseline_warm_start" not in first.details, first.message
    opts = EvalOptions(device="cpu")
    key = processes.baseline_spare_key(opts, "cpu", usable_cores())
    spare = wait_for(pool, key)
    assert (spare.work / "out" / ".spare-ready").exists() and list(spare.procs) == ["baseline"]
    second = run(tmp_path / "b", C.AXPBY_TASK, C.axpby(), **kw)
    assert second.status == "ok" and second.details.get("baseline_warm_start") is True, (second.message,
                                                                                           second.details)
    assert second.details["baseline"] == "measured" and second.times_us["eager"]["median_us"] > 0
    assert second.reward in (1.0, 2.0, 3.0) and not spare.work.exists()
    # a spare whose process is gone before its job: the baselines come from a fresh one
    spare = wait_for(pool, key)
    proc = spare.procs["baseline"]
    proc.kill()
    proc.wait()
    spare.procs["baseline"] = warm.Proc(  # a process that ends without reading a job
        [sys.executable, "-c", "import time; time.sleep(10)"], cwd=spare.work / "out", writable=[spare.work / "out"],
        config=processes.sandbox_config(opts, 60, "cpu"), timeout_s=60)
    third = run(tmp_path / "c", C.AXPBY_TASK, C.axpby(), **kw)
    assert third.status == "ok" and "baseline_spare_failed" in third.details, third.details
    assert "baseline_warm_start" not in third.details and third.times_us["compile"]["median_us"] > 0



def test_a_spare_started_during_a_measurement_waits_for_its_end(tmp_path: Path, pool: warm.Pool) -> None:
    """A spare offered while a measurement of its device is in flight does nothing of its
    device stage (on the CPU: nothing at all) until the measurement ends; a job it is
    given meanwhile is its go, so an evaluation never waits on the one that holds it."""
    opts = EvalOptions(device="cpu")
    threads = usable_cores()
    key = processes.spare_key(opts, "cpu", threads)
    with pool.measuring(processes.device_key(opts, "cpu")):
        pool.offer(key, lambda: processes.start_spare(opts, "cpu", threads))
        spare = pool._spares[key]
        time.sleep(3.0)  # long enough for a warm-up on this machine
        assert all(p.alive() for p in spare.procs.values()) and not spare.released
        assert not any((spare.work / d / name).exists() for d in spare.ready_dirs for name in (protocol.SPARE_GO, protocol.SPARE_READY))
    assert spare.released and all((spare.work / d / protocol.SPARE_GO).exists() for d in spare.ready_dirs)
    assert wait_for(pool, key) is spare
    # held again, then taken by an evaluation inside the measurement that holds it
    res_key = pool.take(key)
    assert res_key is spare
    spare.close()
    with pool.measuring(processes.device_key(opts, "cpu")):
        pool.offer(key, lambda: processes.start_spare(opts, "cpu", threads))
        held = pool._spares[key]
        time.sleep(1.0)  # (usually waiting for the go by now)
        t0 = time.monotonic()
        res = run(tmp_path / "a", C.AXPBY_TASK, C.axpby(), warm=True, early_spare=False)
        assert res.status == "ok" and res.details.get("warm_start") is True, res.message
        assert not held.released and time.monotonic() - t0 < 60
        phases = res.details["candidate_phases_s"]
        # the job was its go (it may have been there before the process looked); on the CPU no host stage
        assert phases["waited for the go (s)"] >= 0 and phases["warm-up, host (s)"] < 0.05, phases


def test_an_early_spare_starts_during_the_evaluation_and_warms_after_it(tmp_path: Path, pool: warm.Pool) -> None:
    first = run(tmp_path / "a", C.AXPBY_TASK, C.axpby(), warm=True, early_spare=True)
    assert first.status == "ok", first.message
    spare = wait_ready(pool)  # started while `first` ran, given the go at its end
    assert spare.released_at - spare.started > 0.2  # it waited, not started after the evaluation
    second = run(tmp_path / "b", C.AXPBY_TASK, C.axpby(), warm=True, early_spare=True)
    assert second.status == "ok" and second.details.get("warm_start") is True, second.message
    assert second.details["candidate_phases_s"]["waited for the go (s)"] > 0.2
    wait_ready(pool)  # and the next one is there again
