"""`--cpu-threads`: the worker's torch threads, resolved once at start-up."""

import argparse
import os

import pytest

from gyrfalcon.config import cli_args
from gyrfalcon.config.cli_args import available_cores
from gyrfalcon.config.server_args import ServerArgs


def parse(*argv):
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(list(argv)))


def test_default_on_cpu_is_the_cores_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(cli_args.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert ServerArgs().cpu_threads is None  # unresolved: decided for the machine
    assert ServerArgs(device="cpu").resolved().cpu_threads == 3


def test_default_without_affinity_is_the_cpu_count(monkeypatch):
    monkeypatch.delattr(cli_args.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(cli_args.os, "cpu_count", lambda: 7)
    assert available_cores() == 7
    monkeypatch.setattr(cli_args.os, "cpu_count", lambda: None)
    assert available_cores() == 1


def test_real_affinity_of_this_process():
    if hasattr(os, "sched_getaffinity"):
        assert available_cores() == len(os.sched_getaffinity(0))
    assert available_cores() >= 1


def test_explicit_value_wins_and_cuda_keeps_torchs_default():
    assert ServerArgs(device="cpu", cpu_threads=2).resolved().cpu_threads == 2
    assert ServerArgs(device="cuda", dtype="bfloat16").resolved().cpu_threads is None
    assert ServerArgs(device="cuda", cpu_threads=4).resolved().cpu_threads == 4
    with pytest.raises(ValueError, match="--cpu-threads"):
        ServerArgs(device="cpu", cpu_threads=0).resolved()


def test_cli_flag():
    assert parse().cpu_threads is None
    assert parse("--cpu-threads", "3").cpu_threads == 3
    with pytest.raises(SystemExit):
        parse("--cpu-threads", "many")
