"""Running loss and metric totals of one phase: a value object per epoch, validation or evaluate.

``update`` adds a batch with no host sync: the loss sum and the sample count (or the sum of
sample weights) stay device tensors, and the torchmetrics states update in place. The terms of a
loss that returns them (:mod:`fitkit.losses.terms`) have sums of their own, ``(K,)``, each added
as the loss is (times the same rows or weights), so their means are weighted as the loss's. ``running``
(batch logs, computed only when a callback reads them) and ``result`` (one transfer for all
values, at the end of the phase) turn them into means. Each phase gets its own
:class:`RunningTotals` with its own copy of the compiled metrics, so an ``evaluate`` nested in
``fit`` (a callback tracking a second data set) never touches the training epoch's totals.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch

from fitkit import distributed as _distributed
from fitkit import nest
from fitkit.checks import FitkitWarning
from fitkit.metrics import MetricSet

__all__ = ["RunningTotals", "Phases", "fresh_metrics"]


def fresh_metrics(template: MetricSet) -> MetricSet:
    """An independent copy of ``template`` with every state reset (one per phase)."""
    return template.clone()


def _nothing_counted(what: str | None) -> None:
    cause = (
        "every sample weight was 0 (or every target token was the loss's ignore_index), so the weighted "
        "mean loss sum(w * l) / sum(w) is 0 / 0"
    )
    if what is not None:
        raise ValueError(
            f"`{what}` has no loss to report: {cause}. Fix: pass data with at least one sample of weight > 0 "
            "(or one target that counts)."
        )
    warnings.warn(
        f"The loss of this epoch or validation counted nothing: {cause}; it is logged as NaN. Fix: give "
        "some samples a weight > 0 (or targets that count).",
        category=FitkitWarning,
        stacklevel=4,
    )


class RunningTotals:
    """Loss sum, sample count and metric states of one phase, on the device.

    Args:
        metrics: the phase's own :class:`~fitkit.metrics.MetricSet` (see :func:`fresh_metrics`).
        device: where the sums live.
        reduce: ``(total, count, wsum) -> (total, count, wsum)`` summed over ranks, or ``None``
            on one process.

    Example:
        >>> t = RunningTotals(MetricSet(), torch.device("cpu"))
        >>> t.update(torch.tensor(2.0), None, torch.zeros(3))
        >>> t.update(torch.tensor(5.0), None, torch.zeros(1))
        >>> t.result()  # (2 * 3 + 5 * 1) / 4
        {'loss': 2.75}
    """

    def __init__(self, metrics: MetricSet, device: torch.device, reduce: Any = None):
        self.metrics = metrics
        self.device = device
        self.reduce = reduce
        self.dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        self.loss_total = torch.zeros((), dtype=self.dtype, device=device)
        self.loss_count = 0
        self.loss_wsum: torch.Tensor | None = None
        # a loss of terms (fitkit.losses.terms): their names and sums, (K,), weighted as the loss's
        self.term_names: tuple[str, ...] | None = None
        self.terms_total: torch.Tensor | None = None

    @property
    def samples(self) -> float:
        """Samples (or the sum of sample weights, which syncs) the loss has seen so far."""
        w = 0.0 if self.loss_wsum is None else float(self.loss_wsum)
        return self.loss_count + w

    def update(
        self,
        loss: torch.Tensor | None,
        y_pred: object,
        y: object,
        sample_weight: torch.Tensor | None = None,
        denominator: int | torch.Tensor | None = None,
        terms: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add one batch: its mean loss times its denominator, and its metrics.

        ``denominator``: what the batch's mean loss divides by (rows, the sum of weights, the
        tokens that count; see :mod:`fitkit.losses.denominators`); ``None``: its rows, or the sum of
        its ``sample_weight``. ``terms``: the 0-dim terms of a loss that returned them
        (:mod:`fitkit.losses.terms`), each added as the loss is (times the same denominator).
        """
        factor: int | torch.Tensor = 0  # what the loss was multiplied by: the terms' too
        if loss is not None and denominator is not None:
            if isinstance(denominator, torch.Tensor):
                # a count of targets or a sum of weights; no cast: the in-place multiply-add (one
                # kernel, the product taken in the totals' dtype) and the sum below promote
                d = factor = denominator.detach() if denominator.requires_grad else denominator
                self.loss_total.addcmul_(loss.detach(), d)
                self.loss_wsum = d.to(self.dtype) if self.loss_wsum is None else self.loss_wsum + d  # float64 sums
            elif denominator:
                self.loss_total.add_(loss.detach(), alpha=denominator)
                self.loss_count += denominator
                factor = denominator
        elif loss is not None:
            if sample_weight is None:
                part = y if y is not None else y_pred
                # nest.rows' rule; a plain tensor (the common case) without the call
                n = (int(part.shape[0]) if part.dim() else 1) if isinstance(part, torch.Tensor) else nest.rows(part)
                if n:  # an empty batch (a rank's share of a short last batch) adds nothing, not 0/0
                    self.loss_total.add_(loss.detach(), alpha=n)
                    self.loss_count += n
                    factor = n
            else:
                ws = factor = sample_weight.detach().sum()
                self.loss_total.add_(loss.detach() * ws)
                self.loss_wsum = ws if self.loss_wsum is None else self.loss_wsum + ws
        if self.metrics.entries != [] and y is not None:
            self.metrics.update(y_pred, y)
        if terms is not None:
            self._add_terms(terms, factor)

    def _add_terms(self, terms: dict[str, torch.Tensor], factor: int | torch.Tensor) -> None:
        """Add a batch's terms times ``factor`` (the loss's), on the device (no host read)."""
        names = tuple(terms)
        total = self.terms_total
        if total is None or names != self.term_names:
            total = self._start_terms(names)
        values = torch.stack(list(terms.values())).detach()  # (K,)
        if isinstance(factor, torch.Tensor):
            total.addcmul_(values, factor)  # the loss's own multiply-add, term by term
        elif factor:
            total.add_(values, alpha=factor)

    def _start_terms(self, names: tuple[str, ...]) -> torch.Tensor:
        """The phase's first batch of terms: their sums start at 0; later batches must name the same terms."""
        if self.term_names is not None:
            raise ValueError(
                f"Expected the loss to return the same terms at every batch. Received: {list(names)} after "
                f"{list(self.term_names)} earlier in this epoch or evaluation. Fix: return every term at every "
                "batch (a 0 where a term does not apply)."
            )
        keys = {f"loss_{n}" for n in names}
        clash = sorted(keys & {e.key for e in self.metrics.entries or []})
        if clash:
            raise ValueError(
                f"Expected the loss's terms and the metrics to log under different names. Received: terms logged as "
                f"{clash}, which metrics log too. Fix: rename the term or the metric (compile(metrics={{name: ...}}))."
            )
        self.term_names = names
        self.terms_total = torch.zeros(len(names), dtype=self.dtype, device=self.device)
        return self.terms_total

    def _loss(self, total: torch.Tensor, count: float, wsum: Any) -> torch.Tensor | None:
        if not count and wsum is None:
            return None
        return total / (count if wsum is None else wsum + count)

    def running(self) -> dict[str, torch.Tensor]:
        """Running means as 0-dim device tensors (rank-local: no collective here)."""
        logs: dict[str, torch.Tensor] = {}
        loss = self._loss(self.loss_total, self.loss_count, self.loss_wsum)
        if loss is not None:
            logs["loss"] = loss.float()
            if self.terms_total is not None:
                means = cast(torch.Tensor, self._loss(self.terms_total, self.loss_count, self.loss_wsum)).float()
                logs.update(self._term_logs(means))
        for e in self.metrics.entries or []:
            if e.metric.update_count:
                # Batch logs are rank-local: a distributed sync here could deadlock when only
                # rank 0 reads them (the progress bar).
                with e.metric.sync_context(should_sync=False, should_unsync=False):
                    logs[e.key] = e.metric.compute()
        return logs

    def _term_logs(self, means: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"loss_<name>": mean}`` for the terms' means ``(K,)``, in the order the loss returned them."""
        return {f"loss_{n}": means[i] for i, n in enumerate(self.term_names or ())}

    def synced(self) -> int:
        """How many metrics :meth:`result` syncs over the ranks: those updated on this rank."""
        return sum(1 for e in self.metrics.entries or [] if e.metric.update_count)

    def result(self, what: str | None = None) -> dict[str, float]:
        """The phase's means as Python floats, reduced over ranks: one host sync for all.

        A phase whose loss counted nothing (every sample weight 0, every token ignored) has no
        mean loss: with ``what`` (``"evaluate"``) that is a ``ValueError`` naming it, otherwise
        the loss is logged as NaN with a :class:`~fitkit.checks.FitkitWarning`.
        """
        total, count, wsum = self.loss_total, self.loss_count, self.loss_wsum
        if self.reduce is not None:  # sums over ranks before the division (metrics sync in compute)
            total, count, wsum = self.reduce(total, count, wsum)
        logs: dict[str, torch.Tensor] = {}
        loss = self._loss(total, count, wsum)
        if loss is not None:
            logs["loss"] = loss
            if self.terms_total is not None:  # summed over ranks too (one all-reduce per epoch)
                terms = self.terms_total if self.reduce is None else _distributed.all_reduce_sum(self.terms_total)
                logs.update(self._term_logs(cast(torch.Tensor, self._loss(terms, count, wsum))))
        logs.update(self.metrics.compute())
        if not logs:
            return {}
        parts = [v.detach().to(self.dtype).reshape(()) for v in logs.values()]
        if wsum is not None and loss is not None:
            parts.append((wsum + count).to(self.dtype).reshape(()))  # the denominator, in the same transfer
        # float64 keeps the loss, summed in float64, exact (5/3 stays 1.6666666666666667).
        values = torch.stack(parts).tolist()
        if wsum is not None and loss is not None and values.pop() == 0:
            _nothing_counted(what)
        return dict(zip(logs.keys(), values, strict=True))

    # -- mid-epoch checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The totals and metric states, for a checkpoint taken inside an epoch.

        Under torchrun they are the sums over all ranks (a collective: every rank calls it), so
        the file resumes at any world size; ``shares`` adds each rank's own totals (one gather),
        so a relaunch on as many ranks gives each rank its own back and sums in the same order
        as the uninterrupted run (float32 metric states: bitwise the same epoch values).
        """
        total, count, wsum = self.loss_total, self.loss_count, self.loss_wsum
        if self.reduce is not None:
            total, count, wsum = self.reduce(total, count, wsum)
        metrics = self.metrics.state_dict(sync=self.reduce is not None)
        out = {"loss_total": total, "loss_count": count, "loss_wsum": wsum, "metrics": metrics}
        if self.terms_total is not None:  # a loss of terms: their names and sums (over ranks)
            terms = self.terms_total if self.reduce is None else _distributed.all_reduce_sum(self.terms_total)
            out["terms"] = {"names": list(self.term_names or ()), "total": terms}
        if self.reduce is not None:
            own = {
                "loss_total": self.loss_total.detach().cpu(),
                "loss_count": self.loss_count,
                "loss_wsum": None if self.loss_wsum is None else self.loss_wsum.detach().cpu(),
                "metrics": _cpu(self.metrics.state_dict(sync=False)),
            }
            if self.terms_total is not None:
                own["terms"] = {"names": list(self.term_names or ()), "total": self.terms_total.detach().cpu()}
            out["shares"] = _distributed.all_gather_object(own)  # once per backup, not per step
        return out

    def load_state_dict(self, state: dict[str, Any], owner: bool = True, rank: int = 0, ranks: int = 1) -> None:
        """Restore :meth:`state_dict`; metrics built from the first batch get their states at birth.

        On as many ranks as saved ``shares``: rank ``rank`` of ``ranks`` takes its own share.
        Otherwise the saved sums are over all ranks: one rank (``owner``) takes them, the others
        take zeros of the same kinds (a weight sum where one was kept, each metric's empty state
        with the saved update count). Either way the sums over ranks come out right, and every
        rank reaches the same collectives at the epoch's end (a rank without the metrics' states
        would skip their sync while the owner waits in it).
        """
        shares = state.get("shares")
        if shares is not None and len(shares) == ranks and ranks > 1:
            state, owner = shares[rank], True
        total, wsum = state["loss_total"].to(self.device), state["loss_wsum"]
        wsum = None if wsum is None else wsum.to(self.device)
        if owner:
            self.loss_total, self.loss_count, self.loss_wsum = total, state["loss_count"], wsum
        else:
            self.loss_total = torch.zeros_like(total)
            self.loss_count, self.loss_wsum = 0, None if wsum is None else torch.zeros_like(wsum)
        terms = state.get("terms")  # a loss of terms (absent from checkpoints of other losses)
        if terms is not None:
            sums = terms["total"].to(self.device, self.dtype)
            self.term_names = tuple(terms["names"])
            self.terms_total = sums if owner else torch.zeros_like(sums)
        self.metrics.load_state_dict(state["metrics"], owner=owner)


def _cpu(states: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Metric states on the CPU (a gather pickles them; a CUDA tensor would land on rank 0's device)."""

    def move(v: object) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().cpu()
        return [t.detach().cpu() for t in v] if isinstance(v, list) else v

    return {key: {k: move(v) for k, v in st.items()} for key, st in states.items()}


