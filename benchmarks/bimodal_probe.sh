# Prepared in the twenty-first pass for the next device session (issue 17; not run yet): why the
# library's eager steps are bimodal (p20 82-85 against p80 98-102 ms on one host) where the bare
# yardstick's are tight. ab_step.py with Python's gc off for a configuration's timed steps, and
# the caching allocator's cudaMalloc / cudaFree counts per configuration, in two processes.
# chunk=16 is what ab_step.py ran as "dc" before the twenty-second pass (its default then);
# chunk=1024 leaves every backward whole. About 2-3 device minutes.
AB_CONFIGS='lora;dc:graphs=1;dc:graphs=1,gc=off;dc:graphs=1,chunk=16;dc:graphs=1,chunk=1024;dc:bare=1' AB_TAG=bimodal exec bash benchmarks/twentyfirst_ab.sh
