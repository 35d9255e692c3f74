"""What the docs say fitkit refuses, raises, warns about, accepts or ignores is proved.

Each claim of a page (``docs/``, the README, the public docstrings of ``fitkit/model.py``) that
fitkit refuses / raises / warns / accepts / ignores / passes on something is a row of ``CLAIMS``:
the page, words of the claim as the page writes them, and its proofs, each a test
(``tests/...py::name``, with ``[case]`` for one row of a table) or an example that the docs build
runs (``example: <code of that page>``). The registry moves with the pages:

- a claim whose words are no longer on its page fails, as does a proof whose test is gone or
  whose example is no longer executed on the page;
- every word of the claim vocabulary (``CLAIM_WORDS``) in a page's prose must lie inside a
  registered claim, or inside ``NOT_CLAIMS`` (the same words saying something else), so a new
  sentence that promises a refusal needs its proof here.

The claims no other test proved are proved below, one parametrized test per kind (refused before
the first step, named optional extras), with the page and line in each row's id.
"""

from __future__ import annotations

import ast
import importlib.util
import pickle
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import fitkit

ROOT = Path(__file__).resolve().parent.parent
README, MODEL = "README.md", "fitkit/model.py"
API, CALLBACKS_API, FILES_API, METRICS_API = (f"docs/api/{p}.rst" for p in ("fitkit", "callbacks", "files", "metrics"))
ARCH, CKPT, FILES, LOSSES = (
    f"docs/guides/{p}.rst" for p in ("architecture", "checkpoints", "files", "losses_and_weights")
)
KERAS, LIGHTNING, INSTALL = (
    "docs/guides/coming_from_keras.rst",
    "docs/guides/coming_from_lightning.rst",
    "docs/install.rst",
)
LOOP, CALLBACKS, SPEED, SCALE = (
    "docs/tutorials/01_loop_to_fit.py",
    "docs/tutorials/05_callbacks.py",
    "docs/tutorials/06_speed.rst",
    "docs/tutorials/07_scaling_out.rst",
)
MLFLOW, OPTUNA, EXPORT, HF = (
    "docs/tutorials/08_mlflow.rst",
    "docs/tutorials/09_optuna.rst",
    "docs/tutorials/10_export.rst",
    "docs/tutorials/11_huggingface.py",
)
HERE = "tests/test_doc_claims.py"
PACKAGING = "tests/test_packaging.py"
SWAPPING = "tests/callbacks/test_callbacks_swapping.py::test_two_averages_for_one_purpose_are_refused_before_step_1"
DECLARED = "tests/checks/test_declared_options.py::test_every_declared_option_refuses_wrong_values_before_step_1"
BAD_INPUT = "tests/checks/test_bad_inputs.py::test_bad_input_raises_a_clear_error_before_step_1_and_changes_nothing"
CHECKS = "tests/checks/test_checks.py::test_bad_input_raises_before_anything_changes"
SILENT = "tests/checks/test_silent_options.py::test_a_silent_option_is_refused_and_changes_nothing"
DAMAGED = "tests/training/test_state_fit.py::test_a_damaged_checkpoint_changes_nothing"
OTHER_MODEL = "tests/training/test_state_fit.py::test_a_checkpoint_of_another_module_lists_module_and_optimizer"
ON_EXCEPTION = (
    "tests/training/test_checkpoint_run_time.py::test_save_on_exception_leaves_a_file_that_resumes_the_crashed_run"
)
RAN_OUT = "tests/data/test_data.py::test_steps_per_epoch_restarts_a_reiterable_source"
FRACTIONAL = (
    "tests/training/test_step_validation.py::test_a_fractional_step_count_is_refused_with_the_fractions_that_exist"
)
MINIMUMS = "tests/training/test_min_epochs.py::test_bad_minimums_are_refused_before_step_1"
SRUN = "tests/distributed/test_distributed_group.py::test_srun_without_torchrun_is_refused_at_model"
LOCKS = "tests/files/test_files_locks.py"
RESUME_CHANGE = (
    "tests/training/test_resume_data_change.py::test_a_resume_onto_another_length_is_refused_and_restart_epoch_"
    "starts_it_over"
)
BACKUP_FALLBACK = (
    "tests/callbacks/test_callbacks_backup.py::test_a_damaged_backup_resumes_from_the_previous_one_with_a_warning"
)
DCP = "tests/distributed/test_distributed_dcp.py"
GROUP = "tests/distributed/test_distributed_group.py"
FINITE = "tests/training/test_finite.py"
CAUSAL = (
    "tests/losses/test_causal_shift.py::test_an_unknown_module_whose_labels_repeat_its_inputs_is_refused_before_step_1"
)
LABEL_NAMES = "tests/checks/test_bad_inputs.py::test_label_names_that_the_batches_do_not_hold_are_refused_before_step_1"
NO_PREDICTION = (
    "tests/losses/test_outputs.py::test_a_compiled_loss_without_a_prediction_fails_before_any_step_and_names_the_fix"
)
KEYS = "tests/training/test_preflight.py::test_a_key_forward_does_not_name_is_refused_unless_forward_takes_kwargs"
TIMEOUT_ELSEWHERE = (
    "tests/distributed/test_distributed_group.py::test_timeout_is_refused_for_a_process_group_fitkit_did_not_start"
)
ZERO_ROWS = (
    "tests/training/test_validation_state.py::test_zero_rows_of_other_sources_and_predict_keeps_the_output_shape"
)
CONTINUOUS_CW = "tests/checks/test_bad_inputs.py::test_class_weight_with_continuous_targets_is_an_error"


@dataclass(frozen=True)
class Claim:
    """A sentence of ``page`` (``phrase``: its words, as written) and what proves it."""

    page: str
    phrase: str
    proofs: tuple[str, ...]


def claim(page: str, phrase: str, *proofs: str) -> Claim:
    return Claim(page, phrase, proofs)


def refused(name: str) -> str:
    """A row of :func:`test_documented_refusal_is_raised_before_anything_changes`."""
    return f"{HERE}::test_documented_refusal_is_raised_before_anything_changes[{name}]"


