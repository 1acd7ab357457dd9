"""Small models for the fastreduce tests, and the inputs that drive them.

Every model is built from a seed, so each rank (and each DDP reference copy) holds
identical parameters; :func:`batch_for` gives every rank its own inputs per step.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 40
WIDTH = 16
CLASSES = 5


def batch_for(model: nn.Module, rank: int, step: int, batch: int = 4) -> tuple:
    """Inputs for ``model`` that differ across ranks and steps but not across runs."""
    g = torch.Generator().manual_seed(1000 * step + rank + 17)
    return model.example_inputs(g, batch)


def stepper(opt: Any, before: Callable[[], None] | None = None) -> Callable[[], None]:
    """The step after backward: ``before`` (a reduction, if any), the optimizer's step, zero_grad."""
    def step() -> None:
        if before is not None:
            before()
        opt.step()
        opt.zero_grad()
    return step


def loss_of(model: nn.Module, inputs: tuple, **kwargs) -> torch.Tensor:
    """A bounded scalar loss whose gradient reaches every parameter the forward used."""
    out = model(*inputs, **kwargs)
    return ((out.float() - 0.5) ** 2).mean()


class ManyTensorModel(nn.Module):
    """100+ parameter tensors of mixed shapes and memory formats, small enough to be fast.

    Holds: Conv2d, a channels_last Conv2d, Linear, LayerNorm, Embedding, loose 1-D
    biases, a transposed (dense but non-contiguous) weight, and an output head tied to
    the embedding (two names, one parameter).
    """

    def __init__(self, blocks: int = 24):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv_cl = nn.Conv2d(4, 4, 3, padding=1).to(memory_format=torch.channels_last)
        self.img_proj = nn.Linear(4, WIDTH)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)
        self.transposed = nn.Parameter(torch.randn(8, WIDTH).t())  # (WIDTH, 8), stride (1, WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(blocks))
        self.lins = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        self.down = nn.Linear(8, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied pair
        assert not self.transposed.is_contiguous()
        assert self.conv_cl.weight.is_contiguous(memory_format=torch.channels_last)
        assert not self.conv_cl.weight.is_contiguous()

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        img = torch.randn(batch, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        tokens = torch.randint(0, VOCAB, (batch, 5), generator=g)
        return img, tokens

    def forward(self, img: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h_img = self.conv_cl(F.relu(self.conv(img))).mean((2, 3))
        h = self.img_proj(h_img) + self.emb(tokens).mean(1) + self.bias
        h = h + self.down(h @ self.transposed)
        for norm, lin in zip(self.norms, self.lins):
            h = h + torch.tanh(lin(norm(h)))
        return self.head(h) * 0.1


def many_tensor_model(seed: int, blocks: int = 24) -> ManyTensorModel:
    torch.manual_seed(seed)
    return ManyTensorModel(blocks)


class LinearStack(nn.Module):
    """``layers`` tiny Linear layers: exactly ``2 * layers`` parameter tensors."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 4, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def linear_stack(seed: int, tensors: int) -> LinearStack:
    assert tensors % 2 == 0
    torch.manual_seed(seed)
    return LinearStack(tensors // 2)


class MixedDtypeModel(nn.Module):
    """fp32 input and output layers around a bf16 middle: grads of both dtypes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.mid = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)).to(torch.bfloat16)
        self.out = nn.Linear(WIDTH, CLASSES)
        self.scale = nn.Parameter(torch.ones(CLASSES))

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 8, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).to(torch.bfloat16)
        h = torch.tanh(self.mid(h)).float()
        return self.out(h) * self.scale


def mixed_dtype_model(seed: int) -> MixedDtypeModel:
    torch.manual_seed(seed)
    return MixedDtypeModel()


class FrozenBackboneModel(nn.Module):
    """A frozen backbone (requires_grad=False) under a trainable head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 8, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def frozen_backbone_model(seed: int) -> FrozenBackboneModel:
    torch.manual_seed(seed)
    return FrozenBackboneModel()


class SkipModel(nn.Module):
    """Layers the forward may skip: ``skip`` names the optional layers left out this step.

    ``sometimes`` and ``rank_dep`` are optional (the caller decides per step and rank);
    ``never`` is never used, so no rank ever produces its gradient.
    """

    OPTIONAL = ("sometimes", "rank_dep")

    def __init__(self, with_never: bool = True):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.rank_dep = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Linear(WIDTH, WIDTH) if with_never else None
        self.out = nn.Linear(WIDTH, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 8, generator=g),)

    def forward(self, x: torch.Tensor, skip: Collection[str] = ()) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for name in self.OPTIONAL:
            if name not in skip:
                h = h + torch.tanh(getattr(self, name)(h))
        return self.out(h)


def skip_model(seed: int, with_never: bool = True) -> SkipModel:
    torch.manual_seed(seed)
    return SkipModel(with_never)


class ShapeModel(nn.Module):
    """``Linear(8, hidden) -> Linear(hidden, 5)``: build with a different ``hidden`` per rank
    to get a layout mismatch."""

    def __init__(self, hidden: int):
        super().__init__()
        self.a = nn.Linear(8, hidden)
        self.b = nn.Linear(hidden, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 8, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class SparseEmbeddingModel(nn.Module):
    """An Embedding with ``sparse=True`` (sparse gradient) and a dense Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, sparse=True)
        self.lin = nn.Linear(WIDTH, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randint(0, VOCAB, (batch, 3), generator=g),)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(tokens).mean(1))


