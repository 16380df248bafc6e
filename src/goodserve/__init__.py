"""goodserve: an LLM inference server built to win on goodput, with its own instruments."""

from goodserve.config import EngineConfig
from goodserve.outputs import CompletionOutput, RequestOutput
from goodserve.sampling_params import SamplingParams
from goodserve.structured_outputs import StructuredOutputsParams
from goodserve.version import __version__


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from goodserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
