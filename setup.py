from setuptools import find_packages, setup

setup(
    name="npu-flashrl",
    version="0.1.0",
    description="FlashRL-style INT8 rollouts for RL of LLMs on Huawei Ascend NPUs (vllm-ascend + verl)",
    python_requires=">=3.10",
    packages=find_packages(include=["npu_flashrl", "npu_flashrl.*"]),
    package_data={"npu_flashrl": ["pins.yaml"]},
    install_requires=["torch", "pyyaml", "safetensors", "tqdm"],
    extras_require={
        "test": ["pytest"],
        "plot": ["matplotlib"],
    },
    entry_points={
        "console_scripts": ["npu-flashrl=npu_flashrl.cli:main"],
        "vllm.general_plugins": ["npu_flashrl=npu_flashrl.plugin:register"],
    },
)
