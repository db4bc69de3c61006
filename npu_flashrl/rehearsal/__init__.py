"""`npu-flashrl rehearse`: the whole INT8 rollout pipeline end to end, without an NPU.

What one run does (each phase with a progress bar):

1. **Model.** By default a tiny Qwen2 (hidden 128, 2 layers, GQA, q/k/v bias, vocab 512) built
   offline and pre-trained for a few seconds (plain torch AdamW, CPU) on a synthetic Markov-chain
   task (`npu_flashrl.sim.synthetic_task`) so that its next-token distributions are peaked like a
   real LM's: a random-init model has near-uniform logits and hides INT8 error. The trained
   checkpoint is cached (`--cache-dir`, default ``~/.cache/npu_flashrl/rehearsal/<hash of the
   settings>``); a second run skips training. `--model DIR` uses a local dense Qwen2/Llama-style
   safetensors checkpoint instead, or a Qwen3-MoE (its weights pushed per expert as verl's trainer
   sends them, its fused-MoE experts checked per expert: `state_moe.py`).
2. **Setup, as a user does it.** `npu-flashrl profile` (``--mode profile``: on a compressed-tensors
   w8a8 checkpoint written from the bf16 one, or ``--w8a8 DIR``) and `npu-flashrl setup` (their
   library functions, `npu_flashrl.commands`) write a FlashRL config; `npu_flashrl.activate(config)` applies the patches; the config entry is applied
   to a real `vllm.engine.arg_utils.EngineArgs` by the engine adapter (`apply_entry`), which picks the
   rollout checkpoint, `quantization="ascend"` and the online quantizer (profile loaded).
3. **Rollout models**, built by vLLM's own loader through the real vLLM + vllm-ascend code (vLLM
   attention replaced by plain causal attention; on CPU the torch_npu kernels are the project's
   reference kernels): ``bf16`` (unquantized, the noise floor), ``int8`` (vllm-ascend W8A8_DYNAMIC
   layers with npu_flashrl's online-quantizing loader) and ``int8+fp32head`` (the same with
   FLASHRL_LMHEAD_FP32's lm head in fp32; the trainer computes its logits in fp32 too).
4. **K simulated training steps** (`--steps`): a few real AdamW iterations on the fp32 master weights
   per step; the bf16 weights (what an FSDP trainer with param_dtype bf16 holds and syncs) are pushed
   into each rollout model in a shuffled order, in about `--buckets` buckets, timed, through the
   transport of the installed line (`--transport`, `transport.py`): on the current line, that verl's
   real `BucketedWeightSender` (own process) and `update_weights_from_ipc` over shared memory, with
   npu_flashrl's server-mode patches (which end every INT8 sync); on the sync-mode verl lines (pinned, lines.v0_11_0)
   `load_weights` per bucket, then `end_weight_sync` for INT8 (verl sync mode).
5. **Metrics** after each step on a fixed set of task sequences, teacher-forced: rollout log-probs =
   log-softmax of the vLLM model's logits at the target tokens; trainer log-probs = the transformers
   model in bf16 with the same weights; `npu_flashrl.metrics.mismatch_metrics` between them.

6. **INT8 state and per-layer error** after every INT8 sync (`state.py`): each quantized layer read
   back (NZ to ND on the device) against `kernels.reference` applied on the CPU to the pushed
   weights (int8 values, scales, derived copies, data pointers since the cold load), and each
   quantized linear's output on fixed random activations against its bf16 counterpart.

Output: a per-step table, a per-layer-type table and the patch summary on stdout, ``report.json``
(atomic) and ``mismatch.png`` (when matplotlib is installed) in `--output-dir`. Exit code 1 when a
check fails (`checks.py`; each failing check names the layer and the number): INT8 state not equal
to the reference quantization, a layer's output error above `--max-layer-error`, INT8
token_mult_prob_error above `--max-error`, the bf16 baseline not within `--baseline-tol` of 1.0,
INT8 not above the baseline (quantization not in the path), non-finite metrics. So it is an
installation check; with `--device npu` the hardware check of the kernels and the in-place reload
(not verified on hardware here).

Modules: `arguments` (options, checked once), `device` (device / environment), `model` (tiny /
--model), `trainer` (trainer side), `rollout` (rollout side), `state` (+ `state_moe`: fused-MoE
experts) and `checks` (the verdict), `output`, `user_setup` (profile / setup / activate through
their library functions, `npu_flashrl.commands`), `transport` (how syncs reach the rollout), `main`
(the run, one function per phase). The test seam that injects faults is part of the simulation:
`npu_flashrl.sim.faults`. `grpo` (`--grpo`): GRPO on the rollout models with verl's own advantage,
TIS and policy-loss code.

Process-global state: vLLM's process group, the torch_npu emulation and npu_flashrl's patches stay
in the process after `run()` (the FP32 lm-head patches included), and so does verl's sender process
(reused by a later run in the same process, closed at exit); run it in its own process.
"""
from __future__ import annotations

from npu_flashrl.rehearsal.arguments import HELP, add_arguments, check_arguments  # noqa: F401
from npu_flashrl.rehearsal.main import run  # noqa: F401
