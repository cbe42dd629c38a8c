"""Tests of verl.utils.device: the device, backend and device module agree with torch's view of CUDA."""

import torch
import torch.distributed as dist

from verl.utils import device


def test_device_choices_are_consistent():
    cuda = torch.cuda.is_available()
    assert device.is_cuda_available() is cuda
    assert device.get_device_name() == ("cuda" if cuda else "cpu")
    assert device.get_dist_backend() == ("nccl" if cuda else "gloo")
    assert device.get_torch_device() is (torch.cuda if cuda else torch.cpu)
    assert isinstance(device.get_device_id(), int)
    assert torch.zeros(1, device=device.get_device_name()).device.type == device.get_device_name()


def test_dist_backend_is_available_in_this_torch_build():
    backend = device.get_dist_backend()
    assert (dist.is_gloo_available() if backend == "gloo" else dist.is_nccl_available())
