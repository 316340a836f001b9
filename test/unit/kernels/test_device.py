import torch

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
        set_launch_pdl(False)
