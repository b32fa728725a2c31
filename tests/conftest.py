import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    from minivllm import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tiny():
    from minivllm import load_model

    return load_model("tiny-random", device="cpu")


@pytest.fixture(scope="session")
def hf_models():
    """The transformers oracle, loaded from the same folders minivllm reads."""
    from transformers import AutoModelForCausalLM

    from minivllm.models import model_folder

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(model_folder(name), dtype=torch.float32).eval()
        return cache[name]

    return get


from hypothesis import settings  # noqa: E402

# 120 examples per property; CI replays the same ones every run, locally hypothesis explores new ones.
# `pytest --hypothesis-profile=long tests/test_engine_property.py` runs 2,000 of each.
settings.register_profile("dev", max_examples=120)
settings.register_profile("ci", max_examples=120, derandomize=True, print_blob=True)
settings.register_profile("long", max_examples=2000, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
