from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitkit
from fitkit.training.finite import scan


def masked_bce(y_pred, y):
    """Multi-task binary loss over the labels that exist (NaN: missing), as Tox21 models train."""
    known = ~torch.isnan(y)
    return F.binary_cross_entropy_with_logits(y_pred[known], y[known])


def where_mse(y_pred, y):
    """Masks the forward only: the backward of (y_pred - y) ** 2 still multiplies NaN by 0."""
    known = ~torch.isnan(y)
    return torch.where(known, (y_pred - y) ** 2, torch.zeros_like(y_pred)).sum() / known.sum()


def _zero_linear(inputs: int = 2, outputs: int = 3) -> nn.Linear:
    net = nn.Linear(inputs, outputs)
    nn.init.zeros_(net.weight)
    nn.init.zeros_(net.bias)
    return net


def _tox() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    nan = float("nan")
    y = torch.tensor([[1.0, nan, 0.0], [nan, 1.0, nan], [0.0, 0.0, 1.0], [1.0, nan, nan]])
    return x, y


def test_a_loss_that_masks_missing_labels_trains_on_nan_targets():
    x, y = _tox()
    model = fitkit.Model(_zero_linear(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss=masked_bce)
    h = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    # Logits 0: loss log(2) over the 8 known labels; the bias gradient is mean(sigmoid(0) - y) per task.
    assert h.history["loss"] == [pytest.approx(0.6931472)]
    known = ~torch.isnan(y)
    grad = [float((0.5 - y[known[:, j], j]).sum() / known.sum()) for j in range(3)]
    assert (-model.module.bias.detach()).tolist() == pytest.approx(grad)
    assert model.evaluate(x, y, verbose=0)["loss"] < 0.6931472


def test_a_module_that_imputes_its_inputs_trains_with_a_builtin_loss():
    class Impute(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = _zero_linear(2, 1)

        def forward(self, x):
            return self.linear(x.nan_to_num(0.0))

    x = torch.tensor([[1.0, float("nan")], [2.0, 1.0]])
    model = fitkit.Model(Impute(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
    model.fit(x, torch.ones(2, 1), batch_size=2, verbose=0)
    # d/dw of mean (w.x + b - 1)^2 at 0: -2 * mean(x_imputed), with x_imputed = [[1, 0], [2, 1]].
    assert model.module.linear.weight.tolist() == [[pytest.approx(1.5), pytest.approx(0.5)]]


def test_nan_targets_with_a_builtin_loss_are_refused_before_step_1():
    x, y = _tox()
    model = fitkit.Model(_zero_linear(), device="cpu")
    model.compile(optimizer="sgd", loss="bce_with_logits")
    with pytest.raises(ValueError, match=r"^`y` holds 5 NaN or infinite values \(first at row 0\)\. Fix: clean"):
        model.fit(x, y, verbose=0)
    assert model.module.bias.tolist() == [0.0, 0.0, 0.0]


def test_a_loss_whose_value_or_gradient_is_nan_on_those_rows_is_refused():
    x, y = _tox()
    for loss, why in (
        (lambda p, t: F.mse_loss(p, t), "the loss of the rows holding them .* is not finite"),
        (where_mse, "the loss .* is finite but its gradient is not"),
    ):
        model = fitkit.Model(_zero_linear(), device="cpu")
        model.compile(optimizer="sgd", loss=loss)
        with pytest.raises(ValueError, match=rf"`y` holds 5 NaN .*Here {why}.*sample_weight` of 0"):
            model.fit(x, y, verbose=0)
        assert model.module.bias.tolist() == [0.0, 0.0, 0.0]


def test_replaced_missing_labels_with_a_zero_weight_mask_train_a_builtin_loss():
    x, y = _tox()
    known = ~torch.isnan(y)
    masked = fitkit.Model(_zero_linear(), device="cpu")
    masked.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="bce_with_logits")
    masked.fit(x, y.nan_to_num(0.0), sample_weight=known.float(), batch_size=4, verbose=0)
    own = fitkit.Model(_zero_linear(), device="cpu")
    own.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss=masked_bce)
    own.fit(x, y, batch_size=4, verbose=0)
    assert masked.module.bias.tolist() == pytest.approx(own.module.bias.tolist())
    torch.testing.assert_close(masked.module.weight, own.module.weight)
    assert masked.module.bias.abs().sum() > 0


def test_nan_sample_weights_are_always_refused():
    model = fitkit.Model(_zero_linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"`sample_weight` holds 1 NaN or infinite values \(first at row 1\)\..*Fix"):
        model.fit(torch.zeros(3, 2), torch.zeros(3, 1), sample_weight=torch.tensor([1.0, float("nan"), 1.0]), verbose=0)


def test_scan_counts_and_names_rows_chunk_by_chunk(monkeypatch):
    import fitkit.training.finite as finite

    monkeypatch.setattr(finite, "_CHUNK", 6)  # 3 rows of 2 per chunk
    t = torch.zeros(10, 2)
    t[1, 0], t[7, 1], t[8, 0], t[8, 1] = float("nan"), float("inf"), float("nan"), -float("inf")
    assert scan(t, keep=2) == (4, [1, 7])
    assert scan(t[:, 1], keep=5) == (2, [7, 8])  # a non-contiguous view: no copy either
    assert scan(torch.tensor(float("nan")), keep=1) == (1, [0])


def test_the_finite_check_reads_the_data_in_chunks_and_copies_none_of_it(monkeypatch):
    import fitkit.training.finite as finite

    sizes = []
    real = torch.isfinite

    def recording(t):
        sizes.append(t.numel())
        return real(t)

    monkeypatch.setattr(finite.torch, "isfinite", recording)
    x, y = torch.randn(300_000, 4), torch.randn(300_000)  # 1.2M + 0.3M values
    model = fitkit.Model(nn.Linear(4, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    model.evaluate(x, y.unsqueeze(1), batch_size=100_000, verbose=0)
    # Every mask is one chunk (2**18 values, a 256 KB mask), never one of the whole array.
    assert sum(s for s in sizes if s > 1) == 1_500_000 and max(sizes) <= finite._CHUNK


def test_a_loader_whose_first_batch_holds_nan_trains_only_with_a_loss_that_handles_them():
    x, y = _tox()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    model = fitkit.Model(_zero_linear(), device="cpu")
    model.compile(optimizer="sgd", loss="bce_with_logits")
    with pytest.raises(ValueError, match=r"first training batch's `y` holds 3 NaN .*\(first at row 0\), and its loss"):
        model.fit(loader, verbose=0)
    assert model.module.bias.tolist() == [0.0, 0.0, 0.0]
    model.compile(optimizer="sgd", loss=masked_bce)
    assert model.fit(loader, verbose=0).history["loss"] == [pytest.approx(0.6931472, rel=1e-3)]


def test_the_scan_reads_the_host_once_per_call_and_not_again_for_unchanged_tensors():
    from fitkit.data import TensorBatches
    from fitkit.training.finite import check_in_memory
    from tests._syncs import SyncCounter

    x = torch.randn(60_000, 20)  # 1.2M values: 5 chunks of rows
    y, w = torch.randn(60_000, 1), torch.ones(60_000)
    source = TensorBatches(x, y, w, batch_size=32, shuffle=False)

    def reads() -> int:
        counter = SyncCounter()
        with counter:
            check_in_memory(None, source, training=True)
        return len(counter.events)

    assert reads() == 1  # x, y and the weights: one read for all their chunks
    assert reads() == 0  # the same tensors, not written since: not scanned again
    x[59_999, 3] = float("nan")  # an in-place write moves the version counter: scanned again, and found
    with pytest.raises(ValueError, match=r"`x` holds 1 NaN or infinite values \(first at row 59999\)"):
        check_in_memory(None, source, training=True)
    x[59_999, 3] = 0.0
    assert reads() == 1
