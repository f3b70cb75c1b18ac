"""Constants of the math contract that every library module shares (docs/design.md section 1).

``EPS``: the norm's floor, g = m / max(n, EPS), as PEFT defines it. The oracles in
``doracheck.reference`` keep their own copy on purpose: they must stay independent of the
code they judge.

Code that torch.compile may trace reads it as ``eps()``, a literal, never as the module global:
with ``torch.compile(dynamic=True)`` dynamo makes a global float a symbolic input, and a global
float read inside an ``autograd.Function`` that a graph applies twice (every layer after the
first) fails with dynamo's internal "lift_tracked_freevar_to_input should not be called on root
SubgraphTracer" (seen with torch 2.13; ``tests/layer/test_compile_fullgraph.py``); a literal is a constant.
"""


def eps() -> float:
    """EPS, as a literal (constant to torch.compile; see the module docstring)."""
    return 1e-12


EPS = eps()
