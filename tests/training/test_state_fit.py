"""All-or-nothing loading: every difference listed first, nothing changed; safetensors weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.files import (
    CheckpointError,
    load_safetensors,
    optimizer_differences,
    save_safetensors,
    state_dict_differences,
)
from fitkit.layers import GPT


def _net(classes: int = 10) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, classes))


def _model(classes: int = 10, optimizer=None) -> fitkit.Model:
    model = fitkit.Model(_net(classes), device="cpu")
    model.compile(optimizer=optimizer or (lambda p: torch.optim.Adam(p, lr=0.01)), loss="cross_entropy")
    return model


def _trained(classes: int = 10, optimizer=None) -> fitkit.Model:
    model = _model(classes, optimizer)
    x, y = torch.randn(16, 64), torch.randint(0, classes, (16,))
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    return model


def _snapshot(model: fitkit.Model) -> list[torch.Tensor]:
    tensors = [t.clone() for t in model.module.state_dict().values()]
    if model.optimizer is not None:
        for state in model.optimizer.state.values():
            tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += [torch.tensor(float(g[k])) for g in model.optimizer.param_groups for k in ("lr", "weight_decay")]
    return tensors


def _unchanged(model: fitkit.Model, before: list[torch.Tensor]) -> bool:
    after = _snapshot(model)
    return len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


# -- pure comparisons -----------------------------------------------------------------------
def test_state_dict_differences_one_line_each():
    current = _net(10).state_dict()
    incoming = {**_net(5).state_dict(), "extra.weight": torch.zeros(1)}
    del incoming["0.bias"]
    incoming["0.weight"] = incoming["0.weight"].double()
    assert state_dict_differences(current, incoming) == [
        "'0.bias': in the module, missing from the file",
        "'extra.weight': in the file, not in the module",
        "'0.weight': dtype torch.float64 in the file, torch.float32 in the module",
        "'2.weight': shape (5, 32) in the file, (10, 32) in the module",
        "'2.bias': shape (5,) in the file, (10,) in the module",
    ]
    assert state_dict_differences(current, incoming, strict=False)[0].startswith("'0.weight': dtype")
    assert state_dict_differences(current, _net(10).state_dict()) == []
    assert state_dict_differences(current, [1, 2]) == ["the file holds a list, not a state dict ({name: tensor})"]


def _stepped(opt_cls, params, **kwargs):
    opt = opt_cls(params, **kwargs)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_optimizer_differences_class_groups_params_and_state_shapes():
    w, b = nn.Parameter(torch.zeros(10, 4)), nn.Parameter(torch.zeros(10))
    adam = _stepped(torch.optim.Adam, [w, b]).state_dict()
    assert optimizer_differences(torch.optim.Adam([w, b]), adam, "Adam") == []
    assert optimizer_differences(torch.optim.SGD([w, b], lr=0.1), adam, "Adam") == [
        "optimizer: Adam in the file, SGD in the model"
    ]
    assert optimizer_differences(torch.optim.SGD([w, b], lr=0.1), adam, None) == [
        "optimizer group 0: hyper-parameters ['amsgrad', 'betas', 'eps'] only in the file, "
        "['dampening', 'momentum', 'nesterov'] only in the model (another optimizer class)"
    ]
    adamw = _stepped(torch.optim.AdamW, [w, b], weight_decay=0.1).state_dict()
    assert optimizer_differences(torch.optim.Adam([w, b]), adamw, "AdamW") == [
        "optimizer: AdamW in the file, Adam in the model"
    ]
    assert optimizer_differences(torch.optim.Adam([w, b]), adamw, None) == [
        "optimizer group 0: decoupled_weight_decay=True in the file, False in the model (Adam vs AdamW)"
    ]
    assert optimizer_differences(torch.optim.Adam([w]), adam, "Adam") == [
        "optimizer group 0: parameters: 2 in the file, 1 in the model"
    ]
    two_groups = torch.optim.Adam([{"params": [w]}, {"params": [b]}])
    assert optimizer_differences(two_groups, adam, "Adam") == ["optimizer: param groups: 1 in the file, 2 in the model"]
    w5 = nn.Parameter(torch.zeros(5, 4))
    assert optimizer_differences(torch.optim.Adam([w5, b]), adam, "Adam") == [
        "optimizer state 'exp_avg' of parameter 0: shape (10, 4) in the file, parameter shape (5, 4) in the model",
        "optimizer state 'exp_avg_sq' of parameter 0: shape (10, 4) in the file, parameter shape (5, 4) in the model",
    ]


def test_factored_optimizer_state_is_not_a_difference():
    w = nn.Parameter(torch.zeros(6, 4))
    adafactor = _stepped(torch.optim.Adafactor, [w]).state_dict()
    assert optimizer_differences(torch.optim.Adafactor([nn.Parameter(torch.zeros(6, 4))]), adafactor, "Adafactor") == []


# -- load_weights ---------------------------------------------------------------------------
def test_a_five_class_head_into_a_ten_class_model_changes_nothing(tmp_path):
    _model(classes=5).save_weights(tmp_path / "w5.pt")
    model = _trained(classes=10)
    before = _snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"(?s)does not fit this model, so nothing was loaded:\n"
        r"  - '2.weight': shape \(5, 32\) in the file, \(10, 32\) in the module\n"
        r"  - '2.bias': shape \(5,\) in the file, \(10,\) in the module\nFix:",
    ):
        model.load_weights(tmp_path / "w5.pt")
    assert _unchanged(model, before)  # the first layer too, though it would have fit


def test_an_extra_key_changes_nothing(tmp_path):
    state = {**_net(10).state_dict(), "head.scale": torch.ones(1)}
    torch.save(state, tmp_path / "extra.pt")
    model = _trained(classes=10)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="'head.scale': in the file, not in the module"):
        model.load_weights(tmp_path / "extra.pt")
    assert _unchanged(model, before)
    model.load_weights(tmp_path / "extra.pt", strict=False)  # as nn.Module: extra keys allowed
    assert torch.equal(model.module[0].weight, state["0.weight"])


# -- load_checkpoint ------------------------------------------------------------------------
def _sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def _adam(p):
    return torch.optim.Adam(p, lr=0.01)


def _adamw(p):
    return torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize(
    "saved, loading, line",
    [
        (_adam, _sgd, "optimizer: Adam in the file, SGD in the model"),
        (_sgd, _adam, "optimizer: SGD in the file, Adam in the model"),
        (_adam, _adamw, "optimizer: Adam in the file, AdamW in the model"),
        (_adamw, _adam, "optimizer: AdamW in the file, Adam in the model"),
    ],
)
def test_a_checkpoint_of_another_optimizer_changes_nothing(tmp_path, saved, loading, line):
    _trained(optimizer=saved).save_checkpoint(tmp_path / "c.pt")
    model = _trained(optimizer=loading)
    before, step = _snapshot(model), model.global_step
    with pytest.raises(ValueError, match=f"nothing was loaded:\n  - {line}\nFix"):
        model.load_checkpoint(tmp_path / "c.pt")
    assert _unchanged(model, before) and model.global_step == step


def test_a_checkpoint_without_the_optimizer_class_is_compared_by_its_hyper_parameters(tmp_path):
    _trained(optimizer=_adam).save_checkpoint(tmp_path / "c.pt")
    old = torch.load(tmp_path / "c.pt", weights_only=True)
    del old["optimizer_class"], old["fitkit_checksum"]  # as an older fitkit wrote it
    torch.save(old, tmp_path / "old.pt")
    model = _trained(optimizer=_sgd)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"hyper-parameters \['amsgrad', 'betas', 'eps'\] only in the file"):
        model.load_checkpoint(tmp_path / "old.pt")
    assert _unchanged(model, before)
    same = _trained(optimizer=_adam)
    assert same.load_checkpoint(tmp_path / "old.pt") == 1


def test_a_checkpoint_of_another_module_lists_module_and_optimizer(tmp_path):
    _trained(classes=5).save_checkpoint(tmp_path / "c.pt")
    model = _trained(classes=10)
    before, step = _snapshot(model), model.global_step
    with pytest.raises(ValueError) as excinfo:
        model.load_checkpoint(tmp_path / "c.pt")
    lines = str(excinfo.value).splitlines()
    assert "  - '2.weight': shape (5, 32) in the file, (10, 32) in the module" in lines
    assert any(line.startswith("  - optimizer state 'exp_avg' of parameter 2: shape (5, 32)") for line in lines)
    assert _unchanged(model, before) and model.global_step == step


def test_a_damaged_checkpoint_changes_nothing(tmp_path):
    _trained().save_checkpoint(tmp_path / "c.pt")
    data = (tmp_path / "c.pt").read_bytes()
    (tmp_path / "c.pt").write_bytes(data[: len(data) // 2])
    model = _trained()
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match="is truncated"):
        model.load_checkpoint(tmp_path / "c.pt")
    assert _unchanged(model, before)


# -- safetensors ----------------------------------------------------------------------------
def _gpt() -> GPT:
    return GPT(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_safetensors_round_trip_of_the_gpt_preset_with_tied_weights(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    source = fitkit.Model(_gpt(), device="cpu")
    path = tmp_path / "gpt.safetensors"
    source.save_weights(path)
    raw = st.load_file(path)  # readable by the Hugging Face tools
    state = source.module.state_dict()
    tied = [k for k in state if k not in raw]
    assert len(tied) == 1 and all(torch.equal(raw[k], state[k]) for k in raw)
    torch.manual_seed(1)
    target = fitkit.Model(_gpt(), device="cpu")
    target.load_weights(path)
    for key, value in state.items():
        assert torch.equal(target.module.state_dict()[key], value), key
    assert target.module.embed.wte.weight is target.module.lm_head.weight  # still tied
    idx = torch.randint(0, 65, (2, 16))
    assert torch.equal(target.module.eval()(idx), source.module.eval()(idx))


def test_safetensors_copies_views_and_loads_all_or_nothing(tmp_path):
    pytest.importorskip("safetensors")
    fused = torch.arange(12.0).reshape(3, 4)
    state = {"q": fused[0], "k": fused[1], "t": fused.t(), "same": fused, "alias": fused}
    save_safetensors(state, tmp_path / "v.safetensors")
    back = load_safetensors(tmp_path / "v.safetensors")
    assert all(torch.equal(back[k], v) for k, v in state.items()) and back["alias"] is back["same"]
    fitkit.Model(nn.Linear(64, 5), device="cpu").save_weights(tmp_path / "w5.safetensors")
    model = fitkit.Model(nn.Linear(64, 10), device="cpu")
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"'weight': shape \(5, 64\) in the file, \(10, 64\) in the module"):
        model.load_weights(tmp_path / "w5.safetensors")
    assert _unchanged(model, before)


def test_a_damaged_safetensors_file_is_named(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "w.safetensors"
    weight = torch.randn(64, 8)
    save_safetensors({"weight": weight}, path)
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[data.find(weight.numpy().tobytes()) + 10] ^= 4
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="w.safetensors' is corrupted: its checksum does not match"):
        load_safetensors(path)
    for bad, what in [
        (b"", "is empty"),
        (data[: len(data) // 2], "is truncated, damaged or not a safetensors file"),
        (b"hello world, not tensors", "is truncated, damaged or not a safetensors file"),
    ]:
        path.write_bytes(bad)
        with pytest.raises(CheckpointError, match=what):
            load_safetensors(path)
