"""The evaluator end to end on the CPU backend: real compiler, real sandbox, real verdicts.

Each failing solution asserts the exact status and that the message names the rule.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cuda_agent.evaluator import rules
from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
from cuda_agent.evaluator.solution import load_solution
from cuda_agent.tasks import load_task_file

from . import cases as C


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def run(tmp_path: Path, task: Path, files: dict[str, str], **opts):  # type: ignore[no-untyped-def]
    sol_dir = write(tmp_path / "solution", files)
    target = sol_dir / "model_new.py" if len(files) == 1 else sol_dir
    opts.setdefault("device", "cpu")
    opts.setdefault("run_timeout_s", 120.0)
    opts.setdefault("profile", False)  # speed is tested in test_profile_cpu.py
    return evaluate(load_task_file(task), load_solution(target), EvalOptions(**opts))


# --- correct solutions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "task, files",
    [
        (C.AXPBY_TASK, C.axpby()),
        (C.RELU_TASK, C.RELU),
        (C.LINEAR_RELU_TASK, C.LINEAR_RELU),
        (C.SOFTMAX_TASK, {"model_new.py": C.SOFTMAX_SINGLE_FILE}),
    ],
    ids=["axpby", "relu", "linear_relu", "softmax_load_inline"],
)
def test_correct_solutions_pass(tmp_path: Path, task: Path, files: dict[str, str]) -> None:
    res = run(tmp_path, task, files)
    assert res.status == "ok", res.message
    assert res.correct and res.reward == 1.0
    assert res.trials_passed == C.TRIALS and len(res.seeds) == C.TRIALS + 1
    assert set(res.timings_s) >= {"build", "candidate", "total"}


def test_seeds_are_random_unless_given(tmp_path: Path) -> None:
    a = run(tmp_path / "a", C.AXPBY_TASK, C.axpby())
    b = run(tmp_path / "b", C.AXPBY_TASK, C.axpby())
    c = run(tmp_path / "c", C.AXPBY_TASK, C.axpby(), seed=7)
    assert a.seeds != b.seeds
    assert c.seeds == list(range(7, 8 + C.TRIALS))
    assert a.correct and b.correct and c.correct


# --- build failures ------------------------------------------------------------------------


def test_compile_error_is_trimmed_to_file_and_line(tmp_path: Path) -> None:
    broken = C.AXPBY_KERNELS["kernels/axpby.cpp"].replace("out[i] = alpha", "out[i] = alpah")
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(**{"axpby__cpp": broken}))
    assert res.status == "compile_error"
    assert "kernels/axpby.cpp:" in res.message and "alpah" in res.message
    assert len(res.message) < 4000
    assert res.reward == -1.0 and not res.correct


def test_cuda_sources_on_cpu_device_are_refused(tmp_path: Path) -> None:
    files = C.axpby(**{"extra__cu": "__global__ void k() {}\n"})
    res = run(tmp_path, C.AXPBY_TASK, files)
    assert res.status == "compile_error"
    assert "kernels/extra.cu" in res.message and "cpu" in res.message


# --- correctness ---------------------------------------------------------------------------


def test_wrong_values_name_the_first_mismatch(tmp_path: Path) -> None:
    wrong = C.AXPBY_KERNELS["kernels/axpby.cpp"].replace("alpha * a[i] + b[i]", "alpha * a[i] - b[i]")
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(**{"axpby__cpp": wrong}))
    assert res.status == "incorrect" and res.rule == "output-values"
    assert "mismatch at index" in res.message and "trial 1" in res.message


def test_wrong_shape(tmp_path: Path) -> None:
    body = "return cuda_extension.axpby(a, b, self.alpha).view(-1)"
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(C.forward(body)))
    assert res.status == "incorrect" and res.rule == "output-shape"
    assert "shape" in res.message


def test_parameter_mismatch(tmp_path: Path) -> None:
    files = dict(C.LINEAR_RELU)
    files["model_new.py"] = files["model_new.py"].replace(
        "nn.Linear(in_features, out_features)", "nn.Linear(in_features, out_features, bias=False)"
    ).replace("self.linear.bias", "self.linear.weight[0]")
    res = run(tmp_path, C.LINEAR_RELU_TASK, files)
    assert res.status == "incorrect" and res.rule == "parameter-mismatch"
    assert "linear.bias" in res.message


# One extension for every fault and cheat below (one build): model_new.py picks the function.
FAULTS = C.BINDING_HEAD + """#include <unistd.h>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" void axpby_launcher(float*, const float*, const float*, float, int64_t);

