from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs, parse_size

__all__ = ["ModelConfig", "ServerArgs", "parse_size"]
