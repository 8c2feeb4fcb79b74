"""The FSDP2 FP8 all-gather's tensors (lowbit.fp8_fsdp) in one process: the
sharded weight behaves as its plain values, its pre/post all-gather pair
gives the weight's codes under the whole weight's scale, and a layer whose
weight is the gathered form trains bitwise as the layer casting W itself.
The all-gather across processes: test_fp8_parallel.py (FSDP2 over gloo and
NCCL)."""

import pytest
import torch

import lowbit
from lowbit.fp8_fsdp import Fp8GatheredWeight, Fp8ShardedWeight, enable_fsdp_fp8_all_gather
from lowbit.nn import Fp8Linear


class OneRankMesh:
    """The part of a DeviceMesh that fsdp_pre_all_gather uses, for one rank."""

    def size(self):
        return 1


def layer(recipe="tensorwise", seed=0, **kwargs):
    torch.manual_seed(seed)
    return Fp8Linear(96, 160, recipe=recipe, dtype=torch.bfloat16, **kwargs)


def gathered_weight(module):
    """module's weight through the pre / post all-gather pair on one rank,
    as FSDP2 runs it."""
    w = module.weight
    sharded = Fp8ShardedWeight(w.detach())
    inputs, meta = sharded.fsdp_pre_all_gather(OneRankMesh(), w.shape, w.stride(), module, None)
    (codes,) = inputs
    assert codes.dtype == torch.uint8 and codes.shape == w.shape  # 1 byte per weight on the wire
    out, inner = sharded.fsdp_post_all_gather(inputs, meta, w.dtype)
    assert inner == (codes,)
    return out


def test_sharded_weight_is_its_plain_values():
    w = torch.randn(8, 16)
    s = Fp8ShardedWeight(w.clone())
    assert type(s * 2) is torch.Tensor and torch.equal(s * 2, w * 2)
    for view in (s.view(-1), s[2:5], s.detach(), s.chunk(2)[1], s.new_zeros(3, 16)):
        assert isinstance(view, Fp8ShardedWeight)
    s.add_(1.0)  # in place: the wrapper stays, its data moves
    assert torch.equal(s._tensor, w + 1)
    s[:2].copy_(torch.zeros(2, 16))
    assert torch.equal(s._tensor[:2], torch.zeros(2, 16))
    # The optimizers' multi-tensor updates (foreach=True, their default on CUDA).
    before = s._tensor.clone()
    torch._foreach_add_([s], [torch.ones(8, 16)])
    assert torch.equal(s._tensor, before + 1)
    opt = torch.optim.SGD([torch.nn.Parameter(s)], lr=0.5, foreach=True)
    opt.param_groups[0]["params"][0].grad = torch.ones(8, 16)
    opt.step()
    assert torch.equal(s._tensor, (before + 1) - 0.5 * torch.ones(8, 16))


def test_gathered_weight_holds_the_codes_of_the_whole_weight():
    module = layer()
    w = module.weight.detach()
    g = gathered_weight(module)
    assert isinstance(g, Fp8GatheredWeight) and g.dtype == torch.bfloat16 and g.shape == w.shape
    want = lowbit.fp8_cast(w, "tensor")  # the cast of the whole W: same scale, same codes
    assert torch.equal(g._data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(g._scale, want.scale)
    # Other ops see the dequantized values (code x scale).
    assert torch.equal(g + 0, (want.data.float() * want.scale).to(torch.bfloat16))
    assert isinstance(g.detach(), Fp8GatheredWeight) and isinstance(g.view(-1, 96), Fp8GatheredWeight)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", lowbit.Fp8Recipe("tensorwise", pow2_scales=True),
                                    lowbit.Fp8Recipe("delayed", amax_history_len=4, pow2_scales=True)],
                         ids=["tensorwise", "delayed", "tensorwise-pow2", "delayed-pow2"])
