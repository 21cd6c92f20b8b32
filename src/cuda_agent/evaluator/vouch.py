"""Times the parent can vouch for, and outputs committed before anyone knows which are checked.

A process that has run candidate code is the candidate's: its extension can replace the
clock the timing code reads, the profiler's results, the report it writes. So besides
the in-process measurement (`timing.measure`: device time, precise, and the candidate's
to forge), the parent times *vouched batches* itself:

- The parent sends a batch `(seed, key, n)` down a pipe (`RunLayout.cmd`); the
  candidate process runs `n` calls back to back and answers down another
  (`RunLayout.reply`). The parent's own clock, from sending to the answer, is the batch's
  time: nothing the candidate does can make it shorter than the work the calls did.
- Each call's inputs are new values, made inside the batch from `seed` (`vary_inputs`:
  each floating-point input mixes two of the trial input sets element by element, under a
  random mask), so no output can be computed before the batch starts, and no memo of an
  earlier input hits.
- Right after each call, its output is *committed*: `commit_hash` (with `key`, sent with
  the batch) over the output's bytes, and every call's hash is in the answer. Only then
  does the parent choose, at random, which calls of the batch it checks; the candidate
  writes those outputs, the parent hashes them itself (a changed output: the work was not
  done when the call returned) and compares them with the reference's outputs for the
  same `(seed, call)`, computed by the reference process after the candidate has ended.
  A candidate that skips work in any call fails with the probability that call is drawn;
  over a profile's batches, a candidate that skips in a share of its calls is caught
  almost surely.

The trusted baseline process times eager, torch.compile and a *null* subject (an output
returned ready-made) with the same batch function and clock, so the protocol's own cost
(new inputs, hashes) can be taken off both sides (`per_call_work_us`). `speed.judge`
counts the in-process speedup only within a band of the vouched one.

Imported by the sandboxed processes and the parent; torch is imported inside functions.
"""

from __future__ import annotations

import errno
import json
import os
import random
import secrets
import select
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BATCHES = 5  # vouched batches after the pilot
REVEALS = 2  # calls checked per batch
BATCH_S = {"cuda": 0.02, "cpu": 0.05}  # a batch's target length: the pipe's latency is well under 1% of it
MAX_CALLS = 2048
KEEP_BYTES = {"cuda": 512 << 20, "cpu": 256 << 20}  # outputs of one batch kept for the reveal
MAX_LINE = 4 << 20
OPEN_WAIT_S = 30.0  # how long the candidate waits for the parent's end of the pipes
_COLS = (61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127)
_perf = time.perf_counter  # bound before candidate code is imported


def call_seed(seed: int, i: int) -> int:
    return (seed * 1_000_003 + i) % (1 << 62)


# -- in the evaluator's processes ----------------------------------------------------------

_M64 = (1 << 64) - 1


def _draws(seed: int, k: int) -> list[int]:
    """`k` pseudo-random 64-bit integers from `seed` (splitmix64: cheap, and the same in
    every process)."""
    out, x = [], seed & _M64
    for _ in range(k):
        x = (x + 0x9E3779B97F4A7C15) & _M64
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


def vary_inputs(buffers: list[Any], sets: Sequence[list[Any]], seed: int, i: int) -> None:
    """Write call `i` of batch `seed`'s inputs into `buffers` (same memory, new values).

    Each contiguous real floating-point tensor of more than one element becomes the
    elementwise maximum (or, by the seed, minimum) of two trial sets' values, each rotated
    by its own random offset: every value is one the task's own `get_inputs` gave, so
    ranges and signs hold, while the multiset of values is new for every call (a memo
    keyed by any fingerprint, permutation-invariant or not, finds nothing). One pass over
    the inputs, exact and deterministic in (sets, seed, i): the reference rebuilds the
    inputs of the calls the parent checks. Other tensors (integer, bool, complex, one
    element, not contiguous) are set `j`'s as they are."""
    import torch

    n_sets = len(sets)
    r = _draws(call_seed(seed, i), 3 + 2 * len(buffers))
    j = r[0] % n_sets
    k = (j + 1 + r[1] % (n_sets - 1)) % n_sets if n_sets > 1 else j
    pick = torch.maximum if r[2] & 1 else torch.minimum
    for pos, dst in enumerate(buffers):
        if not isinstance(dst, torch.Tensor):
            continue
        a, b = sets[j][pos], sets[k][pos]
        n = a.numel()
        if n > 1 and a.is_floating_point() and dst.is_contiguous() and a.is_contiguous() and b.is_contiguous():
            _combine(pick, dst.view(-1), a.view(-1), b.view(-1), r[3 + 2 * pos] % n, r[4 + 2 * pos] % n)
        else:
            dst.copy_(a)


