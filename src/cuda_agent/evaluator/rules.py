"""The names of the rules a candidate can break: a verdict's `rule` is one of these.

One registry for the static checks, the runtime guards, the output comparison and the
speed verdict. The static checks' rules are described in `static_checks/README.md`.
"""

from __future__ import annotations

# Static checks (before anything is built or imported); the guards reuse the first two.
TORCH_COMPUTE = "torch-compute-op"
FUNCTIONAL = "functional-call"
FORBIDDEN_IMPORT = "forbidden-import"
REFERENCE_FALLBACK = "reference-fallback"
TRY_EXCEPT = "try-except-fallback"
INTROSPECTION = "introspection"
THREADS = "threads"
NO_EXTENSION = "no-extension-call"
LIBRARY = "forbidden-library"
SYNTAX = "syntax-error"
MISSING_MODELNEW = "missing-modelnew"

STATIC: tuple[str, ...] = (
    FORBIDDEN_IMPORT, REFERENCE_FALLBACK, TRY_EXCEPT, TORCH_COMPUTE, FUNCTIONAL, INTROSPECTION,
    THREADS, NO_EXTENSION, LIBRARY, SYNTAX, MISSING_MODELNEW,
)

# What the candidate process observes while ModelNew runs.
PARAMETERS = "parameter-mismatch"
INPUT_MUTATION = "input-mutation"
OUTPUT_TYPE = "output-type"
OUTPUT_ALIAS = "output-aliases-input"
STREAM = "non-current-stream"

# The comparison of outputs with the reference's.
STRUCTURE = "output-structure"
SHAPE = "output-shape"
DTYPE = "output-dtype"
DEVICE = "output-device"
VALUES = "output-values"
RELATIVE_ERROR = "output-relative-error"  # within atol everywhere, yet as far off as the reference is large
NONFINITE = "nonfinite-mismatch"
TIMED_OUTPUT = "timed-output-mismatch"

# The speed verdict.
WALL_GAP = "wall-time-gap"
FOREIGN_KERNELS = "device-time-not-in-extension"
NO_DEVICE_WORK = "no-device-work"
BANDWIDTH = "faster-than-memory-bandwidth"
VOUCHED = "vouched-batches"  # the candidate process did not answer the parent's timed batches

ALL: tuple[str, ...] = (
    *STATIC, PARAMETERS, INPUT_MUTATION, OUTPUT_TYPE, OUTPUT_ALIAS, STREAM, STRUCTURE, SHAPE, DTYPE,
    DEVICE, VALUES, RELATIVE_ERROR, NONFINITE, TIMED_OUTPUT, WALL_GAP, FOREIGN_KERNELS, NO_DEVICE_WORK, BANDWIDTH, VOUCHED,
)
