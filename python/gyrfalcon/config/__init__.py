from gyrfalcon.config.cli_args import parse_size
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs

__all__ = ["ModelConfig", "ServerArgs", "parse_size"]
