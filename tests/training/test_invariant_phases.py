"""The loop's invariant 2: every phase honours its source's bound.

Train, validation (a set, or each named set), the sanity validation, ``evaluate`` and
``predict`` stop at ``len()`` of a source that has one, an iterator that cycles forever included
(``__iter__`` returns itself and ``__len__`` bounds a pass, as a Keras ``Sequence`` adapter or
Poutyne's), and at ``steps`` (``steps_per_epoch``, ``validation_steps``, ``steps``) for an endless
source without a length. Property: every phase x every source kind gives the values of a hand
computation over exactly the first pass (the model does not learn: ``lr=0``), and a source that
is pulled past its bound fails instead of hanging. A source fitkit can tell is endless
(``itertools.cycle`` / ``count`` / ``repeat``) without its phase's steps is refused before step 1,
naming the argument and the fix, with nothing drawn; a one-shot generator runs its one pass, and is
refused where validation would need a second one. And a SIGTERM during any validation inside
``fit`` ends it after that batch, with the backup at the last optimizer step.
"""

from __future__ import annotations

import itertools
import os
import signal
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import BackupAndRestore
from tests.conftest import fixed_linear

N, B = 3, 4  # batches of a pass, rows of a batch
GEN = torch.Generator().manual_seed(0)
X, Y = torch.randn(N * B, 2, generator=GEN), torch.randn(N * B, 1, generator=GEN)
BATCHES = [(X[i * B : (i + 1) * B], Y[i * B : (i + 1) * B]) for i in range(N)]


class Cycling:
    """``__iter__`` returns itself; ``__len__`` (when given) bounds a pass; it never runs out.
    Pulled past ``limit`` it raises, so a phase that ignores its bound fails instead of hanging."""

    def __init__(self, length: int | None = N, limit: int = 40, on_pull=None):
        self.length, self.limit, self.on_pull, self.pulls = length, limit, on_pull, 0

    def __len__(self):
        if self.length is None:
            raise TypeError("no len()")
        return self.length

    def __iter__(self):
        return self

    def __next__(self):
        self.pulls += 1
        if self.pulls > self.limit:
            raise RuntimeError(f"pulled {self.pulls} batches: the phase ignored its bound")
        if self.on_pull is not None:
            self.on_pull(self.pulls)
        return BATCHES[(self.pulls - 1) % N]


def _endless():
    """An endless generator (no ``len()``): bounded only by ``steps``."""
    i = 0
    while True:
        if i >= 40:
            raise RuntimeError("an endless generator pulled past its steps")
        yield BATCHES[i % N]
        i += 1


SOURCES = {
    "list": lambda: list(BATCHES),
    "DataLoader": lambda: DataLoader(TensorDataset(X, Y), batch_size=B),
    "generator": lambda: (b for b in BATCHES),
    "cycling iterator with len": lambda: Cycling(),
    "endless generator + steps": _endless,
    "itertools.cycle + steps": lambda: itertools.cycle(BATCHES),
}
STEPPED = {"endless generator + steps", "itertools.cycle + steps"}  # kinds run with the phase's steps
PHASES = ["train", "validation", "named validation", "sanity", "evaluate", "predict"]


