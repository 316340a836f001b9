"""gyrfalcon: an OpenAI-compatible LLM serving engine."""

__version__ = "0.1.0"
