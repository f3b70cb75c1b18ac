"""The ``doracheck`` command line: env, verify, audit, sample, calibrate, bench."""
