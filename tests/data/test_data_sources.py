"""Arguments that cannot apply to a source are refused; DataFrames and lists are converted."""

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fitkit


def _model():
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)


def test_batch_size_with_a_dataloader_is_refused_before_anything_changes():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model = _model()
    w0 = model.module.weight.detach().clone()
    with pytest.raises(
        ValueError,
        match=r"`batch_size` applies to arrays and Datasets only: `x` is a "
        r"DataLoader.*\(batch_size=4\), so batch_size=64 would be ignored\. "
        r"Fix: drop `batch_size=`",
    ):
        model.fit(loader, batch_size=64, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"`validation_batch_size` .* `validation_data` is a DataLoader"):
        model.fit(x, y, validation_data=loader, validation_batch_size=2, epochs=1, verbose=0)
    assert torch.equal(model.module.weight, w0) and model.global_step == 0


def test_shuffle_false_beside_a_dataloader_that_shuffles_is_warned():
    x, y = _data()
    model = _model()
    shuffling = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    expected = (
        r"fit\(shuffle=False\) does not apply to a DataLoader.*RandomSampler.*"
        r"Fix: build it with `DataLoader\(\.\.\., shuffle=False\)`"
    )
    with pytest.warns(fitkit.FitkitWarning, match=expected):
        model.fit(shuffling, shuffle=False, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a loader in order, or fit's default: nothing to say
        model.fit(DataLoader(TensorDataset(x, y), batch_size=4), shuffle=False, epochs=1, verbose=0)
        model.fit(shuffling, epochs=1, verbose=0)


def test_a_dataloader_records_its_own_batch_size():
    x, y = _data()
    history = _model().fit(DataLoader(TensorDataset(x, y), batch_size=4), epochs=1, verbose=0)
    assert history.params["batch_size"] == 4 and history.params["steps"] == 2
    history = _model().fit(DataLoader(TensorDataset(x, y), batch_size=4), batch_size=4, epochs=1, verbose=0)
    assert history.params["batch_size"] == 4  # the loader's own size, passed again: nothing ignored
    history = _model().fit([(x[:4], y[:4]), (x[4:], y[4:])], batch_size=16, epochs=1, verbose=0)
    assert history.params["batch_size"] is None  # a list of batches: no size to record, 16 is not used
    history = _model().fit(x, y, epochs=1, verbose=0)  # arrays: Keras' default of 32
    assert history.params["batch_size"] == 32


def test_a_dataframe_and_a_series_train_as_their_numpy_arrays():
    pd = pytest.importorskip("pandas")
    x, y = _data()
    frame = pd.DataFrame(x.double().numpy(), columns=["a", "b"])
    series = pd.Series(y[:, 0].double().numpy())
    a, b = _model(), _model()
    a.fit(frame, series.to_frame(), batch_size=4, epochs=2, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q)  # float64 columns become float32, as numpy arrays do
    with pytest.raises(TypeError, match=r"Expected `x` to hold numbers\. Received a DataFrame .* dtype object"):
        _model().fit(pd.DataFrame({"a": ["u", "v"], "b": [1.0, 2.0]}), np.zeros((2, 1)), verbose=0)


def test_a_plain_list_beside_y_is_refused_with_the_conversion_as_fix():
    x, y = _data()
    model = _model()
    with pytest.raises(TypeError, match=r"Received: x a plain list .* Fix: pass `np.asarray\(x, dtype=np.float32\)`"):
        model.fit(x.tolist(), y, epochs=1, verbose=0)
    with pytest.raises(TypeError, match=r"Expected `y` to be a tensor or numpy array.*Fix"):
        model.fit(x, y.tolist(), epochs=1, verbose=0)
    assert model.global_step == 0