static torch::Tensor run(const torch::Tensor& a, const torch::Tensor& b, double alpha) {
  auto out = torch::empty_like(a);
  axpby_launcher(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), (float)alpha, a.numel());
  return out;
}
// never writes its output: whatever memory torch::empty_like lands on is returned
static torch::Tensor lazy(torch::Tensor a, torch::Tensor, double) { return torch::empty_like(a); }
static torch::Tensor mutate(torch::Tensor a, torch::Tensor b, double alpha) {
  auto out = run(a, b, alpha);
  a.data_ptr<float>()[0] += 1.0f;
  return out;
}
static torch::Tensor torch_ops(torch::Tensor a, torch::Tensor b, double alpha) { return a.mul(alpha).add(b); }
static torch::Tensor segfault(torch::Tensor a, torch::Tensor, double) {
  volatile float* p = nullptr;
  *p = 1.0f;
  return a;
}
static torch::Tensor spin(torch::Tensor a, torch::Tensor, double) {
  volatile int x = 0;
  while (true) { x = x + 1; }
  return a;
}
static torch::Tensor fork_bomb(torch::Tensor a, torch::Tensor, double) {
  while (true) { fork(); }
  return a;
}
// allocates and touches 30 GB, a gigabyte at a time: more than this machine has
static torch::Tensor memory_hog(torch::Tensor a, torch::Tensor, double) {
  std::vector<char*> held;
  for (int i = 0; i < 30; ++i) {
    char* p = static_cast<char*>(std::malloc(size_t(1) << 30));
    if (p == nullptr) break;
    std::memset(p, 1, size_t(1) << 30);
    held.push_back(p);
  }
  return a;
}
static torch::Tensor huge(torch::Tensor a, torch::Tensor, double) {
  auto out = torch::empty({int64_t(1) << 42}, a.options());
  out.data_ptr<float>()[0] = 0.f;
  return out;
}
static void register_faults(pybind11::module& m) {
  for (auto& [name, fn] : std::vector<std::pair<const char*, torch::Tensor (*)(torch::Tensor, torch::Tensor, double)>>{
           {"lazy", lazy}, {"mutate", mutate}, {"torch_ops", torch_ops}, {"segfault", segfault}, {"spin", spin},
           {"fork_bomb", fork_bomb}, {"memory_hog", memory_hog}, {"huge", huge}})
    m.def(name, fn);
}
REGISTER_BINDING(faults, register_faults);
"""


def faulty(fn: str) -> dict[str, str]:
    """axpby whose forward calls the fault extension's `fn` (evaluate with static_checks=False)."""
    return C.axpby(C.forward(f"return cuda_extension.{fn}(a, b, self.alpha)"), axpby_binding__cpp=FAULTS)


def test_uninitialised_output_fails(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, faulty("lazy"), static_checks=False)
    assert res.status == "incorrect" and res.rule in ("output-values", "nonfinite-mismatch")


# --- rejection rules (runtime: static checks off, so the runtime guard must catch each) ---


RUNTIME_CHEATS = {
    "functional-call": C.forward("out = cuda_extension.axpby(a, b, self.alpha)\nreturn F.relu(out) - F.relu(-out)",
                                 imports="import torch.nn.functional as F"),
    "torch-compute-op": C.forward("return cuda_extension.axpby(a, b, 0.0) + self.alpha * a"),
    "no-extension-call": C.forward("return torch.empty_like(a).copy_(a)"),
    "output-aliases-input": C.forward("out = cuda_extension.axpby(a, b, self.alpha)\nreturn b.copy_(out)"),
}


@pytest.mark.parametrize("rule", sorted(RUNTIME_CHEATS))
def test_runtime_rules_reject(tmp_path: Path, rule: str) -> None:
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(RUNTIME_CHEATS[rule]), static_checks=False)
    assert res.status == "rejected", res.message
    assert res.rule == rule, res.message


def test_input_mutation_rejected(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, faulty("mutate"), static_checks=False)
    assert res.status == "rejected" and res.rule == "input-mutation"
    assert "input[0]" in res.message


def test_output_subclass_rejected(tmp_path: Path) -> None:
    body = "return cuda_extension.axpby(a, b, self.alpha).as_subclass(Lazy)"
    mn = C.forward(body).replace("class ModelNew", "class Lazy(torch.Tensor):\n    pass\n\n\nclass ModelNew")
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(mn), static_checks=False)
    assert res.status == "rejected" and res.rule == "output-type"
    assert "Lazy" in res.message


def test_torch_op_in_cpp_binding_rejected_at_runtime(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, faulty("torch_ops"), static_checks=False)
    assert res.status == "rejected" and res.rule == "torch-compute-op"
    assert "aten.mul" in res.message


