"""What one stack line means to npu_flashrl: the `StackLine` base every line module subclasses.

A line is a frozen object (one per supported vllm-ascend release, `current()` picks the installed
one) holding:
- what it was tested with: the vllm-ascend release (`name`), vLLM, verl and how verl drives the
  rollout (`verl_mode`: "sync" in-process, "server" bucketed IPC syncs);
- where vllm-ascend keeps the classes npu_flashrl drives (`quant_config`, the linear wrapper) and
  the table its scheme classes are picked from by (quant type, layer type) (`quant_method_map`,
  read by `method_class`: the reload's schemes ask it, no scheme class is named here), the layout
  rules: when a layer counts as processed (`is_processed`), how
  NZ is switched (`nz`), the derived tensors kept consistent after an in-place write
  (`commit_extras`, `commit_moe_extras`, `refresh_static`, `fold_checkpoint_bias`), what runs once
  (`process_once`);
- its patches, as `patches.Patch` objects (`patches(bodies)`, names in `PATCHES`), and the
  run-once patch of any scheme class its table has (`once_patch`, one per registered scheme);
- facts the CPU simulation needs about the same upstream code, in one sub-object read only by
  `npu_flashrl.sim` (`sim`, a `SimFacts`; data here so that no module outside `lines/` names a
  version).

Behaviour shared by every line is written here once; a line module overrides what differs.
Importing a line is cheap (no torch, no upstream): detection runs in `verify` and recipes too.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Callable, Mapping, Optional, Protocol, Sequence, Tuple

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
# Set by the run-once guard on a layer whose post-processing ran (its layout is now [in, out]).
PROCESSED_ATTR = "_npu_flashrl_processed"
# Set on the policy rollout's model by the attach (adapters.vllm_ascend.reload): its weight sync.
SYNC_ATTR = "_npu_flashrl_loader"


def resolve(path: str):
    """The object at "module:attr" (imports the module)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class SimFacts:
    """What the CPU simulation (`npu_flashrl.sim`) needs to know about a line's upstream code; no
    runtime module reads it."""
    attention: str        # "module:Class" of vLLM's Attention layer
    compile_mode: bool    # vLLM's CompilationConfig takes `mode=`, not `level=`
    nz: str               # how the NZ cast of int8 weights is switched: "always",
    #                       "utils_flag" (utils._ENABLE_NZ), "weight_nz_mode"
    #                       (get_ascend_config().weight_nz_mode, env VLLM_ASCEND_ENABLE_NZ)
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
    weight_prefetch: bool = False  # the static scheme needs utils.set_weight_prefetch_method


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
    # A source tree (no distribution metadata) is this line when all of `tree_has` and none of
    # `tree_lacks` exist under vllm_ascend/quantization/ (no single file decides).
    tree_has: Tuple[str, ...] = ()
    tree_lacks: Tuple[str, ...] = ()
    # facts about the same upstream code that only the CPU simulation reads (`npu_flashrl.sim`)
    sim: "SimFacts"
    quant_method_map: str = ""
    #   "module:ATTR" of the table vllm-ascend picks its scheme classes from by (quant type, layer
    #   type): {(qt, lt): class} (0.23 `_SCHEME_REGISTRY`), {qt: {lt: class}} (0.11
    #   `ASCEND_QUANTIZATION_METHOD_MAP`) or {qt: quantizer class with build_<lt>_method}
    #   (v0.10.1rc1 `SUPPORT_ASCEND_QUANTIZER_TYPE`); `method_class` reads all three
    refused_architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #   {HF architecture: why} the INT8 rollout refuses on this line (setup / verify / engine build)
    source: str = ""      # how the line was recognised (for `verify` / error messages)
    # what the CPU emulation must stand in for: torchair only where this vllm-ascend imports it
    # unguarded (elsewhere `import torchair` fails as on an NPU host without it)
    emulated_packages: Tuple[str, ...] = ("torch_npu",)
    # what W4A8_DYNAMIC fused-MoE post-processing does to the transposed int4 experts before it
    # packs them (`w4a8_moe_weight_cast`): "maybe_trans_nz" (0.23: NZ as weight_nz_mode says),
    # "nz" (0.11: cast to FRACTAL_NZ unconditionally); None: its post-processing keeps another
    # processed layout (v0.10.1rc1: the fused scales in weight_scale_second), not reloaded here
    w4a8_moe_cast: Optional[str] = None

    # patch names, the same on every line (their targets and bodies are the line's); the run-once
    # patches of the schemes are named by the schemes (`once_patch`)
    PATCH_DESCRIPTION = "ascend_quant_description"
    PATCH_OVERRIDE = "ascend_claims_compressed_tensors"
    PATCH_ATTACH = "model_loader_int8_load_weights"
    PATCHES = (PATCH_DESCRIPTION, PATCH_OVERRIDE, PATCH_ATTACH)

    # ------------------------------------------------------------------ naming
    @property
    def name(self) -> str:
        return self.vllm_ascend

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

    def _method_table(self):
        """The line's scheme table (`quant_method_map`), with every scheme module imported (the
        table fills as they import)."""
        self.import_quantization()
        return resolve(self.quant_method_map)

    def method_class(self, quant_type: str, layer_type: str) -> Optional[type]:
        """vllm-ascend's scheme class for (quant type, layer type) on this line, read from its own
        table (None: this release has none). Read at every call: a table rewritten at run time
        (torchair graph mode's register) is seen as it is."""
        return table_entry(self._method_table(), quant_type, layer_type)

    def linear_wrapper_class(self) -> type:
        """vllm-ascend's LinearMethodBase adapter; `layer.quant_method.quant_method` is the scheme."""
        self.import_quantization()
        return resolve(self.linear_method)

    def refused_reason(self, inner) -> Optional[str]:
        """Why a layer whose scheme object is `inner` is refused even when its class is in the
        table (None: it is not); a line overrides it."""
        return None

    def unsupported_reason(self, inner, supported: Sequence[str] = ()) -> str:
        """Why the online reload cannot serve a vllm-ascend linear scheme no registered scheme
        claims (`supported`: the class names the registered schemes claim on this line)."""
        refused = self.refused_reason(inner)
        if refused is not None:
            return refused
        return (f"{type(inner).__name__} is not a scheme npu_flashrl can reload (supported: "
                f"{', '.join(supported) or 'none'}); float weights pushed into it would be truncated")

    # ------------------------------------------------------------------ vLLM
    def vllm_config_in_build(self):
        """The vLLM config current while a model is built (`set_current_vllm_config`). This
        line's vLLM answers a default config, with a WARNING, when none is set."""
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()

    # ------------------------------------------------------------------ layout rules
    def is_processed(self, layer) -> bool:
        """The layer holds post-processed tensors (marked by the run-once guard)."""
        return marked(layer, PROCESSED_ATTR)

    def layerwise_reload_active(self, model) -> bool:
        """vLLM's own layerwise reload of `model` is under way (begun, not yet finalized): what
        `load_weights` gets meanwhile is vLLM's to load, not a weight sync. No layerwise reload
        on this line."""
        return False

    def commit_extras(self, layer) -> None:
        """After a new weight_scale was written: the copies vllm-ascend derives from it."""
        from npu_flashrl.lines import derived

        derived.commit_extras(layer)

    def w4a8_moe_weight_cast(self, weight):
        """The transposed int4 experts (int8 [E, K, N]) as W4A8_DYNAMIC fused-MoE post-processing
        hands them to its `pack_to_int32` on this line (`w4a8_moe_cast`)."""
        if self.w4a8_moe_cast == "maybe_trans_nz":
            from vllm_ascend.utils import maybe_trans_nz

            return maybe_trans_nz(weight)
        if self.w4a8_moe_cast == "nz":
            import torch_npu  # the device's, or the emulation's on a CPU

            from npu_flashrl.kernels import ACL_FORMAT_FRACTAL_NZ

            return torch_npu.npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)
        raise NotImplementedError(f"vllm-ascend {self.vllm_ascend}: W4A8_DYNAMIC fused-MoE layers are "
                                  "not reloaded on this line (w4a8_moe_cast is None)")

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
            if marked(layer, PROCESSED_ATTR):
                return
            original(scheme, layer)
            if after is not None:
                after(layer)
            setattr(layer, PROCESSED_ATTR, True)
        return process_weights_after_loading

    # ------------------------------------------------------------------ patches
    # what the run-once patch adds on this line to a scheme's own reason (`verify` shows it)
    ONCE_NOTE = ""
    # AscendW4A8DynamicLinearMethod.apply calls npu_weight_quant_batchmatmul without the bias
    # vLLM's linear layer hands it (0.23.0 quantization/methods/w4a8.py, 0.11.0 and v0.10.1rc1
    # quantization/w4a8_dynamic.py; vllm-ascend PR #11371, open): a line whose apply adds the bias
    # itself sets False, and the W4A8 bias patch is then not declared there
    W4A8_LINEAR_DROPS_BIAS = True

    def _prepare_schemes(self) -> None:
        """What to import before a scheme's method is replaced."""
        self._method_table()

    def scheme_modules(self) -> Tuple[str, ...]:
        """The modules whose import fills the scheme table (`_prepare_schemes` imports them): a
        run-once patch armed by activation is applied once they are all imported."""
        return (self.quant_config.partition(":")[0], self.quant_method_map.partition(":")[0])

    def once_patch(self, name: str, quant_type: str, layer_type: str, why: str,
                   after: Optional[Callable] = None) -> patches.Patch:
        """The run-once patch (`process_once`) of the class this line's table has for (quant
        type, layer type): one per registered scheme, named by it. Declared without importing
        vllm-ascend (its target names the table entry); applied to the class the table holds."""
        return self.scheme_method_patch(name, quant_type, layer_type, PWAL,
                                        lambda orig: self.process_once(orig, after=after),
                                        why + self.ONCE_NOTE)

    def scheme_method_patch(self, name: str, quant_type: str, layer_type: str, attr: str,
                            wrap: Callable, why: str) -> patches.Patch:
        """A patch replacing method `attr` of the class this line's table has for (quant type,
        layer type) by `wrap(original)`. Declared without importing vllm-ascend (its target names
        the table entry); applied to the class the table holds."""
        target = f"{self.quant_method_map}[{quant_type!r}, {layer_type!r}].{attr}"

        def apply() -> None:
            self._prepare_schemes()
            cls = self.method_class(quant_type, layer_type)
            if cls is None:
                raise patches.PatchNotApplicable(
                    f"vllm-ascend {self.vllm_ascend} has no ({quant_type}, {layer_type}) scheme "
                    f"in {self.quant_method_map}")
            patches.replace(f"{cls.__module__}:{cls.__qualname__}.{attr}", wrap)
        return patches.Patch(name, target, f"vllm-ascend {self.vllm_ascend}", apply, why,
                             lines=(self.name,), when=self.scheme_modules())

    def patches(self, bodies: PatchBodies) -> Tuple[patches.Patch, ...]:
        """This line's patches (names: `PATCHES`), not yet registered: the patches with
        line-neutral `bodies` on its targets (the quant-description redirect, the
        compressed-tensors override, the INT8 loader attached at model build). The schemes'
        run-once patches are `once_patch`."""
        ascend, vllm = f"vllm-ascend {self.vllm_ascend}", f"vllm {self.vllm}"
        mine = (self.name,)

        def apply_redirect() -> None:
            # no import of vllm-ascend here: applied right after vLLM's weight_utils is imported
            # (before its importers bind get_quant_config), when vLLM's own model modules may be
            # half-initialised; the wrapper imports the "ascend" config class when first called
            patches.replace(GET_QUANT_CONFIG_TARGET,
                            lambda orig: bodies.redirect(orig, self.quant_config_class))

        def apply_override() -> None:
            self.import_quantization()
            patches.replace(self.override_target, bodies.override)

        def apply_attach() -> None:
            patches.replace(INITIALIZE_MODEL_TARGET, bodies.attach_on_init)

        return (
            patches.Patch(self.PATCH_DESCRIPTION, GET_QUANT_CONFIG_TARGET, vllm, apply_redirect,
                          "the policy engine's bf16 and compressed-tensors w8a8 checkpoints load "
                          "on vllm-ascend W8A8_DYNAMIC", lines=mine, required=True),
            patches.Patch(self.PATCH_OVERRIDE, self.override_target, ascend, apply_override,
                          "the policy engine's compressed-tensors w8a8 checkpoint goes to 'ascend' "
                          "on any platform that runs it (other engines: vllm-ascend's own method)",
                          lines=mine, when=(self.quant_config.partition(":")[0],)),
            patches.Patch(self.PATCH_ATTACH, INITIALIZE_MODEL_TARGET, vllm, apply_attach,
                          "the policy rollout's INT8 model gets the online-quantizing load_weights",
                          lines=mine, required=True),
        )


def table_entry(table, quant_type: str, layer_type: str) -> Optional[type]:
    """The scheme class a vllm-ascend scheme table holds for (quant type, layer type), whichever
    of its three shapes (`StackLine.quant_method_map`); None when it has none."""
    if (quant_type, layer_type) in table:
        return table[(quant_type, layer_type)]
    entry = table.get(quant_type)
    if isinstance(entry, Mapping):
        return entry.get(layer_type)
    build = getattr(entry, f"build_{layer_type}_method", None)
    if build is None:
        return None
    # a quantizer class whose static build_<layer type>_method returns `SchemeClass()`: the class
    # it names, read from its code (building one needs a running engine for some schemes)
    build = getattr(build, "__func__", build)
    names = vars(sys.modules[build.__module__])
    found = [names[n] for n in build.__code__.co_names
             if isinstance(names.get(n), type) and not issubclass(names[n], BaseException)]
    return found[0] if found else None
