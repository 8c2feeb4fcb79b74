"""Tiny Hugging Face transformers DeepSeek-V3 and V4 models (random weights)
shared by the transformers tests."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 512


# Routing: (routed experts, experts per token, groups, groups kept). The
# whole-model test routes every token to every expert: a choice between
# near-tied experts flips with BF16 noise (the models' own as well as
# ours), and one flipped token moves the logits more than the rounding
# does. The MoE block tests route sparsely, from identical inputs.
ROUTE_ALL = {"v3": (8, 8, 1, 1), "v4": (8, 8, 1, 1)}
ROUTE_SPARSE = {"v3": (16, 4, 4, 2), "v4": (8, 2, 1, 1)}


def tiny_v3(route) -> torch.nn.Module:
    n_experts, k, n_group, topk_group = route
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=128,
        qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=32, n_routed_experts=n_experts, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=k, n_shared_experts=1, max_position_embeddings=256,
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


def tiny_v4(route) -> torch.nn.Module:
    n_experts, k, _, _ = route
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, q_lora_rank=128, num_experts_per_tok=k, n_routed_experts=n_experts,
        hc_mult=2, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=128, index_n_heads=2, index_head_dim=32,
        index_topk=8, sliding_window=16, num_nextn_predict_layers=0, max_position_embeddings=256,
        mlp_layer_types=["hash_moe", "moe", "moe"],
        swiglu_limit=0.5,  # V4's 10 never binds on these random weights; 0.5 clamps a good share
    )
    return transformers.DeepseekV4ForCausalLM(cfg)


BUILDERS = {"v3": tiny_v3, "v4": tiny_v4}


def build(family: str, device: str, route_all: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    route = (ROUTE_ALL if route_all else ROUTE_SPARSE)[family]
    model = BUILDERS[family](route).to(device=device, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # the checkpoint-only state: nonzero biases, a hash table of distinct experts
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
            if name.endswith("tid2eid"):
                n_experts = model.config.n_routed_experts
                buf.copy_(torch.rand(buf.shape[0], n_experts, device=device).argsort(dim=1)[:, : buf.shape[1]])
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def devices() -> list:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
