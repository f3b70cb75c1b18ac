"""Constants of the math contract that every library module shares (docs/design.md section 1).

``EPS``: the norm's floor, g = m / max(n, EPS), as PEFT defines it. The oracles in
``doracheck.reference`` keep their own copy on purpose: they must stay independent of the
code they judge.
"""

EPS = 1e-12
