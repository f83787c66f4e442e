"""leapdecode: fast LLM generation that does not change what the model says."""

from .api import generate, load, start_generation, stream
from .core.config import MethodConfig
from .core.generate import Generation, GenerationResult
from .core.runner import ModelRunner, runner_for
from .errors import LeapdecodeError
from .models.loader import LoadedModel

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream", "start_generation", "Generation", "GenerationResult", "LoadedModel",
           "ModelRunner", "runner_for", "MethodConfig", "LeapdecodeError"]
