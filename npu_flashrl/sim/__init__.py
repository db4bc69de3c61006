"""The CPU simulation of an Ascend NPU stack, shipped for NPU-free CI (ours and users'): tiny
offline models and checkpoint writers, the harness that runs real vLLM / vllm-ascend models on a
CPU (emulated torch_npu kernels, HCCL stand-ins), verl's weight transfer in a process of its own.

Fenced off: runtime code (adapters, quant, kernels, lines, config, activation, plugin, patches)
never imports this package (tests/deploy/test_import_structure.py checks it); the rehearsal and the
benchmarks, which drive the simulation on purpose, do."""