CLAIMS = (
    # -- README.md ------------------------------------------------------------------------------------------------
    claim(
        README,
        "`import fitkit` warns when it finds it",
        f"{PACKAGING}::test_import_fitkit_warns_once_when_the_namesake_is_on_the_path",
    ),
    claim(
        README,
        "Optional extras, each with a clear error when missing",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line",
    ),
    # -- docs/api ---------------------------------------------------------------------------------------------------
    claim(
        CALLBACKS_API,
        "``fit`` refuses a second one with a ``ValueError`` before step 1 (weights and optimizer unchanged) that "
        "names both callbacks",
        SWAPPING,
    ),
    claim(FILES_API, "damage named with its fix (:class:`~fitkit.files.CheckpointError`)", DAMAGED),
    claim(
        API,
        "The checks come from the declaration and run before the function's body, so a refused call changes "
        "nothing; the message names the argument, what was expected, what was received and the fix.",
        DECLARED,
        "tests/checks/test_declared_options.py::test_every_excluded_pair_is_refused_before_step_1",
    ),
    claim(
        API,
        "``import fitkit`` warns once when an unrelated distribution named ``fitkit`` installs the same import package",
        f"{PACKAGING}::test_namesake_warning_is_given_once_with_the_fix",
        f"{PACKAGING}::test_import_fitkit_warns_once_when_the_namesake_is_on_the_path",
    ),
    claim(METRICS_API, "say it (below), else a ``ValueError``", refused("metrics-auroc-without-output")),
    claim(
        METRICS_API,
        "Otherwise the first batch raises a ``ValueError`` naming that fix, before any weight changes.",
        refused("metrics-auroc-without-output"),
        refused("metrics-binary-f1-without-output"),
    ),
    # -- docs/guides/architecture.rst -------------------------------------------------------------------------------
    claim(
        ARCH,
        "so a damaged or edited file changes nothing (a ``CheckpointError`` for content fitkit does not write, a "
        "``ValueError`` for a file of another model)",
        DAMAGED,
        OTHER_MODEL,
        "tests/files/test_files_content.py::test_a_crafted_checkpoint_is_refused_before_anything_changes",
    ),
    claim(
        ARCH,
        "once ``fit`` returns or raises, nothing of the call",
        "tests/training/test_loop.py::test_the_finished_fit_lets_go_of_its_data_and_callbacks",
    ),
    claim(
        ARCH,
        "dropped when the fit returns or raises",
        "tests/training/test_stepper.py::test_a_fit_hands_the_stepper_hooks_and_a_window_of_its_own_and_a_nested_"
        "step_has_its_own",
        "tests/training/test_loop.py::test_a_fit_that_raised_inside_an_accumulation_window_leaves_nothing_of_it_to_"
        "the_next",
    ),
    claim(
        ARCH,
        "so it needs ``steps`` (not refused: it would run until stopped)",
        "tests/training/test_loop_options.py::test_evaluate_steps_on_an_infinite_generator",
        "tests/training/test_loop_options.py::test_predict_steps_on_an_infinite_generator",
    ),
    # -- docs/guides/checkpoints.rst --------------------------------------------------------------------------------
    claim(CKPT, "keep (or refuse to replace) files", "example: except FileExistsError as e:"),
    claim(
        CKPT,
        "A fit whose step count cannot be known (a generator without ``max_steps``) is refused before step 1.",
        "tests/training/test_checkpoint_run_time.py::test_a_fraction_of_an_unknown_plan_is_refused_before_step_1",
    ),
    claim(
        CKPT,
        "``fit(max_steps=10)`` on a model that took 10 steps trains nothing, with a warning.",
        "tests/training/test_reset_time.py::test_without_it_max_steps_counts_every_fit_and_epochs_each_call",
    ),
    claim(
        CKPT,
        "``save_overwrite=False`` refuses, with a ``FileExistsError`` and nothing written",
        "example: except FileExistsError as e:",
    ),
    claim(CKPT, "when ``fit`` raises an ``Exception`` after at least one step", ON_EXCEPTION),
    # -- docs/guides/coming_from_keras.rst --------------------------------------------------------------------------
    claim(
        KERAS,
        "Where a Keras loss or metric name means what a fitkit name means, it is accepted as that name",
        "tests/losses/test_keras_names.py::test_binary_crossentropy_is_bce_on_probabilities",
        "tests/losses/test_keras_names.py::test_regression_loss_aliases_compute_fitkits_loss",
        "tests/losses/test_keras_names.py::test_keras_accuracy_names_are_accuracy_logged_as_written",
        "tests/losses/test_keras_names.py::test_binary_accuracy_and_auc_follow_the_loss",
    ),
    claim(
        KERAS,
        '``"categorical_crossentropy"`` are refused with the reason',
        "tests/losses/test_keras_names.py::test_keras_cross_entropies_on_probabilities_are_refused_with_the_logits_rule",
    ),
    claim(
        KERAS,
        "are errors that say what to write instead",
        "tests/checks/test_checks.py::test_a_loss_class_asks_for_an_instance",
        "tests/checks/test_checks.py::test_compile_with_a_learning_rate_names_the_ways_to_set_one",
    ),
    claim(KERAS, "an epoch ends early (one warning) when the data runs out", RAN_OUT),
    claim(KERAS, "so a float is refused with the fix", FRACTIONAL),
    # -- docs/guides/coming_from_lightning.rst ----------------------------------------------------------------------
    claim(LIGHTNING, "``on_exception.pt`` when ``fit`` raises after a step", ON_EXCEPTION),
    claim(LIGHTNING, "is a ``ValueError`` before the first step", MINIMUMS),
    claim(
        LIGHTNING,
        'refused, naming the valid values (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``)',
        refused("precision-bf16-true"),
        refused("precision-16-true"),
        refused("precision-64"),
    ),
    claim(LIGHTNING, "``srun`` with several tasks and no ``torchrun`` is refused with the recipe", SRUN),
    # -- docs/guides/files.rst ---------------------------------------------------------------------------------------
    claim(
        FILES,
        "refuses a second run on the same folder before its first step",
        f"{LOCKS}::test_a_second_run_on_a_running_runs_folder_is_refused_before_step_1",
    ),
    claim(
        FILES,
        "is ignored with a :class:`~fitkit.checks.FitkitWarning` and is never deleted or uploaded",
        "tests/files/test_files_owned.py::test_a_backup_edited_to_list_a_file_outside_the_folder_never_deletes_it",
        "tests/files/test_files_owned.py::test_mlflow_uploads_only_a_file_its_checkpoint_owns",
    ),
    claim(
        FILES,
        "An older checkpoint's absolute names are accepted when they lie inside the folder.",
        "tests/files/test_files_owned.py::test_an_old_checkpoint_with_absolute_names_is_accepted_inside_the_folder_only",
    ),
    claim(
        FILES,
        "it is refused before the first step with a ``ValueError`` naming both and the fix",
        RESUME_CHANGE,
        "tests/data/test_data_hf_datasets.py::test_backup_and_restore_resumes_a_shuffled_dataset_mid_epoch_exactly",
    ),
    claim(
        FILES,
        "gets a :class:`fitkit.files.LockError` (a ``RuntimeError``) before its first step",
        f"{LOCKS}::test_a_second_run_on_a_running_runs_folder_is_refused_before_step_1",
        f"{LOCKS}::test_two_callbacks_on_one_file_in_one_fit_are_refused_before_step_1",
        "example: except LockError as e:",
    ),
    claim(
        FILES,
        "is taken over with a warning, so a killed run resumes without a manual step",
        f"{LOCKS}::test_a_dead_runs_lock_is_taken_over_with_a_warning",
        f"{LOCKS}::test_a_reused_pid_of_another_process_is_taken_over_and_a_live_holder_is_not",
    ),
    claim(
        FILES,
        "the refusal names the locks near the one refused and this fix",
        f"{LOCKS}::test_take_over_locks_takes_every_lock_of_another_host_in_one_rerun_and_never_a_live_one",
        f"{LOCKS}::test_a_lock_of_another_host_is_never_taken_over",
    ),
    claim(
        FILES,
        "Locks are released when ``fit`` ends, also when it raises.",
        f"{LOCKS}::test_a_lock_is_held_while_fit_runs_and_released_after",
    ),
    claim(
        FILES,
        "A full disk raises ``OSError(ENOSPC)`` naming the file, and the older file stays.",
        "tests/files/test_files.py::test_a_full_disk_raises_enospc_naming_the_path",
        "tests/files/test_files.py::test_a_real_full_tmpfs",
    ),
    claim(
        FILES,
        "warn once when they cannot write (naming the file or store and the fix) and write nothing more",
        "tests/callbacks/test_callbacks_logging.py::test_a_full_disk_leaves_whole_csv_rows_and_names_the_file",
        "tests/callbacks/test_callbacks_logging.py::test_tensorboard_on_a_full_disk_warns_once_and_the_run_goes_on",
        "tests/callbacks/test_callbacks_mlflow.py::test_a_store_that_cannot_be_written_warns_once_and_training_goes_on",
        "tests/callbacks/test_callbacks_wandb.py::test_a_full_disk_under_the_run_warns_once_naming_the_folder",
    ),
    claim(
        FILES,
        "each raise a ``CheckpointError`` naming the file and what is wrong, and the model and its optimizer stay as "
        "they were",
        "tests/files/test_sharded_digests.py::test_a_flipped_byte_in_any_file_is_named_and_nothing_changes",
        "tests/files/test_sharded_digests.py::test_a_shard_of_another_run_is_named_and_nothing_changes",
        "tests/files/test_sharded_digests.py::test_an_extra_or_a_missing_file_is_named",
    ),
    claim(
        FILES,
        "loads as before, without a warning",
        "tests/files/test_sharded_digests.py::test_a_folder_without_a_manifest_loads_as_before_without_a_warning",
    ),
    claim(
        FILES,
        "``BackupAndRestore`` warns, naming both files, and resumes from ``backup.prev.pt``",
        BACKUP_FALLBACK,
        "tests/files/test_files_content.py::test_every_kind_of_damage_of_the_newest_backup_falls_back_to_the_previous_one",
    ),
    claim(
        FILES,
        "a file that holds pickled code or objects is refused before anything in it runs",
        "tests/files/test_files.py::test_twenty_malicious_pickles_are_refused_and_none_runs",
    ),
    claim(
        FILES,
        "``consolidate_weights`` refuse a crafted folder with ``fitkit.files.RefusedCheckpointError`` (a "
        "``CheckpointError`` and a ``RuntimeError``)",
        "tests/files/test_sharded_metadata_safety.py::test_a_crafted_index_is_refused_before_it_runs",
    ),
    claim(
        FILES,
        "refused this way is passed over for ``backup.prev.pt``, with a warning, as any damage",
        f"{HERE}::test_a_refused_newest_backup_is_passed_over_for_the_previous_one",
    ),
    claim(
        FILES,
        "An error torch's checkpoint reader or writer raises (its ``CheckpointException`` is a ``BaseException``, "
        "which ``except Exception`` misses) reaches you as a ``CheckpointError``",
        f"{DCP}::test_a_shard_torch_cannot_read_gives_a_checkpoint_error_and_a_backup_falls_back",
    ),
    claim(
        FILES,
        "as an ``OSError`` naming the checkpoint and the file, with the previous checkpoint kept",
        f"{DCP}::test_a_failed_sharded_save_is_an_os_error_naming_the_checkpoint",
    ),
    claim(
        FILES,
        "zip records that torch does not write, compressed records and declared sizes past the file's own are "
        "refused before they are read",
        "tests/files/test_files_content.py::test_a_hostile_compressed_record_is_refused_without_reading_it",
        "tests/files/test_files.py::test_a_zip_that_is_not_a_torch_file_is_named_damaged",
    ),
    claim(
        FILES,
        "or past the file's size is refused before it is parsed",
        "tests/files/test_files_content.py::test_damaged_safetensors_metadata_and_a_huge_header_are_named",
    ),
    # -- docs/guides/losses_and_weights.rst -------------------------------------------------------------------------
    claim(
        LOSSES,
        "refuses per-position weights with a ``ValueError`` before the first step",
        "tests/data/test_data_weights.py::test_per_position_class_weights_with_a_per_sample_loss_are_refused_before_"
        "step_1",
        refused("several-losses-per-position-sample-weight"),
    ),
    claim(
        LOSSES,
        "``class_weight`` with several targets (a tuple, list or dict ``y``, one per loss) is refused the same way",
        refused("several-losses-class-weight"),
        refused("several-losses-class-weight-dataloader"),
    ),
    claim(
        LOSSES,
        "``evaluate`` over data whose every weight is 0 (or every token ignored) has no loss to report and raises a "
        "``ValueError``; a training epoch or a validation of that kind logs "
        "``NaN`` with a ``FitkitWarning``",
        "tests/losses/test_denominators.py::test_evaluate_with_every_weight_zero_is_an_error_and_an_epoch_a_warning",
    ),
    claim(
        LOSSES,
        "is refused with the rows named; a loss that masks them (or a module that imputes its inputs) trains",
        f"{FINITE}::test_nan_targets_with_a_builtin_loss_are_refused_before_step_1",
        f"{FINITE}::test_a_loss_whose_value_or_gradient_is_nan_on_those_rows_is_refused",
        f"{FINITE}::test_a_loss_that_masks_missing_labels_trains_on_nan_targets",
        f"{FINITE}::test_a_module_that_imputes_its_inputs_trains_with_a_builtin_loss",
    ),
    claim(
        LOSSES,
        "Any other ``reduction`` (torch accepts any string when the module is built) is a ``ValueError`` from "
        "``compile``.",
        f"{SILENT}[a loss module's bogus reduction]",
        f"{BAD_INPUT}[compile loss reduction avg]",
    ),
    claim(
        LOSSES,
        "``fit`` says so once (a ``FitkitWarning`` with the fix)",
        "tests/training/test_hf.py::test_an_own_loss_without_num_items_on_ignored_labels_is_noted_once_under_"
        "accumulation",
    ),
    claim(
        LOSSES,
        "so weights with it are refused before the first step with a ``ValueError`` naming the cause and the fix",
        "tests/losses/test_own_loss_weights.py::test_weights_that_cannot_reach_a_mean_own_loss_are_refused_before_"
        "step_1",
    ),
    claim(LOSSES, "is refused until it is said", CAUSAL),
    claim(
        LOSSES,
        "are refused before the first step, naming the batch's keys: they would be ignored",
        LABEL_NAMES,
        f"{SILENT}[label_names matching no key]",
    ),
    claim(
        LOSSES,
        "a dict mixing the two kinds, an empty dict or a name that is not letters, digits, ``_``, ``.`` or ``-`` is "
        "refused before the first step",
        "tests/training/test_validation_sets.py::test_bad_dicts_are_refused_before_step_one",
    ),
    # -- docs/install.rst --------------------------------------------------------------------------------------------
    claim(
        INSTALL,
        "it warns once (a :class:`~fitkit.FitkitWarning` that names that distribution, its version and its folder)",
        f"{PACKAGING}::test_namesakes_names_another_distribution_that_installs_fitkit",
        f"{PACKAGING}::test_namesake_warning_is_given_once_with_the_fix",
    ),
    # -- the tutorials -------------------------------------------------------------------------------------------------
    claim(
        LOOP,
        "so a mistake raises at once and changes nothing",
        "example: model.fit(X, Y[:100], epochs=1, verbose=0)",
        CHECKS,
    ),
    claim(CALLBACKS, "``fit`` then warns, naming both files, and resumes from the previous one", BACKUP_FALLBACK),
    claim(
        CALLBACKS,
        "A monitor that no log will hold is an error before the first step",
        'example: callbacks=[EarlyStopping(monitor="val_acc")])',
        f"{BAD_INPUT}[EarlyStopping monitor never logged]",
    ),
    claim(
        CALLBACKS,
        "a ``val_`` monitor there is refused the same way",
        "tests/training/test_validation_state.py::test_batch_level_val_monitor_is_an_error_before_step_1",
    ),
    claim(CALLBACKS, "``fit`` refuses more before the first step, naming both", SWAPPING),
    claim(
        SPEED,
        "If compilation fails, fitkit warns once and continues eagerly.",
        "tests/compile/test_forward.py::test_failing_compile_falls_back_with_one_warning",
    ),
    claim(
        SPEED,
        "dynamo leaves FSDP2's sharded root module to run eagerly, without a warning",
        "tests/distributed/test_distributed_compile.py::test_jit_compile_under_torchrun_compiles_the_module_and_trains_"
        "as_eager",
    ),
    claim(
        SCALE,
        "resumes only at the world size it was saved on (a clear error otherwise)",
        "tests/training/test_position.py::test_a_source_resumed_by_batches_at_another_world_size_is_refused_before_a_step",
        "tests/training/test_position.py::test_already_sharded_data_resumed_at_another_world_size_is_refused_before_a_"
        "step",
    ),
    claim(
        SCALE,
        "fitkit refuses it at the first optimizer step, before anything is applied, naming the parameter and these "
        "fixes",
        "tests/distributed/test_distributed.py::test_a_parameter_without_a_gradient_under_plain_ddp_is_refused_at_the_"
        "first_step",
    ),
    claim(
        SCALE,
        "refused on the CPU",
        "tests/distributed/test_distributed.py::test_sync_batchnorm_converts_in_place_and_is_refused_off_cuda",
    ),
    claim(
        SCALE,
        "(a damaged or refused piece changes nothing)",
        f"{DCP}::test_a_damaged_or_unfinished_folder_is_named_and_nothing_changes",
    ),
    claim(
        SCALE,
        "every rank ends the epoch at the shortest, with a warning naming the counts",
        "tests/distributed/test_distributed_split.py::test_uneven_lengths_end_every_rank_at_the_shortest",
    ),
    claim(
        SCALE,
        "the waiting ranks then fail with the backend's timeout error and the job ends",
        f"{GROUP}::test_a_hanging_rank_ends_the_job_with_the_timeout_in_torchruns_summary",
    ),
    claim(SCALE, "``timeout=`` raises ``ValueError`` naming where to set it instead", TIMEOUT_ELSEWHERE),
    claim(
        SCALE,
        "An exception that ends a rank is written to torchrun's error file",
        f"{GROUP}::test_a_hanging_rank_ends_the_job_with_the_timeout_in_torchruns_summary",
        f"{GROUP}::test_after_an_exception_the_survivors_name_the_failed_rank_as_failed",
    ),
    claim(
        SCALE,
        "a rank that failed with an exception is named as such in the other ranks' lines (``rank 1 failed "
        "(RuntimeError) at epoch 0, in batch 3; rank 0 stopped because of it.``), not as behind",
        f"{GROUP}::test_after_an_exception_the_survivors_name_the_failed_rank_as_failed",
    ),
    claim(SCALE, "``fitkit.Model`` refuses it", SRUN),
    claim(
        SCALE,
        "The container's status is torchrun's own, 1 (the workers' 143 is not passed on)",
        "tests/distributed/test_distributed_kubernetes.py::test_the_tutorials_pytorchjob_stops_with_a_backup_within_"
        "the_grace_period_and_resumes_redoing_no_step",
    ),
    claim(
        MLFLOW,
        "A fit that raises leaves its run ``FAILED`` until the resumed fit finishes it.",
        "tests/callbacks/test_callbacks_mlflow.py::test_a_resumed_fit_logs_into_the_same_run",
        "tests/callbacks/test_callbacks_mlflow.py::test_a_failed_fit_ends_its_run_and_a_second_fit_starts_a_new_one",
    ),
    claim(
        OPTUNA,
        "then raises ``optuna.TrialPruned`` if ``trial.should_prune()``",
        "tests/callbacks/test_callbacks_optuna.py::test_prune_raises_trial_pruned_from_fit",
    ),
    claim(
        EXPORT,
        "the error says so and names the module",
        "tests/tools/test_export.py::test_a_module_that_cannot_be_traced_raises_a_clear_error",
        "example: except RuntimeError as error:",
    ),
    claim(
        HF,
        '``trainable_only`` takes a bool (a string such as ``"no"`` is a ``TypeError``), and with every parameter '
        "frozen ``save_weights(..., trainable_only=True)`` is a ``ValueError``: the file would hold nothing.",
        f"{SILENT}[trainable_only a string]",
        f"{SILENT}[every parameter frozen]",
    ),
    claim(
        HF,
        "a compiled loss or compiled metrics stop before the first step with a ``ValueError`` that names the fix",
        NO_PREDICTION,
        "tests/losses/test_outputs.py::test_metrics_without_a_prediction_fail_before_any_step_and_name_the_fix",
    ),
    claim(
        HF,
        "A label outside ``[0, num_labels)`` anywhere in in-memory data is an error before the first step.",
        "tests/training/test_hf.py::test_labels_out_of_range_anywhere_in_memory_fail_before_any_step",
    ),
    claim(
        HF,
        "a batch of rows of several lengths stops with a ``ValueError`` that says so",
        "tests/data/test_data_hf_datasets.py::test_rows_of_different_lengths_ask_for_a_collator_before_any_step",
        'example: print(str(e).split(" fitkit does not pad")[0])',
    ),
    claim(
        HF,
        "A ``datasets.Dataset`` without the torch format (its rows are Python lists) is refused before the first step "
        'with the fix, ``with_format("torch")``.',
        "tests/data/test_data_hf_datasets.py::test_a_dataset_without_the_torch_format_names_with_format",
    ),
    claim(
        HF,
        'a key it does not name (a leftover ``"text"`` column, say) is refused before the first step, with the '
        "batch's keys and ``forward``'s parameters listed; when ``forward`` takes ``**kwargs``, as most Transformers "
        "models' do today, every key is passed on to it, and the model uses it or ignores it",
        KEYS,
        "tests/training/test_preflight.py::test_dict_batch_with_keys_forward_does_not_take_lists_keys_and_parameters",
    ),
    claim(
        HF,
        "``labels`` is never one to remove: with a compiled loss it is the loss's target and is not passed on.",
        "tests/training/test_preflight.py::test_the_keys_error_never_tells_to_drop_labels",
        "tests/training/test_hf.py::test_labels_in_a_dict_batch_are_the_target_of_a_compiled_loss_and_of_metrics",
    ),
    claim(HF, "is refused before the first step with a ``ValueError`` that names ``shift_labels=``", CAUSAL),
    # -- fitkit/model.py's docstrings --------------------------------------------------------------------------------
    claim(
        MODEL,
        "refused (``ValueError``) when a group started elsewhere is running",
        TIMEOUT_ELSEWHERE,
        "tests/callbacks/test_ray.py::test_model_timeout_is_refused_in_rays_process_group",
    ),
    claim(
        MODEL,
        "TypeError: ``module`` is not an ``nn.Module``, ``strategy`` not a string or ``FSDP``, ``timeout`` not a "
        "number.",
        f"{CHECKS}[module-type]",
        "tests/distributed/test_distributed.py::test_strategy_is_validated",
        f"{GROUP}::test_timeout_is_checked",
    ),
    claim(
        MODEL,
        "ValueError: an unknown ``strategy``; a ``timeout`` that is not positive, or given while a process group that "
        "fitkit did not start is running; an ``activation_checkpointing`` that picks no submodule, or one with an "
        "FSDP strategy.",
        "tests/distributed/test_distributed.py::test_strategy_is_validated",
        f"{GROUP}::test_timeout_is_checked",
        TIMEOUT_ELSEWHERE,
        "tests/training/test_activation_checkpointing.py::test_bad_specs",
    ),
    claim(
        MODEL,
        "TypeError: ``device`` is neither a string nor a ``torch.device``. ValueError: not a device name, or a device "
        "this machine lacks.",
        refused("to-device-int"),
        refused("to-device-mps-lacking"),
        f"{CHECKS}[device-name]",
    ),
    claim(MODEL, "so ``fit`` refuses another averaging callback that swaps in at the end", SWAPPING),
    claim(MODEL, "dict batch does not hold are refused before step 1 (they would be ignored)", LABEL_NAMES),
    claim(MODEL, "on a module fitkit does not know is refused before step 1", CAUSAL),
    claim(
        MODEL,
        "ValueError: unknown names (the message lists valid ones), bad values. TypeError: wrong types.",
        CHECKS,
        DECLARED,
    ),
    claim(
        MODEL,
        "refused (``ValueError``) with a ``DataLoader`` or another iterable of batches",
        "tests/data/test_data_sources.py::test_batch_size_with_a_dataloader_is_refused_before_anything_changes",
    ),
    claim(MODEL, "an epoch ends early (one warning) when the data runs out", RAN_OUT),
    claim(MODEL, "``ValueError`` without ``validation_interval``", refused("validate-at-end-without-interval")),
    claim(MODEL, "``ValueError`` above ``epochs`` / ``max_steps``", MINIMUMS),
    claim(
        MODEL,
        "``ValueError`` with a ``Timer`` in the callbacks already",
        "tests/callbacks/test_callbacks_timer.py::test_fit_max_time_adds_a_timer",
    ),
    claim(MODEL, "another is a ``ValueError`` before step 1", RESUME_CHANGE),
    claim(
        MODEL,
        "A shuffled DataLoader or a generator is refused.",
        "tests/training/test_quick_runs.py::test_overfit_batches_refuses_data_whose_batches_change",
    ),
    claim(
        MODEL,
        "``-1`` with one that has no ``len()`` is a ``ValueError``",
        "tests/training/test_invariant_checks.py::test_sanity_all_of_a_one_shot_source_without_len_is_refused_before_"
        "step_1",
    ),
    claim(
        MODEL,
        "RuntimeError: ``compile`` was not called. TypeError: an argument of the wrong type. ValueError: a bad value "
        "or data (lengths, shapes, labels, NaN / inf values, negative sample weights), raised before the first step "
        "for in-memory data, so the weights are left as they were; a training or scheduled validation source that "
        "yields no batch.",
        refused("fit-before-compile"),
        BAD_INPUT,
        ZERO_ROWS,
        "tests/training/test_validation_state.py::test_used_up_validation_generator_is_an_error_in_epoch_two",
    ),
    claim(
        MODEL,
        "RuntimeError: ``compile`` was not called. TypeError: an argument of the wrong type. ValueError: a bad value "
        "or data (lengths, shapes, labels), or a source with no sample.",
        refused("evaluate-before-compile"),
        f"{BAD_INPUT}[evaluate sample_weight length]",
        "tests/training/test_validation_state.py::test_fit_and_evaluate_on_zero_rows_are_errors_and_predict_gives_"
        "zero_rows",
    ),
    claim(
        MODEL,
        "``(x, y)`` batches are accepted and ``y`` is ignored.",
        "tests/model/test_model.py::test_predict_accepts_x_y_batches_and_ignores_y",
    ),
    claim(MODEL, "another source that yields no batch is a ``ValueError``.", ZERO_ROWS),
    claim(
        MODEL,
        "x: inputs, as for :meth:`fit` (targets, if any, are ignored).",
        "tests/model/test_model.py::test_predict_accepts_x_y_batches_and_ignores_y",
    ),
    claim(
        MODEL,
        "TypeError: an argument of the wrong type. ValueError: a bad value, or a source that yields no batch.",
        ZERO_ROWS,
        DECLARED,
    ),
    claim(
        MODEL,
        "RuntimeError: ``compile`` was not called. TypeError: ``return_dict`` is not a bool (before the step). "
        "ValueError: a label without a class weight.",
        refused("train_on_batch-before-compile"),
        "tests/model/test_model.py::test_on_batch_return_dict_false_gives_keras_scalar_or_list",
        "tests/training/test_loop_options.py::test_train_on_batch_class_weight_names_a_missing_class",
    ),
    claim(
        MODEL,
        "RuntimeError: ``compile`` was not called. TypeError: ``return_dict`` is not a bool.",
        refused("test_on_batch-before-compile"),
        "tests/model/test_model.py::test_on_batch_return_dict_false_gives_keras_scalar_or_list",
    ),
)