def test_layer_with_the_gathered_weight_trains_as_the_layer_casting_w(recipe):
    # The forward op takes W's codes from the gathered weight (delayed: and
    # records its amax), the backward W's transposed copy from them: three
    # steps bitwise those of the layer casting W itself, history included.
    ref, got = layer(recipe), layer(recipe)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(40, 96, generator=gen).to(torch.bfloat16) * (step + 1)
        dy = torch.randn(40, 160, generator=gen).to(torch.bfloat16)
        xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = ref(xr)
        want.backward(dy)
        plain = got.weight
        gathered = torch.nn.Parameter(gathered_weight(got))  # as FSDP2 swaps the unsharded weight in
        del got.weight
        got.weight = gathered
        y = got(xg)
        assert type(y) is torch.Tensor
        y.backward(dy)
        del got.weight
        got.weight = plain
        assert torch.equal(y, want), step
        assert torch.equal(xg.grad, xr.grad), step
        assert gathered.grad.dtype == torch.bfloat16 and torch.equal(gathered.grad, ref.weight.grad), step
        assert torch.equal(got.fp8_state, ref.fp8_state), step
        ref.weight.grad = None


@pytest.mark.parametrize("rows", [53, 0], ids=["uneven", "empty"])
def test_uneven_shard_is_padded_with_zero_codes(rows):
    # FSDP2 gathers equal-sized shards: a last shard shorter than ceil(N /
    # world) rows goes out padded (here one rank, padded to all 160 rows).
    module = layer()
    shard = module.weight.detach()[:rows]
    (codes,), (scale, _) = Fp8ShardedWeight(shard).fsdp_pre_all_gather(OneRankMesh(), (160, 96), (96, 1), module,
                                                                         None)
    assert codes.shape == (160, 96) and codes.dtype == torch.uint8
    if rows:
        assert torch.equal(codes[:rows], lowbit.fp8_cast(shard, "tensor", scale=scale).data.view(torch.uint8))
    assert not codes[rows:].any()


def test_layer_with_a_sharded_weight_outside_fsdp_casts_w_itself():
    ref, got = layer(), layer()
    assert enable_fsdp_fp8_all_gather(got) == 1 and isinstance(got.weight.data, Fp8ShardedWeight)
    x = torch.randn(12, 96).to(torch.bfloat16)
    assert torch.equal(got(x), ref(x))
    assert set(got.state_dict()) == set(ref.state_dict())
    assert type(got.state_dict()["weight"]) is torch.Tensor  # checkpoints hold plain tensors


def test_convert_to_fp8_training_flag():
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 96))
    with pytest.raises(ValueError, match=r"fsdp_fp8_all_gather=True replaces the weight cache.*cache_weight=False"):
        lowbit.convert_to_fp8_training(model, policy="all", progress=False, cache_weight=True, fsdp_fp8_all_gather=True)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())  # refused before converting
    lowbit.convert_to_fp8_training(model, policy="all", progress=False, fsdp_fp8_all_gather=True)
    assert all(isinstance(model[i].weight.data, Fp8ShardedWeight) for i in (0, 2))


def test_enable_changes_tensorwise_layers_only_and_refuses_what_it_cannot_serve():
    model = torch.nn.Sequential(layer("tensorwise"), layer("delayed"), layer("rowwise"), layer("blockwise"),
                                torch.nn.Linear(4, 4))
    assert enable_fsdp_fp8_all_gather(model) == 2
    assert enable_fsdp_fp8_all_gather(model) == 0  # once
    with pytest.raises(ValueError, match=r"cache_weight=True.*build it with cache_weight=False"):
        enable_fsdp_fp8_all_gather(layer(cache_weight=True))
    g = gathered_weight(layer())
    state = lowbit.fp8_state(lowbit.Fp8Recipe("rowwise"))
    with pytest.raises(ValueError, match=r"all-gathered in FP8 serves the recipes \('tensorwise', 'delayed'\), "
                                         r"got 'rowwise'"):
        torch.ops.lowbit.fp8_linear_forward(torch.randn(4, 96), g, None, state, "rowwise")
    with pytest.raises(ValueError, match=r"for an Fp8Linear of a recipe in \('tensorwise', 'delayed'\), got "
                                         r"Fp8Linear of recipe 'rowwise'"):
        Fp8ShardedWeight(torch.randn(160, 96)).fsdp_pre_all_gather(OneRankMesh(), (160, 96), (96, 1),
                                                                     layer("rowwise"), None)
    # w_amax: only for an FP8 W under delayed scaling.
    fwd = torch.ops.lowbit.fp8_linear_forward
    w = layer().weight
    with pytest.raises(ValueError, match=r"argument 'w_amax' is the amax of an FP8 W for the delayed history"):
        fwd(torch.randn(4, 96), w, None, lowbit.fp8_state(lowbit.Fp8Recipe("tensorwise")), "tensorwise",
            w_amax=torch.ones(()))
