"""goodserve: an LLM inference server built to win on goodput, with its own instruments."""

__version__ = "0.1.0"

from goodserve.config import EngineConfig
from goodserve.outputs import CompletionOutput, RequestOutput
from goodserve.sampling_params import SamplingParams
from goodserve.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from goodserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