# Words of the claim vocabulary that say something else (a noun, the user's own code, torch's behaviour).
NOT_CLAIMS = (
    claim(LIGHTNING, "What fitkit counts differently, or refuses", "a section title: the table's rows are the claims"),
    claim(LOSSES, "every token ignored) adds nothing (a 0 loss, never 0/0)", "a value, shown by the example below"),
    claim(LOSSES, "sample weights weigh them; ignored targets add nothing", "a value, shown by the example below"),
    claim(LOSSES, "the last position ignored)", "what a shift is"),
    claim(MODEL, "job ends with an error (a rank that hangs", "torch's timeout"),
    claim(MODEL, "the last position is ignored)", "what a shift is"),
    claim(SPEED, "and where none is ignored every batch's count is its size", "a cost"),
    claim(SPEED, "give a batch where every target is ignored", "a cost"),
    claim(SPEED, "here an ignored target goes", "a cost"),
    claim(SPEED, "and no ignored targets", "a cost"),
    claim(SCALE, "(ignored targets, tokens, weights, a DataLoader's labels)", "a cost"),
    claim(SCALE, "Rank 0 says so on standard error, in one line", "a stream"),
)

CLAIM_WORDS = re.compile(
    r"\b(refus\w*|raise[sd]?|raising|warns?|warning|\w*Warning|\w+Error|\w*Exception|accept(?:s|ed)?|ignored|ignores"
    r"|passed on|passes on|errors?)\b"
)
# The pages whose claims are registered: every page of the docs, the README, the Model's docstrings.
PAGES = sorted(
    [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "docs").rglob("*.rst")
        if not {"_build", "gallery"} & set(p.parts) and p.name != "GALLERY_HEADER.rst"
    ]
    + [p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "tutorials").glob("[0-9][0-9]_*.py")]
    + [README, MODEL]
)
_CODE_DIRECTIVE = re.compile(r"^\s*\.\. (testcode|testoutput|doctest|testsetup|testcleanup|code-block|code)::")
_EXECUTED_DIRECTIVE = re.compile(r"^\s*\.\. (testcode|doctest|testsetup)::")