@pytest.mark.parametrize(
    "files, rule",
    [
        (C.axpby(C.forward("from model import Model\nreturn Model(self.alpha)(a, b)")), "reference-fallback"),
        (C.axpby(C.forward("try:\n    return cuda_extension.axpby(a, b, self.alpha)\nexcept Exception:\n    return self.alpha * a + b")), "try-except-fallback"),
        (C.axpby(C.forward("return torch.nn.functional.linear(a, b)")), "functional-call"),
        (C.axpby(**{"axpby_binding__cpp": C.binding("return torch::matmul(a, b);")}), "torch-compute-op"),
    ],
    ids=["reference-fallback", "try-except", "functional", "cpp-torch-op"],
)
def test_static_rules_reject_early(tmp_path: Path, files: dict[str, str], rule: str) -> None:
    res = run(tmp_path, C.AXPBY_TASK, files)
    assert res.status == "rejected" and res.rule == rule, res.message
    assert "timings_s" not in res.message
    assert "build" not in res.timings_s  # rejected before compiling anything


# --- faults ---------------------------------------------------------------------------------


def test_segfault_is_a_runtime_error_and_the_next_evaluation_works(tmp_path: Path) -> None:
    res = run(tmp_path / "crash", C.AXPBY_TASK, faulty("segfault"), static_checks=False)
    assert res.status == "runtime_error"
    assert "SIGSEGV" in res.message and "trial 1" in res.message
    again = run(tmp_path / "ok", C.AXPBY_TASK, C.axpby())
    assert again.status == "ok"


def test_infinite_loop_in_kernel_times_out(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, faulty("spin"), static_checks=False, run_timeout_s=15.0)
    assert res.status == "timeout"
    assert "trial 1" in res.message


def test_infinite_loop_at_import_times_out(tmp_path: Path) -> None:
    mn = C.AXPBY_MODEL_NEW.replace("import cuda_extension", "import cuda_extension\n\nwhile True:\n    pass")
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(mn), run_timeout_s=10.0)
    assert res.status == "timeout"
    assert "import model_new.py" in res.message


def test_fork_bomb_is_stopped_at_the_process_limit(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, faulty("fork_bomb"), static_checks=False, run_timeout_s=60.0, max_processes=64)
    assert res.status == "runtime_error", res.message
    if _run_cgroups():  # stopped when it reached the limit, not at the time-out
        assert "process limit" in res.message and res.timings_s["candidate"] < 30, (res.message, res.timings_s)
    again = run(tmp_path / "ok", C.AXPBY_TASK, C.axpby())
    assert again.status == "ok"


def test_a_memory_hog_is_killed_at_its_own_limit(tmp_path: Path) -> None:
    if not _run_cgroups(memory=True):
        pytest.skip("needs a memory cgroup (root)")
    res = run(tmp_path, C.AXPBY_TASK, faulty("memory_hog"), static_checks=False, memory_mb=1024)
    assert res.status == "runtime_error" and "memory limit" in res.message, res.message
    assert res.details.get("limit") == "memory"
    again = run(tmp_path / "ok", C.AXPBY_TASK, C.axpby(), memory_mb=1024)  # a real solution fits
    assert again.status == "ok", again.message


def _run_cgroups(memory: bool = False) -> bool:
    from cuda_agent.sandbox.limits import RunCgroup

    return RunCgroup.available("memory" if memory else "pids")


def test_zeros_for_a_wide_softmax_are_incorrect(tmp_path: Path) -> None:
    """Every value of a softmax over 32768 is below atol = 1e-2: zeros pass element by
    element, not against the reference's own size; the real kernel passes."""
    task = tmp_path / "wide_softmax.py"
    task.write_text(C.SOFTMAX_TASK.read_text().replace("dim = 4096", "dim = 32768"))
    zeros = C.SOFTMAX_SINGLE_FILE.replace("return y;\n}", "y.zero_();\n    return y;\n}", 1)
    assert zeros != C.SOFTMAX_SINGLE_FILE and "dim = 32768" in task.read_text()
    res = run(tmp_path / "zeros", task, {"model_new.py": zeros}, static_checks=False)
    assert res.status == "incorrect" and res.rule == rules.RELATIVE_ERROR, res.message
    res = run(tmp_path / "real", task, {"model_new.py": C.SOFTMAX_SINGLE_FILE})
    assert res.status == "ok", res.message


def test_huge_allocation_is_a_runtime_error(tmp_path: Path) -> None:
    res = run(tmp_path, C.AXPBY_TASK, faulty("huge"), static_checks=False)
    assert res.status == "runtime_error"
    assert "alloc" in res.message.lower() or "memory" in res.message.lower()