def _combine(op: Callable[..., Any], d: Any, a: Any, b: Any, oa: int, ob: int) -> None:
    """d[p] = op(a[(p + oa) % n], b[(p + ob) % n]), in at most three contiguous pieces."""
    n = d.numel()
    cuts = sorted({0, n, (n - oa) % n, (n - ob) % n})
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        if hi > lo:
            pa, pb = (lo + oa) % n, (lo + ob) % n
            op(a[pa:pa + hi - lo], b[pb:pb + hi - lo], out=d[lo:hi])


def _words(t: Any) -> Any:
    """`t`'s bytes as a flat tensor of the widest integers (4, 2 or 1 bytes) they divide into."""
    import torch

    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().view(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    nbytes = t.numel() * t.element_size()
    width = 4 if nbytes % 4 == 0 else 2 if nbytes % 2 == 0 else 1
    kind = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    return t if t.dtype == kind else t.view(torch.uint8).view(kind)


SEGMENTS = 2  # random stretches (each at most a quarter of the whole) summed on their own besides it


_plans: dict[tuple[int, int, int, str], tuple[list[tuple[int, int]], Any]] = {}


def _plan(key: int, index: int, n: int, device: Any) -> tuple[list[tuple[int, int]], Any]:
    """The stretches summed besides the whole, and the weights of the sums, for the
    `index`-th tensor of `n` words under `key`; made once per batch and kept."""
    import torch

    k = (key, index, n, str(device))
    if k not in _plans:
        if len(_plans) > 256:
            _plans.clear()
        r = _draws(key * 7919 + index, 1 + 3 * SEGMENTS)
        segs = []
        for s in range(SEGMENTS):
            lo = r[1 + 3 * s] % (n + 1)
            segs.append((lo, lo + r[2 + 3 * s] % (min(n - lo, n // 4) + 1)))
        weights = [r[0] >> 2] + [r[3 + 3 * s] >> 2 for s in range(SEGMENTS)]
        _plans[k] = segs, torch.tensor(weights, dtype=torch.int64, device=device)
    return _plans[k]


def commit_hash(obj: Any, key: int, device: Any) -> Any:
    """A 64-bit commitment to the bytes of `obj`'s tensors (a 0-d int64 tensor on
    `device`; no synchronisation): the sum of the bytes as integers (modulo 2**32), and
    of `SEGMENTS` stretches drawn from `key`, combined with weights drawn from `key`
    (modulo 2**64). Exact, whatever the order of the sums, so the parent gets the same
    value from the revealed bytes on its CPU; contiguous sums, about one pass over the
    output. Matching it without the output means knowing those sums of its bit patterns,
    which takes the output; a call whose work is still running when it returns leaves
    other bytes than the ones it reveals later."""
    import torch

    from cuda_agent.evaluator.tensors import tensors

    total = None
    for index, (_, t) in enumerate(tensors(obj)):
        w = _words(t)
        n = w.numel()
        segs, weights = _plan(key, index, n, w.device)
        sums = torch.stack([w.sum(dtype=torch.int32), *(w[lo:hi].sum(dtype=torch.int32) for lo, hi in segs)])
        h = (sums.to(torch.int64) * weights).sum().to(device) + n
        total = h if total is None else total * 1_000_003 + h
    return total if total is not None else torch.zeros((), dtype=torch.int64, device=device)


def run_batch(subject: Callable[..., Any], sets: Sequence[list[Any]], buffers: list[Any], seed: int, key: int,
              n: int, device: Any) -> tuple[list[Any], list[int]]:
    """`n` calls on new inputs each, each output committed right after its call; returns
    the outputs (kept for the reveal) and the hashes (one synchronisation, at the end)."""
    import torch

    outs: list[Any] = []
    hashes: list[Any] = []
    with torch.no_grad():
        for i in range(n):
            vary_inputs(buffers, sets, seed, i)
            out = subject(*buffers)
            hashes.append(commit_hash(out, key, device))
            outs.append(out)
        values = torch.stack(hashes).tolist() if hashes else []
    return outs, [int(v) for v in values]


def out_bytes(obj: Any) -> int:
    from cuda_agent.evaluator.tensors import tensors

    return sum(t.numel() * t.element_size() for _, t in tensors(obj))


def calls_per_batch(per_call_s: float, one_output_bytes: int, device: str) -> int:
    """How many calls make a batch of about `BATCH_S`, within what a batch may keep."""
    n = int(BATCH_S[device] / max(per_call_s, 1e-7)) + 1
    return max(1, min(n, MAX_CALLS, KEEP_BYTES[device] // max(one_output_bytes, 1)))


def time_batches(subject: Callable[..., Any], sets: Sequence[list[Any]], device: Any, batches: int = BATCHES
                 ) -> dict[str, Any]:
    """In a trusted process (the baselines'): the same batches, timed by its own clock.
    Returns `stats` of the per-call times (us) and the calls per batch."""
    import torch

    from cuda_agent.evaluator.tensors import tree_map

    buffers = [t.clone() if isinstance(t, torch.Tensor) else t for t in sets[0]]
    dev = torch.device(device)
    seed = secrets.randbits(40)
    outs, _ = run_batch(subject, sets, buffers, seed, secrets.randbits(40), 1, dev)  # warm
    t0 = _perf()
    outs, _ = run_batch(subject, sets, buffers, seed + 1, secrets.randbits(40), 1, dev)
    n = calls_per_batch(_perf() - t0, out_bytes(outs[0]) if outs else 0, dev.type)
    per_call: list[float] = []
    for b in range(batches):
        outs = []
        t0 = _perf()
        outs, _ = run_batch(subject, sets, buffers, seed + 2 + b, secrets.randbits(40), n, dev)
        per_call.append((_perf() - t0) / n * 1e6)
    del outs, tree_map
    return summary(per_call, n)


def summary(per_call_us: list[float], n: int) -> dict[str, Any]:
    med = statistics.median(per_call_us)
    return {"median_us": med, "min_us": min(per_call_us), "max_us": max(per_call_us),
            "batches": len(per_call_us), "calls": n, "per_call_us": [round(x, 3) for x in per_call_us]}


def null_subject(output: Any) -> Callable[..., Any]:
    """A subject whose work is nothing: it returns `output`, made once."""

    def call(*_inputs: Any) -> Any:
        return output

    return call


def per_call_work_us(total: dict[str, Any], null: dict[str, Any] | None) -> tuple[float, float]:
    """A subject's vouched time per call less the protocol's own (the null subject's),
    and how uncertain that difference is, as a fraction of it. A batch's time is its work
    plus whatever else the machine did meanwhile, which only ever adds: the fastest
    batch is the estimate, and the distance to the median batch its uncertainty, on both
    sides. Never below a tenth of the whole (the protocol's cost is measured, not exact)."""
    whole = float(total["min_us"])
    protocol_us = float(null["min_us"]) if null else 0.0
    work = max(whole - protocol_us, 0.1 * whole)
    spread = float(total["median_us"]) - whole
    if null:
        spread += float(null["median_us"]) - protocol_us
    return work, spread / work


class Serve:
    """The candidate's end of the pipes: answers the parent's batches until it says `end`.
    Only the evaluator's code here; what the subject does is the candidate's."""

    def __init__(self, cmd: Path, reply: Path) -> None:
        self.cmd_path, self.reply_path = cmd, reply

    def run(self, subject: Callable[..., Any], sets: Sequence[list[Any]], device: Any,
            save: Callable[[int, int, Any], None], timeout_s: float) -> str:
        """Serve; returns how it ended ("end", "no parent", "timed out", "error: ...")."""
        import torch

        deadline = time.monotonic() + timeout_s
        open_by = time.monotonic() + OPEN_WAIT_S
        while True:
            try:
                reply = os.open(self.reply_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                break
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                if time.monotonic() > open_by:
                    return "no parent"  # nobody reads the answers: no batches to run
                time.sleep(0.01)  # the parent's reader is not open yet
        os.set_blocking(reply, True)
        cmd = os.open(self.cmd_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        lines = _Lines(cmd)
        buffers = [t.clone() if isinstance(t, torch.Tensor) else t for t in sets[0]]
        dev = torch.device(device)
        kept: tuple[int, list[Any]] = (-1, [])

        def send(obj: dict[str, Any]) -> None:
            _write_all(reply, (json.dumps(obj) + "\n").encode())

        try:
            send({"ready": True})
            while True:
                msg = lines.next(deadline)
                if msg is None:
                    return "timed out"
                op = msg.get("op")
                if op == "end":
                    return "end"
                if op == "batch":
                    kept = (-1, [])
                    try:
                        outs, hashes = run_batch(subject, sets, buffers, int(msg["seed"]), int(msg["key"]),
                                                 int(msg["n"]), dev)
                    except BaseException as exc:
                        send({"b": msg["b"], "error": f"{type(exc).__name__}: {exc}"[:2000]})
                        return f"error: {exc}"
                    kept = (int(msg["b"]), outs)
                    send({"b": msg["b"], "hashes": hashes})
                elif op == "reveal":
                    b = int(msg["b"])
                    for i in msg["i"]:
                        if kept[0] == b and 0 <= int(i) < len(kept[1]):
                            save(b, int(i), kept[1][int(i)])
                    send({"revealed": b})
        finally:
            os.close(cmd)
            os.close(reply)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Lines:
    """JSON lines from a non-blocking pipe, with a deadline (time.monotonic())."""

    def __init__(self, fd: int, alive: Callable[[], bool] = lambda: True) -> None:
        self.fd, self.alive, self.buf = fd, alive, b""

    def next(self, deadline: float) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(self.buf) > MAX_LINE:
                return None
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.05))
            if not ready:
                if not self.alive():
                    return None
                continue
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:  # no writer (yet, or any more)
                if not self.alive():
                    return None
                time.sleep(0.001)
                continue
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            return {"malformed": line[:200].decode(errors="replace")}
        return msg if isinstance(msg, dict) else {"malformed": line[:200].decode(errors="replace")}


# -- in the parent ---------------------------------------------------------------------------


@dataclass
class Batch:
    b: int
    seed: int
    key: int
    n: int
    wall_s: float
    hashes: list[int]
    revealed: list[int] = field(default_factory=list)


@dataclass
class VouchedRun:
    """What the parent saw of the candidate's vouched batches."""

    batches: list[Batch] = field(default_factory=list)
    error: str = ""  # why they did not all run ("" if they did)
    started: bool = False  # the candidate reached them

    def timed(self) -> list[Batch]:
        """The batches whose time counts (not the pilot)."""
        return [b for b in self.batches if b.b > 0]

    def stats(self) -> dict[str, Any] | None:
        timed = self.timed()
        if not timed:
            return None
        return summary([b.wall_s / b.n * 1e6 for b in timed], timed[-1].n)

    def requests(self) -> list[dict[str, int]]:
        """The checked calls, for the reference (`ExpectRequest`)."""
        return [{"b": b.b, "seed": b.seed, "i": i} for b in self.batches for i in b.revealed]


def drive(cmd: Path, reply: Path, alive: Callable[[], bool], device: str, one_output_bytes: Callable[[], int],
          deadline: float) -> VouchedRun:
    """The parent's side: wait for the candidate to be ready (or to end), run the pilot
    and `BATCHES` batches, each timed by this process's clock, and reveal `REVEALS` calls
    of each, chosen after its hashes arrived."""
    run = VouchedRun()
    rfd = os.open(reply, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    wfd = -1
    lines = _Lines(rfd, alive)
    try:
        first = lines.next(deadline)
        if first is None or not first.get("ready"):
            run.error = "the candidate process ended before its timed batches" if first is None \
                else f"the candidate process answered {str(first)[:200]} instead of being ready"
            return run
        run.started = True
        while wfd < 0:
            try:
                wfd = os.open(cmd, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.ENXIO or time.monotonic() > deadline or not alive():
                    run.error = "the candidate process did not open its command pipe"
                    return run
                time.sleep(0.001)
        os.set_blocking(wfd, True)
        per_call_s = None
        for b in range(BATCHES + 1):
            n = 1 if per_call_s is None else calls_per_batch(per_call_s, one_output_bytes(), device)
            batch = Batch(b=b, seed=secrets.randbits(40), key=secrets.randbits(40), n=n, wall_s=0.0, hashes=[])
            t0 = _perf()
            _write_all(wfd, (json.dumps({"op": "batch", "b": b, "seed": batch.seed, "key": batch.key, "n": n})
                             + "\n").encode())
            answer = lines.next(deadline)
            batch.wall_s = _perf() - t0
            if answer is None:
                run.error = f"the candidate process stopped answering during timed batch {b + 1}"
                return run
            if answer.get("error"):
                run.error = f"timed batch {b + 1} failed: {str(answer['error'])[:1500]}"
                return run
            hashes = answer.get("hashes")
            if answer.get("b") != b or not isinstance(hashes, list) or len(hashes) != n \
                    or not all(isinstance(h, int) for h in hashes):
                run.error = f"the candidate process answered timed batch {b + 1} with {str(answer)[:200]}"
                return run
            batch.hashes = hashes
            batch.revealed = sorted(random.Random(secrets.randbits(64)).sample(range(n), min(REVEALS, n)))
            run.batches.append(batch)
            per_call_s = batch.wall_s / n
            _write_all(wfd, (json.dumps({"op": "reveal", "b": b, "i": batch.revealed}) + "\n").encode())
            answer = lines.next(deadline)
            if answer is None or answer.get("revealed") != b:
                run.error = f"the candidate process did not write the checked outputs of timed batch {b + 1}"
                return run
        _write_all(wfd, b'{"op": "end"}\n')
        return run
    except OSError as exc:  # the candidate closed its end
        run.error = run.error or f"the timed batches' pipe broke ({exc.strerror or exc})"
        return run
    finally:
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