def _model() -> fitkit.Model:
    model = fitkit.Model(fixed_linear(2, 1, weight=0.5, bias=0.25), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse")
    return model


def _hand_loss() -> float:
    """The mean loss of one pass, by rows (every batch has B rows)."""
    with torch.no_grad():
        net = fixed_linear(2, 1, weight=0.5, bias=0.25)
        return sum(torch.nn.functional.mse_loss(net(x), y).item() * B for x, y in BATCHES) / (N * B)


def _run(phase: str, kind: str):
    """The phase's value over its source, and the value a hand computation gives."""
    model, source = _model(), SOURCES[kind]()
    endless = kind in STEPPED
    if phase == "train":
        history = model.fit(source, epochs=1, verbose=0, steps_per_epoch=N if endless else None)
        assert model.global_step == N
        return history.history["loss"], [_hand_loss()]
    if phase in ("validation", "named validation", "sanity"):
        val = {"a": source, "b": list(BATCHES)} if phase == "named validation" else source
        history = model.fit(
            list(BATCHES),
            epochs=1,
            verbose=0,
            validation_data=val,
            validation_steps=N if endless else None,
            num_sanity_val_steps=2 if phase == "sanity" else 0,
        )
        key = "val_a_loss" if phase == "named validation" else "val_loss"
        return history.history[key], [_hand_loss()]
    if phase == "evaluate":
        return model.evaluate(source, verbose=0, steps=N if endless else None, return_dict=True)["loss"], _hand_loss()
    out = model.predict(source, verbose=0, steps=N if endless else None)
    with torch.no_grad():
        return out, model.module(X)


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_stops_at_its_sources_bound(phase, kind):
    got, expected = _run(phase, kind)
    if isinstance(got, torch.Tensor):
        assert got.shape == (N * B, 1) and torch.equal(got, expected)
    else:
        assert got == expected  # the batches' float32 losses, summed by rows in float64


ENDLESS = {
    "itertools.cycle": lambda: itertools.cycle(BATCHES),
    "itertools.repeat": lambda: itertools.repeat(BATCHES[0]),
}
# phase -> (argument as the error names it, the steps keyword of the fix, how the phase is called)
REFUSALS = {
    "train": ("x", "steps_per_epoch", lambda m, s: m.fit(s, epochs=2, verbose=0)),
    "validation": ("validation_data", "validation_steps", lambda m, s: m.fit(BATCHES, verbose=0, validation_data=s)),
    "named validation": (
        "validation_data['b']",
        "validation_steps",
        lambda m, s: m.fit(BATCHES, verbose=0, validation_data={"a": BATCHES, "b": s}),
    ),
    "sanity": (
        "validation_data",
        "validation_steps",
        lambda m, s: m.fit(BATCHES, verbose=0, validation_data=s, num_sanity_val_steps=2),
    ),
    "evaluate": ("x", "steps", lambda m, s: m.evaluate(s, verbose=0)),
    "predict": ("x", "steps", lambda m, s: m.predict(s, verbose=0)),
}


@pytest.mark.parametrize("kind", list(ENDLESS))
@pytest.mark.parametrize("phase", PHASES)
def test_an_endless_source_without_its_steps_is_refused_before_step_1(phase, kind):
    argument, steps_name, call = REFUSALS[phase]
    model, source = _model(), ENDLESS[kind]()
    model.optimizer.param_groups[0]["lr"] = 0.5  # a step would move the weights
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    message = (
        rf"Expected `{argument}` to end, or `{steps_name}=` to bound .*Received: {argument}={kind} \(endless.*"
        rf"with {steps_name}=None.*Fix: pass {steps_name}=N"
    )
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(model, source)
    assert model.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())
    if kind == "itertools.cycle":  # nothing was drawn: the cycle still starts at the first batch
        assert [torch.equal(next(source)[0], x) for x, _ in BATCHES] == [True] * N


def test_an_endless_training_source_runs_with_a_budget_that_ends_the_run():
    """``max_steps`` ends a run over an endless source without ``steps_per_epoch`` (Lightning's rule)."""
    model = _model()
    history = model.fit(itertools.cycle(BATCHES), verbose=0, max_steps=2 * N)
    assert model.global_step == 2 * N and history.history["loss"] == [_hand_loss()]  # 2 passes of equal means


def _one_shot_run(phase: str, model: fitkit.Model):
    source = (b for b in BATCHES)
    if phase == "train":  # Keras' rule: the pass runs, the used-up generator stops the fit with a warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(source, epochs=3, verbose=0)
        assert [str(w.message)[:67] for w in caught] == [
            "The training data (generator) yielded no batch in epoch 2, so train"
        ]
        return history.history["loss"], [_hand_loss()]
    val = {"a": BATCHES, "b": source} if phase == "named validation" else source
    name = "validation_data['b']" if phase == "named validation" else "validation_data"
    message = rf"Expected `{name}` to give a pass for each of the 2 validations this fit schedules\. Received: "
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        model.fit(BATCHES, epochs=2, verbose=0, validation_data=val, num_sanity_val_steps=2 if phase == "sanity" else 0)
    assert torch.equal(next(source)[0], BATCHES[0][0])  # refused before a batch was drawn
    history = model.fit(BATCHES, epochs=2, verbose=0, validation_data=val, validation_steps=1)  # one batch each time
    with torch.no_grad():
        first, second = (torch.nn.functional.mse_loss(model.module(x), y).item() for x, y in BATCHES[1:])
    return history.history["val_b_loss" if phase == "named validation" else "val_loss"], [first, second]


@pytest.mark.parametrize("phase", ["train", "validation", "named validation", "sanity"])
def test_a_one_shot_generator_where_the_fit_needs_a_second_pass(phase):
    """``evaluate`` / ``predict`` and a single validation run a generator's one pass
    (``test_every_phase_stops_at_its_sources_bound``); a fit that needs a second pass stops after
    the first (training, Keras' rule) or is refused before step 1 (validation)."""
    got, expected = _one_shot_run(phase, _model())
    assert got == expected


