"""The object cache: a source compiled once is linked, not compiled again, into the next
build that has it unchanged (an agent's edit of a kernel leaves its binding as it was).
Real compiler, real sandbox, real evaluation of the module that links the cached object."""

from __future__ import annotations

import uuid

from cuda_agent.evaluator import build
from cuda_agent.evaluator.evaluate import EvalOptions, evaluate
from cuda_agent.evaluator.solution import solution_from_files
from cuda_agent.evaluator.toolchain import toolchain
from cuda_agent.tasks import load_task_file

from . import cases as C

KERNEL = "kernels/axpby.cpp"


def edited(tag: str) -> dict[str, str]:
    files = C.axpby()
    files[KERNEL] += f"\n// {tag}\n"
    return files


def spec_of(files: dict[str, str]) -> build.ExtensionSpec:
    return build.workspace_extension(solution_from_files(files), "cpu")


def test_an_edited_kernel_links_the_unchanged_bindings_cached_object() -> None:
    opts = build.BuildOptions(device="cpu")
    run = uuid.uuid4().hex  # new kernels: nothing of this test is in a cache kept between runs
    first = build.build_extension(spec_of(edited(f"first {run}")), opts, build_key=f"objects-{run}-a")
    assert first.ok, first.message
    second = build.build_extension(spec_of(edited(f"second {run}")), opts, build_key=f"objects-{run}-b")
    assert second.ok and not second.cached, second.message
    # the binding's object came from the cache: the kernel alone was compiled (then the link)
    assert second.rebuilt == [KERNEL, "link cuda_extension.so"], second.rebuilt
    ninja = (second.build_dir / "obj" / "build.ninja").read_text()
    assert "/objects/" in ninja and "axpby_binding.cpp.o:" not in ninja
    # a build sees only the cached objects it links: another solution's object, included
    # by its path, is not there to be quoted in a compile error
    tc = toolchain("cpu", None)
    other = build.cache_dir("objects") / f"{build._object_key(spec_of(edited(f'first {run}')), tc, KERNEL, {})}.o"
    assert other.is_file()
    spying = edited(f"spy {run}")
    spying[KERNEL] = f'#include "{other}"\n' + spying[KERNEL]
    spy = build.build_extension(spec_of(spying), opts, build_key=f"objects-{run}-c")
    assert not spy.ok and "No such file" in spy.message, spy.message
    # the module that links it is the real thing
    res = evaluate(load_task_file(C.AXPBY_TASK), solution_from_files(edited(f"second {run}")),
                   EvalOptions(device="cpu", profile=False, trials=2, distribution_trials=0,
                               build_key=f"objects-{run}-b"))
    assert res.status == "ok" and res.correct, res.message


def test_an_objects_key_covers_what_it_is_made_of() -> None:
    tc = toolchain("cpu", None)
    base = spec_of(C.axpby())
    binding = "kernels/axpby_binding.cpp"

    def key(spec: build.ExtensionSpec, rel: str = binding) -> str:
        return build._object_key(spec, tc, rel, {})

    kernel_edit = spec_of(edited("x"))
    assert key(kernel_edit) == key(base) and key(kernel_edit, KERNEL) != key(base, KERNEL)
    # any header of the solution may be included: changing one changes every key
    with_header = spec_of({**C.axpby(), "kernels/common.h": "#pragma once\n"})
    assert key(with_header) != key(base)
    # a compiled source included by another: then every source counts
    files = C.axpby()
    files[binding] = files[binding].replace('#include "../binding_registry.h"',
                                            '#include "../binding_registry.h"\n#include "axpby.cpp"')
    including = spec_of(files)
    assert key(spec_of({**files, KERNEL: files[KERNEL] + "\n// y\n"})) != key(including)
    # flags are part of it
    flagged = build.ExtensionSpec(base.name, base.sources, base.with_cuda, extra_cflags=["-DX=1"])
    assert key(flagged) != key(base)
