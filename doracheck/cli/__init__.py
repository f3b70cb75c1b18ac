"""The ``doracheck`` command line: env, verify, audit, bench, calibrate."""
