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
import contextlib
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
COMPOSER, TRANSFORMERS = "docs/guides/coming_from_composer.rst", "docs/guides/coming_from_transformers.rst"
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
PHASES = "tests/training/test_invariant_phases.py"
ENDLESS = f"{PHASES}::test_an_endless_source_without_its_steps_is_refused_before_step_1"
ONE_SHOT = f"{PHASES}::test_a_one_shot_generator_where_the_fit_needs_a_second_pass"
ONE_PASS = (
    "tests/training/test_validation_state.py::test_one_shot_training_generator_ends_training_instead_of_an_empty_epoch"
)
TOKENS_REFUSED = "tests/training/test_token_budget.py::test_bad_token_budgets_are_refused_before_step_1"
TERMS = "tests/losses/test_loss_terms.py"
MISMATCH = (
    "tests/distributed/test_distributed_fail_fast.py::test_ranks_at_different_collectives_raise_a_named_error_at_once_"
    "on_every_rank"
)


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


DOC_CLAIMS = (
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
    claim(
        README,
        "Where fitkit imports the package itself, a missing one is an error that names its extra's install line",
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
        "cannot be told from a long one: it needs ``steps``, else it runs until stopped",
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
        refused("several-losses-class-weight-train-on-batch"),
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
        "has no ``len()`` and no ``validation_steps`` is a ``ValueError``",
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
        "tests/training/test_validation_state.py::test_used_up_validation_generator_is_refused_before_step_1",
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


def cbf(name: str) -> str:
    return f"fitkit/callbacks/{name}.py"


def cbt(name: str, test: str) -> str:
    return f"tests/callbacks/test_callbacks{'_' + name if name else ''}.py::{test}"


AVERAGING_ERRORS = (cbt("averaging", "test_ema_errors"), cbt("averaging", "test_weight_averaging_errors"))
EMA_ERRORS = (*AVERAGING_ERRORS, cbt("averaging", "test_ema_half_life_and_interval_errors"))
NOT_SHARDED = f"{HERE}::test_an_average_of_a_sharded_module_is_refused_at_train_begin"
SAVE_OVERWRITE = (
    "tests/training/test_checkpoint_run_time.py::test_save_overwrite_false_never_replaces_a_file_that_was_there"
)
MONITOR_KEYS = (
    cbt("", "test_missing_monitor_key_lists_the_available_keys"),
    "tests/training/test_validation_state.py::test_batch_level_val_monitor_is_an_error_before_step_1",
    f"{BAD_INPUT}[EarlyStopping monitor never logged]",
    "tests/training/test_validation_state.py::test_key_missing_at_the_first_decision_lists_the_keys",
)
LOGGER_FULL_DISK = (
    "tests/callbacks/test_callbacks_logging.py::test_a_full_disk_leaves_whole_csv_rows_and_names_the_file",
    "tests/callbacks/test_callbacks_logging.py::test_tensorboard_on_a_full_disk_warns_once_and_the_run_goes_on",
)
CALLBACK_CLAIMS = (
    claim(
        cbf("accumulation"),
        "Raises: TypeError: not a dict, or a key or value that is not an int. ValueError: an empty dict, a key < 0 or "
        "a value < 1.",
        cbt("accumulation", "test_a_bad_schedule_is_a_clear_error"),
    ),
    claim(
        cbf("accumulation"),
        "Raises: TypeError: not a dict, or a key or value that is not an int. ValueError: an empty dict, a key < 0, "
        "a value < 1; at ``fit``, together with a dict "
        "``compile(gradient_accumulation_steps=...)``.",
        cbt("accumulation", "test_a_bad_schedule_is_a_clear_error"),
        cbt("accumulation", "test_two_schedules_for_one_fit_are_an_error_before_step_1"),
    ),
    claim(
        cbf("average_fns"),
        "A function that raises, takes the wrong arguments or returns a tensor of the wrong shape is found here "
        "instead, at ``on_train_begin``",
        f"{BAD_INPUT}[WeightAveraging avg_fn raises]",
        f"{BAD_INPUT}[WeightAveraging avg_fn of 2 arguments]",
        f"{BAD_INPUT}[WeightAveraging avg_fn returns a scalar]",
    ),
    claim(
        cbf("average_fns"),
        "Raises: ValueError: it raised, or ``avg_fn`` returned no tensor of ``averaged``'s shape.",
        f"{BAD_INPUT}[WeightAveraging avg_fn raises]",
        f"{BAD_INPUT}[WeightAveraging avg_fn returns a scalar]",
    ),
    claim(
        cbf("average_fns"),
        "ValueError: WeightAveraging's `avg_fn` failed when tried before training",
        'example: try_average_fn("WeightAveraging", lambda a, c: a, None, w, w)',
    ),
    claim(cbf("averaging"), "``fit`` refuses more before step 1 (see", SWAPPING),
    claim(
        cbf("averaging"),
        "Raises: TypeError: ``decay`` or ``half_life`` is not a number, a flag not a bool, a step count not an int. "
        "ValueError: ``decay`` outside ``[0, 1]``, ``half_life`` not positive and finite, both given, an unknown "
        '``update_interval`` or a step option with ``"epoch"``, a step count below its minimum; at '
        '``on_train_begin``, a module sharded with ``strategy="fsdp"``; at ``fit``, before step 1, a second average '
        "to validate on or to swap in at the end.",
        *EMA_ERRORS,
        NOT_SHARDED,
        SWAPPING,
    ),
    claim(cbf("averaging"), "so ``fit`` refuses it with another callback that does", SWAPPING),
    claim(
        cbf("averaging"),
        "Raises: TypeError: arguments of the wrong type. ValueError: bad values; at ``on_train_begin``, a "
        "``swa_lrs`` list whose length is not the number of parameter groups, or a module sharded with "
        '``strategy="fsdp"``.',
        cbt("averaging", "test_swa_errors"),
        cbt("averaging", "test_swa_lrs_per_group_must_match_the_groups"),
        cbt("averaging", "test_swa_refuses_both_avg_fns"),
        NOT_SHARDED,
    ),
    claim(
        cbf("backup"),
        "When the newest backup is damaged (:class:`fitkit.files.CheckpointError`), ``fit`` warns, naming both "
        "files, and resumes from the previous one.",
        BACKUP_FALLBACK,
    ),
    claim(
        cbf("backup"),
        "and kept when ``fit`` raises",
        "tests/training/test_resume.py::test_backup_and_restore_after_a_crash_equals_the_uninterrupted_run",
    ),
    claim(
        cbf("backup"),
        "Raises: TypeError: ``backup_dir`` is not a str or a path. ValueError: a bad ``save_freq``; ``backup_dir`` is "
        "empty or an existing file.",
        cbt("backup", "test_file_owning_callbacks_check_their_paths_when_built"),
        f"{BAD_INPUT}[BackupAndRestore dir is a file]",
        f"{BAD_INPUT}[BackupAndRestore save_freq]",
    ),
    claim(
        cbf("base"),
        "called once ``fit`` is over, also when it raises. Runs after ``on_train_end`` (or instead of it when ``fit`` "
        "raises).",
        cbt("backup", "test_thirty_failing_fits_leak_no_writer_thread"),
        cbt("mlflow", "test_a_failed_fit_ends_its_run_and_a_second_fit_starts_a_new_one"),
    ),
    claim(
        cbf("base"),
        "Raises: ImportError: matplotlib is not installed. ValueError: a key that the history does not hold. "
        "OSError: the PNG cannot be written (a full disk)",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line[plot]",
        "tests/callbacks/test_callbacks_logging.py::test_history_plot_writes_a_png",
        "tests/callbacks/test_callbacks_logging.py::test_history_plot_on_a_full_disk_keeps_the_old_png",
    ),
    claim(cbf("base"), "Raises: KeyError: ``hook`` is not a hook name.", f"{HERE}::test_the_callback_list_s_promises"),
    claim(
        cbf("base"), "``fit`` raised after a step: let the callbacks that ask write a checkpoint first.", ON_EXCEPTION
    ),
    claim(
        cbf("base"),
        "Call every callback's :meth:`Callback.close`, each even if another one raises.",
        f"{HERE}::test_the_callback_list_s_promises",
    ),
    claim(cbf("checkpoint_options"), "a checkpoint when ``fit`` raises after a step", ON_EXCEPTION),
    claim(
        cbf("checkpoint_options"),
        "Raises: ValueError: a float outside ``(0, 1]``.",
        "example: check_fraction(1.5)",
        "tests/training/test_checkpoint_run_time.py::test_a_fraction_of_the_run_saves_at_those_planned_steps",
    ),
    claim(
        cbf("checkpoint_options"), "ValueError: Expected a float `save_freq` in (0, 1]", "example: check_fraction(1.5)"
    ),
    claim(
        cbf("checkpoint_options"),
        "Raises: TypeError: neither a bool nor a path. ValueError: ``True`` with a folder that changes per save.",
        "tests/callbacks/test_callback_options.py::test_save_last_with_a_changing_folder_is_refused",
        "tests/callbacks/test_callback_options.py::test_model_checkpoint_option_errors",
    ),
    claim(
        cbf("checkpoint_options"),
        "Raises: ValueError: ``keep_last=0`` with neither ``save_best_only`` nor ``save_last``.",
        "tests/training/test_checkpoint_retention.py::test_bad_keep_last_is_refused",
    ),
    claim(
        cbf("checkpoint_options"),
        "``save_overwrite=False``: ``FileExistsError`` for a file that was on disk when the fit began",
        SAVE_OVERWRITE,
    ),
    claim(
        cbf("checkpoint_paths"),
        "refused where it is one of ``filepath``'s own files",
        f"{BAD_INPUT}[ModelCheckpoint save_last is its own filepath]",
        f"{BAD_INPUT}[ModelCheckpoint save_last matches the filepath pattern]",
    ),
    claim(
        cbf("checkpointing"),
        "``ValueError`` at ``on_train_begin`` when the planned steps are unknown",
        "tests/training/test_checkpoint_run_time.py::test_a_fraction_of_an_unknown_plan_is_refused_before_step_1",
    ),
    claim(
        cbf("checkpointing"),
        "A path that ``filepath`` formats to (its own file) is refused",
        f"{BAD_INPUT}[ModelCheckpoint save_last is its own filepath]",
        f"{BAD_INPUT}[ModelCheckpoint save_last matches the filepath pattern]",
    ),
    claim(cbf("checkpointing"), "writing one raises ``FileExistsError`` and writes nothing", SAVE_OVERWRITE),
    claim(
        cbf("checkpointing"),
        "when ``fit`` raises an ``Exception`` after at least one step, write a full checkpoint of the last completed "
        "batch there before the error goes on",
        ON_EXCEPTION,
    ),
    claim(
        cbf("checkpointing"),
        "under torchrun every rank must raise, as a save is a collective. With ``save_overwrite=False`` a file there "
        "before the fit began is left as it was (the error goes on, nothing written).",
        f"{HERE}::test_save_on_exception_keeps_a_file_that_was_there_with_save_overwrite_false",
    ),
    claim(
        cbf("checkpointing"),
        "Raises: ValueError: a bad ``filepath`` (an existing folder too), ``mode``, ``save_freq``, ``save_top_k`` or "
        "``every_n_epochs``",
        "tests/callbacks/test_callback_options.py::test_model_checkpoint_option_errors",
        f"{BAD_INPUT}[ModelCheckpoint path is a folder]",
        f"{BAD_INPUT}[ModelCheckpoint save_freq 0]",
        f"{BAD_INPUT}[ModelCheckpoint monitor never logged]",
        DECLARED,
    ),
    claim(
        cbf("checkpointing"),
        "TypeError: ``initial_value_threshold`` is not a number, ``save_last`` neither a bool nor a path, "
        "``train_time_interval`` not a positive timedelta, ``clock`` not callable.",
        "tests/callbacks/test_callback_options.py::test_model_checkpoint_option_errors",
        DECLARED,
    ),
    claim(
        cbf("locking"),
        "Acquire a :class:`FileLock`; warn when it was a dead run's. Raises: fitkit.files.LockError: a live run (or "
        "another callback of this fit) holds it.",
        f"{LOCKS}::test_a_dead_runs_lock_is_taken_over_with_a_warning",
        f"{LOCKS}::test_a_second_run_on_a_running_runs_folder_is_refused_before_step_1",
        f"{LOCKS}::test_two_callbacks_on_one_file_in_one_fit_are_refused_before_step_1",
    ),
    claim(
        cbf("locking"),
        ":meth:`Owned.restore`, warning about a name it refuses.",
        "tests/files/test_files_owned.py::test_a_backup_edited_to_list_a_file_outside_the_folder_never_deletes_it",
    ),
    claim(
        cbf("logging"),
        "a key that first appears in a later epoch is left out, with one warning",
        "tests/training/test_validation_state.py::test_csv_logger_columns_plan_plus_first_epoch_extras_later_keys_"
        "warned_once",
    ),
    claim(
        cbf("logging"),
        "Raises: TypeError: ``filename`` is not a str or a path. ValueError: ``separator`` is not such a character; "
        "``filename`` is empty or a folder.",
        cbt("backup", "test_file_owning_callbacks_check_their_paths_when_built"),
        f"{BAD_INPUT}[CSVLogger separator newline]",
        f"{BAD_INPUT}[CSVLogger file is a folder]",
    ),
    claim(
        cbf("logkeys"), ":func:`check_log_key` refuses, in ``on_train_begin``, a key no log will hold", *MONITOR_KEYS
    ),
    claim(cbf("logkeys"), "Any other missing key is an error.", *MONITOR_KEYS),
    claim(
        cbf("logkeys"),
        "Raises: ValueError: ``monitor`` is not in ``logs`` (the message lists the keys there are).",
        cbt("", "test_missing_monitor_key_lists_the_available_keys"),
        'example: monitor_value({"loss": 0.5}, "val_acc", "EarlyStopping")',
    ),
    claim(
        cbf("logkeys"),
        "ValueError: EarlyStopping monitors 'val_acc', which the logs do not hold.",
        'example: monitor_value({"loss": 0.5}, "val_acc", "EarlyStopping")',
    ),
    claim(cbf("logkeys"), "``key`` can hold a value when the callback decides, or ``ValueError``.", *MONITOR_KEYS),
    claim(cbf("logkeys"), "A key outside the plan is an error unless a callback that may add keys", *MONITOR_KEYS),
    claim(
        cbf("logkeys"),
        "a ``val_`` or learning-rate key there is always an error",
        "tests/training/test_validation_state.py::test_batch_level_val_monitor_is_an_error_before_step_1",
        'example: check_log_key("val_loss", params, None, "ModelCheckpoint", batch_level=5)',
    ),
    claim(
        cbf("logkeys"),
        "Raises: ValueError: a key no log will hold when the callback decides.",
        *MONITOR_KEYS,
        'example: check_log_key("val_loss", params, None, "ModelCheckpoint", batch_level=5)',
    ),
    claim(
        cbf("logkeys"),
        "ValueError: ModelCheckpoint monitors 'val_loss' every 5 batches",
        'example: check_log_key("val_loss", params, None, "ModelCheckpoint", batch_level=5)',
    ),
    claim(
        cbf("lr"),
        "Raises: ValueError: ``factor`` not in ``[0, 1)``, bad arguments; at ``on_train_begin``, an unknown direction "
        "or a monitor the epoch logs will not hold",
        f"{BAD_INPUT}[ReduceLROnPlateau factor 1.5]",
        f"{BAD_INPUT}[ReduceLROnPlateau and a compiled scheduler]",
        refused("reduce-lr-monitor-never-logged"),
    ),
    claim(
        cbf("lr"),
        "Raises: TypeError: ``schedule`` is not callable, or returns something that is not a number.",
        f"{BAD_INPUT}[LearningRateScheduler returns str]",
        DECLARED,
    ),
    claim(
        cbf("lr"),
        "Raises: TypeError, ValueError: bad arguments, as :func:`fitkit.tools.lr_finder.find_lr` raises them.",
        cbt("lr", "test_learning_rate_finder_errors"),
    ),
    claim(
        cbf("misc"),
        "raise_error: raise ``RuntimeError`` at the stop instead of stopping quietly.",
        cbt("", "test_terminate_on_nan_can_raise"),
    ),
    claim(
        cbf("misc"),
        "Raises: TypeError: ``raise_error`` is not a bool. RuntimeError: with ``raise_error=True``, at the stop. "
        "ValueError: ``check_every`` < 1.",
        f"{BAD_INPUT}[TerminateOnNaN raise_error str]",
        cbt("", "test_terminate_on_nan_can_raise"),
        cbt("", "test_terminate_on_nan_check_every_must_be_positive"),
    ),
    claim(
        cbf("misc"),
        "Raises: TypeError: an unknown hook name, a value that is not callable, or a function that cannot take the "
        "hook's arguments",
        f"{BAD_INPUT}[LambdaCallback unknown hook]",
        f"{BAD_INPUT}[LambdaCallback wrong arity]",
        f"{BAD_INPUT}[LambdaCallback batch hook of 1 argument]",
    ),
    claim(cbf("mixins"), "it warns once, naming the file and the fix, and writes nothing more", *LOGGER_FULL_DISK),
    claim(
        cbf("mlflow"),
        "If ``fit`` raises, :meth:`close` (which fit calls on its callbacks when it fails) marks the run ``FAILED``",
        cbt("mlflow", "test_a_failed_fit_ends_its_run_and_a_second_fit_starts_a_new_one"),
    ),
    claim(
        cbf("mlflow"),
        'Raises: ImportError: mlflow is not installed (``pip install ".[mlflow]"`` from a checkout). ValueError: a '
        "``log_every_n_steps`` that is not a positive int. TypeError: ``checkpoint`` is neither a path nor a "
        "ModelCheckpoint.",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line[mlflow]",
        cbt("mlflow", "test_bad_arguments"),
    ),
    claim(
        cbf("monitor"),
        'and refuses to guess the rest. Raises: ValueError: ``mode`` is not ``"auto"``, ``"min"`` or ``"max"``, '
        "or ``auto`` cannot tell.",
        cbt("", "test_mode_auto_refuses_a_metric_without_a_direction_before_the_first_step"),
        cbt("", "test_unknown_direction_raises_before_the_first_step"),
    ),
    claim(
        cbf("monitor"),
        "Raises: ValueError: bad arguments (a NaN threshold too); at ``on_train_begin``, a direction ``auto`` cannot "
        "infer, or a monitor the epoch logs will not hold",
        "tests/callbacks/test_callback_options.py::test_early_stopping_option_errors",
        cbt("", "test_mode_auto_refuses_a_metric_without_a_direction_before_the_first_step"),
        cbt("", "test_val_monitor_without_validation_data_raises_before_the_first_step"),
    ),
    claim(
        cbf("mlflow"),
        "it warns once (a ``FitkitWarning`` naming the store and the fix) and writes nothing more in that ``fit``, "
        "which goes on",
        cbt("mlflow", "test_a_store_that_cannot_be_written_warns_once_and_training_goes_on"),
        cbt("mlflow", "test_a_full_disk_under_a_real_store_warns_and_training_goes_on"),
    ),
    claim(
        cbf("wandb"),
        "an error of W&B is turned into one ``FitkitWarning`` and the logger goes quiet for the rest of the fit",
        cbt("wandb", "test_a_wandb_failure_warns_and_training_goes_on"),
    ),
    claim(cbf("neftune"), "(also when it raises)", cbt("neftune", "test_the_hook_comes_off_when_fit_raises")),
    claim(
        cbf("neftune"),
        "Raises: TypeError, ValueError: ``noise_alpha`` not a positive number (at construction); ``ValueError`` before "
        "step 1 when no embedding is found, the name is unknown, or the module has several ``nn.Embedding`` and no "
        "``get_input_embeddings``.",
        cbt("neftune", "test_a_bad_alpha_is_refused"),
        cbt("neftune", "test_no_embedding_found_is_an_error_before_step_1"),
        cbt("neftune", "test_a_bad_embedding_argument_is_refused"),
    ),
    claim(
        cbf("optim_monitor"),
        "Raises: TypeError: a count that is not an int, ``norm_type`` not a number, a flag not a bool. ValueError: "
        "``log_every_n_steps < 1`` or ``norm_type`` not positive.",
        cbt("optim_monitor", "test_optimizer_monitor_errors"),
    ),
    claim(
        cbf("optim_monitor"),
        "gives a warning at the start of ``fit`` and no key",
        cbt("optim_monitor", "test_learning_rate_monitor_warns_for_an_optimizer_without_momentum"),
    ),
    claim(
        cbf("optim_monitor"),
        "Raises: TypeError: a flag that is not a bool.",
        cbt("optim_monitor", "test_learning_rate_monitor_errors"),
    ),
    claim(
        cbf("optuna"),
        "the callback raises ``optuna.TrialPruned``: ``fit`` ends by that exception",
        cbt("optuna", "test_prune_raises_trial_pruned_from_fit"),
    ),
    claim(
        cbf("optuna"),
        'Raises: ImportError: optuna is not installed (``pip install ".[optuna]"`` from a checkout). TypeError: '
        "``trial`` has no ``report`` / ``should_prune`` methods, ``interval`` is not an int. ValueError: "
        "``interval`` < 1. ValueError: at ``on_train_begin``, a ``val_`` monitor without validation data",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line[optuna]",
        cbt("optuna", "test_bad_arguments"),
        cbt("optuna", "test_interval_errors"),
    ),
    claim(
        cbf("optuna"),
        "or a ``monitor`` no log will hold; at the first epoch end, when another callback may add keys "
        "(:func:`~fitkit.callbacks.logkeys.may_add_keys`), a ``monitor`` the logs do not hold.",
        refused("optuna-monitor-never-logged"),
        f"{HERE}::test_a_monitor_missing_at_the_first_epoch_end_is_named_there",
    ),
    claim(
        cbf("profiler"),
        "Raises: TypeError, ValueError: bad arguments (checked when it is created).",
        cbt("profiler", "test_errors"),
    ),
    claim(cbf("progress"), "Raises: ValueError: anything else.", f"{CHECKS}[verbose-invalid]"),
    claim(
        cbf("raytrain"),
        "fitkit refuses ``timeout=`` when the group is already running",
        "tests/callbacks/test_ray.py::test_model_timeout_is_refused_in_rays_process_group",
    ),
    claim(
        cbf("raytrain"),
        'Raises: ImportError: Ray is not installed (``pip install ".[ray]"`` from a checkout). TypeError, ValueError: '
        "a bad ``save_freq`` or ``checkpoint``. RuntimeError: (at ``on_train_begin``) ``fit`` runs outside a Ray "
        "Train worker. FileNotFoundError: (at ``on_train_begin``) Ray's checkpoint holds no fitkit checkpoint.",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line[ray]",
        "tests/callbacks/test_ray.py::test_ray_report_checks_its_arguments",
        "tests/callbacks/test_ray.py::test_ray_report_outside_a_ray_worker_says_so",
        f"{HERE}::test_a_ray_checkpoint_without_fitkits_file_is_refused_before_step_1",
    ),
    claim(
        cbf("signatures"),
        "Raises: TypeError: naming the hook, the arguments it is called with and the fix.",
        f"{BAD_INPUT}[LambdaCallback wrong arity]",
        'example: check_hook_arity("on_epoch_end", lambda: None)',
    ),
    claim(
        cbf("signatures"),
        "TypeError: `on_epoch_end` is called as on_epoch_end(epoch, logs), but the function given takes",
        'example: check_hook_arity("on_epoch_end", lambda: None)',
    ),
    claim(
        cbf("swap_ema"),
        "another averaging callback that validates on its own average is refused before step 1, as is, with "
        "``swap_on_epoch``, another one that swaps its average in at the end.",
        SWAPPING,
    ),
    claim(
        cbf("swap_ema"),
        "Raises: TypeError: ``swap_on_epoch`` is not a bool. ValueError: at ``on_train_begin`` (or evaluate / "
        "predict), no EMA to swap with; at ``fit``, before step 1, a second average to validate on or to end with.",
        cbt("averaging", "test_swap_ema_weights_without_an_ema_is_an_error_before_step_1"),
        SWAPPING,
        DECLARED,
    ),
    claim(cbf("swap_ema"), "another averaging callback that validates on its own average is refused.", SWAPPING),
    claim(
        cbf("swap_ema"),
        "``SWA`` or a second end swap is refused before step 1. Raises: TypeError: ``use_ema`` not a bool, "
        "``ema_momentum`` not a number, the frequency not an int. ValueError: ``ema_momentum`` outside ``[0, 1]``, a "
        "frequency below 1.",
        SWAPPING,
        cbt("averaging", "test_compile_ema_errors"),
    ),
    claim(cbf("swapping"), ":func:`check_weight_swaps` refuses, before step 1 (nothing changed)", SWAPPING),
    claim(
        cbf("swapping"), "``ValueError`` when two averages would be swapped into the module for one purpose.", SWAPPING
    ),
    claim(cbf("swapping"), "so ``fit`` refuses them before step 1 (weights and optimizer as they were)", SWAPPING),
    claim(
        cbf("swapping"),
        "Raises: ValueError: two averages validated on, or two swapped in at the end; the message names both callbacks "
        "and the fix.",
        SWAPPING,
        "example: check_weight_swaps(model, [EMA(), EMA()])",
    ),
    claim(
        cbf("swapping"),
        "ValueError: Expected at most one averaged copy of the weights to validate on.",
        "example: check_weight_swaps(model, [EMA(), EMA()])",
    ),
    claim(
        cbf("tensorboard"),
        'Raises: ImportError: the ``tensorboard`` package is missing (``pip install ".[tensorboard]"`` from a '
        "checkout). ValueError: a bad ``update_freq`` or ``histogram_freq``; ``log_dir`` is empty or an existing file. "
        "TypeError: ``write_steps_per_second`` not a bool, ``clock`` not callable.",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line[tensorboard]",
        "tests/callbacks/test_callbacks_tensorboard.py::test_bad_options",
        f"{BAD_INPUT}[TensorBoard log_dir is a file]",
    ),
    claim(
        cbf("throughput"),
        "Raises: TypeError, ValueError: bad arguments (checked when it is created).",
        cbt("throughput", "test_errors"),
    ),
    claim(
        cbf("timer"),
        "Raises: TypeError, ValueError: anything else, or a duration that is not > 0.",
        cbt("timer", "test_bad_arguments_are_refused"),
    ),
    claim(
        cbf("tokens"),
        "Raises: ValueError: at the first batch, when the batch has no token input",
        cbt("tokens", "test_batches_without_tokens_are_refused_at_the_first_batch"),
    ),
    claim(
        cbf("wandb"),
        "**init_kwargs: passed on to ``wandb.init``",
        cbt("wandb", "test_an_offline_run_holds_config_step_and_epoch_logs_and_the_best_checkpoint"),
    ),
    claim(
        cbf("wandb"),
        'Raises: ImportError: wandb is not installed (``pip install ".[wandb]"`` from a checkout). ValueError: a '
        "``log_every_n_steps`` that is not a positive int. TypeError: ``checkpoint`` is neither a path nor a "
        "ModelCheckpoint.",
        f"{HERE}::test_a_missing_extra_is_named_with_its_install_line[wandb]",
        cbt("wandb", "test_missing_wandb_and_bad_arguments_are_named"),
    ),
    claim(cbf("weight_averaging"), "``fit`` refuses two before step 1", SWAPPING),
    claim(
        cbf("weight_averaging"),
        "so a broken function is refused before step 1 (a ``ValueError``), nothing changed",
        f"{BAD_INPUT}[WeightAveraging avg_fn raises]",
        f"{BAD_INPUT}[WeightAveraging multi_avg_fn raises]",
    ),
    claim(
        cbf("weight_averaging"),
        "Raises: TypeError: a function that is not callable, a flag that is not a bool, a step that is not an int. "
        "ValueError: both ``avg_fn`` and ``multi_avg_fn``; a count below its minimum; at ``on_train_begin``, a module "
        'sharded with ``strategy="fsdp"``; at ``fit``, before step 1, another averaging callback that also validates '
        "on its average, or that also swaps its average in at the end.",
        *AVERAGING_ERRORS,
        cbt("averaging", "test_swa_refuses_both_avg_fns"),
        NOT_SHARDED,
        SWAPPING,
    ),
    claim(
        cbf("weight_averaging"),
        "A ``fit`` that raised with an average swapped in (in a validation) gets its training weights back.",
        f"{HERE}::test_a_fit_that_raises_in_a_validation_on_the_average_gets_its_training_weights_back",
    ),
)


# Words of the claim vocabulary that say something else (a noun, the user's own code, torch's behaviour).
LATER_CLAIMS = (
    # -- the agreed epoch end and the signal watchdog ------------------------------------------------------------------
    claim(ARCH, "so ranks at different collectives raise at once", MISMATCH),
    claim(
        SCALE,
        "the headers differ, every rank sees it in the same result and raises a ``RuntimeError``",
        MISMATCH,
        "tests/distributed/test_distributed_group.py::test_a_mismatch_names_every_rank_by_place_grouping_ranks_at_the_"
        "same_one",
    ),
    claim(SCALE, "Rank(s) 1 differ from rank 0; every rank raises this error. Fix: ...", MISMATCH),
    claim(
        SCALE,
        "after one line on standard error: ``fitkit: SIGTERM received 20 s",
        "tests/distributed/test_distributed_resume_signals.py::test_a_sigterm_while_a_rank_waits_for_a_slow_peer_ends_"
        "every_process_with_a_named_line",
        "tests/training/test_signals.py::test_the_watchdog_ends_a_process_that_does_not_act_on_a_signal_within_the_"
        "grace",
    ),
    # -- sources that never end, budgets in tokens, loss terms ---------------------------------------------------------
    claim(API, "needs ``validation_steps``: refused before step 1 otherwise", ENDLESS, ONE_SHOT),
    claim(ARCH, "refuses, with the fix and before a batch is drawn", ENDLESS, ONE_SHOT),
    claim(ARCH, "the fit stops after it with a warning", ONE_SHOT, ONE_PASS),
    claim(KERAS, "pass (the fit stops after it, with a warning, as Keras does)", ONE_SHOT, ONE_PASS),
    claim(
        KERAS, "validation without ``validation_steps``, is refused before step 1, naming the fix", ENDLESS, ONE_SHOT
    ),
    claim(MODEL, "``itertools.cycle``: refused without it", ENDLESS),
    claim(MODEL, "one pass, and with ``epochs`` > 1 the fit stops after it with a warning", ONE_SHOT, ONE_PASS),
    claim(MODEL, "Needed for an endless source (refused without it)", ENDLESS),
    claim(MODEL, "for a generator validated in more than one epoch (refused without it", ONE_SHOT),
    claim(MODEL, "``repeat`` without it is a ``ValueError``", ENDLESS),
    claim(MODEL, "needs in-memory tensors (else a ``ValueError`` before step 1)", TOKENS_REFUSED),
    claim(COMPOSER, "other data is refused before step 1 with the fix", TOKENS_REFUSED),
    claim(TRANSFORMERS, "in-memory token ids only (else refused before step 1)", TOKENS_REFUSED),
    claim(
        LOSSES,
        "a term the loss does not return is refused at the callback's first decision",
        f"{TERMS}::test_a_term_key_is_refused_before_the_first_step_unless_the_loss_is_a_callable",
    ),
    claim(
        LOSSES,
        "Each of these is refused at the first batch, before any step.",
        f"{TERMS}::test_a_loss_of_terms_that_cannot_be_logged_is_refused_before_the_first_step",
        f"{TERMS}::test_several_losses_refuse_an_output_loss_that_returns_terms",
    ),
)

CLAIMS = DOC_CLAIMS + CALLBACK_CLAIMS + LATER_CLAIMS

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
    claim(cbf("accumulation"), "name: how errors name the argument.", "an argument"),
    claim(cbf("mlflow"), "the default of MLflow 3, which refuses the old ``file:`` store", "MLflow's behaviour"),
    claim(cbf("monitor"), "``auto`` is ``min`` for loss / error keys", "a key name"),
    claim(cbf("monitor"), "any key ending in ``loss`` or ``error``", "a key name"),
    claim(LOSSES, "against 0 the squared errors are 4, 16 and 36", "a value"),
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
    + [p.relative_to(ROOT).as_posix() for p in (ROOT / "fitkit" / "callbacks").glob("*.py")]
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


def _public(tree: ast.AST) -> list[ast.AST]:
    """The module and its public classes and functions (``__init__`` of a public class too)."""
    nodes: list[ast.AST] = [tree]
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and (
            not node.name.startswith("_") or node.name == "__init__" and not isinstance(tree, ast.Module)
        ):
            nodes += _public(node) if isinstance(node, ast.ClassDef) else [node]
    return nodes


def _docstring_lines(source: str) -> tuple[list[tuple[int, str]], list[str]]:
    """A module of fitkit: its public docstrings are prose, their ``>>>`` lines the code doctest runs."""
    prose, code = [], []
    for node in _public(ast.parse(source)):
        docstring = ast.get_docstring(node, clean=False)  # type: ignore[arg-type]
        if docstring:
            first = node.body[0].lineno  # type: ignore[attr-defined]
            for i, line in enumerate(docstring.splitlines()):
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


@cache
def _functions(path: Path) -> tuple[str, frozenset[str]]:
    """A test module's source and the names of its functions."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    return source, frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def proof_problem(page: str, proof: str) -> str | None:
    """Why ``proof`` proves nothing (no such test, no such case, not executed on ``page``), or ``None``."""
    if proof.startswith("example: "):
        code = page_text(page).code
        return None if _norm(proof[len("example: ") :]) in code else f"{proof!r} is not executed on {page}"
    path, _, name = proof.partition("::")
    name, _, case = name.partition("[")
    if not (ROOT / path).is_file():
        return f"{path}: no such file"
    source, names = _functions(ROOT / path)
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
    _functions.cache_clear()
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
        _functions.cache_clear()


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


class _Trial:
    """What OptunaPruning asks of an optuna trial: ``report`` and ``should_prune``."""

    def __init__(self):
        self.reports: list[tuple[float, int]] = []

    def report(self, value, step):
        self.reports.append((value, step))

    def should_prune(self):
        return False


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
    "several-losses-class-weight-train-on-batch": (
        lambda: _compiled(Twice(), loss=["cross_entropy", "cross_entropy"]),
        lambda m: m.train_on_batch(torch.zeros(2, 3), {"a": TOKENS, "b": TOKENS}, class_weight={0: 1, 1: 3}),
        ValueError,
        r"Expected one target tensor `y` with `class_weight`.*Received: y, a dict of 2 targets",
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
        r"Expected `device` to be 'auto', a device string or a torch\.device\. Received: device=3 of type int\. "
        r"Fix: pass device='auto', 'cpu' or 'cuda:0'\.",
    ),
    "to-device-mps-lacking": (
        lambda: _compiled(nn.Linear(3, 1)),
        lambda m: m.to("mps"),
        ValueError,
        r"Expected `device` to name a device this machine has\. Received: device='mps', but MPS is not available on "
        r"this machine\. Fix: pass device='auto' or 'cpu'\.",
    ),
    "reduce-lr-monitor-never-logged": (
        lambda: _compiled(nn.Linear(3, 1)),
        lambda m: m.fit(
            X,
            X[:, :1],
            validation_data=(X, X[:, :1]),
            callbacks=[fitkit.callbacks.ReduceLROnPlateau("val_acc")],
            verbose=0,
        ),
        ValueError,
        r"ReduceLROnPlateau monitors 'val_acc', which the logs will not hold\. Available keys: learning_rate, loss, "
        r"val_loss.*Fix",
    ),
    "optuna-monitor-never-logged": (
        lambda: _compiled(nn.Linear(3, 1)),
        lambda m: m.fit(
            X,
            X[:, :1],
            validation_data=(X, X[:, :1]),
            callbacks=[fitkit.callbacks.OptunaPruning(_Trial(), "val_acc")],
            verbose=0,
        ),
        ValueError,
        r"OptunaPruning monitors 'val_acc', which the logs will not hold\. Available keys: learning_rate, loss, "
        r"val_loss.*Fix",
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


def test_a_monitor_missing_at_the_first_epoch_end_is_named_there():
    """optuna.py: with a callback that may add keys, the monitor is looked for at the first epoch end."""
    model = _compiled(nn.Linear(3, 1))
    adds_nothing = fitkit.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None)
    trial = _Trial()
    with pytest.raises(ValueError, match=r"OptunaPruning monitors 'val_acc', which the logs do not hold\. Available"):
        model.fit(
            X,
            X[:, :1],
            batch_size=4,
            validation_data=(X, X[:, :1]),
            verbose=0,
            callbacks=[adds_nothing, fitkit.callbacks.OptunaPruning(trial, "val_acc")],
        )
    assert model.global_step == 2 and trial.reports == []  # the first epoch trained, nothing was reported


@pytest.mark.parametrize(
    "make", [fitkit.callbacks.EMA, lambda: fitkit.callbacks.SWA(0.01), fitkit.callbacks.WeightAveraging]
)
def test_an_average_of_a_sharded_module_is_refused_at_train_begin(make, monkeypatch):
    """averaging.py, weight_averaging.py: under torchrun a strategy='fsdp' module has no full copy to average
    (the process group is stood in for: on one process fitkit trains plainly)."""
    model = fitkit.Model(nn.Linear(3, 1), device="cpu", strategy="fsdp")
    model.compile(optimizer="sgd", loss="mse")
    callback = make()
    callback.set_model(model)
    callback.set_params({"epochs": 1})
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(
        ValueError,
        match=rf"^{type(callback).__name__} keeps a full copy of the module, which a sharded "
        r"\(strategy='fsdp'\) module does not have\. Fix: use strategy='ddp'\.$",
    ):
        callback.on_train_begin()
    assert callback.averaged_model is None


class _Closes(fitkit.callbacks.Callback):
    def __init__(self, error: Exception | None = None):
        super().__init__()
        self.error, self.closed = error, 0

    def close(self):
        self.closed += 1
        if self.error is not None:
            raise self.error


def test_the_callback_list_s_promises():
    """base.py: close() closes every callback even if one raises, then raises the first error (not after a
    failed fit, whose own error goes on); wants() knows only hook names."""
    first, second = _Closes(RuntimeError("first")), _Closes(RuntimeError("second"))
    callbacks = fitkit.callbacks.CallbackList([first, second, _Closes()], model=None, params={})
    with pytest.raises(RuntimeError, match="^first$"):
        callbacks.close()
    callbacks.close(finished=False)
    assert [cb.closed for cb in callbacks.callbacks] == [2, 2, 2]
    with pytest.raises(KeyError, match="on_epoch_ending"):
        callbacks.wants("on_epoch_ending")


def test_save_on_exception_keeps_a_file_that_was_there_with_save_overwrite_false(tmp_path):
    """checkpointing.py: the fit's own error goes on, and the file that was there is left as it was."""
    (tmp_path / "on_exception.pt").write_bytes(b"kept")
    checkpoint = fitkit.callbacks.ModelCheckpoint(
        tmp_path / "ep{epoch}.pt", save_on_exception=True, save_overwrite=False
    )

    def crash(batch, logs):
        if batch == 1:
            raise RuntimeError("crash")

    model = _compiled(nn.Linear(3, 1))
    with pytest.raises(RuntimeError, match="^crash$"):
        model.fit(
            X,
            X[:, :1],
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[checkpoint, fitkit.callbacks.LambdaCallback(on_train_batch_end=crash)],
        )
    assert model.global_step == 2 and (tmp_path / "on_exception.pt").read_bytes() == b"kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["on_exception.pt"]


class _RayTrain:
    """What RayReport asks of ``ray.train`` inside a worker: a context, and a checkpoint to resume from."""

    def __init__(self, folder: Path):
        self.folder = folder

    def get_context(self):
        return self

    def get_world_rank(self):
        return 0

    def get_checkpoint(self):
        return self

    @contextlib.contextmanager
    def as_directory(self):
        yield str(self.folder)


def test_a_ray_checkpoint_without_fitkits_file_is_refused_before_step_1(tmp_path, monkeypatch):
    """raytrain.py: Ray gives back a checkpoint folder without RayReport's file: named, nothing changed."""
    from fitkit.callbacks import raytrain

    monkeypatch.setattr(raytrain, "_ray_train", lambda: _RayTrain(tmp_path))
    model = _compiled(nn.Linear(3, 1))
    before = _state(model)
    with pytest.raises(
        FileNotFoundError,
        match=r"Ray's checkpoint .* holds no 'checkpoint\.pt', so fitkit cannot "
        r"resume from it\. Fix",
    ):
        model.fit(X, X[:, :1], verbose=0, callbacks=[fitkit.callbacks.RayReport()])
    assert all(torch.equal(a, b) for a, b in zip(_state(model), before, strict=True)) and model.global_step == 0


def test_a_fit_that_raises_in_a_validation_on_the_average_gets_its_training_weights_back():
    """weight_averaging.py: the validation runs on the EMA; a crash there puts the training weights back."""
    ema = fitkit.callbacks.EMA(0.5)
    trained: list[torch.Tensor] = []

    def keep(batch, logs):  # after the last step of the epoch: the training weights
        trained[:] = [p.detach().clone() for p in model.module.parameters()]

    def crash(batch, logs):
        raise RuntimeError("crash in validation")

    model = _compiled(nn.Linear(3, 1))
    callbacks = [ema, fitkit.callbacks.LambdaCallback(on_train_batch_end=keep, on_test_batch_begin=crash)]
    with pytest.raises(RuntimeError, match="^crash in validation$"):
        model.fit(X, X[:, :1], batch_size=4, validation_data=(X, X[:, :1]), verbose=0, callbacks=callbacks)
    average = list(ema.averaged_model.module.parameters())
    assert model.global_step == 2 and not all(torch.equal(a, t) for a, t in zip(average, trained, strict=True))
    assert all(torch.equal(p, t) for p, t in zip(model.module.parameters(), trained, strict=True))