@dataclass(frozen=True)
class Text:
    """A page split into its prose and its executed code, whitespace collapsed, with line numbers."""

    prose: str
    starts: tuple[tuple[int, int], ...]  # (offset in prose, line number) of each prose line
    code: str


def _rst_lines(lines: list[str]) -> tuple[list[tuple[int, str]], list[str]]:
    prose, code, inside, executed, indent = [], [], False, False, 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if _CODE_DIRECTIVE.match(line):
            inside, executed, indent = True, bool(_EXECUTED_DIRECTIVE.match(line)), len(line) - len(line.lstrip())
            continue
        if inside and stripped and len(line) - len(line.lstrip()) <= indent:
            inside = False
        if not inside:
            prose.append((number, stripped))
        elif executed:
            code.append(stripped)
    return prose, code


def _script_lines(lines: list[str]) -> tuple[list[tuple[int, str]], list[str]]:
    """A sphinx-gallery script: the comments are prose (its title docstring too), the rest runs."""
    prose, code = [], []
    docstring = ast.get_docstring(ast.parse("\n".join(lines))) or ""
    prose += [(number, line.strip()) for number, line in enumerate(docstring.splitlines(), 2)]
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#") and "sphinx_gallery" not in stripped:
            prose.append((number, stripped.lstrip("#").strip()))
        elif stripped and not stripped.startswith(('"""', "#")):
            code.append(stripped)
    return prose, code


