import argparse

import torch

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.kernels.device import launch_pdl, set_launch_pdl


def test_pdl_only_when_asked_and_never_off_the_gpu():
    x = torch.zeros(4)
    try:
        set_launch_pdl(True)
        assert not launch_pdl(x)  # CPU tensors (the interpreter) never launch with it
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
            assert launch_pdl(x.cuda())
        set_launch_pdl(False)
        assert not launch_pdl(x)
    finally:
        set_launch_pdl(True)


def test_pdl_is_on_unless_disabled_on_the_command_line():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert not ServerArgs.from_cli_args(parser.parse_args(["m"])).disable_pdl
    assert ServerArgs.from_cli_args(parser.parse_args(["m", "--disable-pdl"])).disable_pdl
