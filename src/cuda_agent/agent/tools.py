"""The agent's tools, as OpenAI function schemas with their implementations.

`bash` runs in the episode's sandboxed shell. The file tools (`read_file`, `write_file`,
`edit_file`, `glob`, `grep`) act on the workspace only: a path that leaves it (also
through a symlink) is refused, and so is any change to a locked file. Every output is
bounded; what is cut is said. Compile, verify and profile are the workspace commands
run through `bash`, as in the published system.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from cuda_agent.agent.shell import ShellSession
from cuda_agent.files import LinkOutside, open_inside, write_inside
from cuda_agent.workspace import LOCKED

MAX_OUTPUT_CHARS = 20_000
MAX_READ_LINES = 2000
MAX_LINE_CHARS = 2000
MAX_MATCHES = 200
MAX_FILE_BYTES = 2 * 1024 * 1024  # larger files are not read whole, nor searched
SKIP_DIRS = {".git", "__pycache__", ".cuda-agent-build", "build"}


@dataclass
class ToolResult:
    output: str
    ok: bool = True
    finish: bool = False  # the episode ends after this tool
    meta: dict[str, Any] = field(default_factory=dict)


class ToolError(Exception):
    """A refused or failed tool call: its message goes back to the model."""


def truncate(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut from the middle of this output ...]\n{text[-half:]}"


def _schema(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


SCHEMAS = [
    _schema("bash", "Run a shell command in the workspace (a persistent bash session: the working directory, "
            "variables and background jobs carry over). No network. Use it to compile (`bash utils/compile.sh`), "
            "verify (`python3 -m utils.verification`) and profile (`python3 -m utils.profiling`). Send the output "
            "of background jobs to a file (`cmd > log 2>&1 &`), read it later and stop them with `kill`.",
            {"command": {"type": "string", "description": "the command line(s) to run"},
             "timeout": {"type": "number", "description": "seconds before the command (and the shell) is killed; "
                         "default 600"}}, ["command"]),
    _schema("read_file", "Read a text file of the workspace, with line numbers. Use offset/limit for long files.",
            {"path": {"type": "string"}, "offset": {"type": "integer", "description": "first line (1-based)"},
             "limit": {"type": "integer", "description": f"number of lines (default {MAX_READ_LINES})"}}, ["path"]),
    _schema("write_file", "Create or overwrite a file in the workspace with the given content.",
            {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _schema("edit_file", "Replace exact text in a file. Give old_string/new_string for one edit, or `edits` "
            "(a list of {old_string, new_string, replace_all}) applied in order, all or none. old_string must "
            "occur exactly once unless replace_all is true.",
            {"path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
             "replace_all": {"type": "boolean"},
             "edits": {"type": "array", "items": {"type": "object", "properties": {
                 "old_string": {"type": "string"}, "new_string": {"type": "string"},
                 "replace_all": {"type": "boolean"}}, "required": ["old_string", "new_string"]}}}, ["path"]),
    _schema("glob", "List workspace files matching a glob pattern (e.g. `kernels/*.cu`, `**/*.py`).",
            {"pattern": {"type": "string"}, "path": {"type": "string", "description": "folder to search from"}},
            ["pattern"]),
    _schema("grep", "Search workspace files for a regular expression; prints file:line: text.",
            {"pattern": {"type": "string"}, "path": {"type": "string", "description": "file or folder"},
             "glob": {"type": "string", "description": "only files whose name matches, e.g. *.cu"},
             "ignore_case": {"type": "boolean"}}, ["pattern"]),
    _schema("finish", "End the episode: the solution in the workspace is final. Say briefly what you did.",
            {"summary": {"type": "string"}}, []),
]

TOOL_NAMES = [s["function"]["name"] for s in SCHEMAS]
_REQUIRED = {s["function"]["name"]: s["function"]["parameters"]["required"] for s in SCHEMAS}
_ALLOWED = {s["function"]["name"]: set(s["function"]["parameters"]["properties"]) for s in SCHEMAS}


def parse_call(name: str, arguments: str) -> dict[str, Any]:
    """The arguments of a tool call, or ToolError saying what is malformed."""
    if name not in _REQUIRED:
        raise ToolError(f"there is no tool named {name!r}; the tools are {', '.join(TOOL_NAMES)}")
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        raise ToolError(f"the arguments of {name} are not valid JSON ({exc}); send a JSON object such as "
                        "{" + ", ".join(f'"{r}": ...' for r in _REQUIRED[name]) + "}") from exc
    if not isinstance(args, dict):
        raise ToolError(f"the arguments of {name} must be a JSON object, not {type(args).__name__}")
    missing = [r for r in _REQUIRED[name] if r not in args]
    if missing:
        raise ToolError(f"{name} needs {', '.join(missing)}")
    unknown = sorted(set(args) - _ALLOWED[name])
    if unknown:
        raise ToolError(f"{name} has no argument(s) {', '.join(unknown)}; it takes {', '.join(sorted(_ALLOWED[name]))}")
    return args


class Tools:
    """The tools of one episode, bound to its workspace and shell."""

    def __init__(self, workspace: Path, shell: ShellSession, *, command_timeout_s: float = 600.0,
                 max_output_chars: int = MAX_OUTPUT_CHARS) -> None:
        self.root = workspace.resolve()
        self.shell = shell
        self.command_timeout_s = command_timeout_s
        self.max_output = max_output_chars
        self._impl: dict[str, Callable[[dict[str, Any]], Awaitable[ToolResult]]] = {
            "bash": self.bash, "read_file": self.read_file, "write_file": self.write_file,
            "edit_file": self.edit_file, "glob": self.glob, "grep": self.grep, "finish": self.finish}

    async def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        try:
            res = await self._impl[name](args)
        except ToolError as exc:
            return ToolResult(f"Error: {exc}", ok=False)
        except (OSError, UnicodeError, ValueError, TypeError) as exc:
            return ToolResult(f"Error: {type(exc).__name__}: {exc}", ok=False)
        res.output = truncate(res.output, self.max_output)
        return res

    # ----------------------------------------------------------------- paths

    def _path(self, raw: Any, *, for_write: bool = False) -> Path:
        if not isinstance(raw, str) or not raw.strip():
            raise ToolError("path must be a non-empty string")
        p = Path(raw)
        p = p if p.is_absolute() else self.root / p
        real = Path(os.path.realpath(p))
        if real != self.root and self.root not in real.parents:
            raise ToolError(f"{raw} is outside the workspace ({self.root}); only files in it can be used")
        if for_write:
            rel = real.relative_to(self.root)
            if rel.parts and rel.parts[0] in LOCKED:
                raise ToolError(f"{rel} is locked ({', '.join(LOCKED)} may not be changed); write your code in "
                                "model_new.py and kernels/")
        return real

    def _rel(self, p: Path) -> str:
        return str(p.relative_to(self.root)) if p != self.root else "."

    def _own(self, p: Path) -> None:
        """Files made here belong to the shell's uid (when root runs the sandbox), so the
        shell can change them too."""
        uid = self.shell.uid
        if uid is None:
            return
        q = p
        while q != self.root and self.root in q.parents:
            try:
                os.lchown(q, uid, uid)
            except OSError:
                break
            q = q.parent

    # ----------------------------------------------------------------- tools

    async def bash(self, args: dict[str, Any]) -> ToolResult:
        cmd = args["command"]
        if not isinstance(cmd, str) or not cmd.strip():
            raise ToolError("command must be a non-empty string")
        timeout = float(args.get("timeout") or self.command_timeout_s)
        timeout = max(1.0, min(timeout, self.command_timeout_s))
        out = await self.shell.arun(cmd, timeout)
        text = out.output
        if out.cut_bytes:
            text += f"\n[... {out.cut_bytes} bytes of output were cut from the middle ...]"
        notes = []
        if out.restarted:
            notes.append("(the previous shell had ended; this ran in a new one: working directory and "
                         "variables were reset)")
        if out.timed_out:
            notes.append(f"[timed out after {timeout:.0f} s: the command and the shell were killed; the next "
                         "command starts a new shell in the workspace]")
        elif out.exit_code is None:
            notes.append("[the shell exited; the next command starts a new one]")
        elif out.exit_code != 0:
            notes.append(f"[exit code {out.exit_code}]")
        body = text.rstrip("\n") + ("\n" if text.strip() else "") + "\n".join(notes)
        return ToolResult(body.strip("\n") or "(no output)", ok=out.exit_code == 0,
                          meta={"exit_code": out.exit_code, "timed_out": out.timed_out,
                                "seconds": round(out.seconds, 3)})

    def _open(self, raw: Any, p: Path) -> BinaryIO:
        """`p` (a checked path) opened for reading without following a link, whatever
        the tree became since the check (the agent's shell can change it meanwhile)."""
        if p.is_dir():
            raise ToolError(f"{raw} is a folder")
        try:
            return open_inside(self.root, p)
        except FileNotFoundError:
            raise ToolError(f"{raw} does not exist") from None
        except LinkOutside as exc:
            raise ToolError(f"{raw}: {exc}; the tools do not follow symbolic links") from None

    def _write(self, raw: Any, p: Path, text: str) -> None:
        try:
            write_inside(self.root, p, text.encode())
        except LinkOutside as exc:
            raise ToolError(f"{raw}: {exc}; the tools do not follow symbolic links") from None

    async def read_file(self, args: dict[str, Any]) -> ToolResult:
        p = self._path(args["path"])
        with self._open(args["path"], p) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_FILE_BYTES and "offset" not in args:
                raise ToolError(f"{args['path']} is {size} bytes; read it in parts with offset and limit")
            data = fh.read()
        if b"\0" in data[:8192]:
            raise ToolError(f"{args['path']} is a binary file")
        lines = data.decode(errors="replace").splitlines()
        start = max(1, int(args.get("offset") or 1))
        limit = max(1, min(int(args.get("limit") or MAX_READ_LINES), MAX_READ_LINES))
        chunk = lines[start - 1:start - 1 + limit]
        out = [f"{i:6d}\t{line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + ' [line cut]'}"
               for i, line in enumerate(chunk, start)]
        if not lines:
            return ToolResult("(empty file)")
        if start - 1 + len(chunk) < len(lines):
            out.append(f"[{len(lines) - (start - 1 + len(chunk))} more lines; read on with offset="
                       f"{start + len(chunk)}]")
        return ToolResult("\n".join(out) if chunk else f"(the file has {len(lines)} lines)")

    async def write_file(self, args: dict[str, Any]) -> ToolResult:
        p = self._path(args["path"], for_write=True)
        content = args["content"]
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        if p.is_dir():
            raise ToolError(f"{args['path']} is a folder")
        existed = p.exists()
        self._write(args["path"], p, content)
        self._own(p)
        n = content.count("\n") + (1 if content and not content.endswith("\n") else 0)
        return ToolResult(f"{'Overwrote' if existed else 'Created'} {self._rel(p)} ({n} lines)")

    async def edit_file(self, args: dict[str, Any]) -> ToolResult:
        p = self._path(args["path"], for_write=True)
        if not p.exists() and not p.is_symlink():
            raise ToolError(f"{args['path']} does not exist; create it with write_file")
        edits = args.get("edits")
        if edits is None:
            if "old_string" not in args or "new_string" not in args:
                raise ToolError("give old_string and new_string, or a list of edits")
            edits = [{"old_string": args["old_string"], "new_string": args["new_string"],
                      "replace_all": bool(args.get("replace_all"))}]
        elif not isinstance(edits, list) or not edits:
            raise ToolError("edits must be a non-empty list")
        with self._open(args["path"], p) as fh:
            text = fh.read().decode()
        total = 0
        for k, e in enumerate(edits, 1):
            if not isinstance(e, dict) or not isinstance(e.get("old_string"), str) or \
                    not isinstance(e.get("new_string"), str):
                raise ToolError(f"edit {k}: needs old_string and new_string (strings)")
            old, new = e["old_string"], e["new_string"]
            if old == new:
                raise ToolError(f"edit {k}: old_string and new_string are the same")
            if not old:
                raise ToolError(f"edit {k}: old_string is empty")
            count = text.count(old)
            if count == 0:
                raise ToolError(f"edit {k}: old_string was not found in {self._rel(p)} (no change made; check "
                                "whitespace and read the file again)")
            if count > 1 and not e.get("replace_all"):
                raise ToolError(f"edit {k}: old_string occurs {count} times in {self._rel(p)}; add context to make "
                                "it unique or set replace_all (no change made)")
            text = text.replace(old, new) if e.get("replace_all") else text.replace(old, new, 1)
            total += count if e.get("replace_all") else 1
        self._write(args["path"], p, text)
        self._own(p)
        return ToolResult(f"Edited {self._rel(p)}: {total} replacement(s)")

    def _walk(self, base: Path) -> list[Path]:
        files = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for f in sorted(filenames):
                files.append(Path(dirpath) / f)
        return files

    async def glob(self, args: dict[str, Any]) -> ToolResult:
        base = self._path(args.get("path") or ".")
        pattern = args["pattern"]
        if not isinstance(pattern, str) or not pattern:
            raise ToolError("pattern must be a non-empty string")
        if pattern.startswith("/") or ".." in Path(pattern).parts:
            raise ToolError("the pattern must be relative to the folder searched")
        hits = sorted({self._rel(Path(os.path.realpath(q))) for q in base.glob(pattern)
                       if Path(os.path.realpath(q)) == self.root or self.root in Path(os.path.realpath(q)).parents})
        if not hits:
            return ToolResult(f"no files match {pattern}")
        more = f"\n[{len(hits) - MAX_MATCHES} more]" if len(hits) > MAX_MATCHES else ""
        return ToolResult("\n".join(hits[:MAX_MATCHES]) + more)

    async def grep(self, args: dict[str, Any]) -> ToolResult:
        try:
            rx = re.compile(args["pattern"], re.IGNORECASE if args.get("ignore_case") else 0)
        except (re.error, TypeError) as exc:
            raise ToolError(f"bad regular expression: {exc}") from exc
        base = self._path(args.get("path") or ".")
        files = [base] if base.is_file() else self._walk(base)
        only = args.get("glob")
        out: list[str] = []
        n = 0
        for f in files:
            if only and not fnmatch.fnmatch(f.name, only):
                continue
            try:
                with open_inside(self.root, f) as fh:
                    if os.fstat(fh.fileno()).st_size > MAX_FILE_BYTES:
                        continue
                    data = fh.read()
            except OSError:  # a link, a FIFO, gone: not searched
                continue
            if b"\0" in data[:8192]:
                continue
            for i, line in enumerate(data.decode(errors="replace").splitlines(), 1):
                if rx.search(line):
                    n += 1
                    if n <= MAX_MATCHES:
                        out.append(f"{self._rel(f)}:{i}: {line[:MAX_LINE_CHARS]}")
        if not n:
            return ToolResult(f"no matches for {args['pattern']}")
        if n > MAX_MATCHES:
            out.append(f"[{n - MAX_MATCHES} more matches]")
        return ToolResult("\n".join(out))

    async def finish(self, args: dict[str, Any]) -> ToolResult:
        return ToolResult("Episode finished; the workspace's solution will be evaluated.", finish=True,
                          meta={"summary": str(args.get("summary") or "")[:4000]})