def test_network_and_outside_writes_fail_inside_the_sandbox(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    body = (
        f"open({str(outside)!r}, 'w').write('changed')\n"
        "return cuda_extension.axpby(a, b, self.alpha)"
    )
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(C.forward(body)), static_checks=False)
    assert res.status == "runtime_error"
    assert outside.read_text() == "untouched"
    # A server on the host's loopback: the sandboxed candidate must not reach it.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    net = C.forward(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "return cuda_extension.axpby(a, b, self.alpha)"
    )
    res = run(tmp_path / "net", C.AXPBY_TASK, C.axpby(net), static_checks=False)
    assert res.status == "runtime_error"
    assert "refused" in res.message.lower() or "unreachable" in res.message.lower()
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_build_timeout(tmp_path: Path) -> None:
    # Thousands of constant evaluations, each within gcc's loop and operation limits (one
    # long one fails at those limits in a second): the compiler is busy for minutes, not
    # only while the other sources of the build compile (their objects may be cached).
    slow = (
        "#include <cstdint>\n#include <utility>\n"
        "template <int K> constexpr int64_t spin() {\n"
        "  int64_t s = K; for (int64_t i = 0; i < 200000; ++i) s += (i ^ K) % 7; return s; }\n"
        "template <int K> constexpr int64_t val = spin<K>();\n"
        "template <int... K> int64_t total(std::integer_sequence<int, K...>) { return (val<K> + ...); }\n"
        "extern \"C\" int64_t busy() { return total(std::make_integer_sequence<int, 4000>{}); }\n"
    )
    res = run(tmp_path, C.AXPBY_TASK, C.axpby(**{"slow__cpp": slow}), build_timeout_s=5.0)
    assert res.status == "timeout"
    assert "build timed out" in res.message


def test_the_linker_probe_picks_one_that_links_or_none(tmp_path: Path) -> None:
    from cuda_agent.evaluator.toolchain import _fast_linker, toolchain

    flags = _fast_linker("c++")
    assert flags in ([], ["-fuse-ld=mold"], ["-fuse-ld=lld"], ["-fuse-ld=gold"])
    assert set(flags) <= set(toolchain("cpu").ldflags)  # what every build here links with
    assert _fast_linker(str(tmp_path / "no-such-compiler")) == []  # GNU ld's default, no error


def _dangling_libstdcxx(root: Path) -> Path:
    """A library folder whose `libstdc++.so` is a link to nothing: what a compiler installed
    under /opt with links into /usr showed on the GPU machine. GNU ld skips it and searches
    on; gold stops there ("cannot open")."""
    d = root / "dangling"
    d.mkdir()
    (d / "libstdc++.so").symlink_to(root / "no-such-dir" / "libstdc++.so")
    return d


def test_the_linker_probe_links_cxx_as_an_extension_does(tmp_path: Path) -> None:
    import subprocess

    from cuda_agent.evaluator.toolchain import _fast_linker

    d = _dangling_libstdcxx(tmp_path)
    chosen = _fast_linker("c++", ["-L", str(d)], readonly=[d])
    if _fast_linker("c++") == ["-fuse-ld=gold"]:  # this machine's case: only gold beside GNU ld
        assert chosen == [], "the probe chose gold, which cannot link libstdc++ past the dangling link"
    src = tmp_path / "x.cpp"
    src.write_text("#include <string>\nstd::string f() { return std::string(2, 'y'); }\n")
    r = subprocess.run(["c++", "-shared", "-fPIC", str(src), "-L", str(d), *chosen, "-o", str(tmp_path / "x.so")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_failing_fast_link_falls_back_to_gnu_ld(tmp_path: Path) -> None:
    import dataclasses
    import subprocess

    from cuda_agent.evaluator.build import ExtensionSpec, _ninja_file, _sync_sources
    from cuda_agent.evaluator.toolchain import toolchain

    tc = toolchain("cpu")
    fast = [f for f in tc.ldflags if f.startswith("-fuse-ld=")]
    if not fast:
        pytest.skip("no faster linker than GNU ld here: builds link with GNU ld alone")
    d = _dangling_libstdcxx(tmp_path)
    tc = dataclasses.replace(tc, ldflags=(*tc.ldflags, "-L", str(d)))
    spec = ExtensionSpec(name="fallback_ext", with_cuda=False,
                         sources={"k.cpp": "#include <string>\nstd::string k() { return std::string(4, 'z'); }\n"})
    _sync_sources(spec, tmp_path / "src")
    obj = tmp_path / "obj"
    obj.mkdir()
    (obj / "build.ninja").write_text(_ninja_file(spec, tc, {}))
    r = subprocess.run([tc.ninja, "-C", str(obj)], capture_output=True, text=True)
    assert r.returncode == 0 and (obj / "fallback_ext.so").exists(), r.stdout + r.stderr
    # the fast linker alone fails on this link: the module came from the fallback
    alone = subprocess.run([tc.cxx, str(obj / "k.o"), *tc.ldflags, "-o", str(tmp_path / "alone.so")],
                           capture_output=True, text=True)
    if fast == ["-fuse-ld=gold"]:
        assert alone.returncode != 0 and "cannot open" in alone.stderr, alone.stderr
