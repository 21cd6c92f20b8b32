"""`cuda-agent show TRAJECTORY`: an episode, readable in the terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from cuda_agent.agent.trajectory import read_events


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters)"


def _call_view(name: str, raw: str) -> Any:
    try:
        args = json.loads(raw) if raw else {}
    except ValueError:
        return Text(f"{name}(<malformed> {raw[:300]!r})", style="red")
    if name == "bash" and isinstance(args, dict):
        return Group(Text("bash", style="bold cyan"), Syntax(str(args.get("command", "")), "bash", word_wrap=True))
    if name == "write_file" and isinstance(args, dict):
        path = str(args.get("path", ""))
        lexer = {"cu": "cuda", "cpp": "cpp", "h": "cpp", "py": "python"}.get(path.rsplit(".", 1)[-1], "text")
        return Group(Text(f"write_file {path}", style="bold cyan"),
                     Syntax(_clip(str(args.get("content", "")), 3000), lexer, line_numbers=True, word_wrap=True))
    return Text(f"{name} {json.dumps(args, ensure_ascii=False)[:600]}", style="bold cyan")


def render(path: Path, console: Console | None = None, *, full: bool = False) -> None:
    console = console or Console()
    limit = 10**9 if full else 1500
    for e in read_events(path):
        t = e.get("type")
        turn = e.get("turn", 0)
        if t == "start":
            task = e.get("task", {})
            console.rule(f"[bold]episode: {task.get('name')} ({e.get('device')}) with {e.get('model')}")
        elif t == "message":
            m = e["message"]
            role = m.get("role")
            if role == "system":
                console.print(Panel(Text(_clip(m.get("content") or "", 600)), title="system", border_style="dim"))
            elif role == "user":
                console.print(Panel(Text(_clip(m.get("content") or "", limit)), title="user", border_style="green"))
            elif role == "assistant":
                parts: list[Any] = []
                if m.get("content"):
                    parts.append(Text(_clip(m["content"], limit)))
                for tc in m.get("tool_calls") or []:
                    parts.append(_call_view(tc["function"]["name"], tc["function"].get("arguments", "")))
                console.print(Panel(Group(*parts) if parts else Text("(empty)"), title=f"turn {turn}: assistant",
                                    border_style="blue"))
            elif role == "tool":
                body = m.get("content") or ""
                style = "red" if body.startswith("Error") else "white"
                console.print(Panel(Text(_clip(body, limit), style=style), title="tool result", border_style="dim"))
        elif t == "model" and e.get("error"):
            console.print(Text(f"model error: {e['error']}", style="red"))
        elif t == "evaluation":
            r = e.get("result") or {}
            if r:
                sp = f" {r.get('speedup_vs_eager')}x eager, {r.get('speedup_vs_compile')}x compile" \
                    if r.get("speedup_vs_compile") else ""
                console.print(Text(f"evaluation ({e.get('source')}, {e.get('command')}): {r.get('status')}, "
                                   f"reward {r.get('reward')}{sp}", style="magenta"))
        elif t == "elide":
            console.print(f"[dim]context: {len(e.get('indices', []))} old tool outputs elided")
        elif t == "resume":
            console.print(f"[yellow]resumed ({e.get('dropped', 0)} turn(s) in flight dropped)")
        elif t == "end":
            console.rule(f"[bold]end: {e.get('reason')} after {e.get('turns')} turns, reward {e.get('reward')}, "
                         f"{e.get('speedup_vs_compile')}x vs torch.compile, best from {e.get('best_from')}, "
                         f"{e.get('prompt_tokens', 0) + e.get('completion_tokens', 0)} tokens, {e.get('seconds')} s")
