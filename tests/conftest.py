"""Test harness: the real upstream code on CPU with emulated torch_npu.

Environment is fixed here before anything imports torch or vLLM: no torch device-backend
autoload (a stray torch_npu would break `import torch`), and vLLM plugins only as a test asks.
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("FLASHRL_CONFIG", None)
