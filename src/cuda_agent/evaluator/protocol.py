"""How the evaluator talks to its sandboxed processes: the run directory's layout, the
marker files, and the typed records written as JSON.

One evaluation's run directory (`RunLayout`); each sandboxed process writes only where
the table says:

    private/          reference's cwd; written by the reference, never seen by the candidate
      reference_spec.json  ReferenceSpec (parent)    reference.json   ReferenceReport
      model.py             the task's code (parent)  expected_K.pt    trial K's expected outputs
      started              the job reached the process
      expect.json          ExpectRequest (parent): the checked calls of the vouched batches
      vexp_B_I.pt          call I of vouched batch B's expected outputs; then `expected`
      end                  (parent) nothing more to compute: the reference exits
    shared/           written by the reference, read by the candidate
      init_inputs.pt, state_dict.pt, inputs_K.pt, and then `ready` (or `failed`)
    cin/              written by the parent, read by the candidate
      candidate_spec.json  CandidateSpec             task_model.py    the task's code
      ext/K/NAME.so        the built extensions      watch/         the op watch (op_watch)
    run/              candidate's cwd: the solution's files
      out/            progress.json (Progress), report.json (CandidateReport),
                      out_K.pt (trial K's outputs), after_K.pt (trial K's inputs after
                      the call), timed_K.pt (a timed call's outputs), vouched_B_I.pt
                      (a checked call of vouched batch B), device-free (it waits for the
                      go, or is done with the device)
    gate-candidate/   `go` (measure now) or `cancel`, written by the parent; the FIFOs
                      `cmd` (parent -> candidate) and `reply` (candidate -> parent) of
                      the vouched batches (see `vouch`)
    capture/          single-file solutions: the `load_inline` calls (CaptureReport)

A baseline run (`BaselineLayout`) has out/ (its cwd: spec.json, `compiled`,
baseline.json), gate/ (`go`) and task/ (the task's code).

Every record carries `schema`; one written under another schema, or not matching its
fields' types, reads as missing (`read` returns None), so a malformed or foreign file is
a verdict about its writer, never an exception in the parent. The module imports only the
standard library: the sandboxed processes import it before anything else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cuda_agent.files import atomic_write, read_inside

SCHEMA = 1
MAX_RECORD_BYTES = 64 << 20  # a larger report is not one the evaluator's processes write

# Marker files: their existence is the message; they are written whole (a rename).
READY = "ready"  # shared/: the inputs are written
FAILED = "failed"  # shared/: the reference failed (a candidate waiting for inputs stops)
STARTED = "started"  # private/: the reference's job reached its process
GO = "go"  # a gate: measure now
CANCEL = "cancel"  # a gate: do not measure
DEVICE_FREE = "device-free"  # run/out/: the candidate waits for the go, or has finished
EXPECTED = "expected"  # private/: the vouched batches' expected outputs are written
END = "end"  # private/: the reference has nothing more to compute
COMPILED = "compiled"  # baseline out/: torch.compile is done (or failed); measuring may start
SPARE_GO = ".spare-go"  # a spare's cwd: its device stage may start (see `warm`)
SPARE_READY = ".spare-ready"  # a spare's cwd: it has warmed up and waits for its spec


def write_marker(path: Path) -> None:
    atomic_write(path, "")


# -- run directories -----------------------------------------------------------------------


class _Under:
    """A layout's fixed part: `layout.<name>` is its root joined with these parts."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    def __get__(self, layout: Any, owner: type) -> Path:
        return Path(layout.root).joinpath(*self.parts)


@dataclass(frozen=True)
class RunLayout:
    """The parts of one evaluation's run directory (see the module's table)."""

    work: Path

    @property
    def root(self) -> Path:
        return self.work

    private = _Under("private")
    shared = _Under("shared")
    cin = _Under("cin")
    run = _Under("run")
    out = _Under("run", "out")
    gate = _Under("gate-candidate")
    capture = _Under("capture")
    reference_spec = _Under("private", "reference_spec.json")
    reference_report = _Under("private", "reference.json")
    task_code = _Under("private", "model.py")  # the reference's copy of the task
    candidate_task_code = _Under("cin", "task_model.py")  # its Model is eager beside the candidate
    candidate_spec = _Under("cin", "candidate_spec.json")
    progress = _Under("run", "out", "progress.json")
    candidate_report = _Under("run", "out", "report.json")
    init_inputs = _Under("shared", "init_inputs.pt")
    state_dict = _Under("shared", "state_dict.pt")
    cmd = _Under("gate-candidate", "cmd")  # FIFO: the parent's commands (see `vouch`)
    reply = _Under("gate-candidate", "reply")  # FIFO: the candidate's answers
    expect_request = _Under("private", "expect.json")
    timing_sets = _Under("shared", "timing_sets.json")  # TimingSets, from the reference

    def inputs(self, k: int) -> Path:
        """Trial k's inputs (written by the reference)."""
        return self.shared / f"inputs_{k}.pt"

    def expected(self, k: int) -> Path:
        """Trial k's expected outputs (never seen by the candidate)."""
        return self.private / f"expected_{k}.pt"

    def output(self, k: int) -> Path:
        """Trial k's outputs as the candidate wrote them."""
        return self.out / f"out_{k}.pt"

    def inputs_after(self, k: int) -> Path:
        """Trial k's inputs as the candidate's call left them."""
        return self.out / f"after_{k}.pt"

    def vouched_output(self, b: int, i: int) -> Path:
        """Call i of vouched batch b's outputs, as the candidate revealed them."""
        return self.out / f"vouched_{b}_{i}.pt"

    def vouched_expected(self, b: int, i: int) -> Path:
        return self.private / f"vexp_{b}_{i}.pt"

    def timed_output(self, k: int) -> Path:
        """A timed call's outputs for trial k's inputs."""
        return self.out / f"timed_{k}.pt"

    def extension_dir(self, k: int) -> Path:
        return self.cin / "ext" / str(k)

    def make(self) -> RunLayout:
        """The directories the sandboxed processes bind, readable by their uid."""
        for d in (self.shared, self.private, self.out, self.cin / "ext", self.gate):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)
        # the candidate reads `cmd` and writes `reply`; the folder is read-only to it
        for path, mode in ((self.cmd, 0o644), (self.reply, 0o622)):
            if not path.exists():
                os.mkfifo(path)
            os.chmod(path, mode)
        return self


