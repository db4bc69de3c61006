"""What one stack line means to npu_flashrl: the `StackLine` base every line module subclasses.

A line is a frozen object (one per supported vllm-ascend release, `current()` picks the installed
one) holding:
- what it was tested with: the vllm-ascend release (`name`), vLLM, verl and how verl drives the
  rollout (`verl_mode`: "sync" in-process, "server" bucketed IPC syncs);
- where vllm-ascend keeps the classes npu_flashrl drives (`quant_config`, the W8A8 schemes, the
  fused-MoE scheme) and the layout rules: when a layer counts as processed (`is_processed`), how
  NZ is switched (`nz`), the derived tensors kept consistent after an in-place write
  (`commit_extras`, `commit_moe_extras`, `refresh_static`, `fold_checkpoint_bias`), what runs once
  (`process_once`);
- its patches, as `patches.Patch` objects (`patches(bodies)`, names in `PATCHES`);
- facts the CPU simulation needs about the same upstream code (`npu_flashrl.sim` reads them; they
  are data here so that no module outside `lines/` names a version).

Behaviour shared by every line is written here once; a line module overrides what differs.
Importing a line is cheap (no torch, no upstream): detection runs in `verify` and recipes too.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Mapping, Optional, Protocol, Tuple

from npu_flashrl import patches
from npu_flashrl.marks import marked

_Q = "vllm_ascend.quantization"
# Where vLLM's model loader looks things up; the same names on every supported vLLM.
GET_QUANT_CONFIG_TARGET = "vllm.model_executor.model_loader.weight_utils:get_quant_config"
INITIALIZE_MODEL_TARGET = "vllm.model_executor.model_loader.base_loader:initialize_model"
PWAL = "process_weights_after_loading"
# Set by the INT8 loader attach (adapters.vllm_ascend.hooks) on every module of the policy
# rollout's model: the run-once guard acts on those only; any other engine's layers get upstream's
# post-processing unchanged.
POLICY_ATTR = "_npu_flashrl_policy"


def resolve(path: str):
    """The object at "module:attr" (imports the module)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class PatchBodies(Protocol):
    """The patch bodies a line's shared patches wrap upstream with; the vllm-ascend adapter's
    `hooks` module is one (passed in, so this layer imports no adapter)."""

    def redirect(self, original, quant_config_class: Callable[[], type]): ...

    def override(self, original): ...

    def attach_on_init(self, original): ...


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)  # eq=False: hashable by identity (dict fields)
class StackLine:
    """One supported stack line. Subclasses set the data fields' defaults and override rules."""
    vllm_ascend: str      # the vllm-ascend release
    vllm: str             # the vLLM release it is built against
    verl: str             # the verl release / commit tested with it
    verl_mode: str        # how verl drives the rollout: "sync" or "server"
    label: str            # the line's one name for users, pins.yaml, the recipes and the CPU test
    #                       stack ("pinned", "0.11", "current"); releases are the fields above
    layout: str           # quantization package layout family (lines sharing files share it)
    quant_config: str     # "module:Class" of the "ascend" QuantizationConfig
    linear_method: str    # "module:Class" wrapping a scheme for vLLM's LinearBase
    static_method: str    # W8A8 (static activations) linear scheme
    dynamic_method: str   # W8A8_DYNAMIC linear scheme
    nz: str               # how the NZ cast of int8 weights is switched: "always",
    #                       "utils_flag" (utils._ENABLE_NZ), "weight_nz_mode"
    #                       (get_ascend_config().weight_nz_mode, env VLLM_ASCEND_ENABLE_NZ)
    attention: str        # "module:Class" of vLLM's Attention layer
    compile_mode: bool    # vLLM's CompilationConfig takes `mode=`, not `level=`
    # A source tree (no distribution metadata) is this line when all of `tree_has` and none of
    # `tree_lacks` exist under vllm_ascend/quantization/ (no single file decides).
    tree_has: Tuple[str, ...] = ()
    tree_lacks: Tuple[str, ...] = ()
    # --- facts the CPU simulation reads (npu_flashrl.sim.ascend_harness), by line
    moe_layers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #   {vLLM layer name: "module:Class"} vllm-ascend's platform swaps in for MoE layers
    moe_comm_selection: str = "model_runner"
    #   who picks the MoE comm method: "forward_context" (set_ascend_forward_context itself) or
    #   "model_runner" (NPUModelRunner._select_moe_comm_method, passed as moe_comm_type=)
    cpu_moe_forward_unsupported: Optional[str] = None  # why the CPU harness cannot run a MoE forward
    device_neutral_ops: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #   {qualified op: "module:function"} NPU-only custom ops whose bodies are plain torch
    per_model_caches: Tuple[str, ...] = ()  # vllm_ascend.utils globals caching "the" model's facts
    hccl_token_dispatchers: Tuple[str, ...] = ()  # "module:Class" built with HCCL names
    moe_fusion_flag: Optional[str] = None
    #   "comm-method module:attribute" of the all-gather comm method's fused gmm+swiglu switch
    quant_method_map: str = ""  # "module:ATTR" of the table W8A8 scheme classes are picked from
    weight_prefetch: bool = False  # the static scheme needs utils.set_weight_prefetch_method
    refused_architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #   {HF architecture: why} the INT8 rollout refuses on this line (setup / verify / engine build)
    source: str = ""      # how the line was recognised (for `verify` / error messages)
    # what the CPU emulation must stand in for: torchair only where this vllm-ascend imports it
    # unguarded (elsewhere `import torchair` fails as on an NPU host without it)
    emulated_packages: Tuple[str, ...] = ("torch_npu",)

    # patch names, the same on every line (their targets and bodies are the line's)
    PATCH_DYNAMIC = "ascend_w8a8_dynamic_process_once"
    PATCH_STATIC = "ascend_w8a8_static_process_once"
    PATCH_MOE = "ascend_w8a8_dynamic_moe_process_once"
    PATCH_DESCRIPTION = "ascend_quant_description"
    PATCH_OVERRIDE = "ascend_claims_compressed_tensors"
    PATCH_ATTACH = "model_loader_int8_load_weights"
    PATCHES = (PATCH_DYNAMIC, PATCH_STATIC, PATCH_MOE, PATCH_DESCRIPTION, PATCH_OVERRIDE,
               PATCH_ATTACH)

    # ------------------------------------------------------------------ naming
    @property
    def name(self) -> str:
        return self.vllm_ascend

    @property
    def moe_method(self) -> str:
        """W8A8_DYNAMIC fused-MoE scheme: next to the linear one on every supported line."""
        return self.dynamic_method.partition(":")[0] + ":AscendW8A8DynamicFusedMoEMethod"

    @property
    def override_target(self) -> str:
        return self.quant_config + ".override_quantization_method"

    def architecture_refusal(self, name: Optional[str]) -> Optional[str]:
        """Why this line refuses an INT8 rollout of architecture `name` (None: not refused)."""
        why = self.refused_architectures.get(name or "")
        return f"{name} INT8 rollouts are refused on the {self.label} line ({self.describe()}): {why}" \
            if why else None

    def describe(self) -> str:
        """One line for `verify` and logs: what this line is and was tested with."""
        return (f"vllm-ascend {self.vllm_ascend} line (vllm {self.vllm}, verl {self.verl} "
                f"{self.verl_mode} mode)")

    def matches_tree(self, quant_dir: str) -> bool:
        import os

        return bool(self.tree_has) and \
            all(os.path.exists(os.path.join(quant_dir, f)) for f in self.tree_has) and \
            not any(os.path.exists(os.path.join(quant_dir, f)) for f in self.tree_lacks)

    # ------------------------------------------------------------------ classes
    def import_quantization(self):
        """Import vllm-ascend's quantization config module (it registers the "ascend" method with
        vLLM), the way vllm-ascend itself starts: the config module first (importing the W8A8
        methods first hits a circular import through vllm_ascend.ops on some lines)."""
        return importlib.import_module(self.quant_config.partition(":")[0])

    def quant_config_class(self) -> type:
        self.import_quantization()
        return resolve(self.quant_config)

    def quant_method_classes(self) -> Tuple[type, type, type]:
        """(AscendLinearMethod, W8A8 static scheme, W8A8_DYNAMIC scheme)."""
        self.import_quantization()
        return resolve(self.linear_method), resolve(self.static_method), resolve(self.dynamic_method)

    def moe_method_class(self) -> type:
        """vllm-ascend's W8A8_DYNAMIC fused-MoE scheme."""
        self.import_quantization()
        return resolve(self.moe_method)

    def method_classes(self) -> Tuple[type, type]:
        """(static, dynamic) W8A8 linear scheme classes the reload targets."""
        _, static_cls, dynamic_cls = self.quant_method_classes()
        return static_cls, dynamic_cls

    def linear_wrapper_class(self) -> type:
        """vllm-ascend's LinearMethodBase adapter; `layer.quant_method.quant_method` is the scheme."""
        return self.quant_method_classes()[0]

    def unsupported_reason(self, inner) -> str:
        """Why the online reload cannot serve a vllm-ascend linear scheme other than W8A8 /
        W8A8_DYNAMIC."""
        return (f"{type(inner).__name__} is not a W8A8 scheme npu_flashrl can reload (supported: "
                "AscendW8A8LinearMethod, AscendW8A8DynamicLinearMethod); float weights pushed into "
                "it would be truncated")

    # ------------------------------------------------------------------ vLLM
    def vllm_config_in_build(self):
        """The vLLM config current while a model is built (`set_current_vllm_config`). This
        line's vLLM answers a default config, with a WARNING, when none is set."""
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()

    # ------------------------------------------------------------------ layout rules
    def is_processed(self, layer) -> bool:
        """The layer holds post-processed tensors (marked by the run-once guard)."""
        return marked(layer, "_npu_flashrl_processed")

    def layerwise_reload_active(self, model) -> bool:
        """vLLM's own layerwise reload of `model` is under way (begun, not yet finalized): what
        `load_weights` gets meanwhile is vLLM's to load, not a weight sync. No layerwise reload
        on this line."""
        return False

    def commit_extras(self, layer) -> None:
        """After a new weight_scale was written: the copies vllm-ascend derives from it."""
        from npu_flashrl.lines import derived

        derived.commit_extras(layer)

    def commit_moe_extras(self, layer) -> None:
        """After new expert scales were written: what the fused-MoE scheme derives from them."""
        from npu_flashrl.lines import derived

        derived.commit_moe_extras(layer)

    def refresh_static(self, layer) -> None:
        """Static W8A8 after a new weight scale / bias: the derived deq_scale and quant_bias."""
        from npu_flashrl.lines import derived

        derived.refresh_static(layer)

    def fold_checkpoint_bias(self, layer) -> None:
        """Static W8A8 at its first post-processing: a checkpoint's float bias into quant_bias."""
        from npu_flashrl.lines import derived

        derived.fold_checkpoint_bias(layer)

    def process_once(self, original, after: Optional[Callable] = None):
        """`original` (a scheme's process_weights_after_loading) run once per layer: upstream
        transposes and re-allocates on every call, so a second call would corrupt the layer;
        afterwards the layer is marked (its layout is now [in, out]) and `after(layer)` ran."""
        def process_weights_after_loading(scheme, layer):
            if not marked(layer, POLICY_ATTR):
                return original(scheme, layer)  # not the policy rollout's: upstream's behaviour
            if marked(layer, "_npu_flashrl_processed"):
                return
            original(scheme, layer)
            if after is not None:
                after(layer)
            layer._npu_flashrl_processed = True
        return process_weights_after_loading

    # ------------------------------------------------------------------ patches
    # why each run-once patch exists on this line (shown by `npu-flashrl verify`)
    WHY_DYNAMIC = "post-processing runs once per layer and marks its [in,out] layout"
    WHY_STATIC = "post-processing runs once per layer; float bias folded into quant_bias"
    WHY_MOE = "fused-MoE post-processing runs once per layer (a second run re-transposes the experts)"

    def _prepare_schemes(self) -> None:
        """What to import before a scheme's method is replaced."""
        self.import_quantization()

    def _once_patch(self, name: str, scheme: str, why: str, after=None) -> patches.Patch:
        target = f"{scheme}.{PWAL}"

        def apply() -> None:
            self._prepare_schemes()
            patches.replace(target, lambda orig: self.process_once(orig, after=after))
        return patches.Patch(name, target, f"vllm-ascend {self.vllm_ascend}", apply, why,
                             lines=(self.name,))

    def patches(self, bodies: PatchBodies) -> Tuple[patches.Patch, ...]:
        """This line's patches (names: `PATCHES`), not yet registered: the three run-once guards
        on its scheme classes, and the patches with line-neutral `bodies` on its targets (the
        quant-description redirect, the compressed-tensors override, the INT8 loader attached at
        model build)."""
        ascend, vllm = f"vllm-ascend {self.vllm_ascend}", f"vllm {self.vllm}"
        mine = (self.name,)

        def apply_redirect() -> None:
            self.import_quantization()
            patches.replace(GET_QUANT_CONFIG_TARGET,
                            lambda orig: bodies.redirect(orig, self.quant_config_class))

        def apply_override() -> None:
            self.import_quantization()
            patches.replace(self.override_target, bodies.override)

        def apply_attach() -> None:
            patches.replace(INITIALIZE_MODEL_TARGET, bodies.attach_on_init)

        return (
            self._once_patch(self.PATCH_DYNAMIC, self.dynamic_method, self.WHY_DYNAMIC),
            self._once_patch(self.PATCH_STATIC, self.static_method, self.WHY_STATIC,
                             after=self.fold_checkpoint_bias),
            self._once_patch(self.PATCH_MOE, self.moe_method, self.WHY_MOE),
            patches.Patch(self.PATCH_DESCRIPTION, GET_QUANT_CONFIG_TARGET, vllm, apply_redirect,
                          "the policy engine's bf16 and compressed-tensors w8a8 checkpoints load "
                          "on vllm-ascend W8A8_DYNAMIC", lines=mine),
            patches.Patch(self.PATCH_OVERRIDE, self.override_target, ascend, apply_override,
                          "the policy engine's compressed-tensors w8a8 checkpoint goes to 'ascend' "
                          "on any platform that runs it (other engines: vllm-ascend's own method)",
                          lines=mine),
            patches.Patch(self.PATCH_ATTACH, INITIALIZE_MODEL_TARGET, vllm, apply_attach,
                          "the policy rollout's INT8 model gets the online-quantizing load_weights",
                          lines=mine),
        )