def test_validation_of_a_cycling_iterator_stops_at_its_len_every_epoch():
    """The issue's example: ``fit(validation_data=it)`` validated forever (a regression)."""
    source = Cycling()
    history = _model().fit(list(BATCHES), epochs=3, verbose=0, validation_data=source)
    assert source.pulls == 3 * N  # one pass per epoch, the first batch's check put back
    assert history.history["val_loss"] == [_hand_loss()] * 3


def _val_fit(tmp_path, where: str, source: Cycling, signalled: bool = True):
    """The fit of the signal cases; ``signalled``: it ends by a SIGTERM (``SystemExit``), else it runs
    through (resuming from the backup in ``tmp_path`` if one is there)."""
    model = fitkit.Model(fixed_linear(2, 1, weight=0.5), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.125), loss="mse")
    kwargs: dict = {"validation_data": source}
    if where == "named sets":
        kwargs["validation_data"] = {"a": list(BATCHES), "b": source, "c": list(BATCHES)}
    if where == "inside the epoch":
        kwargs["validation_interval"] = 2
    if where == "at the run's end":  # steps 4 and 6: the last by validate_at_end
        kwargs.update(validation_interval=4, validate_at_end=True)
    backup = BackupAndRestore(tmp_path / "backup")
    if not signalled:
        model.fit(list(BATCHES), epochs=2, verbose=0, callbacks=[backup], **kwargs)
        return model, None
    with pytest.raises(SystemExit) as exit_info:
        model.fit(list(BATCHES), epochs=2, verbose=0, callbacks=[backup], **kwargs)
    return model, exit_info.value.code


@pytest.mark.parametrize("where", ["epoch end", "named sets", "inside the epoch"])
def test_a_sigterm_during_validation_ends_it_within_one_batch(tmp_path, where):
    pulls_at_signal: list[int] = []

    def signal_on_second(pull: int) -> None:
        if pull == 2 and not pulls_at_signal:
            pulls_at_signal.append(pull)
            os.kill(os.getpid(), signal.SIGTERM)

    source = Cycling(length=1000, limit=1000, on_pull=signal_on_second)  # validation that would take 1000 batches
    model, code = _val_fit(tmp_path, where, source)
    assert code == 128 + signal.SIGTERM
    assert source.pulls == 2  # the batch the signal came in was the last one validated
    steps = 2 if where == "inside the epoch" else N  # the validation after step 2, or at epoch 0's end
    assert model.global_step == steps
    saved = torch.load(tmp_path / "backup" / "backup.pt", weights_only=False)
    assert saved["global_step"] == steps  # the backup holds the last optimizer step


@pytest.mark.parametrize("where", ["epoch end", "named sets", "inside the epoch", "at the run's end"])
def test_the_resume_after_a_sigterm_during_validation_has_the_uninterrupted_history(tmp_path, where):
    """The cut validation counts nowhere, and the resume runs it again: History (per-epoch logs
    and every validation's record), weights and steps equal those of the run never signalled."""
    sent: list[int] = []
    length = 2 * N  # whole cycles: every validation sees the same batches, wherever its source stands
    at = length + 2 if where == "at the run's end" else 2  # the second batch of the first / last validation

    def signal_on(pull: int) -> None:
        if pull == at and not sent:
            sent.append(pull)
            os.kill(os.getpid(), signal.SIGTERM)

    _val_fit(tmp_path, where, Cycling(length=length, limit=10**6, on_pull=signal_on))
    assert sent == [at]
    resumed, _ = _val_fit(tmp_path, where, Cycling(length=length, limit=10**6), signalled=False)
    reference, _ = _val_fit(tmp_path / "reference", where, Cycling(length=length, limit=10**6), signalled=False)
    assert resumed.history.history == reference.history.history
    assert resumed.history.validations == reference.history.validations
    assert len(reference.history.validations) == (3 if where == "inside the epoch" else 2)  # steps 2, 4, 6; 4, 6
    assert resumed.global_step == reference.global_step == 2 * N
    assert torch.equal(resumed.module.weight, reference.module.weight)


def test_a_sanity_check_of_all_batches_stops_at_validation_steps():
    """``num_sanity_val_steps=-1`` checks a validation's batches: ``validation_steps`` of an endless
    source (it was refused as a one-shot source to hold in memory whole), teed, so the validation
    after epoch 1 sees the same ``N`` batches and nothing more is drawn."""
    source = Cycling(length=None)
    history = _model().fit(
        list(BATCHES), epochs=1, verbose=0, validation_data=source, validation_steps=N, num_sanity_val_steps=-1
    )
    assert source.pulls == N and history.history["val_loss"] == [_hand_loss()]