class Phases:
    """The phase stack of one model: the running phases' totals, innermost last.

    A fit epoch, its validation, an ``evaluate`` (nested in a callback too) and a
    ``*_on_batch`` call each push their own :class:`RunningTotals` while they run;
    ``update_metrics`` adds to the innermost one. The stack also owns the metric template
    that each phase copies (``model.metrics``): metrics built from a phase's first batch
    (iterable data) serve the later phases too.

    Args:
        device: where the sums live.
        reduce: as for :class:`RunningTotals` (torchrun), or ``None``.

    Example:
        >>> phases = Phases(torch.device("cpu"))
        >>> outer, inner = phases.new_totals(), phases.new_totals()
        >>> with phases.running(outer), phases.running(inner):
        ...     phases.stack[-1] is inner
        True
        >>> phases.stack
        []
    """

    def __init__(self, device: torch.device, reduce: Any = None):
        self.template = MetricSet()
        self.device, self.reduce = device, reduce
        self.stack: list[RunningTotals] = []  # read by update_metrics; changed by running() only

    def configure(self, template: MetricSet) -> None:
        """The compiled metrics: the template every later phase copies."""
        self.template = template

    def to(self, device: torch.device) -> None:
        """Later phases keep their sums on ``device`` (the template's states move too)."""
        self.device = device
        self.template.to(device)

    def new_totals(self) -> RunningTotals:
        """Fresh totals for a phase, with its own copy of the metrics."""
        return RunningTotals(fresh_metrics(self.template), self.device, self.reduce)

    @contextlib.contextmanager
    def running(self, totals: RunningTotals) -> Iterator[None]:
        """``totals`` is the innermost running phase while the body runs."""
        self.stack.append(totals)
        try:
            yield
        finally:
            self.stack.pop()

    @contextlib.contextmanager
    def template_kept(self) -> Iterator[None]:
        """The metric template as it was before the body ran (a run that must leave no trace:
        ``fit``'s sanity check adopts nothing from validation batches)."""
        template = self.template
        try:
            yield
        finally:
            self.template = template

    def adopt(self, totals: RunningTotals) -> None:
        """Metrics that ``totals`` built from its first batch become the template (once)."""
        if self.template.entries is None and totals.metrics.entries is not None:
            self.template = fresh_metrics(totals.metrics)
