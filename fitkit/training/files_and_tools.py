"""``Model``'s files and tools: weights, checkpoints, export, ``summary``, the LR and batch-size finders.

:class:`~fitkit.Model` inherits these methods; each hands its work to the module that owns it
(:mod:`fitkit.training.checkpoint`, :mod:`fitkit.tools`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch  # noqa: F401  (the examples use it)
from torch import nn  # noqa: F401  (the examples use it)

from fitkit.files.differences import check_state_dict_fits
from fitkit.tools.summary import summary_input, summary_table
from fitkit.training import checkpoint as _checkpoint
from fitkit.training import partial as _partial
from fitkit.training import run_files as _run_files

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["FilesAndTools"]


class FilesAndTools:
    """The file and tool methods of :class:`~fitkit.Model` (a base class of it, not used alone)."""

    module: nn.Module
    device: torch.device
    _core: Any

    def _model(self) -> Model:
        return cast("Model", self)

    # -- files -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict (never with ``_orig_mod.`` or ``module.`` prefixes).

        With ``strategy="fsdp"`` under torchrun it is the full, unsharded state: a collective
        that every rank calls; rank 0 gets the tensors on the CPU, other ranks an empty dict.

        Returns:
            ``{name: tensor}``, as ``nn.Module.state_dict`` returns it. Without FSDP the tensors
            share storage with the module's: clone them to keep a snapshot.

        Example:
            >>> from fitkit import Model
            >>> sorted(Model(nn.Linear(2, 1), device="cpu").state_dict())
            ['bias', 'weight']
        """
        if self._core.parallel is not None:
            return self._core.parallel.state_dict(self.module)
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True):
        """Load a module state dict (as ``nn.Module.load_state_dict``; a full one under FSDP).

        Args:
            state_dict: ``{name: tensor}``, e.g. from :meth:`state_dict`, without ``module.``
                or ``_orig_mod.`` prefixes; tensors are copied onto the module's device.
            strict: require the keys to match the module's exactly.

        Returns:
            ``nn.Module.load_state_dict``'s named tuple of ``missing_keys`` and
            ``unexpected_keys``.

        Raises:
            RuntimeError: keys that do not match (with ``strict=True``), or tensors of another
                shape or dtype; every difference is listed and nothing is loaded (with
                ``strict=False`` the keys both hold must still fit).

        Example:
            >>> from fitkit import Model
            >>> a, b = Model(nn.Linear(2, 1), device="cpu"), Model(nn.Linear(2, 1), device="cpu")
            >>> b.load_state_dict(a.state_dict())
            <All keys matched successfully>
        """
        if self._core.parallel is not None:
            return self._core.parallel.load_state_dict(self.module, state_dict, strict=strict)
        check_state_dict_fits(self.module, state_dict, strict)  # all or nothing, as load_weights
        return self.module.load_state_dict(state_dict, strict=strict)

    def save_weights(self, path: str | os.PathLike, *, trainable_only: bool = False) -> None:
        """Write the module's state dict to ``path`` atomically (under torchrun: rank 0 writes).

        With ``strategy="fsdp"`` gathering the state is a collective: call it on every rank.
        The file holds only tensors (no optimizer state); reload it with :meth:`load_weights`.
        A path ending in ``.safetensors`` writes safetensors (``pip install ".[safetensors]"`` from a checkout;
        tied weights are stored once), readable by Hugging Face's and timm's tools.

        With ``trainable_only=True`` the file holds only the parameters with ``requires_grad``
        (their full state-dict names): for a PEFT ``PeftModel`` the LoRA adapters, as the
        Transformers Trainer saves only a ``PeftModel``'s adapters. Load it back onto the same base
        model with ``load_weights(path, trainable_only=True)``. (PEFT's own adapter folder, for
        ``PeftModel.from_pretrained``, is ``model.module.save_pretrained(folder)``.)

        Args:
            path: the file to write; missing parent folders are created, an existing file is
                replaced.
            trainable_only: write the trainable parameters alone (no frozen weights, no buffers).

        Raises:
            OSError: the file cannot be written (the old file, if any, is left as it was).
            ValueError: ``trainable_only=True`` with every parameter frozen (nothing to save).

        Example:
            >>> from fitkit import Model
            >>> import os, tempfile
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_weights(os.path.join(d, "weights.pt"))
            ...     sorted(torch.load(os.path.join(d, "weights.pt"), weights_only=True))
            ['bias', 'weight']
        """
        _checkpoint.save_weights(self._model(), path, trainable_only)

    def load_weights(self, path: str | os.PathLike, strict: bool = True, *, trainable_only: bool = False) -> None:
        """Load a state dict saved by :meth:`save_weights` (or a checkpoint) onto ``model.device``.

        The file is read with ``torch.load(..., weights_only=True)``, or with safetensors when
        the path ends in ``.safetensors``. A file written by :meth:`save_checkpoint` works too:
        only its module weights are loaded. Keys, shapes and dtypes are compared first: on any
        mismatch nothing is loaded.

        Args:
            path: the file to read.
            strict: require the file's keys to match the module's exactly, as in
                ``nn.Module.load_state_dict``.
            trainable_only: the file holds the trainable parameters alone (written by
                ``save_weights(..., trainable_only=True)``): its keys are compared with those, and
                the frozen weights are left as they are.

        Raises:
            FileNotFoundError: no file at ``path``.
            RuntimeError: an unsafe file (pickled code; refused before it runs).
            ValueError: keys, shapes or dtypes that do not match (nothing is loaded then).

        Example:
            >>> from fitkit import Model
            >>> import os, tempfile
            >>> model, other = Model(nn.Linear(2, 1), device="cpu"), Model(nn.Linear(2, 1), device="cpu")
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_weights(os.path.join(d, "weights.pt"))
            ...     other.load_weights(os.path.join(d, "weights.pt"))
            >>> torch.equal(other.module.weight, model.module.weight)
            True
        """
        _checkpoint.load_weights(self._model(), path, strict, trainable_only)

    def checkpoint_state(self) -> dict[str, Any]:
        """The full training state as a ``weights_only``-loadable dict.

        Module, optimizer (and its class), scheduler, grad scaler, epoch, position inside the
        epoch (batches and samples; with ``steps_per_epoch``, the running pass's offset and what
        drew its order), global step, RNG states, callback states, history, the
        fitkit version; :meth:`save_checkpoint` adds a checksum of the payload.
        """
        return _checkpoint.checkpoint_state(self._model())

    def save_checkpoint(
        self, path: str | os.PathLike | None = None, *, sharded: bool | None = None, async_save: bool = False
    ) -> None:
        """Write the full training state (:meth:`checkpoint_state`) to ``path`` atomically.

        Under torchrun rank 0 writes (its RNG states); the state is unwrapped, so the file
        resumes at any world size. With ``strategy="fsdp"`` the checkpoint is a folder of shards
        (``torch.distributed.checkpoint``, see :mod:`fitkit.distributed.dcp`): every rank
        writes its own shards and no rank gathers the full state; it loads at any world size,
        one process included. Call it on every rank.

        Args:
            path: the file (or folder) to write; missing parent folders are created, an
                existing one is replaced once the new one is complete. ``None``: the run's
                ``last.pt``, beside the files of the ``ModelCheckpoint`` of the running or last
                fit (its ``save_last`` path if it has one; :mod:`fitkit.training.run_files`). A
                file of a ``keep_last`` callback's pattern joins its rotation.
            sharded: write a folder of shards; ``None``: under ``strategy="fsdp"`` only.
            async_save: for a sharded checkpoint: return once the state is copied off the
                training tensors and write it in a background thread (one save in flight;
                the next save, the end of ``fit`` and a SIGTERM wait for it).

        Raises:
            OSError: the file cannot be written (the old file, if any, is left as it was).
            ValueError: ``async_save=True`` for a one-file checkpoint.
            RuntimeError: no path, and no fit of this model had a ``ModelCheckpoint``.
        """
        model = self._model()
        _checkpoint.save_checkpoint(model, _run_files.save_path(model) if path is None else path, sharded, async_save)

    def load_checkpoint(
        self,
        path: str | os.PathLike | None = None,
        *,
        weights_only: bool = False,
        ignore_keys: Sequence[str] | None = None,
    ) -> int:
        """Restore a checkpoint; the next ``fit(..., initial_epoch=k)`` continues from it.

        Tensors are mapped onto ``model.device``. RNG states, the position inside the epoch
        and callback states are applied when ``fit`` reaches that point, so code run in
        between does not change the result. A ``BackupAndRestore`` calls it for you.

        Args:
            path: a file or a folder of shards written by :meth:`save_checkpoint`. ``None`` or
                ``"last"``: the newest checkpoint of the run's folder (that of the
                ``ModelCheckpoint`` of the running or last fit; :mod:`fitkit.training.run_files`).
            weights_only: load the module's weights alone (Composer's ``load_weights_only``).
            ignore_keys: the parts to leave out, of ``"module"``, ``"optimizer"``,
                ``"global_step"``, ``"scheduler"``, ``"position"``, ``"callbacks"``,
                ``"history"`` (Composer's ``load_ignore_keys``): e.g. fine-tune from a
                pre-training checkpoint without its optimizer, scheduler and position. Parts
                left out are not compared with the model; what was taken is logged (logger
                ``"fitkit"``, INFO). See :mod:`fitkit.training.partial`.

        Returns:
            ``k``: the epoch to pass as ``initial_epoch`` (0-based; 0 without ``"position"``).

        Raises:
            FileNotFoundError: no file at ``path``.
            RuntimeError: the model is not compiled (the optimizer must exist), or the file is
                unsafe.
            ValueError: the file is not a fitkit checkpoint, is damaged, or does not match the
                model (nothing is loaded then); an unknown name in ``ignore_keys``.
            TypeError: ``weights_only`` not a bool, ``ignore_keys`` not a list of names.
        """
        self._core.require_compiled("load_checkpoint")
        taken = _partial.taken_parts(weights_only, ignore_keys)
        model = self._model()
        if path is None or (isinstance(path, str) and path == "last"):
            path = _run_files.load_path(model)
        return _checkpoint.load_checkpoint(model, path, taken)

    def summary(
        self, print_fn: object = None, *, input_shape: tuple[int, ...] | None = None, example_input: object = None
    ) -> Any:
        """Print a rich table of layers: type, output shape, parameters (trainable, frozen).

        Output shapes come from one forward pass with hooks (eval mode, ``no_grad``, flags
        restored) on ``example_input``, else on zeros of ``input_shape``, else on the first
        batch of the last in-memory data that fit / evaluate saw; ``?`` when there is none.

        Args:
            print_fn: called with the table; default: print it to the terminal with rich
                (under torchrun, on rank 0 only).
            input_shape: the shape of one sample, without the batch dimension, e.g. ``(64,)``:
                a ``(1, *input_shape)`` batch of zeros in the parameters' dtype on
                ``model.device`` (float inputs only: pass token ids as ``example_input``).
            example_input: one input batch: a tensor, a tuple (``module(*x)``) or a dict
                (``module(**x)``); moved to ``model.device``.

        Returns:
            The ``rich.table.Table``: one row per submodule, then a ``Total`` row.

        Raises:
            TypeError: ``input_shape`` is not a tuple or list of ints.
            ValueError: both ``input_shape`` and ``example_input``, a size < 1, or an input
                the module fails on (the error is chained).

        Example:
            >>> from fitkit import Model
            >>> model = Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), device="cpu")
            >>> table = model.summary(print_fn=lambda table: None, input_shape=(4,))
            >>> [list(c.cells) for c in table.columns[:3]]
            [['0', '1', 'Total'], ['Linear', 'ReLU', ''], ['(1, 8)', '(1, 8)', '(1, 8)']]
        """
        example = summary_input(self.module, self.device, input_shape, example_input, self._core.example_x)
        return summary_table(self.module, print_fn, example)

    def export(
        self, path: str | os.PathLike, example_input: object, format: str = "torch", dynamic_batch: bool = True
    ) -> Path:
        """Export the module for serving: a ``torch.export`` program (``.pt2``) or ONNX.

        See :func:`fitkit.tools.export.export`: traced once in eval mode under ``no_grad`` (flags
        restored), with dimension 0 of the inputs symbolic when ``dynamic_batch``.

        Args:
            path: the file to write.
            example_input: one input batch (tensor, tuple or dict, as ``fit`` passes ``x``);
                moved to ``model.device``.
            format: ``"torch"`` (``torch.export.save``) or ``"onnx"`` (``torch.onnx.export``,
                needs ``pip install ".[onnx]"`` from a checkout).
            dynamic_batch: export a symbolic batch size instead of the example's.

        Returns:
            The path written.

        Raises:
            ValueError: an unknown ``format``.
            ImportError: ONNX without onnx / onnxscript.
            RuntimeError: a module that ``torch.export`` cannot trace (cause chained).

        Example:
            >>> from fitkit import Model
            >>> import tempfile
            >>> model = Model(nn.Linear(4, 2), device="cpu")
            >>> path = model.export(tempfile.mkdtemp() + "/linear.pt2", torch.zeros(1, 4))
            >>> torch.export.load(path).module()(torch.ones(3, 4)).shape
            torch.Size([3, 2])
        """
        from fitkit.data import device_batch
        from fitkit.tools.export import export

        example = device_batch(example_input, device=self.device)[0]
        return export(self.module, path, example, format=format, dynamic_batch=dynamic_batch)

    # -- tools ------------------------------------------------------------------------------
    def find_lr(self, x: object, y: object = None, **kwargs: Any) -> Any:
        """Sweep the learning rate and suggest one; the model is left exactly as it was.

        See :func:`fitkit.tools.lr_finder.find_lr` for the arguments (``batch_size``, ``start_lr``,
        ``end_lr``, ``num_steps``, ``smooth``, ``diverge_threshold``, ``plot``, ``path``).

        Returns:
            A :class:`fitkit.tools.lr_finder.LRFinderResult` (``lrs``, ``losses``, ``suggestion``).

        Example:
            >>> from fitkit import Model
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.compile(optimizer="sgd", loss="mse")
            >>> result = model.find_lr(torch.randn(32, 2), torch.randn(32, 1), num_steps=5)
            >>> len(result.lrs), result.lrs[-1]
            (5, 10.0)
        """
        from fitkit.tools.lr_finder import find_lr

        return find_lr(self, x, y, **kwargs)

    def find_batch_size(self, x: object, y: object = None, **kwargs: Any) -> Any:
        """The largest batch size that fits, by doubling; everything is put back afterwards.

        See :func:`fitkit.tools.batch_size_finder.find_batch_size` for the arguments
        (``init_val``, ``max_trials``, ``steps_per_trial``, ``max_val``); Lightning's
        ``BatchSizeFinder``.

        Returns:
            A :class:`fitkit.tools.batch_size_finder.BatchSizeResult` (``batch_size``, ``trials``).

        Example:
            >>> from fitkit import Model
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.compile(loss="mse")
            >>> model.find_batch_size(torch.randn(8, 2), torch.randn(8, 1)).trials  # 8: all the data
            [(2, True), (4, True), (8, True)]
        """
        from fitkit.tools.batch_size_finder import find_batch_size

        return find_batch_size(self, x, y, **kwargs)