def _docstring_lines(source: str) -> tuple[list[tuple[int, str]], list[str]]:
    """A module of fitkit: its docstrings are prose, their ``>>>`` lines the code doctest runs."""
    prose, code = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node, clean=False):
            first = node.body[0].lineno
            for i, line in enumerate(ast.get_docstring(node, clean=False).splitlines()):
                stripped = line.strip()
                (code.append(stripped[4:]) if stripped.startswith(">>> ") else prose.append((first + i, stripped)))
    return sorted(prose), code


def _markdown_lines(lines: list[str]) -> tuple[list[tuple[int, str]], list[str]]:
    prose, inside = [], False
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            prose.append((number, line.strip()))
    return prose, []


@cache
def page_text(page: str) -> Text:
    source = (ROOT / page).read_text(encoding="utf-8")
    if page.endswith(".md"):
        prose, code = _markdown_lines(source.splitlines())
    elif page.startswith("fitkit/"):
        prose, code = _docstring_lines(source)
    elif page.endswith(".py"):
        prose, code = _script_lines(source.splitlines())
    else:
        prose, code = _rst_lines(source.splitlines())
    return _joined(prose, code)


def _joined(prose: list[tuple[int, str]], code: list[str]) -> Text:
    text, starts = "", []
    for number, line in prose:
        if line:
            starts.append((len(text), number))
            text += line + " "
    return Text(text, tuple(starts), " ".join(" ".join(code).split()))


