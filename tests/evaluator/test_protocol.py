"""The evaluator's process protocol: records survive the trip through JSON, and a report
that is missing, foreign or malformed reads as missing (a verdict), never as a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cuda_agent import sandbox
from cuda_agent.evaluator import protocol as P
from cuda_agent.evaluator import record
from cuda_agent.evaluator.verdict import correctness_verdict


def a_report() -> P.CandidateReport:
    return P.CandidateReport(
        ok=True, verified=True, phases_s={"import torch": 0.1},
        trials=[P.TrialReport(trial=1, forward_s=0.01, guard=None, extension_calls=2, ops={"aten::empty": 1},
                              structure={"kind": "tensor", "shape": [4]}, exact_types=True)],
        profile=P.ProfileReport(candidate={"device": {"median_us": 1.0}}, eager={"device": {"median_us": 2.0}},
                                timed_outputs=[0], threads=2, seconds=0.5))


def test_records_round_trip_through_json(tmp_path: Path) -> None:
    report = a_report()
    report.write(tmp_path / "report.json")
    back = P.CandidateReport.read(tmp_path / "report.json")
    assert back == report
    assert isinstance(back.trials[0], P.TrialReport) and isinstance(back.profile, P.ProfileReport)
    spec = P.CandidateSpec(work="/w", device="cpu", trials=5, init_seed=3, format="workspace",
                           extensions=[P.Extension(name="cuda_extension", so_path="/w/cin/ext/0/x.so")], threads=2,
                           profile=P.ProfileSpec(protocol={"warmup": 3}, gate_timeout_s=60.0))
    assert P.CandidateSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["schema"] == P.SCHEMA


@pytest.mark.parametrize("text", [
    "",  # nothing written
    "{not json",
    "[]",  # not an object
    json.dumps({"ok": True}),  # no schema
    json.dumps({"schema": P.SCHEMA + 1, "ok": True}),  # another schema
    json.dumps({"schema": P.SCHEMA, "ok": True, "verdict": "ok"}),  # a field the protocol does not have
    json.dumps({"schema": P.SCHEMA, "ok": "yes"}),  # wrong type
    json.dumps({"schema": P.SCHEMA, "ok": True, "trials": "all passed"}),
    json.dumps({"schema": P.SCHEMA, "ok": True, "trials": [{"trial": 1, "extension_calls": "many"}]}),
    json.dumps({"schema": P.SCHEMA, "ok": True, "trials": [{"trial": True}]}),  # a bool is not an int
    json.dumps({"schema": P.SCHEMA, "ok": True, "profile": {"candidate": 1, "eager": {}}}),
    "[" * 100000,  # deeper than the parser goes
])
def test_a_malformed_report_reads_as_missing(tmp_path: Path, text: str) -> None:
    path = tmp_path / "report.json"
    path.write_text(text)
    assert P.CandidateReport.read(path) is None


def test_a_missing_file_reads_as_missing(tmp_path: Path) -> None:
    assert P.ReferenceReport.read(tmp_path / "nothing.json") is None


def test_numbers_are_kept_as_their_types(tmp_path: Path) -> None:
    report = P.TrialReport.from_dict({"schema": P.SCHEMA, "trial": 2, "forward_s": 1})
    assert report.forward_s == 1.0 and isinstance(report.forward_s, float) and report.trial == 2


def test_a_malformed_candidate_report_is_a_runtime_error_verdict(tmp_path: Path) -> None:
    """What the parent concludes when the candidate process left garbage where its report goes."""
    files = P.RunLayout(tmp_path).make()
    files.candidate_report.write_text(json.dumps({"schema": P.SCHEMA, "ok": True, "trials": "all passed"}))
    run = sandbox.RunResult(returncode=0, stdout="", stderr="", timed_out=False, duration_s=1.0, signal=None,
                            sandboxed=True)
    v = correctness_verdict(run, P.CandidateReport.read(files.candidate_report),
                            P.Progress(phase="trial", trial=3), P.ReferenceReport(ok=True), files, plan=[(1, "")] * 5,
                            atol=1e-2, rtol=1e-2, timeout_s=60)
    assert v.status == record.RUNTIME_ERROR and not v.correct
    assert "during trial 3" in v.message


def test_layout_names_are_where_the_processes_look(tmp_path: Path) -> None:
    files = P.RunLayout(tmp_path).make()
    for d in (files.shared, files.private, files.out, files.cin, files.gate):
        assert d.is_dir() and d.stat().st_mode & 0o777 == 0o755
    assert files.out.parent == files.run and files.candidate_report.parent == files.out
    assert files.expected(2).parent == files.private and files.inputs(2).parent == files.shared
    base = P.BaselineLayout(tmp_path / "b").make()
    assert base.spec.parent == base.out and base.gate.is_dir() and base.task_code.parent.is_dir()
