"""Turn a failed build's raw output into the few lines an agent needs to fix it.

Input is whatever ninja printed while running g++/nvcc/ld (as torch's cpp_extension or
``utils/compile.sh`` run them): progress lines and the failing commands (often many
kilobytes of flags), ``In file included from`` chains through torch headers, candidate
lists, template instantiation backtraces, caret lines, linker errors. Output keeps, for
each of the first few errors, ``file:line:col: error: message``, the source and caret
lines, and at most two notes. An error reported inside a system or torch header is moved
to the user's line that triggered it (the ``required from here`` of g++'s backtrace),
with the header location kept as a note. Paths under ``strip_prefixes`` become relative
(``kernels/axpby.cu:12:5: error: ...``) and ``.../site-packages/`` is dropped from
header paths. When nothing recognisable is found, the last lines of the output are
returned instead, so a failed build never yields an empty message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["first_error_location", "trim_compiler_output"]

_LINE_LIMIT = 300  # characters kept of any one output line
_EXTRA_LIMIT = 4  # source/caret/detail lines kept per error
_NOTE_LIMIT = 2  # notes kept per error
_FALLBACK_LINES = 20

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# g++/clang/nvcc-host: path:line[:col]: kind: message
_GCC_RE = re.compile(
    r"^(?P<file>[^\s:][^:]*?):(?P<line>\d+):(?:(?P<col>\d+):)?\s+"
    r"(?P<kind>fatal error|error|warning|note):\s?(?P<msg>.*)$"
)
# g++ template backtrace: path:line:col:   required from here / required from 'X'
_BACKTRACE_RE = re.compile(
    r"^(?P<file>[^\s:][^:]*?):(?P<line>\d+):(?:(?P<col>\d+):)?\s+"
    r"(?P<msg>(?:recursively )?required (?:from|by)\b.*|in (?:constexpr|requirements)\b.*)$"
)
# path: In function 'f': / path: In instantiation of '...': / path: At global scope:
_CONTEXT_RE = re.compile(r"^(?P<file>[^\s:][^:]*?):\s+(?P<msg>(?:In|At) [^:].*:)$")
# nvcc front end (EDG): path(line): error #123-D: message
_NVCC_RE = re.compile(
    r"^(?P<file>\S.*?)\((?P<line>\d+)\):\s+(?P<kind>catastrophic error|error|warning|note|"
    r"remark)(?:\s+#[\w-]+)?:\s?(?P<msg>.*)$"
)
# Tools without a source location: "cc1plus: fatal error: ...", "nvcc fatal   : ..."
_TOOL_RE = re.compile(
    r"^(?P<file>(?:\S*/)?(?:cc1plus|cc1|c\+\+|g\+\+|gcc|cc|clang\+\+|clang|nvcc|ptxas|nvlink|"
    r"fatbinary|cicc|cudafe\+\+|ld|ld\.lld|ld\.gold|collect2))\s*:?\s*"
    r"(?P<kind>fatal error|error|fatal)\s*:\s?(?P<msg>.*)$"
)
_UNDEFINED_RE = re.compile(
    r"^(?P<file>[^\s:][^:]*?):(?:\([^)]*\)|\d+):\s*(?P<msg>undefined reference to .*)$"
)
_LD_RE = re.compile(r"^(?:\S*/)?ld(?:\.\w+)?:\s+(?P<msg>.*)$")
_UNDEFINED_SYMBOL_RE = re.compile(r"(?P<msg>undefined symbol: \S+)")
_INCLUDE_CHAIN_RE = re.compile(r"^(?:In file included from|\s+from)\s+\S+:\d+[:,]?$")
# "[1/3] c++ ...", also after torch's "Error building extension 'x': " prefix.
_PROGRESS_RE = re.compile(r"^(?:.*?': )?\[\d+/\d+\]\s")
_COMMAND_RE = re.compile(
    r"^(?:\S*/)?(?:ccache\s+)?(?:c\+\+|g\+\+|gcc|cc|clang\+\+|clang|nvcc|hipcc|ld|"
    r"x86_64-linux-gnu-(?:g\+\+|gcc)|(?:g\+\+|gcc)-\d+)\s.*\s-\S"
)
_SUMMARY_RE = re.compile(
    r"^(?:compilation terminated\.|\d+ errors? detected in the compilation of .*|"
    r"Remark: The warnings can be suppressed .*|ninja: .*|FAILED: .*|"
    r"collect2: error: ld returned \d+ exit status|.*error: ld returned \d+ exit status)$"
)
_SYSTEM_PATH_RE = re.compile(r"(?:/site-packages/|/dist-packages/|^/usr/|^/opt/|/include/)")
_SITE_PACKAGES_RE = re.compile(r"/[^\s‘’'\"():,]*?/(?:site|dist)-packages/")
_ERROR_KINDS = ("error", "fatal error", "catastrophic error", "fatal")


@dataclass
class _Diag:
    kind: str  # error / fatal error / warning / note / backtrace / context
    file: str
    line: int
    col: int
    msg: str
    extra: list[str] = field(default_factory=list)

    def location(self) -> str:
        if self.line <= 0:
            return self.file
        if self.col > 0:
            return f"{self.file}:{self.line}:{self.col}"
        return f"{self.file}:{self.line}"


@dataclass
class _Error:
    diag: _Diag
    user: _Diag | None = None  # the user's line when the error sits in a header
    notes: list[_Diag] = field(default_factory=list)

    @property
    def shown(self) -> _Diag:
        return self.user or self.diag


def _clip(text: str, limit: int = _LINE_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 4] + " ..."


class _Paths:
    def __init__(self, prefixes: Sequence[str]) -> None:
        cleaned = {p.rstrip("/") + "/" for p in prefixes if p and p.strip("/")}
        self.prefixes = sorted(cleaned, key=len, reverse=True)

    def relative(self, path: str) -> str:
        for prefix in self.prefixes:
            if path.startswith(prefix):
                return path[len(prefix) :]
        return path

    def is_user(self, path: str) -> bool:
        if any(path.startswith(p) for p in self.prefixes):
            return True
        if self.prefixes and path.startswith("/"):
            return False
        return not _SYSTEM_PATH_RE.search(path)

    def text(self, text: str) -> str:
        for prefix in self.prefixes:
            text = text.replace(prefix, "")
        return _SITE_PACKAGES_RE.sub("", text)


def _is_noise(line: str) -> bool:
    stripped = line.strip()
    if not stripped:
        return True
    if _TOOL_RE.match(stripped) and not _SUMMARY_RE.match(stripped):
        return False
    if _PROGRESS_RE.match(line) or _SUMMARY_RE.match(stripped) or _COMMAND_RE.match(stripped):
        return True
    # Whatever else is a very long flag soup is a command line too.
    flags = len(re.findall(r"\s-(?:I|isystem|D|L|l|W|f|O|std|gencode|arch|Xcompiler)\S*", line))
    return len(line) > 300 and flags >= 4


def _parse(text: str) -> list[_Diag]:
    diags: list[_Diag] = []
    current: _Diag | None = None
    for raw in _ANSI_RE.sub("", text).splitlines():
        line = raw.rstrip()
        if not line.strip():
            current = None  # nvcc separates its diagnostics with blank lines
            continue
        if _is_noise(line) or _INCLUDE_CHAIN_RE.match(line):
            continue
        m = _GCC_RE.match(line)
        if m:
            current = _Diag(
                m["kind"], m["file"], int(m["line"]), int(m["col"] or 0), m["msg"].strip()
            )
            diags.append(current)
            continue
        m = _BACKTRACE_RE.match(line)
        if m:
            current = _Diag(
                "backtrace", m["file"], int(m["line"]), int(m["col"] or 0), m["msg"].strip()
            )
            diags.append(current)
            continue
        m = _NVCC_RE.match(line)
        if m:
            kind = "error" if m["kind"] == "catastrophic error" else m["kind"]
            kind = "warning" if kind == "remark" else kind
            current = _Diag(kind, m["file"], int(m["line"]), 0, m["msg"].strip())
            diags.append(current)
            continue
        m = _CONTEXT_RE.match(line)
        if m:
            current = _Diag("context", m["file"], 0, 0, m["msg"].strip())
            diags.append(current)
            continue
        m = _UNDEFINED_RE.match(line)
        if m:
            current = _Diag("error", m["file"], 0, 0, m["msg"].strip())
            diags.append(current)
            continue
        m = _TOOL_RE.match(line)
        if m:
            kind = "error" if m["kind"] == "error" else "fatal error"
            current = _Diag(kind, m["file"].rsplit("/", 1)[-1], 0, 0, m["msg"].strip())
            diags.append(current)
            continue
        m = _LD_RE.match(line)
        if m:
            msg = m["msg"].strip()
            if re.search(r"in function|: warning:", msg):
                current = None
                continue
            current = _Diag("error", "ld", 0, 0, msg)
            diags.append(current)
            continue
        m = _UNDEFINED_SYMBOL_RE.search(line)
        if m and re.search(r"error", line, re.I):
            current = _Diag("error", "", 0, 0, m["msg"])  # the built module fails to load
            diags.append(current)
            continue
        if current is not None and line[:1].isspace():
            current.extra.append(line)
            continue
        current = None
    return diags


def _group(diags: list[_Diag], paths: _Paths) -> list[_Error]:
    errors: list[_Error] = []
    pending: list[_Diag] = []  # backtrace lines seen since the last error
    open_error: _Error | None = None  # the error that notes attach to
    for d in diags:
        if d.kind in ("backtrace", "context"):
            if d.kind == "backtrace" or "instantiation" in d.msg or "substitution" in d.msg:
                pending.append(d)
            if d.kind == "context" and "In instantiation" in d.msg:
                open_error = None
            continue
        if d.kind in _ERROR_KINDS:
            in_header = d.line > 0 and not paths.is_user(d.file)
            user = next(
                (b for b in reversed(pending) if b.kind == "backtrace" and paths.is_user(b.file)),
                None,
            )
            if in_header and user is None and open_error is not None:
                # g++ reports substitution failures inside a candidate list as errors in
                # headers; they explain the open error rather than being new ones.
                open_error.notes.append(d)
            else:
                open_error = _Error(d, user=user if in_header else None)
                if not in_header and user and (user.file, user.line) != (d.file, d.line):
                    # A template error in user code: say where it was instantiated.
                    open_error.notes.append(
                        _Diag("note", user.file, user.line, user.col, "instantiated from here")
                    )
                errors.append(open_error)
            pending = []
        elif d.kind == "note":
            if open_error is not None:
                open_error.notes.append(d)
        else:  # warning: its notes must not attach to the previous error
            open_error = None
            pending = []
    # Drop repeats (the same line reported for each template instantiation or twice by nvcc).
    seen: set[tuple[str, int, int, str]] = set()
    unique: list[_Error] = []
    for e in errors:
        s = e.shown
        key = (s.file, s.line, s.col, e.diag.msg)
        if key not in seen:
            seen.add(key)
            unique.append(e)
    return unique


def _kind_word(kind: str) -> str:
    return "fatal error" if kind in ("fatal error", "fatal") else "error"


def _render(error: _Error, paths: _Paths, *, notes: int) -> list[str]:
    d, shown = error.diag, error.shown
    head = paths.relative(shown.location())
    head = f"{head}: " if head else ""
    lines = [_clip(paths.text(f"{head}{_kind_word(d.kind)}: {d.msg}"))]
    lines += [_clip(paths.text(x)) for x in shown.extra[:_EXTRA_LIMIT]]
    if error.user is not None:
        where = paths.text(paths.relative(d.location()))
        lines.append(_clip(f"  note: reported in {where} while instantiating a template"))
    kept = 0
    for note in error.notes:
        if kept >= notes:
            break
        if note.kind in _ERROR_KINDS:
            text = f"  note: {note.msg}"
        elif paths.is_user(note.file) and note.line > 0:
            text = f"  {paths.relative(note.location())}: note: {note.msg}"
        else:
            text = f"  note: {note.msg}"
        lines.append(_clip(paths.text(text)))
        kept += 1
    return lines


def _fallback(text: str, paths: _Paths, max_chars: int) -> str:
    kept: list[str] = []
    for raw in _ANSI_RE.sub("", text).splitlines():
        line = raw.rstrip()
        if _is_noise(line) and not re.search(r"error", line, re.I):
            continue
        if _is_noise(line):  # a command line that also says "error": keep only its end
            line = "..." + line[-200:]
        kept.append(_clip(paths.text(line)))
    kept = kept[-_FALLBACK_LINES:]
    if not kept:
        tail = [line for line in text.strip().splitlines() if line.strip()][-5:]
        kept = [_clip(paths.text(x)) for x in tail]
    if not kept:
        return "(the build failed without printing any compiler output)"
    out = "\n".join(kept)
    if len(out) > max_chars:
        out = "..." + out[-max(max_chars - 3, 1) :]
    return out


def trim_compiler_output(
    text: str,
    *,
    max_errors: int = 5,
    max_chars: int = 4000,
    strip_prefixes: Sequence[str] = (),
) -> str:
    """The first ``max_errors`` errors of a failed build, in at most ``max_chars`` characters.

    Each error comes as ``file:line:col: error: message`` (nvcc's ``file(line)`` form is
    rewritten to match) followed by its source and caret lines and up to two notes; command
    lines, include chains, candidate lists and template backtraces are dropped. Ends with
    ``(N more errors not shown)`` when errors were cut. Never returns an empty string.
    """
    paths = _Paths(strip_prefixes)
    errors = _group(_parse(text), paths)
    if not errors:
        return _fallback(text, paths, max_chars)
    blocks: list[str] = []
    shown = 0
    used = 0
    for i, error in enumerate(errors[: max(max_errors, 1)]):
        footer_room = len(f"\n({len(errors)} more errors not shown)")
        for notes in (_NOTE_LIMIT, 1, 0):
            block = "\n".join(_render(error, paths, notes=notes))
            if used + len(block) + 1 + footer_room <= max_chars:
                break
        else:
            if i > 0:
                break
            block = block[: max(max_chars - footer_room - 4, 0)] + " ..."
        blocks.append(block)
        used += len(block) + 1
        shown += 1
    out = "\n".join(blocks)
    hidden = len(errors) - shown
    if hidden > 0:
        word = "error" if hidden == 1 else "errors"
        out += f"\n({hidden} more {word} not shown)"
    return out if len(out) <= max_chars else out[: max(max_chars - 3, 1)] + "..."


def first_error_location(
    text: str, *, strip_prefixes: Sequence[str] = ()
) -> tuple[str, int] | None:
    """(file, line) of the first error, moved out of headers as in the trimmed output.

    Paths under ``strip_prefixes`` are made relative. None when no error names a line
    (for example a link error).
    """
    paths = _Paths(strip_prefixes)
    for error in _group(_parse(text), paths):
        shown = error.shown
        if shown.line > 0:
            return paths.relative(shown.file), shown.line
    return None
