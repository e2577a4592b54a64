"""Shared test set-up: the runtime environment every entry point uses, and repo paths."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from config.runtime_env import apply_defaults

apply_defaults()

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench.synthetic (test helpers shared with the benches)
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def reap_finished_multiprocessing_children() -> None:
    """Join this process's multiprocessing children that have ended (what `active_children` does).
    vLLM ends an engine core that outlives its 5 s grace with SIGKILL and never joins it
    (vllm/v1/utils.py `shutdown`): the dead child stays a zombie of the pytest worker until
    multiprocessing next polls, and a later test's waitpid(-1) reaped it instead (a fresh-clone
    failure of test_code_exec_sandbox.py)."""
    import multiprocessing

    multiprocessing.active_children()


@pytest.fixture(autouse=True)
def _no_zombie_from_an_earlier_test():
    reap_finished_multiprocessing_children()  # what a module's teardown before this test left
    yield
    reap_finished_multiprocessing_children()


_SHARED_HEAD: dict = {}  # "head": this worker's SharedHead, once a test asked for it


@pytest.fixture(scope="session")
def ray_head():
    """One real Ray head node for the whole test run, started by the first test that asks;
    the end-to-end runs that do not test a local cluster's start-up join it (tests/rayharness.py).
    It is stopped when this worker reaches a test of another kind (pytest_runtest_setup below)."""
    from rayharness import SharedHead

    head = _SHARED_HEAD["head"] = SharedHead.start()
    try:
        yield head
    finally:
        head.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The shared head only while the end-to-end files run: they come first (the order below), and
    the head with the Serve controller the joined runs leave on it costs ~0.08 of a core while
    idle, ~25 minutes of the other files' run. A test that asks for it again gets it started
    again, before its fixtures read the address (tryfirst: before fixture set-up)."""
    head = _SHARED_HEAD.get("head")
    if head is None:
        return
    if "ray_head" in item.fixturenames:
        head.ensure_running()
    elif _item_rank(item) > 0:
        head.stop()


