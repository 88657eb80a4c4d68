"""mcore_compat.cpu: each redirected megatron call works on CPU and keeps megatron's math; and
mcore_compat.distrib_optimizer's format of the distributed optimizer's gathered state."""

from __future__ import annotations

import math

import torch

from mcore_compat import cpu as cpu_compat

cpu_compat.install(force=True)


def test_cuda_device_requests_land_on_cpu():
    from megatron.core import utils

    buf = utils.GlobalMemoryBuffer()
    t = buf.get_tensor((2, 3), torch.float32, "test")
    assert t.device.type == "cpu" and t.shape == (2, 3)
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu" and torch.equal(mask, torch.triu(torch.ones(4, 4), 1).bool())


def test_clip_grad_scales_like_megatron():
    from megatron.core.optimizer import clip_grads

    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0])
    total = 5.0
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    coeff = 1.0 / (total + 1e-6)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 0.0, 0.0]) * coeff)
    assert math.isclose(params[1].grad[1].item(), 4.0 * coeff, rel_tol=0, abs_tol=1e-7)
    params[0].grad = torch.tensor([0.1, 0.0, 0.0])
    clip_grads.clip_grad_by_total_norm_fp32(params[:1], max_norm=1.0, total_norm=0.1)
    assert torch.equal(params[0].grad, torch.tensor([0.1, 0.0, 0.0])), "no clipping below max_norm"


def test_rng_tracker_forks_and_restores_the_cpu_generator():
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-rng", 123)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with tracker.fork("test-rng"):
        forked = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the outer state"
    torch.manual_seed(123)
    assert torch.equal(forked, torch.rand(3)), "the fork draws from the tracker's own stream"
    tracker.reset()


def test_cpu_tensors_report_cuda_types_only_inside_the_float16_optimizer_init():
    t = torch.zeros(2, dtype=torch.bfloat16)
    with cpu_compat._cpu_tensors_report_cuda_types():
        assert t.type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float32).dtype == torch.float32
    assert t.type() == "torch.BFloat16Tensor"


def test_dp_zero_state_gets_the_padding_between_buckets_back():
    """megatron-core 0.19.2's get_parameter_state_dp_zero drops the padding between buckets; the
    fully_reshardable save slices at padded offsets (param_index_map). Buckets [0, 6) with 5
    real elements and [6, 10) with 3: element i of bucket b must land at its padded offset."""
    from types import SimpleNamespace

    from mcore_compat.distrib_optimizer import with_bucket_padding

    buckets = [SimpleNamespace(offset=0, numel_unpadded=5), SimpleNamespace(offset=6, numel_unpadded=3)]
    buffer = SimpleNamespace(numel=10, buckets=buckets)
    flat = torch.arange(1.0, 9.0)  # bucket 0: 1..5, bucket 1: 6..8
    state = {"buckets_coalesced": True,
             0: {torch.float32: {"param": flat, "exp_avg": flat + 10, "numel_unpadded": 8}}}
    world = with_bucket_padding([buffer], state)[0][torch.float32]
    assert world["param"].tolist() == [1, 2, 3, 4, 5, 0, 6, 7, 8, 0]
    assert world["exp_avg"].tolist() == [11, 12, 13, 14, 15, 0, 16, 17, 18, 0]
    assert world["numel_unpadded"] == 8
    assert with_bucket_padding([buffer], None) is None
