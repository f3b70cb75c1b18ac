# Twenty-second pass (issue 17): norm groups. The GPU tests (test_norm_groups.py among them),
# memcheck over the kernel cases, verify --quick, then ab_step.py (PEFT LoRA, the library with
# groups off and on, the bare yardstick) in two processes of ten rounds. About 7 device minutes.
AB_CONFIGS='lora;dc:groups=0;dc:groups=1;dc:bare=1' AB_ROUNDS=10 AB_TAG=groups_check exec bash benchmarks/twentyfirst_check.sh
