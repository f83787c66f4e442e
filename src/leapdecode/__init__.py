"""leapdecode: fast LLM generation that does not change what the model says."""

from .core.generate import Generation, GenerationResult, generate, stream
from .errors import LeapdecodeError
from .models.loader import LoadedModel, load

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream", "Generation", "GenerationResult", "LoadedModel", "LeapdecodeError"]
