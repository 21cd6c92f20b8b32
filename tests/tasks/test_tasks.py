"""Tests for cuda_agent.tasks: loading, validation, naming, importing, writing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cuda_agent.tasks import (
    Task,
    TaskError,
    compute_task_id,
    find_task,
    import_task_module,
    load_task_file,
    load_tasks,
    load_tasks_report,
    task_from_code,
    write_jsonl,
    write_parquet,
)

DATA = Path(__file__).parent / "data"

RELU = """\
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

batch_size = 16
dim = 16384

def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]

def get_init_inputs():
    return []
"""

MATMUL = """\
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
    def forward(self, A, B):
        return torch.matmul(A, B)

N = 64

get_inputs = lambda: [torch.randn(N, N), torch.randn(N, N)]
get_init_inputs = lambda: []
"""

CONV_RELU = """\
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, c_in, c_out, k):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k)
    def forward(self, x):
        return torch.relu(self.conv(x))

def get_inputs():
    return [torch.randn(2, 3, 8, 8)]

def get_init_inputs():
    return [3, 4, 3]
"""


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", newline="")
    return path


@pytest.fixture
def kernelbench(tmp_path: Path) -> Path:
    root = tmp_path / "KernelBench"
    _write(root / "level1" / "1_Square_matrix_multiplication_.py", MATMUL)
    _write(root / "level1" / "19_ReLU.py", RELU)
    _write(root / "level1" / "2_Standard_matrix_multiplication_.py", MATMUL)
    _write(root / "level1" / "__init__.py", "")
    _write(root / "level1" / "_helper.py", "x = 1\n")
    _write(root / "level1" / "__pycache__" / "19_ReLU.py", "junk")
    _write(root / ".hidden" / "1_x.py", "junk")
    _write(root / "level2" / "10_Conv2d_ReLU.py", CONV_RELU)
    _write(root / "level2" / "19_ReLU.py", RELU.replace("dim = 16384", "dim = 1024"))
    _write(root / "level2" / "3_Conv2d_ReLU.py", CONV_RELU)
    return root


# ----------------------------------------------------------------------------- ids


def test_id_is_stable_under_line_endings_and_trailing_whitespace() -> None:
    base = compute_task_id(RELU)
    assert len(base) == 16 and all(c in "0123456789abcdef" for c in base)
    assert compute_task_id(RELU.replace("\n", "\r\n")) == base
    assert compute_task_id(RELU.replace("\n", "  \n")) == base
    assert compute_task_id(RELU.replace("\n", " \t\r\n")) == base
    assert compute_task_id(RELU.rstrip("\n")) == base
    assert compute_task_id(RELU + "\n\n") == base
    assert compute_task_id(RELU.replace("16384", "16385")) != base
    assert compute_task_id("    " + RELU) != base  # leading whitespace matters


def test_task_from_code_fields() -> None:
    task = task_from_code(RELU, name="19_ReLU")
    assert task.id == compute_task_id(RELU)
    assert (task.name, task.source, task.level, task.meta) == ("19_ReLU", "<string>", None, {})
    assert task.ops is None
    assert task.code == RELU
    assert "code" not in repr(task)
    hash(task)  # frozen and hashable despite the dict field
    with pytest.raises(AttributeError):
        task.name = "x"  # type: ignore[misc]


def test_crlf_file_same_id_as_lf(tmp_path: Path) -> None:
    a = load_task_file(_write(tmp_path / "a.py", RELU))
    b = load_task_file(_write(tmp_path / "b.py", RELU.replace("\n", "  \r\n")))
    assert a.id == b.id
    assert b.code == RELU.replace("\n", "  \r\n")  # code is kept exactly


# ----------------------------------------------------------------------------- validation


def test_assignment_forms_accepted() -> None:
    task_from_code(MATMUL, name="mm")
    code = RELU.replace("def get_init_inputs():\n    return []", "get_init_inputs: object = list")
    task_from_code(code, name="annotated")
    code = RELU.replace("def get_init_inputs():\n    return []", "")
    task_from_code(code + "get_init_inputs, other = (lambda: [], 1)\n", name="tuple")


def test_missing_names_listed_all_at_once() -> None:
    with pytest.raises(TaskError) as err:
        task_from_code("import torch\nx = 1\n", name="bad", source="bad.py")
    msg = str(err.value)
    assert msg.startswith("bad.py lacks ")
    for name in ("Model", "get_inputs", "get_init_inputs"):
        assert name in msg
    only_init = RELU.replace("def get_init_inputs():\n    return []", "")
    with pytest.raises(TaskError, match=r"lacks get_init_inputs$"):
        task_from_code(only_init, name="x")


def test_wrong_kind_of_binding() -> None:
    code = RELU.replace(
        "class Model(nn.Module):", "def Model():\n    pass\nclass Other(nn.Module):"
    )
    with pytest.raises(TaskError, match=r"Model \(bound by function, expected a class\)"):
        task_from_code(code, name="x")


def test_names_inside_nested_scopes_do_not_count() -> None:
    code = "class Model:\n    pass\ndef f():\n    def get_inputs():\n        pass\n"
    with pytest.raises(TaskError, match="get_inputs, get_init_inputs"):
        task_from_code(code, name="x")


def test_syntax_error_names_line() -> None:
    code = RELU.replace("return torch.relu(x)", "return torch.relu(x")
    with pytest.raises(TaskError, match=r"^f\.py: syntax error at line \d+: "):
        task_from_code(code, name="f", source="f.py")


def test_empty_and_non_string_code() -> None:
    with pytest.raises(TaskError, match="is empty"):
        task_from_code("  \n", name="e")
    with pytest.raises(TaskError, match="code must be a string"):
        task_from_code(b"x", name="e")  # type: ignore[arg-type]
    with pytest.raises(TaskError, match="name"):
        task_from_code(RELU, name="")


# ----------------------------------------------------------------------------- files


def test_load_single_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "19_ReLU.py", RELU)
    (task,) = load_tasks(path)
    assert task == load_task_file(str(path))
    assert (task.name, task.source, task.level, task.meta) == ("19_ReLU", str(path), None, {})


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "is empty"),
        (b"\x00\x01\x02binary", "binary"),
        (b"x = '\xff\xfe'\n", "not valid UTF-8"),
    ],
)
def test_bad_file_contents(tmp_path: Path, content: bytes, match: str) -> None:
    path = _write(tmp_path / "t.py", content)
    with pytest.raises(TaskError, match=match):
        load_tasks(path)


def test_bom_is_dropped(tmp_path: Path) -> None:
    task = load_task_file(_write(tmp_path / "t.py", b"\xef\xbb\xbf" + RELU.encode()))
    assert task.code == RELU


def test_missing_path_and_unsupported_suffix(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "nope.py")
    with pytest.raises(TaskError, match="does not exist"):
        load_task_file(tmp_path / "nope.py")
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "nope")
    with pytest.raises(TaskError, match="unsupported type '.txt'"):
        load_tasks(_write(tmp_path / "t.txt", RELU))
    with pytest.raises(TaskError, match="is a directory"):
        load_task_file(tmp_path)


# ----------------------------------------------------------------------------- folders


def test_kernelbench_tree(kernelbench: Path) -> None:
    tasks = load_tasks(kernelbench)
    assert [t.name for t in tasks] == [
        "1_Square_matrix_multiplication_",
        "2_Standard_matrix_multiplication_",
        "level1/19_ReLU",
        "3_Conv2d_ReLU",
        "10_Conv2d_ReLU",
        "level2/19_ReLU",
    ]
    assert [t.level for t in tasks] == ["level1"] * 3 + ["level2"] * 3
    assert tasks[0].source == str(kernelbench / "level1" / "1_Square_matrix_multiplication_.py")
    assert all(t.meta == {} for t in tasks)
    # duplicate ids are kept, names stay unique
    assert tasks[0].id == tasks[1].id and tasks[3].id == tasks[4].id
    assert tasks[2].id != tasks[5].id
    assert len({t.name for t in tasks}) == len(tasks)
    # stable across loads
    assert load_tasks(kernelbench) == tasks


def test_level_folder_directly(kernelbench: Path) -> None:
    tasks = load_tasks(kernelbench / "level1")
    assert [t.name for t in tasks] == [
        "1_Square_matrix_multiplication_",
        "2_Standard_matrix_multiplication_",
        "19_ReLU",
    ]
    assert all(t.level is None for t in tasks)


def test_pattern(kernelbench: Path) -> None:
    tasks = load_tasks(kernelbench, pattern="*ReLU.py")
    assert [t.name for t in tasks] == [
        "level1/19_ReLU",
        "3_Conv2d_ReLU",
        "10_Conv2d_ReLU",
        "level2/19_ReLU",
    ]


def test_invalid_file_in_folder_raises_or_is_skipped(kernelbench: Path) -> None:
    bad = _write(kernelbench / "level1" / "5_broken.py", "import torch\nclass Model: pass\n")
    _write(kernelbench / "level1" / "6_binary.py", b"\x00\x00")
    with pytest.raises(TaskError, match="5_broken.py lacks get_inputs, get_init_inputs"):
        load_tasks(kernelbench)
    tasks, skipped = load_tasks_report(kernelbench, skip_invalid=True)
    assert len(tasks) == 6
    assert [s for s, _ in skipped] == [str(bad), str(kernelbench / "level1" / "6_binary.py")]
    assert "lacks get_inputs" in skipped[0][1] and "binary" in skipped[1][1]
    assert load_tasks(kernelbench, skip_invalid=True) == tasks


def test_empty_folder(tmp_path: Path) -> None:
    _write(tmp_path / "README.md", "hi")
    _write(tmp_path / "__init__.py", "")
    with pytest.raises(TaskError, match="no task files found under"):
        load_tasks(tmp_path)


def test_folder_all_invalid_with_skip(tmp_path: Path) -> None:
    _write(tmp_path / "1_a.py", "x = 1\n")
    with pytest.raises(TaskError, match="no valid tasks under .*lacks Model"):
        load_tasks(tmp_path, skip_invalid=True)


def test_root_file_and_level_file_with_same_stem(tmp_path: Path) -> None:
    _write(tmp_path / "19_ReLU.py", RELU)
    _write(tmp_path / "a" / "level1" / "19_ReLU.py", RELU)
    _write(tmp_path / "b" / "level1" / "19_ReLU.py", RELU)
    tasks = load_tasks(tmp_path)
    assert [t.name for t in tasks] == ["19_ReLU", "a/level1/19_ReLU", "b/level1/19_ReLU"]
    assert [t.level for t in tasks] == [None, "level1", "level1"]


# ----------------------------------------------------------------------------- rows


def _rows() -> list[dict[str, object]]:
    return [
        {"ops": "['torch.relu']", "data_source": "torch#2", "code": RELU},
        {"ops": ["torch.matmul"], "data_source": "torch#3", "code": MATMUL, "extra": 5},
        {"ops": "['torch.nn.Conv2d', 'torch.relu']", "data_source": "torch#4", "code": CONV_RELU},
    ]


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "ops.jsonl"
    lines = [json.dumps(r) for r in _rows()]
    path.write_text(lines[0] + "\n\n" + lines[1] + "\r\n" + lines[2], encoding="utf-8")
    tasks = load_tasks(path)
    assert [t.name for t in tasks] == ["ops_00000", "ops_00001", "ops_00002"]
    assert [t.source for t in tasks] == [f"{path}#0", f"{path}#1", f"{path}#2"]
    assert [t.ops for t in tasks] == [
        ["torch.relu"],
        ["torch.matmul"],
        ["torch.nn.Conv2d", "torch.relu"],
    ]
    assert tasks[1].meta == {"ops": ["torch.matmul"], "data_source": "torch#3", "extra": 5}
    assert all(t.level is None for t in tasks)
    assert tasks[0].id == compute_task_id(RELU)


def test_row_names_and_collisions(tmp_path: Path) -> None:
    rows = [
        {"name": "relu", "code": RELU},
        {"name": "mm", "code": MATMUL},
        {"name": "relu", "code": RELU},
        {"task_id": "kb_1", "code": MATMUL},
        {"code": CONV_RELU},
    ]
    path = tmp_path / "named.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tasks = load_tasks(path)
    assert [t.name for t in tasks] == ["relu#0", "mm", "relu#2", "kb_1", "named_00004"]
    assert tasks[3].meta == {"task_id": "kb_1"}  # a foreign task_id is kept in meta


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"code": 1}\n', r"row 0 \(line 1\) has a non-string 'code' field \(int\)"),
        ('{"ops": []}\n', r"row 0 \(line 1\) has no 'code' field"),
        ("\n[1, 2]\n", r"row 0 \(line 2\) is not an object"),
        (json.dumps({"code": RELU}) + "\n{not json\n", r"line 2 is not valid JSON"),
        ("", "contains no rows"),
        ("\n  \n", "contains no rows"),
        (json.dumps({"code": "x = 1"}) + "\n", r"\.jsonl#0 lacks Model"),
    ],
)
def test_bad_jsonl(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TaskError, match=match):
        load_tasks(path)


def test_bad_jsonl_bytes(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="not valid UTF-8"):
        load_tasks(_write(tmp_path / "a.jsonl", b'{"code": "\xff"}\n'))
    with pytest.raises(TaskError, match="binary"):
        load_tasks(_write(tmp_path / "b.jsonl", b"\x00\x01"))


def test_jsonl_skip_invalid(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"code": RELU}),
        "{oops",
        json.dumps({"code": 3}),
        json.dumps({"code": MATMUL}),
    ]
    path.write_text("\n".join(lines), encoding="utf-8")
    tasks, skipped = load_tasks_report(path, skip_invalid=True)
    assert [t.name for t in tasks] == ["mixed_00000", "mixed_00003"]
    assert [s for s, _ in skipped] == [f"{path}#1", f"{path}#2"]
    assert "line 2 is not valid JSON" in skipped[0][1]


def test_json_list(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_rows()), encoding="utf-8")
    assert [t.code for t in load_tasks(path)] == [RELU, MATMUL, CONV_RELU]
    path.write_text(json.dumps({"code": RELU}), encoding="utf-8")
    with pytest.raises(TaskError, match="must contain a JSON list of rows"):
        load_tasks(path)
    path.write_text("[{", encoding="utf-8")
    with pytest.raises(TaskError, match="not valid JSON.*line 1"):
        load_tasks(path)
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(TaskError, match="contains no rows"):
        load_tasks(path)


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = _rows()
    table = pa.table(
        {
            "ops": [str(r["ops"]) for r in rows],
            "data_source": [r["data_source"] for r in rows],
            "code": [r["code"] for r in rows],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    tasks = load_tasks(path)
    assert [t.name for t in tasks] == ["train_00000", "train_00001", "train_00002"]
    assert tasks[2].ops == ["torch.nn.Conv2d", "torch.relu"]
    assert tasks[1].meta == {"ops": "['torch.matmul']", "data_source": "torch#3"}

    pq.write_table(pa.table({"code": [1, 2]}), path)
    with pytest.raises(TaskError, match=r"row 0 has a non-string 'code' field \(int\)"):
        load_tasks(path)
    pq.write_table(pa.table({"x": ["a"]}), path)
    with pytest.raises(TaskError, match="row 0 has no 'code' field"):
        load_tasks(path)
    path.write_bytes(b"definitely not parquet")
    with pytest.raises(TaskError, match="not a readable parquet file"):
        load_tasks(path)


def test_parquet_without_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "x.parquet", b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(TaskError, match="pip install pyarrow"):
        load_tasks(path)
    with pytest.raises(TaskError, match="pip install pyarrow"):
        write_parquet([task_from_code(RELU, name="r")], tmp_path / "y.parquet")


def test_ops_parsing() -> None:
    def ops(value: object) -> list[str] | None:
        return task_from_code(RELU, name="r", meta={"ops": value}).ops

    assert ops(["a", "b"]) == ["a", "b"]
    assert ops("['a', 'b']") == ["a", "b"]
    assert ops('["a"]') == ["a"]
    assert ops("") == []
    assert ops("not a list [") is None
    assert ops(None) is None


# ----------------------------------------------------------------------------- writing


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_write_round_trip(kernelbench: Path, tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    jsonl = tmp_path / "ops.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in _rows()), encoding="utf-8")
    original = load_tasks(kernelbench) + load_tasks(jsonl)
    out = tmp_path / "out" / f"all.{fmt}"
    writer = write_jsonl if fmt == "jsonl" else write_parquet
    assert writer(original, out) == out
    back = load_tasks(out)
    key = [(t.id, t.name, t.code) for t in original]
    assert [(t.id, t.name, t.code) for t in back] == key
    assert back[0].meta == {"ops": [], "data_source": ""}
    assert back[-1].ops == ["torch.nn.Conv2d", "torch.relu"]
    assert back[-1].meta["data_source"] == "torch#4"
    assert back[len(original) - 2].meta["extra"] == 5
    assert all("task_id" not in t.meta for t in back)
    if fmt == "jsonl":
        first = json.loads(out.read_text(encoding="utf-8").split("\n")[0])
        assert set(first) == {"task_id", "name", "ops", "data_source", "code"}
        assert first["task_id"] == original[0].id
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_write_jsonl_unserialisable_meta(tmp_path: Path) -> None:
    task = task_from_code(RELU, name="r", meta={"bad": object()})
    with pytest.raises(TaskError, match="cannot be written as JSON"):
        write_jsonl([task], tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


# ----------------------------------------------------------------------------- find_task


def test_find_task(kernelbench: Path) -> None:
    tasks = load_tasks(kernelbench)
    conv = find_task(tasks, "3_Conv2d_ReLU")
    assert conv.name == "3_Conv2d_ReLU"
    relu1 = find_task(tasks, "level1/19_ReLU")
    assert find_task(tasks, relu1.id) is relu1
    assert find_task(tasks, relu1.id[:6].upper()) is relu1
    with pytest.raises(TaskError, match="ambiguous"):
        find_task(tasks, conv.id)  # two files with the same code
    with pytest.raises(TaskError, match="ambiguous.*level1/19_ReLU.*level2/19_ReLU"):
        find_task(tasks, "19_ReLU")
    only_level1 = [t for t in tasks if t.level == "level1"]
    assert find_task(only_level1, "19_ReLU") is relu1
    with pytest.raises(TaskError, match="close matches: 3_Conv2d_ReLU"):
        find_task(tasks, "3_Conv2d_ReLu")
    with pytest.raises(TaskError, match="no task named"):
        find_task(tasks, relu1.id[:5])  # too short for a prefix
    with pytest.raises(TaskError, match="among 0 task"):
        find_task([], "x")


# ----------------------------------------------------------------------------- importing


def test_import_good_task_runs() -> None:
    torch = pytest.importorskip("torch")
    task = task_from_code(RELU, name="19_ReLU")
    module = import_task_module(task)
    assert "_cuda_agent_task" not in sys.modules
    inputs = module.get_inputs()
    model = module.Model(*module.get_init_inputs())
    out = model(*inputs)
    assert torch.equal(out, torch.relu(inputs[0]))


def test_import_lambda_task_runs() -> None:
    pytest.importorskip("torch")
    module = import_task_module(task_from_code(MATMUL, name="mm"))
    a, b = module.get_inputs()
    assert module.Model(*module.get_init_inputs())(a, b).shape == (64, 64)


def test_import_register() -> None:
    pytest.importorskip("torch")
    name = "_cuda_agent_task_register_test"
    try:
        module = import_task_module(task_from_code(RELU, name="r"), name, register=True)
        assert sys.modules[name] is module
        assert module.Model.__module__ == name
    finally:
        sys.modules.pop(name, None)


def test_import_failure_wrapped() -> None:
    code = RELU.replace("dim = 16384", "dim = 16384\nraise RuntimeError('boom')")
    task = task_from_code(code, name="boom")
    line = code.splitlines().index("raise RuntimeError('boom')") + 1
    with pytest.raises(
        TaskError, match=rf"^task boom failed to import: RuntimeError: boom \(line {line}\)$"
    ):
        import_task_module(task, "_boom", register=True)
    assert "_boom" not in sys.modules


def test_import_failure_system_exit_and_missing_module() -> None:
    code = "import sys\nsys.exit(3)\n" + RELU
    with pytest.raises(TaskError, match=r"SystemExit: 3 \(line 2\)"):
        import_task_module(task_from_code(code, name="exit"))
    code = "import no_such_module_xyz\n" + RELU
    with pytest.raises(TaskError, match="ModuleNotFoundError.*line 1"):
        import_task_module(task_from_code(code, name="mod"))


def test_import_checks_callables() -> None:
    code = RELU + "\nget_inputs = None\n"
    task = task_from_code(code, name="nc")
    with pytest.raises(TaskError, match="lacks callable get_inputs$"):
        import_task_module(task)
    # a hand-made Task that skipped validation
    bare = Task(id="0" * 16, name="bare", code="x = 1\n", source="<string>")
    with pytest.raises(TaskError, match="lacks callable Model, get_inputs, get_init_inputs"):
        import_task_module(bare)


# ----------------------------------------------------------------------------- fixtures


def test_shipped_fixture_tasks_run() -> None:
    torch = pytest.importorskip("torch")
    tasks = load_tasks(DATA)
    assert [t.name for t in tasks] == ["19_ReLU", "23_Softmax", "76_Linear_ReLU", "Elementwise_Chain"]
    for task in tasks:
        module = import_task_module(task)
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs())
        inputs = module.get_inputs()
        out = model(*inputs)
        assert isinstance(out, torch.Tensor)
        assert out.shape[0] == inputs[0].shape[0]
    linear = find_task(tasks, "76_Linear_ReLU")
    module = import_task_module(linear)
    model = module.Model(*module.get_init_inputs())
    assert sum(p.numel() for p in model.parameters()) == 256 * 128 + 128
