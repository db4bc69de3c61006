"""A stand-in for MindSpeed's `mindspeed/megatron_adaptor.py` (the real one imports torch_npu and
CANN at import; MindSpeed is a source install from gitcode.com/Ascend/MindSpeed, branch
core_r0.16.0 for verl 0.9.1, which is not reachable from this machine). Modelled on the adaptor
pattern of MindSpeed and its derivatives as read in the stored public index: at import, a patches
manager applies MindSpeed's feature patches to Megatron attributes, recording each original;
`repatch(config)` (what verl 0.9.1's `MindspeedEngineWithLMHead._init_device_mesh` calls with
`override_transformer_config`) removes every patch, restoring the originals, and applies them
again for the new config. Two of the attributes MindSpeed patches are used here:
`ColumnParallelLinear.forward` (MindSpeed's linear / sequence-parallel features) and
`GPTModel.__init__` (MindSpeed-LLM swaps Megatron's GPT model). Each patched function counts its
calls in `CALLS`; `REPATCHED` records the configs, `WRAPPED_BEFORE` whether an npu_flashrl
wrapper sat on `GPTModel.__init__` when a repatch started."""

ADAPTOR = '''
import functools

CALLS = {"column_parallel_forward": 0, "gpt_init": 0}
REPATCHED = []
WRAPPED_BEFORE = []
_ORIGINALS = {}


def _targets():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return {"column_parallel_forward": (ColumnParallelLinear, "forward"),
            "gpt_init": (GPTModel, "__init__")}


def _apply():
    for key, (owner, attr) in _targets().items():
        original = _ORIGINALS.setdefault(key, owner.__dict__[attr])

        def patched(*args, __key=key, __original=original, **kwargs):
            CALLS[__key] += 1
            return __original(*args, **kwargs)

        functools.update_wrapper(patched, original)
        setattr(owner, attr, patched)


def _remove():
    for key, (owner, attr) in _targets().items():
        if key in _ORIGINALS:
            setattr(owner, attr, _ORIGINALS[key])


def repatch(config):
    init = _targets()["gpt_init"][0].__dict__["__init__"]
    WRAPPED_BEFORE.append(getattr(init, "__npu_flashrl_original__", None) is not None)
    REPATCHED.append(dict(config))
    _remove()
    _apply()


_apply()
'''


def write(root) -> str:
    """Write the stand-in package under `root`; returns the directory to put on the path."""
    import os

    pkg = os.path.join(str(root), "mindspeed")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("")
    with open(os.path.join(pkg, "megatron_adaptor.py"), "w") as f:
        f.write(ADAPTOR)
    return str(root)
