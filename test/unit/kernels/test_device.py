import argparse

import torch

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.kernels.device import launch_pdl, pdl_supported
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, TORCH_REFERENCE, KernelPolicy


def test_pdl_only_when_asked_and_never_off_the_gpu():
    x = torch.zeros(4)
    assert not pdl_supported(x.device)
    assert not launch_pdl(x, True)  # CPU tensors (the interpreter) never launch with it
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert launch_pdl(x.cuda(), True)
        assert not launch_pdl(x.cuda(), False)
    assert not launch_pdl(x, False)


def test_pdl_is_on_unless_disabled_on_the_command_line():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert not ServerArgs.from_cli_args(parser.parse_args(["m"])).disable_pdl
    assert ServerArgs.from_cli_args(parser.parse_args(["m", "--disable-pdl"])).disable_pdl


def test_kernel_policy_is_a_value_never_fused_off_cuda():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    for policy in (DEFAULT_KERNELS, TORCH_REFERENCE, KernelPolicy(pdl=False)):
        assert not policy.use_fused(x)  # CPU: the torch reference, bit-exact with HF
        assert not policy.use_skinny_gemm(x) and not policy.use_norm_skinny_gemm(x)
    assert DEFAULT_KERNELS == KernelPolicy(fused=True, pdl=True)
    assert not TORCH_REFERENCE.fused and not TORCH_REFERENCE.pdl
    if torch.cuda.is_available():
        assert not TORCH_REFERENCE.use_fused(x.cuda())
