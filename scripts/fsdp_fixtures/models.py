"""Small, deterministic example models for the FSDP fixtures.

Every factory takes no arguments and returns a freshly built ``nn.Module``.
Dimensions are tiny on purpose: the fixtures record structure, not values.
"""
import torch
import torch.nn as nn


# --------------------------------------------------------------------------
# GPT-like transformer with tied input/output embeddings (nanoGPT layout,
# flattened: wte, wpe, h, ln_f, lm_head).
# --------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)


class Block(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)


class GPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=16, n_embd=16, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying


def gpt_tied() -> nn.Module:
    return GPT()


# --------------------------------------------------------------------------
# torch.nn.TransformerEncoder (contains MultiheadAttention, a force-leaf type
# of size_based_auto_wrap_policy by default).
# --------------------------------------------------------------------------
class EncoderModel(nn.Module):
    def __init__(self, vocab=32, d_model=16, nhead=2, ff=32, layers=2, n_out=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=ff)
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=layers, enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, n_out)


def transformer_encoder() -> nn.Module:
    return EncoderModel()


# --------------------------------------------------------------------------
# Convnet with BatchNorm2d inside a Sequential.
# --------------------------------------------------------------------------
class ConvNetBN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(16, n_classes)


def convnet_bn() -> nn.Module:
    return ConvNetBN()


# --------------------------------------------------------------------------
# One module instance registered at two paths (branch_a.shared and
# branch_b.shared).
# --------------------------------------------------------------------------
class Branch(nn.Module):
    def __init__(self, shared: nn.Module, dim: int):
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(dim, dim)


class SharedModuleNet(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.stem = nn.Linear(4, dim)
        shared = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.branch_a = Branch(shared, dim)
        self.branch_b = Branch(shared, dim)
        self.head = nn.Linear(dim, 2)


def shared_module() -> nn.Module:
    return SharedModuleNet()


class AliasNet(nn.Module):
    """The same Linear registered directly under the root twice (layer, alias)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.layer = nn.Linear(4, 6)
        self.alias = self.layer
        self.last = nn.Linear(6, 2)


def alias_net() -> nn.Module:
    return AliasNet()


# --------------------------------------------------------------------------
# ModuleDict.
# --------------------------------------------------------------------------
class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 12)
        self.heads = nn.ModuleDict(
            {
                "cls": nn.Linear(12, 3),
                "reg": nn.Linear(12, 1),
                "aux": nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 4)),
            }
        )


def module_dict() -> nn.Module:
    return DictNet()


# --------------------------------------------------------------------------
# requires_grad=False params.
# --------------------------------------------------------------------------
class FrozenMix(nn.Module):
    """proj.weight frozen, proj.bias trainable (mixed inside one module);
    embed fully frozen."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.proj = nn.Linear(8, 8)
        self.proj.weight.requires_grad_(False)
        self.head = nn.Linear(8, 4)


def frozen_mix() -> nn.Module:
    return FrozenMix()


class FrozenModules(nn.Module):
    """Frozen and trainable params only in different modules."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)


def frozen_modules() -> nn.Module:
    return FrozenModules()


# --------------------------------------------------------------------------
# Scalar and zero-size params.
# --------------------------------------------------------------------------
class ZeroOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 3))


class ScalarZeroNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))  # shape []
        self.lin = nn.Linear(4, 4)
        self.zero = ZeroOnly()  # only a [0, 3] param
        self.gate = nn.Parameter(torch.zeros(0))  # shape [0]
        self.out = nn.Linear(4, 1)


def scalar_zero() -> nn.Module:
    return ScalarZeroNet()


# --------------------------------------------------------------------------
# Plain MLP stacks in other dtypes.
# --------------------------------------------------------------------------
class MLPStack(nn.Module):
    def __init__(self, dims=(8, 16, 16, 4)):
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
        )
        self.norm = nn.LayerNorm(dims[-1])


def mlp_fp16() -> nn.Module:
    return MLPStack().to(torch.float16)


def mlp_bf16() -> nn.Module:
    return MLPStack().to(torch.bfloat16)


def mlp_fp64() -> nn.Module:
    return MLPStack().to(torch.float64)


# --------------------------------------------------------------------------
# Mixed dtypes.
# --------------------------------------------------------------------------
class MixedDtypeModules(nn.Module):
    """fp32 and fp16 params, in different modules."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).to(torch.float16)


def mixed_dtype_modules() -> nn.Module:
    return MixedDtypeModules()


class HalfBiasLinear(nn.Module):
    """fp32 weight and fp16 bias in one module."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self.bias = nn.Parameter(torch.zeros(4, dtype=torch.float16))


class MixedDtypeInModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.mixed = HalfBiasLinear()


def mixed_dtype_in_module() -> nn.Module:
    return MixedDtypeInModule()


# --------------------------------------------------------------------------
# Integer parameter (requires_grad=False, int64).
# --------------------------------------------------------------------------
class IntParamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counts = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


def int_param() -> nn.Module:
    return IntParamNet()


# --------------------------------------------------------------------------
# Tied parameters: one Parameter registered under two names of the same
# module (proj.weight / proj.weight_alias) and in another module (dec.weight).
# --------------------------------------------------------------------------
class TiedParamsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.proj.register_parameter("weight_alias", self.proj.weight)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.proj.weight


def tied_params() -> nn.Module:
    return TiedParamsNet()
