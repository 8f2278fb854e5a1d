"""Helix: a decode runtime for long-context LLMs with Helix parallelism (KVP x TP_A attention,
TP_F x EP FFN on the same ranks)."""

from helix.config import Layout, ModelConfig, RuntimeConfig
from helix.errors import HelixError
from helix.runtime.sampling import SamplingParams

__all__ = ["Layout", "ModelConfig", "RuntimeConfig", "HelixError", "SamplingParams", "LLM"]


def __getattr__(name):
    if name == "LLM":  # lazy: importing the engine pulls in the model code
        from helix.runtime.llm import LLM
        return LLM
    raise AttributeError(name)
