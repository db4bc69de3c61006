"""The `npu-flashrl rehearse` options, and their checks before anything starts (one place)."""
from __future__ import annotations

import os

from npu_flashrl.rehearsal.common import (DEFAULT_BASELINE_TOL, DEFAULT_MAX_LAYER_ERROR, DEFAULT_MAX_W4A8_ERROR,
                                          DEFAULT_MAX_W4A8_LAYER_ERROR, DEFAULT_OUTPUT_DIR, MOE_BASELINE_TOL,
                                          TINY_TRAIN, RehearsalError)

HELP = ("rehearse the INT8 rollout end to end (default: a tiny Qwen2 trained for a few seconds; "
        "CPU with emulated torch_npu, or --device npu [not verified on hardware]) and report the "
        "rollout-vs-trainer mismatch per simulated training step, the INT8 state after every sync and "
        "each quantized layer's output error; non-zero exit when a check fails")


# The largest --seed: int32, so that the offsets the run adds (seed + 999, ...) stay below numpy's
# and torch's seed limits (2**32 - 1, 2**64 - 1); a huge seed ended in a raw OverflowError.
MAX_SEED = 2**31 - 1


def _number(kind, lo, lo_ok=True, hi=None):
    """argparse type: a finite `kind` >= lo (> lo when not lo_ok) and <= hi when given; bad values are
    usage errors (exit 2) before anything runs, not a failure at the end of a long run (`--max-error nan`)."""
    import argparse
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < lo or (value == lo and not lo_ok):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number {'>=' if lo_ok else '>'} {lo}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"{text!r}: expected at most {hi}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


# torch.set_num_threads(100000) crashes the process (SIGSEGV in the OpenMP runtime); more threads
# than a few per CPU only spin.
MAX_THREADS = max(64, 4 * (os.cpu_count() or 1))


# the built-in tiny model's families (`sim.tiny_models`): the first is the default
TINY_ARCHS = ("qwen2", "llama", "deepseek_v3")


