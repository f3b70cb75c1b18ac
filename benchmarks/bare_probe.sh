# Issue 17, twenty-first pass: how close the eager step gets to PEFT LoRA with doracheck's Python
# taken away (bare_layer_probe.BareFunction, a yardstick; bare=fwd / bare=bwd one pass only),
# beside the library, in one process, two processes. About 3 device minutes.
AB_CONFIGS='lora;dc:graphs=1;dc:bare=1;dc:bare=fwd;dc:bare=bwd' AB_TAG=bare exec bash benchmarks/twentyfirst_ab.sh