def _norm(words: str) -> str:
    return " ".join(words.split())


def line_of(page: str, phrase: str) -> int:
    """The line where ``phrase`` starts on ``page`` (0: not on it)."""
    text = page_text(page)
    at = text.prose.find(_norm(phrase))
    return max((n for start, n in text.starts if start <= at), default=0) if at >= 0 else 0


def unregistered(page: str, registered: list[str]) -> list[str]:
    """Each word of the claim vocabulary in ``page``'s prose outside every ``registered`` phrase."""
    text = page_text(page)
    covered = []
    for phrase in registered:
        start = text.prose.find(_norm(phrase))
        while start >= 0:
            covered.append((start, start + len(_norm(phrase))))
            start = text.prose.find(_norm(phrase), start + 1)
    left = []
    for m in CLAIM_WORDS.finditer(text.prose):
        if not any(a <= m.start() < b for a, b in covered):
            number = max(n for start, n in text.starts if start <= m.start())
            left.append(f"{page}:{number}: {m.group(0)!r} in ...{text.prose[max(0, m.start() - 60) : m.end() + 40]}...")
    return left


def proof_problem(page: str, proof: str) -> str | None:
    """Why ``proof`` proves nothing (no such test, no such case, not executed on ``page``), or ``None``."""
    if proof.startswith("example: "):
        code = page_text(page).code
        return None if _norm(proof[len("example: ") :]) in code else f"{proof!r} is not executed on {page}"
    path, _, name = proof.partition("::")
    name, _, case = name.partition("[")
    if not (ROOT / path).is_file():
        return f"{path}: no such file"
    source = (ROOT / path).read_text(encoding="utf-8")
    names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name not in names or not name.startswith("test"):
        return f"{path}: no test {name}"
    if case and case[:-1] not in source:
        return f"{path}: {name} has no case {case[:-1]!r}"
    return None


