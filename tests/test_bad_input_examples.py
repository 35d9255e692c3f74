"""Bad inputs, one test each: a clear error before step 1, nothing changed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import BackupAndRestore, CSVLogger, ModelCheckpoint
from fitkit.layers import GPT


def _model(module: nn.Module | None = None, loss: str = "cross_entropy") -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(module if module is not None else nn.Linear(4, 3), device="cpu")
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"] if loss == "cross_entropy" else None)
    return model


def _state(model: fitkit.Model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _unchanged(model: fitkit.Model, before: dict[str, torch.Tensor]) -> bool:
    now = model.module.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], v) for k, v in before.items())


def _fit_fails(model, tmp_path, *args, error=ValueError, **kwargs) -> BaseException:
    """fit with a checkpoint and a CSV log; the error must come before either writes a file."""
    before = _state(model)
    callbacks = [ModelCheckpoint(tmp_path / "ckpt.pt", save_freq=1), CSVLogger(tmp_path / "log.csv")]
    with pytest.raises(error) as info:
        model.fit(*args, epochs=2, verbose=0, callbacks=callbacks, **kwargs)
    assert _unchanged(model, before) and model.global_step == 0
    assert list(tmp_path.iterdir()) == []
    return info.value


# -- raw torch errors from the first batch, wrapped ------------------------------------------------
def test_a_wrong_feature_count_names_the_forward_and_what_was_fed(tmp_path):
    e = _fit_fails(_model(), tmp_path, torch.randn(10, 5), torch.arange(10) % 3, batch_size=4)
    assert str(e).startswith(
        "The first batch failed in the module's forward: RuntimeError: mat1 and mat2 shapes cannot be multiplied "
        "(4x5 and 4x3). It was fed x: float32 (4, 5); y: int64 (4,) values 0..2. Fix: make the data's shapes"
    )
    assert isinstance(e.__cause__, RuntimeError)  # the original, chained


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return {"scores": self.lin(x), "features": x}


def test_a_module_returning_a_dict_with_a_compiled_loss_names_the_loss_and_the_keys(tmp_path):
    e = _fit_fails(_model(_DictOut(), loss="mse"), tmp_path, torch.randn(10, 4), torch.randn(10, 3), batch_size=4)
    # The structured-output rule (fitkit.outputs) names the loss, the dict's entries and the fix.
    message = str(e)
    assert message.startswith("fitkit cannot pick one prediction tensor for the loss 'mse' out of the module's output")
    assert "'scores'" in message and "'features'" in message and "Fix" in message


def test_a_gpt_token_id_above_the_vocabulary_shows_the_id_range(tmp_path):
    torch.manual_seed(0)
    gpt = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8)
    x = torch.randint(0, 10, (6, 8))
    x[4, 3] = 12
    e = _fit_fails(_model(gpt), tmp_path, x, torch.randint(0, 10, (6, 8)), batch_size=6)
    assert str(e).startswith(
        "The first batch failed in the module's forward: IndexError: index out of range in self. It was fed "
        "x: int64 (6, 8) values 0..12;"
    )
    assert isinstance(e.__cause__, IndexError)


def test_a_dataloader_gets_the_same_check_on_its_first_training_batch(tmp_path):
    model = _model()
    data = DataLoader(TensorDataset(torch.randn(10, 5), torch.arange(10) % 3), batch_size=4)
    before = _state(model)
    with pytest.raises(ValueError, match=r"^The first training batch failed in the module's forward: RuntimeError: "
                       r"mat1 and mat2 shapes cannot be multiplied \(4x5 and 4x3\)\. It was fed x: float32 \(4, 5\)"):
        model.fit(data, epochs=2, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "ckpt.pt", save_freq=1)])
    assert _unchanged(model, before) and model.global_step == 0
    assert list(tmp_path.iterdir()) == []


def test_float64_batches_of_a_dataloader_get_a_dtype_fix():
    model = _model()
    data = DataLoader(TensorDataset(torch.randn(10, 4, dtype=torch.float64), torch.arange(10) % 3), batch_size=4)
    with pytest.raises(ValueError, match=r"Fix: the module's parameters are float32 and x is float64: convert"):
        model.fit(data, epochs=1, verbose=0)


def test_predict_names_the_forward_on_a_bad_first_batch():
    with pytest.raises(ValueError, match=r"^The first batch failed in the module's forward: RuntimeError: mat1"):
        _model().predict(torch.randn(10, 6), verbose=0)


# -- float64 NumPy arrays ----------------------------------------------------------------------------
def test_float64_numpy_inputs_are_cast_and_train_exactly_as_float32():
    x32, y = torch.randn(24, 4), torch.arange(24) % 3
    as32, as64 = _model(), _model()
    as32.fit(x32, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    as64.fit(x32.numpy().astype(np.float64), y.numpy(), epochs=2, batch_size=8, verbose=0, shuffle=False)
    for k, v in as32.module.state_dict().items():
        assert torch.equal(as64.module.state_dict()[k], v)
    x64 = x32.double()  # a float64 tensor too, in evaluate and predict
    assert as64.evaluate(x64, y, verbose=0) == as32.evaluate(x32, y, verbose=0)
    out = as64.predict(x64, verbose=0)
    assert out.dtype == torch.float32 and torch.equal(out, as32.predict(x32, verbose=0))


# -- accepted silently before --------------------------------------------------------------------
def test_nan_and_inf_in_x_and_y_name_the_count_and_the_first_row(tmp_path):
    x = torch.randn(12, 4)
    x[5, 1], x[9, 0], x[9, 2] = float("nan"), float("inf"), -float("inf")
    e = _fit_fails(_model(), tmp_path, x, torch.arange(12) % 3)
    assert str(e) == ("`x` holds 3 NaN or infinite values (first at row 5). Fix: clean or impute `x` before fit; "
                      "a NaN input turns every weight NaN.")  # fmt: skip
    y = torch.randn(12, 3)
    y[7, 2] = float("nan")
    e = _fit_fails(_model(nn.Linear(4, 3), loss="mse"), tmp_path, torch.randn(12, 4), y)
    assert str(e).startswith("`y` holds 1 NaN or infinite values (first at row 7).")


def test_a_negative_sample_weight_is_an_error(tmp_path):
    w = torch.ones(12)
    w[4] = -2.0
    e = _fit_fails(_model(), tmp_path, torch.randn(12, 4), torch.arange(12) % 3, sample_weight=w)
    assert str(e) == ("`sample_weight` must be >= 0. Received a negative weight at index 4 (-2.0). Fix: weights "
                      "scale each sample's loss; use 0 to ignore one.")  # fmt: skip


@pytest.mark.parametrize("shape", [(12,), (12, 1), (12, 3)])
def test_class_weight_with_continuous_targets_is_an_error(tmp_path, shape):
    model = _model(nn.Linear(4, shape[-1] if len(shape) > 1 else 1), loss="mse")
    y = torch.randn(*shape) + 0.25
    e = _fit_fails(model, tmp_path, torch.randn(12, 4), y, class_weight={0: 1.0, 1: 2.0})
    assert str(e).startswith("`class_weight` needs class labels (or one-hot / probability rows), but the targets "
                             "are continuous (e.g. ")  # fmt: skip
    assert str(e).endswith("Fix: pass `sample_weight` for regression targets.")


def test_class_weight_with_one_hot_or_probability_rows_still_works():
    model = _model()
    one_hot = torch.eye(3)[torch.arange(12) % 3] * 0.9 + 0.1 / 3  # label smoothing: rows in [0, 1]
    model.fit(torch.randn(12, 4), one_hot, class_weight={0: 1.0, 1: 2.0, 2: 1.0}, epochs=1, verbose=0)
    assert model.global_step == 1


def test_initial_epoch_at_or_past_epochs_warns_that_nothing_will_train():
    model = _model()
    before = _state(model)
    with pytest.warns(UserWarning, match=r"initial_epoch=3 >= epochs=3: nothing will train.*Fix: pass epochs > "):
        history = model.fit(torch.randn(8, 4), torch.arange(8) % 3, initial_epoch=3, epochs=3, verbose=0)
    assert history.epoch == [] and model.global_step == 0 and _unchanged(model, before)


# -- paths that cannot be written, at construction ----------------------------------------------------
def test_paths_of_the_wrong_kind_fail_at_construction(tmp_path):
    (tmp_path / "ckpt.pt").mkdir()
    (tmp_path / "log.csv").mkdir()
    (tmp_path / "backup").write_text("")
    made = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"ModelCheckpoint writes a file at `filepath`, but it is an existing folder"):
        ModelCheckpoint(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"CSVLogger writes a file at `filename`, but it is an existing folder"):
        CSVLogger(tmp_path / "log.csv")
    with pytest.raises(ValueError, match=r"BackupAndRestore writes a folder at `backup_dir`, but it is an existing"):
        BackupAndRestore(tmp_path / "backup")
    assert sorted(p.name for p in tmp_path.iterdir()) == made
    assert list((tmp_path / "ckpt.pt").iterdir()) == [] and list((tmp_path / "log.csv").iterdir()) == []
    assert (tmp_path / "backup").read_text() == ""


def test_path_arguments_must_be_paths():
    model = _model()
    for call in (model.save_weights, model.load_weights, model.save_checkpoint, model.load_checkpoint):
        with pytest.raises(TypeError, match=r"Expected `path` to be a str or a path\. Received: path=3 \(int\)\. Fix"):
            call(3)


def test_no_warning_for_good_inputs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _model().fit(np.random.default_rng(0).normal(size=(16, 4)), np.arange(16) % 3, epochs=1, verbose=0)