# ---------------------------------------------------------------------------------- test kinds
# Markers (registered in pyproject.toml): `slow` starts Ray, vLLM or a model; `subprocess` starts
# a child process: a `counterpoint` CLI run, a Python helper, a sandboxed script (`unshare`), a
# server, promtool or nvidia-smi. (The receipt's own `uname -p` / `git` look-ups do not count:
# they take milliseconds and run in whichever test first records an environment.) `make test`
# runs every test whatever its markers; `make test-fast` runs `not slow and not subprocess`.
#
# A file of one kind says so in its own `pytestmark`. In a file of mixed kinds, the tests that
# start a process are named here, by function (every parametrization of it), and marked at
# collection. The list was taken from a run of every non-slow test with process creation
# forbidden by an audit hook (subprocess.Popen, os.fork, os.posix_spawn, os.system, os.exec and
# _posixsubprocess.fork_exec, which multiprocessing uses): exactly these tests tried to start one.
# It cannot go stale silently: a name that is not a test function of its module is a collection
# error, and the same audit hook fails an unmarked test that starts a process: in its body under
# `make test` (so CI sees it), anywhere under `make test-fast` (CP_TEST_NO_SPAWN=1).
SUBPROCESS_TESTS = {
    "test_adapter_ipc.py": {
        "test_a_changed_byte_in_the_learners_buffer_is_refused",
        "test_a_replica_process_gets_the_host_paths_adapter_bit_for_bit",
        "test_replacement_replicas_each_open_the_same_buffer",
        "test_two_buffers_across_processes_and_the_replicas_acknowledgement",
    },
    "test_alerts.py": {
        "test_promtool_rule_unit_tests_pass",
        "test_unit_tests_catch_a_broken_alert",
        "test_unit_tests_catch_a_broken_recording_rule",
    },
    "test_cluster_memory.py": {
        "test_the_cli_prints_the_table_of_the_shipped_config",
        "test_the_cli_refuses_bad_input_in_one_line",
    },
    "test_code_exec_sandbox.py": {
        "test_bare_level_still_limits_and_times_out",
        "test_below_min_isolation_refuses_to_start",
        "test_child_escaping_the_process_group_dies_with_the_run",
        "test_cpu_limit_is_a_timeout",
        "test_environment_scrubbed_and_limits_applied",
        "test_fork_bomb_contained",
        "test_huge_stdout_is_cut_and_killed",
        "test_infinite_loop_times_out",
        "test_isolation_detected_and_reported",
        "test_memory_bomb_is_a_memory_error",
        "test_no_network_outside_or_to_a_local_listener",
        "test_private_answers_unreachable_by_any_path",
        "test_script_deleting_its_own_workspace",
        "test_sleep_past_timeout_ignoring_sigint",
        "test_slots_queue_then_resource_exhausted",
        "test_symlinked_or_special_submission_is_not_followed",
        "test_the_leak_check_sees_a_planted_child",
        "test_workspace_quota_is_enospc_for_bytes_and_for_files",
        "test_writes_outside_the_workspace_never_reach_the_host",
    },
    "test_code_exec_service.py": {
        "test_below_min_isolation_refuses_to_start",
        "test_cases_carry_prompt_and_task_metadata",
        "test_cli_list_and_score",
        "test_health_says_which_grading_rules_grade",
        "test_registered_and_health_reports_isolation",
        "test_resource_exhausted_past_the_limit",
        "test_statuses_and_sentinel_over_grpc",
        "test_task_files_larger_than_the_workspace_refuse_to_start",
        "test_whatever_a_script_leaves_is_that_scripts_status_alone",
    },
    "test_code_exec_verifier.py": {
        "test_a_users_mlebench_style_task_dir_works_unchanged",
        "test_an_mlebench_prepared_task_gets_mlebench_verdict_and_metric",
        "test_cases_carry_description_preview_and_metadata",
        "test_constant_submission_without_reading_train_is_ok",
        "test_failed_statuses_get_the_sentinel",
        "test_ladder_orders_constant_below_gbm_and_is_written",
        "test_one_extra_column_is_graded_as_grade_grades_it",
        "test_reward_split_test_and_score_many_order",
        "test_submission_linked_to_the_answers_is_invalid",
        "test_unknown_task_is_a_key_error",
    },
    "test_configs.py": {"test_train_dry_run_refuses_top_p_before_anything_starts"},
    "test_console.py": {"test_run_logs_send_people_lines_to_the_terminal_and_the_rest_to_driver_log"},
    "test_deploy_manifests.py": {"test_an_install_the_way_the_image_installs_imports_every_package_and_runs"},
    "test_eval_cli.py": {"test_module_entry_point_runs"},
    "test_grader_hardening.py": {
        "test_checker_strict_through_the_service",
        "test_cli_proxy_ingress_refuses_a_port_held_on_any_interface",
        "test_cli_refuses_a_held_port_in_one_line",
        "test_cli_refuses_an_unset_token_env",
        "test_grpc_core_log_of_a_grader_is_rate_limited",
    },
    "test_grader_service.py": {
        "test_cli_serve_prints_address_and_serves",
        "test_require_pool_refuses_before_serving",
        "test_serve_refuses_another_schema",
    },
    "test_learner_compile.py": {
        "test_compiled_layers_give_the_eager_loss_and_gradients",
        "test_policy_update_with_compiled_layers",
    },
    "test_memory_bench.py": {"test_a_sampled_run_sees_its_child_leaves_out_what_was_there_and_stops_one_past_its_time"},
    "test_memory_budget.py": {
        "test_dry_run_shows_the_split_and_refuses_a_small_budget",
        "test_the_split_needs_neither_torch_nor_ray",
    },
    "test_mps.py": {
        "test_a_capped_role_runs_the_gemm_check_under_its_share",
        "test_a_daemon_that_does_not_come_up_fails_in_one_line",
        "test_gemm_check_failures_read_in_one_line",
        "test_auto_run_where_mps_pays_starts_the_daemon",
        "test_auto_time_slices_on_a_gpu_where_mps_was_not_measured_to_pay",  # a stand-in nvidia-smi
        "test_client_check_reports_in_one_line",
        "test_run_joins_a_running_daemon_and_leaves_it",
        "test_run_starts_its_daemon_and_quits_it",
    },
    "test_observability.py": {  # the Prometheus server (tests/promharness.py) is a child process
        "test_assert_all_queries_names_every_failing_expr",
        "test_drifting_ppl_ratio_trips_the_alert",
        "test_every_alert_and_recording_rule_series_returns_data",
        "test_every_dashboard_query_returns_data",
        "test_every_rule_loads_and_evaluates",
        "test_grader_scaling_panel_shows_replicas_and_both_directions",
        "test_healthy_run_trips_no_band_alert",
        "test_promtool_check_config",
        "test_promtool_check_rules",
        "test_ray_prefixed_grader_series_are_relabelled",
        "test_recoveries_panel_shows_each_part_that_recovered",
    },
    "test_records_run_dir.py": {"test_sigkill_during_appends_leaves_a_recoverable_file"},
    "test_search_round.py": {  # the round's scripts run in the code-exec sandbox
        "test_collaborators_breaking_the_contract_fail_the_round",
        "test_diagnostics_of_the_real_round",
        "test_driver_adapters_give_the_same_round_as_the_verifier",
        "test_parents_debug_depth_and_n_children",
        "test_round_continued_from_a_saved_tree_is_the_same_round",
        "test_round_grows_every_mode_and_status",
        "test_rows_fit_the_archive",
        "test_summary_chooses_on_validation_and_reports_test",
    },
    "test_search_scaffold.py": {"test_bundled_tasks_ship_scaffolds_whose_scripts_run"},
    "test_services_launch.py": {
        "test_a_local_start_that_timed_out_is_cleaned_up_and_tried_again",
        "test_a_process_that_was_running_before_the_start_is_left_alone",
    },
    "test_services_preflight.py": {
        "test_a_run_directory_has_one_live_driver_and_a_dead_ones_lock_is_released",
        "test_bad_input_fails_in_one_line_before_ray_starts",
        "test_liveness_tells_a_dead_driver_from_a_live_one",
        "test_resume_refuses_a_config_that_differs_and_applies_only_what_may_change",
        "test_resume_refuses_a_run_that_is_still_alive",
    },
    "test_services_receipt.py": {
        "test_sigterm_in_a_subprocess_is_recorded_as_interrupted",
        "test_sigterm_inside_a_blocking_ray_get_is_still_an_interruption",
    },
}