@dataclass(frozen=True)
class BaselineLayout:
    """One baseline run: out/ (its cwd, the only place it writes), gate/, task/."""

    base: Path

    @property
    def root(self) -> Path:
        return self.base

    out = _Under("out")
    gate = _Under("gate")
    spec = _Under("out", "spec.json")
    report = _Under("out", "baseline.json")
    task_code = _Under("task", "task_model.py")

    def make(self) -> BaselineLayout:
        for d in (self.out, self.gate, self.task_code.parent):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)
        return self


# -- records -------------------------------------------------------------------------------

R = TypeVar("R", bound="Record")


class Record:
    """A dataclass that crosses a process boundary as JSON."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def write(self, path: Path) -> None:
        atomic_write(path, self.to_json())

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        """The record of `data`; ValueError when it is not one (wrong schema, unknown
        field, a value of the wrong type)."""
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: not an object")
        data = dict(data)
        if data.pop("schema", None) != SCHEMA:
            raise ValueError(f"{cls.__name__}: not schema {SCHEMA}")
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        return cls(**{k: _coerce(hints[k], v, f"{cls.__name__}.{k}") for k, v in data.items()})

    @classmethod
    def from_json(cls: type[R], text: str) -> R:
        return cls.from_dict(json.loads(text))

    @classmethod
    def read(cls: type[R], path: Path, inside: Path | None = None) -> R | None:
        """The record in `path`; None when it is missing or not a valid record. With
        `inside`, no symbolic link below that folder is followed (`files.open_inside`)."""
        try:
            data = read_inside(inside, path, MAX_RECORD_BYTES) if inside is not None else path.read_bytes()
            return cls.from_json(data.decode())
        except (OSError, ValueError, TypeError, RecursionError):
            return None


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """`value` checked against the annotation `hint` (nested records built)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(hint):
            try:
                return _coerce(arm, value, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise ValueError(f"{where}: expected null")
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict({"schema": SCHEMA, **value} if isinstance(value, dict) else value)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(item, v, where) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object")
        _, item = typing.get_args(hint) or (str, Any)
        return {str(k): _coerce(item, v, where) for k, v in value.items()}
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{where}: expected a number")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected an integer")
    if hint in (str, bool, list, dict):
        if isinstance(value, hint):
            return value
        raise ValueError(f"{where}: expected {hint.__name__}")
    raise TypeError(f"{where}: unsupported annotation {hint!r}")



# -- the reference process -----------------------------------------------------------------


@dataclass
class ReferenceSpec(Record):
    work: str  # the run directory (RunLayout)
    task_name: str
    device: str
    seeds: list[int]
    init_seed: int
    serve_s: float = 0.0  # how long it waits for an ExpectRequest after its trials
    distributions: list[str] = field(default_factory=list)  # each trial's (distributions); [] = the task's
    atol: float = 1e-2  # the tolerance, for `barely_varies`
    rtol: float = 1e-2


@dataclass
class TimingSets(Record):
    """The trials whose inputs the candidate's timed calls and vouched batches use, in
    order: those the reference could judge (see `distributions.usable`)."""

    trials: list[int]


@dataclass
class ExpectRequest(Record):
    """The calls of the vouched batches the parent checks: {"b", "seed", "i"} each."""

    calls: list[dict[str, int]]