class BranchModel(nn.Module):
    """Two parallel branches whose forward order the caller picks per step.

    Autograd runs the branch built last first, so ``flip=True`` (right branch built
    first) changes the order in which the branches' gradients become ready in backward.
    Every parameter is used on every step.
    """

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.left = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.right = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.out = nn.Linear(WIDTH, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 8, generator=g),)

    def forward(self, x: torch.Tensor, flip: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        first, second = (self.right, self.left) if flip else (self.left, self.right)
        a = first(h)
        b = second(h)
        return self.out(torch.tanh(a + b))


def branch_model(seed: int) -> BranchModel:
    torch.manual_seed(seed)
    return BranchModel()


class OddModel(nn.Module):
    """``Linear(7, 13) -> Linear(13, 11) -> Linear(11, 5)`` times a learned scale: 323 = 17 * 19
    parameters in 7 tensors of odd sizes, a count that neither 2, 3 nor 32 divides (so
    shards and alignment pads come out uneven). Follows its parameters' dtype."""

    NUMEL = 323

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 11)
        self.c = nn.Linear(11, CLASSES)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, CLASSES))

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 7, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        h = torch.tanh(self.b(h))
        return self.c(h) * self.scale


def odd_model(seed: int) -> OddModel:
    torch.manual_seed(seed)
    return OddModel()


class TwiceModel(nn.Module):
    """One hidden Linear applied twice in the forward: its parameters get two grad
    contributions per backward (summed before they are accumulated)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 6, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


def twice_model(seed: int) -> TwiceModel:
    torch.manual_seed(seed)
    return TwiceModel()


class BatchNormModel(nn.Module):
    """``Linear -> BatchNorm1d -> Linear``: float running stats (and an int64 counter) as buffers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.out = nn.Linear(WIDTH, CLASSES)

    def example_inputs(self, g: torch.Generator, batch: int) -> tuple:
        return (torch.randn(batch, 6, generator=g),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.inp(x))))


def batchnorm_model(seed: int) -> BatchNormModel:
    torch.manual_seed(seed)
    return BatchNormModel()


TRAINER_MODES = {  # every mode by name, as the trainers' tests run it: fp32 wires, settings that make each act
    "fused": {"wire_dtype": torch.float32},
    "overlap": {"wire_dtype": torch.float32, "bucket_mb": 0.01},
    "zero": {},
    "localsgd": {"sync_every": 4},
    "diloco": {"sync_every": 4, "fragments": 2},
    "gossip": {"topology": "ring"},  # at 2 ranks W = [[1/3, 2/3], [2/3, 1/3]]: the ranks stay apart
}


def hf_regression() -> tuple[type, type, type]:
    """``(TinyConfig, Tiny, Data)``: a ``transformers`` regression MLP with LayerNorm (a no-decay
    group) whose forward takes no ``**kwargs`` (the Trainer then scales each micro-batch's loss by
    1/accumulation, as a loop does), and a dataset of ``{"x", "labels"}`` drawn from a seed.
    Imports transformers here (the trainers' workers call it)."""
    from torch.utils.data import Dataset
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyConfig(PretrainedConfig):
        model_type = "fastreduce_tiny"

        def __init__(self, width: int = 16, **kwargs: Any) -> None:
            self.width = width
            super().__init__(**kwargs)

    class Tiny(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config: TinyConfig) -> None:
            super().__init__(config)
            w = config.width
            self.net = nn.Sequential(nn.Linear(8, w), nn.LayerNorm(w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(),
                                     nn.Linear(w, 1))
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            pass  # torch's own initialisation, from the seed

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            y = self.net(x).squeeze(-1)
            return {"loss": F.mse_loss(y, labels), "logits": y}

    class Data(Dataset):
        def __init__(self, n: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randn(n, 8, generator=g)
            self.y = torch.sin(self.x.sum(1)) + 0.1 * torch.randn(n, generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "labels": self.y[i]}

    return TinyConfig, Tiny, Data


def resume_one_step(trainer: Any, checkpoint: str, flat: Callable[[], torch.Tensor],
                    at_load: Callable[[dict], None] | None = None) -> dict:
    """Train ``trainer`` (an HF-family trainer built for one step past ``checkpoint``) from
    ``checkpoint``: ``params`` when training begins (the load done; ZeRO's all-gather waited
    for), what ``at_load(facts)`` adds then, and ``trained_after``: ``max_steps`` reached, the
    parameters moved."""
    from transformers import TrainerCallback

    facts: dict = {}

    class AtLoad(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            from fastreduce.modes.contract import commit_style

            obj = trainer.fastreduce_mode.obj
            if commit_style(obj) == "zero":  # its parameters' last all-gather
                obj.wait_params()
            facts["params"] = flat()
            if at_load is not None:
                at_load(facts)

    trainer.add_callback(AtLoad())
    trainer.train(resume_from_checkpoint=checkpoint)
    facts["trained_after"] = trainer.state.global_step == trainer.args.max_steps and not torch.equal(
        flat(), facts["params"])
    return facts