def add_arguments(p) -> None:
    p.add_argument("--model", metavar="DIR",
                   help="a local bf16/fp16 HF safetensors checkpoint of a dense Qwen2/Llama-style decoder or "
                        "a Qwen3-MoE (fused-MoE experts checked per expert; --mode profile-free only) "
                        "(default: the built-in tiny Qwen2, pre-trained on a synthetic task and cached)")
    p.add_argument("--arch", choices=TINY_ARCHS, default=TINY_ARCHS[0],
                   help="the built-in tiny model's family: qwen2 (default), llama (Llama 3.x: no bias, "
                        "llama3 rope scaling, untied as the 8B / 70B) or deepseek_v3 (MLA attention, a dense first "
                        "layer, MoE layers with shared experts and sigmoid grouped routing; --mode profile-free; "
                        "current line). Not offered: the vision-language models (see docs/compatibility.md, "
                        "Architectures)")
    p.add_argument("--mode", choices=("profile-free", "profile"), default="profile-free",
                   help="profile-free: fn=int8_profile_free (fresh per-channel scales every sync); "
                        "profile: fn=int8 with a FlashRL profile (a w8a8 checkpoint is written from the "
                        "bf16 one unless --w8a8 is given, then `npu-flashrl profile`). Default profile-free")
    p.add_argument("--w8a8", metavar="DIR", help="--mode profile: an existing compressed-tensors w8a8 "
                   "checkpoint of --model (else one is written)")
    p.add_argument("--device", choices=("auto", "cpu", "npu"), default="auto",
                   help="npu: real torch_npu/CANN, no emulation (NOT VERIFIED ON HARDWARE); cpu: emulated "
                        "torch_npu kernels; auto (default): npu when torch_npu works, else cpu")
    p.add_argument("--steps", type=_number(int, 1), default=None,
                   help="simulated training steps (weight syncs); default 4 (--grpo: GRPO steps per run, default "
                        "6, --quick 4)")
    p.add_argument("--buckets", type=_number(int, 1), default=4,
                   help="each sync arrives in (about) this many buckets, the weights in a shuffled order; "
                        "default 4")
    p.add_argument("--transport", choices=("auto", "verl", "direct"), default="auto",
                   help="how the syncs reach the rollout model: verl = verl's real bucketed sender (own "
                        "process) and receiver update_weights_from_ipc over shared memory (verl's "
                        "server mode); direct = load_weights per bucket in process (verl's "
                        "sync mode); auto (default): verl on a line whose verl runs in server "
                        "mode (current), else direct")
    p.add_argument("--inner-iters", type=_number(int, 1), default=None,
                   help="AdamW iterations on the synthetic task per simulated step; default 2")
    p.add_argument("--step-lr", type=_number(float, 0, lo_ok=False), default=None,
                   help="AdamW learning rate of the simulated steps (default 5e-4 for the tiny model, "
                        "1e-5 for --model)")
    p.add_argument("--num-seqs", type=_number(int, 1), default=None, help="evaluation sequences; default 16")
    p.add_argument("--seq-len", type=_number(int, 2), default=None, help="tokens per evaluation sequence; default 48")
    p.add_argument("--train-iters", type=_number(int, 1), default=TINY_TRAIN["iters"],
                   help=f"pre-training iterations of the tiny model; default {TINY_TRAIN['iters']}")
    p.add_argument("--no-fp32-head", action="store_true",
                   help="skip the INT8 + FP32 lm-head variant")
    p.add_argument("--w4a8", action="store_true",
                   help="also rehearse a W4A8 rollout (fn w4a8_profile_free: vllm-ascend W4A8_DYNAMIC linear "
                        "layers, int4 weights in groups) beside INT8: its mismatch, its state after every sync "
                        "(equal to a fresh W4A8 load) and each layer's output error; with --grpo the variants "
                        "w4a8 and w4a8+tis (and with --positive-control its W4A8 setting). A Qwen3-MoE --model: "
                        "its experts W4A8_DYNAMIC fused-MoE layers too (group size 256, the A8W4 grouped "
                        "matmul's, which every projection's input size must be a multiple of); "
                        "a model with linear biases (Qwen2's q/k/v) relies on npu_flashrl's patch "
                        "ascend_w4a8_dynamic_linear_bias (vllm-ascend's W4A8 linear apply drops the bias; "
                        "docs/w4a8.md), which the forward check verifies")
    p.add_argument("--group-size", type=_number(int, 1), default=None,
                   help="the W4A8 variant's group size (input channels per int4 scale); default the largest "
                        "power of two <= 256 (vllm-ascend's default) dividing every projection's input size")
    p.add_argument("--max-w4a8-error", type=_number(float, 1.0), default=None,
                   help=f"fail when the W4A8 token_mult_prob_error exceeds this; default {DEFAULT_MAX_W4A8_ERROR}")
    p.add_argument("--max-w4a8-layer-error", type=_number(float, 0.0, lo_ok=False),
                   default=None,  # None: not given (refused without --w4a8); check_arguments fills the default
                   help="--max-layer-error for the W4A8 variant's layers; default "
                        f"{DEFAULT_MAX_W4A8_LAYER_ERROR} (int4 in groups is coarser than INT8's per-channel int8)")
    p.add_argument("--max-error", type=_number(float, 1.0), default=None,
                   help="fail when an INT8 token_mult_prob_error exceeds this; default 1.05")
    p.add_argument("--max-layer-error", type=_number(float, 0.0, lo_ok=False), default=DEFAULT_MAX_LAYER_ERROR,
                   help="fail when a quantized linear's output on fixed random activations differs from its "
                        "bf16 counterpart by more than this (relative Frobenius norm); default "
                        f"{DEFAULT_MAX_LAYER_ERROR} (INT8 per-channel/per-token is ~1%%, a broken layer 10-100%%)")
    p.add_argument("--baseline-tol", type=_number(float, 0.0), default=None,
                   help=f"fail when the bf16 baseline's token_mult_prob_error exceeds 1 + this; default "
                        f"{DEFAULT_BASELINE_TOL} (bf16 vLLM and bf16 transformers differ only by kernel rounding), "
                        f"{MOE_BASELINE_TOL} for a MoE --model (the same rounding also flips the top-k of tokens "
                        "whose router logits nearly tie: those tokens take other experts)")
    p.add_argument("--seed", type=_number(int, 0, hi=MAX_SEED), default=0,
                   help=f"seed of pre-training, steps and data, 0 to {MAX_SEED}; default 0")
    p.add_argument("--threads", type=_number(int, 1, hi=MAX_THREADS), default=None,
                   help="torch CPU threads, at most %(max)d here (default 1 on CPU: these tiny ops are "
                        "latency-bound and several threads spin against each other on a busy machine)"
                        % {"max": MAX_THREADS})
    p.add_argument("--cache-dir", default=None,
                   help="where the pre-trained tiny model is cached (default $XDG_CACHE_HOME or "
                        "~/.cache, /npu_flashrl/rehearsal)")
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                   help=f"report.json, mismatch.png and the work files; default ./{DEFAULT_OUTPUT_DIR}")
    p.add_argument("--no-plot", action="store_true", help="do not write mismatch.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="keep npu_flashrl/vLLM INFO logging")
    g = p.add_argument_group("GRPO (--grpo)")
    g.add_argument("--grpo", action="store_true",
                   help="instead of the weight-path rehearsal: GRPO on a task with a verifiable reward, rollouts "
                        "sampled from the bf16 / INT8 / INT8+fp32-head rollout models, verl's own GRPO advantage, "
                        "TIS and policy loss; variants bf16, int8, int8+tis, int8+tis+fp32head; writes grpo.png; "
                        "fails unless bf16 learns, int8+tis trains like it (paired over seeds) and each negative "
                        "control fails its check (within 5 min of CPU time on 2 cores)")
    g.add_argument("--quick", action="store_true", help="--grpo: the CI size (4 seeds x 4 steps)")
    g.add_argument("--seeds", type=_number(int, 1), default=None,
                   help="--grpo: runs per variant (default 5, --quick 4)")
    g.add_argument("--no-controls", action="store_true",
                   help="--grpo: skip the negative controls and the power probe (the run then shows no check able "
                        "to fail, and its detectable differences hold only when nothing is wrong)")
    g.add_argument("--positive-control", action="store_true",
                   help="--grpo: also run the positive control's settings (npu_flashrl/rehearsal/grpo/positive.py: "
                        "a rollout far enough from the trainer that int8 without TIS trains worse, and one where "
                        "TIS hurts) and report int8 - bf16, int8+tis - int8 and the recovered fraction on the "
                        "held-out score; with --quick at a size that exercises it only")


# Options of the weight-path rehearsal only, with their defaults there: `None` on the command line
# means "not given", so --grpo can refuse them instead of ignoring them (a --max-error that --grpo
# ignored read as a passed limit).
WEIGHT_PATH_ONLY = {
    "max_error": ("--max-error", 1.05, "the INT8 token_mult_prob_error limit of the weight-path checks"),
    "baseline_tol": ("--baseline-tol", None, "the bf16 baseline's token_mult_prob_error limit"),
    "num_seqs": ("--num-seqs", 16, "the evaluation sequences of the weight-path checks"),
    "seq_len": ("--seq-len", 48, "the evaluation sequences' length"),
    "inner_iters": ("--inner-iters", 2, "the AdamW iterations per simulated step"),
    "max_w4a8_error": ("--max-w4a8-error", DEFAULT_MAX_W4A8_ERROR, "the W4A8 token_mult_prob_error limit"),
}
GRPO_CHECKS = ("--grpo checks its own results (bf16 learns, int8+tis trains like it paired over seeds, each "
               "negative control fails its check; sizes from --quick / "
               "--steps / --seeds) and the INT8 state after every sync (--max-layer-error)")


def check_arguments(args) -> None:
    """Refuse option combinations and values before anything process-global happens."""
    if not getattr(args, "w4a8", False):  # the W4A8 variant's options, without it, would be ignored
        for attr, flag in (("group_size", "--group-size"), ("max_w4a8_error", "--max-w4a8-error"),
                           ("max_w4a8_layer_error", "--max-w4a8-layer-error")):
            if getattr(args, attr, None) is not None:
                raise RehearsalError(f"{flag} {getattr(args, attr)} is the W4A8 variant's: add --w4a8, or drop it")
    if getattr(args, "max_w4a8_layer_error", None) is None:
        args.max_w4a8_layer_error = DEFAULT_MAX_W4A8_LAYER_ERROR
    grpo = getattr(args, "grpo", False)
    if grpo:
        for attr, (flag, _, what) in WEIGHT_PATH_ONLY.items():
            value = getattr(args, attr, None)
            if value is not None:
                raise RehearsalError(f"{flag} {value}: not a --grpo option ({what}, the rehearsal without "
                                     f"--grpo); {GRPO_CHECKS}. Drop {flag}, or run without --grpo", code=2)
    else:
        for flag, value in (("--quick", getattr(args, "quick", False)), ("--seeds", getattr(args, "seeds", None)),
                            ("--no-controls", getattr(args, "no_controls", False)),
                            ("--positive-control", getattr(args, "positive_control", False))):
            if value:
                raise RehearsalError(f"{flag} is a --grpo option")
        if args.steps is None:
            args.steps = 4
        for attr, (_, default, _) in WEIGHT_PATH_ONLY.items():
            if getattr(args, attr, None) is None:
                setattr(args, attr, default)
    arch = getattr(args, "arch", TINY_ARCHS[0])
    if arch != TINY_ARCHS[0] and getattr(args, "model", None) is not None:
        raise RehearsalError(f"--arch {arch} picks the built-in tiny model; --model {args.model} brings its own")
    if args.mode != "profile" and args.w8a8:
        raise RehearsalError("--w8a8 is only used with --mode profile")
    if args.w8a8 and not os.path.isdir(args.w8a8):
        raise RehearsalError(f"--w8a8 {args.w8a8}: no such directory")
    for flag, value, lo in (("--steps", args.steps, 1), ("--buckets", args.buckets, 1),
                            ("--num-seqs", args.num_seqs, 1), ("--seq-len", args.seq_len, 2),
                            ("--inner-iters", args.inner_iters, 1), ("--train-iters", args.train_iters, 1)):
        if value is not None and value < lo:
            raise RehearsalError(f"{flag} must be >= {lo}, got {value}")
    from npu_flashrl.config import output_path_problem

    for flag, where in (("--output-dir", args.output_dir), ("--cache-dir", args.cache_dir)):
        problem = where and output_path_problem(os.path.join(os.path.expanduser(where), "probe"))
        if problem:  # found now, not after pre-training
            raise RehearsalError(f"{flag} {where}: cannot be used as a directory ({problem})")
    if not (args.max_layer_error > 0 and args.max_layer_error < float("inf")):
        raise RehearsalError(f"--max-layer-error must be a finite number > 0, got {args.max_layer_error}")


def check_seq_len(args, model_cfg) -> None:
    """--seq-len within the model's positions (the rollout's rotary table has max_position_embeddings
    rows; a longer sequence was a raw IndexError deep in the forward)."""
    if model_cfg is None:
        from npu_flashrl.sim.tiny_models import TINY_QWEN2

        positions, what = TINY_QWEN2["max_position_embeddings"], "the built-in tiny model"
    else:
        positions = model_cfg.get("max_position_embeddings")
        if isinstance(model_cfg.get("text_config"), dict) and positions is None:
            positions = model_cfg["text_config"].get("max_position_embeddings")
        what = f"--model {args.model}"
    if getattr(args, "model", None) is None:
        what = "the built-in tiny model"
    if isinstance(positions, int) and args.seq_len > positions:
        raise RehearsalError(f"--seq-len {args.seq_len}: longer than the {positions} positions of {what} "
                             f"(max_position_embeddings); use --seq-len {positions} or less")