def _item_rank(item) -> int:
    if item.path.name.endswith("_e2e.py"):
        return 0
    return 1 if item.get_closest_marker("slow") else 2


def pytest_collection_modifyitems(config, items):
    # Files in the order they are run: the `counterpoint` end-to-end files (minutes each) first,
    # then the other files with a test that starts Ray, vLLM or a model, then the rest. `make
    # test` runs two pytest-xdist workers, each taking whole files in this order (--dist
    # loadfile): the longest first, so the seconds-long files fill in at the end instead of one
    # long file running alone. The sort is stable and by file: a file's tests stay together and
    # in order (its module fixtures are set up once).
    file_rank: dict[Path, int] = {}
    for item in items:
        file_rank[item.path] = min(file_rank.get(item.path, 2), _item_rank(item))
    items.sort(key=lambda item: file_rank[item.path])
    checked = set()
    for item in items:
        names = SUBPROCESS_TESTS.get(item.path.name)
        if names is None:
            continue
        if item.path.name not in checked:  # every listed name is a test function of its module
            checked.add(item.path.name)
            missing = sorted(n for n in names if not callable(getattr(item.module, n, None)))
            if missing:
                raise pytest.UsageError(f"tests/conftest.py SUBPROCESS_TESTS names no test in {item.path.name}: "
                                        f"{', '.join(missing)}")
        if getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.subprocess)


# Under `make test-fast` nothing may start a process: a test that tries fails at once, naming what
# it started, so a test that needs the `subprocess` marker cannot slip into the fast set unmarked.
# CI runs only `make test`, so the fast set alone could go stale unseen (it did: 13 tests, found
# by hand). `make test` therefore holds every unmarked test's body to the same rule, on the main
# thread only: threads left running by an earlier slow test on the same worker (an engine's, Ray's)
# start processes of their own and must not be failed for it. Fixtures are checked by
# `make test-fast` alone.
_SPAWN_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.system",
                 "os.exec", "os.spawn", "pty.spawn"}
_SPAWN_ALLOWED = {"uname", "git"}  # the receipt's environment look-ups (see above)
_FORBID_EVERYWHERE = os.environ.get("CP_TEST_NO_SPAWN") == "1"
_unmarked_body_running = False  # set around the body of a test marked neither slow nor subprocess


class SpawnInFastTests(RuntimeError):
    """A test of the fast set (neither `slow` nor `subprocess`) started a process: mark it."""


def _spawn_forbidden_now() -> bool:
    if _FORBID_EVERYWHERE:
        return True
    return _unmarked_body_running and threading.current_thread() is threading.main_thread()


def _spawned(what: object) -> None:
    raise SpawnInFastTests(f"{what}: this test starts a process; mark it `subprocess` "
                           f"(tests/conftest.py SUBPROCESS_TESTS or the module's pytestmark)")


def _forbid_spawning() -> None:
    import _posixsubprocess

    def hook(event: str, args: tuple) -> None:
        if event in _SPAWN_EVENTS and _spawn_forbidden_now():
            exe = args[0] if event == "subprocess.Popen" and args else None
            if exe is None or Path(os.fsdecode(exe)).name not in _SPAWN_ALLOWED:
                _spawned(f"{event} {exe or ''}".strip())

    fork_exec = _posixsubprocess.fork_exec

    def guarded_fork_exec(args, *rest, **kw):  # multiprocessing's spawn/forkserver start here, unaudited
        exe = Path(os.fsdecode(args[0])).name if args else ""
        if exe not in _SPAWN_ALLOWED and _spawn_forbidden_now():
            _spawned(f"fork_exec {exe}")
        return fork_exec(args, *rest, **kw)

    sys.addaudithook(hook)
    _posixsubprocess.fork_exec = guarded_fork_exec


_forbid_spawning()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    global _unmarked_body_running
    _unmarked_body_running = not any(item.iter_markers(name="slow")) and not any(item.iter_markers(name="subprocess"))
    try:
        yield
    finally:
        _unmarked_body_running = False
