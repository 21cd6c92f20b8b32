"""Static checks on a candidate solution, run before anything is built or imported.

The runtime checks (torch.nn.functional blocked while ``ModelNew`` runs, outputs compared
with fresh inputs, the sandbox) are the authority; these checks reject obvious rule breaks
early and say precisely, with file and line, what to change. They are tuned for precision:
an honest solution must pass, so anything the text cannot decide is left to the runtime.
The rules, what each catches and what it does not: ``README.md`` in this package.
"""

from cuda_agent.evaluator.static_checks.cpp_rules import check_cpp_source
from cuda_agent.evaluator.static_checks.inline_sources import InlineSource, extract_inline_sources
from cuda_agent.evaluator.static_checks.python_rules import check_model_new
from cuda_agent.evaluator.static_checks.solution_check import check_solution
from cuda_agent.evaluator.static_checks.violation import Violation

__all__ = [
    "InlineSource",
    "Violation",
    "check_cpp_source",
    "check_model_new",
    "check_solution",
    "extract_inline_sources",
]