def _claim_id(c: Claim) -> str:
    return f"{c.page}:{line_of(c.page, c.phrase)}"


@pytest.mark.parametrize("c", [pytest.param(c, id=_claim_id(c)) for c in CLAIMS])
def test_the_claim_is_on_its_page_and_its_proofs_exist(c):
    assert c.page in PAGES, c.page
    assert line_of(c.page, c.phrase), f"no longer on {c.page}: {c.phrase!r}; move the claim with its page"
    problems = [problem for problem in (proof_problem(c.page, p) for p in c.proofs) if problem]
    assert c.proofs and not problems, problems


@pytest.mark.parametrize("c", [pytest.param(c, id=_claim_id(c)) for c in NOT_CLAIMS])
def test_a_phrase_registered_as_no_claim_is_on_its_page(c):
    assert line_of(c.page, c.phrase), f"no longer on {c.page}: {c.phrase!r}"


@pytest.mark.parametrize("page", PAGES)
def test_every_claim_word_of_the_page_is_in_a_registered_claim(page):
    registered = [c.phrase for c in (*CLAIMS, *NOT_CLAIMS) if c.page == page]
    left = unregistered(page, registered)
    assert not left, "claims without a proof in CLAIMS (or, if they claim nothing, NOT_CLAIMS):\n" + "\n".join(left)


def test_the_registry_checks_fail_where_they_should(tmp_path, monkeypatch):
    """A page with an unregistered refusal, a missing test, a case and an example that do not exist."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.rst").write_text(
        "\n\n\n``fit`` refuses a float.\nIt also\nwarns once.\n\n.. testcode::\n\n   print(1)\n\n"
        ".. code-block:: python\n   :caption: Keras\n\n   raise ValueError\n",
        encoding="utf-8",
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('def test_a():\n    "case one"\n', encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page_text.cache_clear()
    try:
        assert line_of("docs/p.rst", "It also warns once.") == 5
        assert unregistered("docs/p.rst", ["It also warns once."]) == [
            "docs/p.rst:4: 'refuses' in ...``fit`` refuses a float. It also warns once. ..."
        ]
        assert unregistered("docs/p.rst", ["``fit`` refuses a float.", "warns"]) == []  # code blocks are no prose
        assert proof_problem("docs/p.rst", "example: print(1)") is None
        assert (
            proof_problem("docs/p.rst", "example: raise ValueError")
            == "'example: raise ValueError' is not executed on docs/p.rst"
        )
        assert proof_problem("docs/p.rst", "tests/test_x.py::test_a[case one]") is None
        assert (
            proof_problem("docs/p.rst", "tests/test_x.py::test_a[case two]")
            == "tests/test_x.py: test_a has no case 'case two'"
        )
        assert proof_problem("docs/p.rst", "tests/test_x.py::test_b") == "tests/test_x.py: no test test_b"
        assert proof_problem("docs/p.rst", "tests/test_y.py::test_a") == "tests/test_y.py: no such file"
    finally:
        page_text.cache_clear()


# -- the claims no other test proved ----------------------------------------------------------------------------------
X = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 1] * 4)
TOKENS = torch.tensor([[0, 0, 1], [1, 1, 0]])


class Twice(nn.Module):
    """Two outputs ``(B, T, 2)`` of logits 0, for two losses on per-token targets ``(B, T)``."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        z = self.b.expand(x.shape[0], x.shape[1], 2)
        return z, z


def _compiled(module: nn.Module, **kwargs) -> fitkit.Model:
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer="sgd", **{"loss": "mse", **kwargs})
    return model


def _ce(y_pred, y):  # a plain callable: fitkit cannot tell logits from probabilities
    return F.cross_entropy(y_pred, y)


def _bce(y_pred, y):
    return F.binary_cross_entropy_with_logits(y_pred.squeeze(-1), y.float())


