# Prepared in the twenty-first pass for the next device session (issue 17; not run yet): why the
# library's eager steps are bimodal (p20 82-85 against p80 98-102 ms on one host) where the bare
# yardstick's are tight. ab_step.py with Python's gc off for a configuration's timed steps, and
# the caching allocator's cudaMalloc / cudaFree counts per configuration, in two processes.
# About 2 device minutes.
AB_CONFIGS='lora;dc:graphs=1;dc:graphs=1,gc=off;dc:bare=1' AB_TAG=bimodal exec bash benchmarks/twentyfirst_ab.sh
