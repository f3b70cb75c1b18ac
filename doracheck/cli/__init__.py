"""The ``doracheck`` command line: env, verify (and, as they land, audit, bench, calibrate)."""