@dataclass
class ReferenceReport(Record):
    ok: bool
    structures: list[Any] = field(default_factory=list)  # tensors.describe() of each trial's outputs
    seconds: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    n_params: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # trial index -> why it is not judged
    timing_sets: list[int] = field(default_factory=list)  # the trials whose inputs timed calls rotate through
    barely_varies: bool = False  # the task's own trials' outputs are all within the tolerance of each other
    phase: str = ""  # where it failed
    error: str = ""
    traceback: str = ""


# -- the candidate process -----------------------------------------------------------------


@dataclass
class Extension(Record):
    name: str
    so_path: str


@dataclass
class ProfileSpec(Record):
    protocol: dict[str, Any]  # timing.Protocol's fields
    gate_timeout_s: float


@dataclass
class CandidateSpec(Record):
    work: str  # the run directory (RunLayout)
    device: str
    trials: int
    init_seed: int
    format: str  # solution.WORKSPACE or solution.SINGLE_FILE
    extensions: list[Extension]
    threads: int
    profile: ProfileSpec | None = None  # time it after the trials (the task's Model beside it)
    watch_so: str = ""  # the op watch's extension (see op_watch); "" runs without it


@dataclass
class Progress(Record):
    phase: str
    trial: int | None = None

    def where(self) -> str:
        return f"trial {self.trial}" if self.trial else self.phase


@dataclass
class TrialReport(Record):
    trial: int
    forward_s: float = 0.0
    guard: list[str] | None = None  # [rule, message] of the first guard the forward broke
    exception: str | None = None
    traceback: str = ""
    extension_calls: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    structure: Any = None  # tensors.describe() of the outputs
    aliases: list[str] = field(default_factory=list)
    exact_types: bool = False
    streams: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProfileReport(Record):
    candidate: dict[str, Any]  # timing.Measurement.summary()
    eager: dict[str, Any]
    probe: dict[str, Any] | None = None
    timed_outputs: list[int] = field(default_factory=list)  # trials whose timed outputs were saved
    threads: int = 0
    seconds: float = 0.0
    measure_s: dict[str, Any] = field(default_factory=dict)  # timing.measure's spent_s


# What a candidate's report says went wrong before its trials were judged.
ERROR_RUNTIME = "runtime"  # load, import or construction failed
ERROR_REJECTED = "rejected"  # a rule (its `rule`) was broken
ERROR_INCORRECT = "incorrect"  # parameters do not match the reference's
ERROR_REFERENCE = "reference"  # the reference failed (it is reported as such)
ERROR_FORWARD = "forward"  # a trial's forward raised (see that trial)
ERROR_CHECKS = "checks"  # a trial broke a runtime check (see that trial)


@dataclass
class CandidateReport(Record):
    ok: bool = False
    trials: list[TrialReport] = field(default_factory=list)
    error: str | None = None  # one of ERROR_*
    rule: str | None = None
    message: str = ""
    phase: str = ""
    traceback: str = ""
    verified: bool = False
    profile: ProfileReport | None = None
    profile_skipped: bool = False
    vouch_end: str = ""  # how the vouched batches ended, as the candidate saw it
    watch: dict[str, Any] = field(default_factory=dict)  # op_watch: phase -> thread -> operator -> calls
    phases_s: dict[str, float] = field(default_factory=dict)


# -- single-file solutions: the load_inline calls ------------------------------------------


@dataclass
class CaptureReport(Record):
    ok: bool
    calls: list[dict[str, Any]] = field(default_factory=list)  # load_inline's keyword arguments
    error: str = ""


# -- the baseline process ------------------------------------------------------------------


@dataclass
class BaselineSpec(Record):
    base: str  # the baseline run's directory (BaselineLayout)
    task_name: str
    device: str
    init_seed: int
    seeds: list[int]
    compile_mode: str
    threads: int
    protocol: dict[str, Any]
    gate_timeout_s: float
    distributions: list[str] = field(default_factory=list)  # each seed's (distributions); [] = the task's


@dataclass
class BaselineReport(Record):
    ok: bool = False
    eager: dict[str, Any] | None = None  # timing.Measurement.summary()
    compile: dict[str, Any] | None = None  # eager's when torch.compile failed
    probe: dict[str, Any] | None = None
    compile_s: float | None = None
    compile_error: str | None = None
    compile_retried: str | None = None  # the first failure, when a retry compiled
    compile_traceback: str | None = None
    compile_matches_eager: bool | None = None
    copy_gbps: float | None = None
    vouched: dict[str, Any] | None = None  # vouch.time_batches of eager, compile and null
    device_name: str | None = None
    threads: int | None = None
    torch_version: str | None = None
    seconds: float = 0.0
    measure_s: dict[str, Any] = field(default_factory=dict)  # timing.measure's spent_s
    phase: str = ""
    error: str = ""
    traceback: str = ""

    # What the cache keeps beside the two times (see `baselines.Baseline.extra`).
    EXTRA = ("compile_s", "compile_error", "compile_retried", "compile_traceback", "compile_matches_eager",
             "copy_gbps", "device_name", "threads", "torch_version", "seconds", "measure_s", "probe", "vouched")

    def extra(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.EXTRA if getattr(self, k) is not None}
