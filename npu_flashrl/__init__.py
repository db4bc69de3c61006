"""npu_flashrl: FlashRL-style INT8 rollouts for RL of LLMs on Huawei Ascend NPUs."""
__version__ = "0.1.0"