# name: (the model, the call, the error, fitkit's message)
REFUSALS: dict[str, tuple[Callable[[], fitkit.Model], Callable[[fitkit.Model], object], type, str]] = {
    "metrics-auroc-without-output": (
        lambda: _compiled(nn.Linear(3, 2), loss=_ce, metrics=["auroc"]),
        lambda m: m.fit(X, LABELS, batch_size=4, verbose=0),
        ValueError,
        r"Metric 'auroc' needs probabilities, and the loss \(_ce\) does not say whether the module outputs logits or "
        r"probabilities\. Fix: pass `fitkit\.metrics\.MetricSpec\('auroc', output='logits'\)`",
    ),
    "metrics-binary-f1-without-output": (
        lambda: _compiled(nn.Linear(3, 1), loss=_bce, metrics=["f1"]),
        lambda m: m.fit(X, LABELS, batch_size=4, verbose=0),
        ValueError,
        r"Metric 'f1' needs a threshold for binary predictions.*Fix: .*`fitkit\.losses\.Loss\(fn, output='logits'\)`",
    ),
    **{
        f"precision-{p}": (
            lambda: _compiled(nn.Linear(3, 1)),
            lambda m, p=p: m.compile(optimizer="sgd", loss="mse", precision=p),
            ValueError,
            rf"Unknown precision '{p}'\. Valid values: 32, bf16-mixed, 16-mixed\. Fix",
        )
        for p in ("bf16-true", "16-true", "64")
    },
    "several-losses-per-position-sample-weight": (
        lambda: _compiled(Twice(), loss=["cross_entropy", "cross_entropy"]),
        lambda m: m.fit(torch.zeros(2, 3), (TOKENS, TOKENS), sample_weight=torch.ones(2, 3), verbose=0),
        ValueError,
        r"Expected `sample_weight` to be a 1-D array with one weight per sample.*Received shape \(2, 3\)\. Fix",
    ),
    "several-losses-class-weight": (
        lambda: _compiled(Twice(), loss=["cross_entropy", "cross_entropy"]),
        lambda m: m.fit(torch.zeros(2, 3), (TOKENS, TOKENS), class_weight={0: 1, 1: 3}, verbose=0),
        ValueError,
        r"Expected one target tensor `y` with `class_weight`.*Received: y, a tuple of 2 targets.*Fix: .*"
        r"sample_weight=fitkit\.data\.ClassWeights\(class_weight\)\(y\[0\]\)",
    ),
    "several-losses-class-weight-dataloader": (
        lambda: _compiled(Twice(), loss=["cross_entropy", "cross_entropy"]),
        lambda m: m.fit(
            DataLoader(list(zip(torch.zeros(2, 3), zip(TOKENS, TOKENS, strict=True), strict=True)), batch_size=2),
            verbose=0,
            class_weight={0: 1, 1: 3},
        ),
        ValueError,
        r"Expected one target tensor `y` with `class_weight`.*Received: y, a list of 2 targets",
    ),
    "validate-at-end-without-interval": (
        lambda: _compiled(nn.Linear(3, 1)),
        lambda m: m.fit(X, X[:, :1], validation_data=(X, X[:, :1]), validate_at_end=True, verbose=0),
        ValueError,
        r"validate_at_end=True adds a validation .* but validation_interval is None .*Fix: pass validation_interval=N",
    ),
    "to-device-int": (
        lambda: _compiled(nn.Linear(3, 1)),
        lambda m: m.to(3),
        TypeError,
        r"Expected `device` to be 'auto', a device string or a torch\.device\. Received: device=3 of type int",
    ),
    "to-device-mps-lacking": (
        lambda: _compiled(nn.Linear(3, 1)),
        lambda m: m.to("mps"),
        ValueError,
        r"Received: device='mps', but MPS is not available on this machine",
    ),
    **{
        f"{verb}-before-compile": (
            lambda: fitkit.Model(nn.Linear(3, 1), device="cpu"),
            lambda m, verb=verb: (
                getattr(m, verb)(X, X[:, :1], verbose=0)
                if verb in ("fit", "evaluate")
                else getattr(m, verb)(X, X[:, :1])
            ),
            RuntimeError,
            rf"`{verb}` needs a compiled model\. Call `model\.compile\(optimizer=\.\.\., loss=\.\.\.\)` before "
            rf"`model\.{verb}\(\.\.\.\)`",
        )
        for verb in ("fit", "evaluate", "train_on_batch", "test_on_batch")
    },
}


def _state(model: fitkit.Model) -> list[torch.Tensor]:
    optimizer = [t for s in model.optimizer.state.values() for t in s.values()] if model.optimizer else []
    return [t.detach().clone() for t in (*model.module.parameters(), *model.module.buffers(), *optimizer)]


@pytest.mark.parametrize("name", list(REFUSALS))
def test_documented_refusal_is_raised_before_anything_changes(name):
    if name == "to-device-mps-lacking" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    build, call, error, match = REFUSALS[name]
    model = build()
    before, device, step = _state(model), model.device, model.global_step
    with pytest.raises(error, match=match):
        call(model)
    after = _state(model)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert (model.device, model.global_step) == (device, step) == (torch.device("cpu"), 0)


def _history_plot() -> object:
    return fitkit.History().plot()


def _export_onnx(tmp_path: Path) -> object:
    return fitkit.Model(nn.Linear(2, 1), device="cpu").export(tmp_path / "m.onnx", torch.zeros(1, 2), format="onnx")


# extra: (modules that go missing, the call that needs one of them, the error)
EXTRAS: dict[str, tuple[tuple[str, ...], Callable[[Path], object], type]] = {
    "plot": (("matplotlib", "matplotlib.pyplot"), lambda tmp: _history_plot(), ImportError),
    "tensorboard": (("torch.utils.tensorboard",), lambda tmp: fitkit.callbacks.TensorBoard(tmp), ImportError),
    "mlflow": (("mlflow",), lambda tmp: fitkit.callbacks.MLflowLogger(), ImportError),
    "optuna": (("optuna",), lambda tmp: fitkit.callbacks.OptunaPruning(object()), ImportError),
    "onnx": (("onnx", "onnxscript"), _export_onnx, ImportError),
    "safetensors": (
        ("safetensors", "safetensors.torch"),
        lambda tmp: fitkit.Model(nn.Linear(2, 1), device="cpu").save_weights(tmp / "w.safetensors"),
        ImportError,
    ),
    "wandb": (("wandb",), lambda tmp: fitkit.callbacks.WandbLogger(), ImportError),
    "ray": (("ray",), lambda tmp: fitkit.callbacks.RayReport(), ImportError),
    "examples": (
        ("sklearn", "sklearn.datasets", "sklearn.model_selection"),
        lambda tmp: importlib.import_module("fitkit.examples.digits").load_digits_split(),
        SystemExit,
    ),
}


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_a_missing_extra_is_named_with_its_install_line(extra, tmp_path, monkeypatch):
    """README: each extra fitkit imports itself names its install line when its package is missing
    (``hf``, ``stateful`` and ``peft`` are the user's own imports: Python names those)."""
    missing, call, error = EXTRAS[extra]
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name, *a))
    with pytest.raises(error, match=rf"pip install '\.\[{extra}\]'`? from a checkout"):
        call(tmp_path)
    assert list(tmp_path.iterdir()) == []


class _Exec:
    """Unpickled as ``exec(...)``: writes ``marker`` if it ever runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.slow  # the first import of torch.distributed.checkpoint
def test_a_refused_newest_backup_is_passed_over_for_the_previous_one(tmp_path):
    """files.rst: a sharded backup whose index would run code is refused, and BackupAndRestore
    resumes from ``backup.prev.pt`` with a warning, as from any damaged backup."""
    y = X[:, :1]
    previous = _compiled(nn.Linear(3, 1))
    previous.fit(X, y, batch_size=4, epochs=1, verbose=0)  # epoch 0 done in 2 steps
    previous.save_checkpoint(tmp_path / "backup.prev.pt")
    newest = _compiled(nn.Linear(3, 1))
    newest.fit(X, y, batch_size=2, epochs=1, verbose=0)  # epoch 0 done in 4 steps
    newest.save_checkpoint(tmp_path / "backup.pt", sharded=True)
    marker = tmp_path / "marker"
    (tmp_path / "backup.pt" / ".metadata").write_bytes(pickle.dumps(_Exec(marker)))
    resumed = _compiled(nn.Linear(3, 1))
    with pytest.warns(
        fitkit.checks.FitkitWarning,
        match=r"(?s)is damaged, so training resumes from the previous backup .*backup\.prev\.pt'.*"
        r"Refused to load '.*\.metadata': it names builtins\.exec",
    ):
        history = resumed.fit(
            X, y, batch_size=4, epochs=2, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path)]
        )
    assert not marker.exists()
    assert history.epoch == [0, 1] and resumed.global_step == 2 + 2  # from the previous backup: 2 + 2, not 4 + 2
