"""Example models and data: layer lists equal to the reference models, ties, determinism, sharding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine.models import data, gpt, mlp, resnet
from pipeengine.training.data import batches


def chain(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def test_resnet18_flattened_equals_torchvision() -> None:
    import torchvision
    torch.manual_seed(0)
    ref = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    layers = resnet.flatten(ref)
    assert len(layers) == 10
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(chain(layers, x), ref(x))
    assert len(resnet.build(resnet.Config(arch="resnet50"))) == 18


def test_gpt_is_causal_and_tied() -> None:
    torch.manual_seed(0)
    cfg = gpt.presets()["tiny"]()
    layers = gpt.build(cfg)
    assert len(layers) == cfg.n_layer + 2
    assert layers[-1].lm_head.weight is layers[0].wte.weight
    (a, _), (b, _) = gpt.tied_parameters(len(layers))[0]
    assert layers[a].get_parameter("wte.weight") is layers[b].get_parameter("lm_head.weight")
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    out_x, out_y = chain(layers, x), chain(layers, y)
    assert out_x.shape == (1, 16, 256)
    torch.testing.assert_close(out_x[:, :10], out_y[:, :10])
    assert not torch.allclose(out_x[:, 10:], out_y[:, 10:])


@pytest.mark.parametrize("mod,cfg", [(gpt, gpt.Config(n_layer=3)), (mlp, mlp.Config(depth=3)),
                                     (resnet, resnet.Config())])
def test_layer_i_gets_the_same_weights_alone_and_in_the_whole_model(mod, cfg) -> None:  # type: ignore[no-untyped-def]
    from pipeengine.runtime.layers import build_layer
    factories = mod.layer_factories(cfg)
    whole = mod.build(cfg, seed=7)
    for i in (1, len(factories) - 2):
        alone = build_layer(factories[i], i, seed=7)   # what a rank holding only layer i builds
        assert all(torch.equal(a, b) for a, b in zip(alone.state_dict().values(), whole[i].state_dict().values()))
        other = build_layer(factories[i], i, seed=8)
        assert not all(torch.equal(a, b) for a, b in zip(other.parameters(), whole[i].parameters()))
    if mod is resnet:   # torchvision's init: He-normal convs, unit BatchNorm
        conv = whole[1].conv1.weight
        fan_out = conv.shape[0] * conv.shape[2] * conv.shape[3]
        assert abs(conv.std().item() - (2 / fan_out) ** 0.5) < 0.2 * (2 / fan_out) ** 0.5
        assert torch.equal(whole[1].bn1.weight, torch.ones_like(whole[1].bn1.weight))
    # sizing (the engine's parameter counts) builds nothing: every factory's layer on meta
    from pipeengine.runtime.layers import sizing_layers
    sized = sizing_layers(factories)
    assert all(t.is_meta for m in sized for t in [*m.parameters(), *m.buffers()] if t.is_floating_point())
    assert [sum(p.numel() for p in m.parameters()) for m in sized] == \
        [sum(p.numel() for p in m.parameters()) for m in whole]


def test_byte_corpus_default_and_path(tmp_path: Path) -> None:
    c1, c2 = data.ByteCorpus(max_bytes=200_000), data.ByteCorpus(max_bytes=200_000)
    assert torch.equal(c1.train, c2.train) and len(c1.train) + len(c1.val) == 200_000
    x, y = c1.example("train", 5)
    assert torch.equal(x[1:], y[:-1])
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("more text " * 50)
    c3 = data.ByteCorpus(str(tmp_path), block_size=16)
    assert len(c3.train) + len(c3.val) == 1100
    with pytest.raises(ValueError, match="does not exist"):
        data.ByteCorpus(str(tmp_path / "missing"))


def test_fake_images_are_reproducible() -> None:
    a = data.ImageSource(None, 32, 10).example("train", 7)
    b = data.ImageSource(None, 32, 10).example("train", 7)
    assert torch.equal(a[0], b[0]) and int(a[1]) == int(b[1]) and a[0].shape == (3, 32, 32)


@pytest.mark.parametrize("mod,preset", [(mlp, "tiny"), (gpt, "tiny")])
def test_a_few_steps_reduce_the_loss(mod, preset: str) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cfg = mod.presets()[preset]()
    layers = mod.build(cfg)
    src = mod.make_source(cfg, None) if mod is mlp else data.ByteCorpus(max_bytes=100_000, block_size=cfg.block_size)
    opt = torch.optim.Adam(nn.ModuleList(layers).parameters(), lr=3e-3)
    losses = []
    for step in range(15):
        (x, y), = batches(src, "train", step, 0, 0, 1, 1, 16)
        loss = mod.loss_fn(chain(layers, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
