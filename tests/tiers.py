# ruff: noqa: E501  (a table: one test pattern and its reason a line)
"""What the quick tier leaves to the full one (``conftest.py``), and why.

Each entry: a pattern of test ids (``fnmatch``, ``path::test[case]``) and the quicker test that
keeps its feature in the quick tier. Every feature the README promises still runs in the quick
tier on real processes, against the unpipelined model or megatron-core; these entries are the
second, third, ... way of showing it (a whole ``train`` command where a runtime test shows the
same, a larger p where p = 2..4 already ran, a published model where a smaller one did).
"""

from __future__ import annotations

FULL_ONLY: dict[str, str] = {
    # faults: test_runtime_faults (dead, hung and silent peers on real processes) stays quick
    "tests/test_faults.py::*": "SIGTERM and killed ranks through whole train runs",
    "tests/test_runtime_faults.py::test_train_survives_a_dead_and_a_hung_peer_and_resumes_from_the_checkpoint": (
        "the other runtime fault tests and test_checkpoint"
    ),
    # train's command line: test_main_job_trains_and_reports and test_checkpoint stay quick
    "tests/test_train_cli.py::test_the_main_job_starts_quietly_and_verbose_shows_megatron_warnings": "log levels",
    "tests/test_train_cli.py::test_save_then_load_resumes_with_one_command": "test_checkpoint resumes exactly",
    "tests/test_train_cli.py::test_tensorboard_logs_have_megatron_lm_tags_and_every_rank": "TensorBoard tags",
    # data: test_mock_data_trains stays quick; DP is test_parallel_compose's
    "tests/test_train_data.py::test_trains_on_an_indexed_dataset_and_dp2_gives_the_dp1_losses": "indexed data",
    "tests/test_train_data.py::test_a_run_resumed_on_an_indexed_dataset_takes_the_next_samples": "data resume",
    "tests/test_train_data.py::test_trains_on_text_tokenized_by_a_local_hugging_face_tokenizer": "HF tokenizer",
    # Megatron-LM's pretrain_gpt.py: the train-vs-pretrain_gpt rows and the bad lines stay quick
    "tests/test_pretrain_gpt.py::test_train_step_v_shape_equals_1f1b": "V-shape through pretrain_gpt.py",
    "tests/test_pretrain_gpt.py::test_train_step_vocab_parallel_with_context_parallelism_equals_1f1b": "vocab x CP",
    "tests/test_pretrain_gpt.py::test_get_model_builds_the_schedules_stages": "stage building",
    "tests/test_pretrain_gpt.py::test_train_step_vocab_parallel_equals_1f1b": "vocab through pretrain_gpt.py",
    "tests/test_moe_exact.py::test_moe_schedule_equals_megatron_s_own[[]*-3]": "every schedule at p = 2",
    "tests/test_moe_exact.py::test_sliced_moe_schedule_equals_megatron_s_unsliced_one[[]3-*]": "seq1f1b at p = 2",
    # checkpoints: 1f1b, v-zb (a B/W split), slimpipe with offload, vocabulary parallel stay quick
    "tests/test_checkpoint.py::test_six_iterations_equal_three_saved_resumed_and_three_more[[]zb-h2]": "v-zb",
    "tests/test_checkpoint.py::test_v_zb_checkpoint_continues_under_another_schedule_or_layout[[]1f1b-pp2-first-1]": (
        "the other layouts load the same checkpoint; test_train_layer_split splits layers"
    ),
    "tests/test_checkpoint.py::test_v_zb_checkpoint_continues_under_another_schedule_or_layout[[]1f1b-pp1-dp2]": (
        "1f1b-pp1-tp2 reshards the same way"
    ),
    "tests/test_checkpoint.py::test_vocab_parallel_checkpoint_continues_without_it[[]1f1b-pp1-tp2]": "1f1b-pp2",
    "tests/test_moe_train.py::test_a_checkpoint_resumes_under_one_ep_rank_and_another_schedule": (
        "test_a_checkpoint_resumes_bitwise_under_its_layout"
    ),
    "tests/test_moe_train.py::test_experts_split_over_tensor_or_context_parallel_ranks_train_as_on_one": (
        "test_experts_over_two_ranks_train_as_over_one (EP 2); TP 2 + SP and CP 2 are test_parallel_compose's"
    ),
    "tests/test_moe_train.py::test_experts_over_two_ranks_train_as_over_one[[]allgather]": "the alltoall one",
    "tests/test_moe_train.py::test_other_schedule_families_with_experts_over_two_ranks_train_as_over_one*": (
        "ZB-H1 at EP 2 (test_experts_over_two_ranks_train_as_over_one); every family at EP 1 in test_moe_exact"
    ),
    "tests/test_pretrain_gpt.py::test_train_step_moe_with_expert_parallelism_equals_megatron_s_1f1b*": (
        "test_moe_exact (megatron-core's schedule) and test_moe_train (EP 2)"
    ),
    "tests/test_pretrain_gpt.py::test_megatron_save_checkpoint_loads_under_another_schedule": "Megatron-LM's save",
    "tests/test_train_data.py::test_mock_data_trains": "the main job trains on mock data",
    "tests/test_pretrain_gpt.py::test_train_and_pretrain_gpt_agree_on_every_row*": "the bad lines run the parser",
    # the planner against published runs: the smaller models stay quick
    "tests/test_planner_pins.py::*[[]Korthikanti-gpt-175b]": "GPT-175B",
    "tests/test_planner_pins.py::*[[]Korthikanti-gpt-530b]": "GPT-530B",
    "tests/test_planner_pins.py::*[[]Korthikanti-gpt-1t]": "GPT-1T",
    "tests/test_planner_pins.py::test_from_sbatch_predicts_each_of_our_scripts[[]llama2-70b-slimpipe-*]": "long seqs",
    "tests/test_planner_pins.py::test_from_args_predicts_megatron_s_gpt3_example": "GPT-3 example",
    "tests/test_planner_pins.py::test_vocabulary_parallelism_pinned_spreads_the_output_layer": "vocab pin",
    "tests/test_planner_pins.py::test_from_args_text_shows_the_run_then_the_alternative": "the text report",
    "tests/test_planner.py::test_ranking_is_stable_under_the_stated_uncertainty": "ranking sweep",
    # the NCCL rules in the schedule core: p = 2..4 stay quick
    "tests/test_nccl_check.py::test_sweep_what_holds_for_every_generator[[][5678]]": "p = 5..8",
    "tests/test_nccl_check.py::test_sweep_attention_exchanges_complete_in_order[[][34]]": "p = 3, 4",
    "tests/test_nccl_check.py::test_every_vocab_schedule_hangs_at_its_first_collective_up_to_p8[[][5678]]": "p 5..8",
    # NCCL emulation on real processes: the runtime's cases here, test_megatron_hook's V-Half and
    # test_megatron_contract's variable lengths stay quick
    "tests/test_nccl_emulation.py::test_train_under_emulation_gives_the_same_losses*": "whole train runs",
    "tests/test_nccl_emulation.py::test_runs_exactly_on_plain_gloo_and_warmed_under_emulation[[]*vocab-2]": "vocab",
    # launch scripts and benches: one dry run, one bench stay quick
    "tests/test_slurm_scripts.py::test_every_sbatch_dry_run_passes_megatrons_parser": "every sbatch script",
    "tests/test_slurm_scripts.py::test_the_harness_sees_megatrons_refusals": "the dry runs stay quick",
    "tests/test_bench_emulate.py::test_the_runner_executes_each_ranks_lowered_ops_in_order": "the other emulate tests",
    "tests/test_bench_emulate.py::test_fidelity_sweep_within_a_bound_that_wrong_predictions_miss": "the same",
    "tests/test_bench_emulate.py::test_the_runner_runs_each_pair_as_one_unit": "test_expert_overlap's real pairs",
    "tests/test_bench_emulate.py::test_paired_run_agrees_with_its_prediction": "the paired prediction's unit test",
    # overlapped pairs: test_expert_overlap (every pairing schedule, real processes) stays quick
    "tests/test_pretrain_gpt.py::test_train_step_moe_overlapped_pairs_equal_unpaired": (
        "test_expert_overlap and train's paired DualPipeV (test_moe_train)"
    ),
    # the timeline: the runtime test and train's zb-h1 picture stay quick
    "tests/test_timeline.py::test_train_writes_the_trace_and_the_picture[[]schedule1]": "zb-h1's (schedule0)",
    "tests/test_bench.py::test_against_megatron_same_step_paired_rounds": "bench against megatron-core",
    "tests/test_bench.py::test_bad_flags_fail_before_launch[[]args[12]*": "more bad bench flags",
    "tests/test_gpu_validate.py::test_probe_without_gpu_skips_the_gpu_checks_and_appends_to_docs": "GPU probe",
    "tests/test_tiers.py::test_every_full_only_pattern_and_first_file_names_collected_tests": "a whole collection",
    # exactness at p = 4: p = 2 and the odd p = 3 run every schedule (and every slicing) quick
    "tests/test_runtime_exact.py::test_exact_p4[[]*": "test_exact_p2, test_exact_p3",
    "tests/test_runtime_sliced.py::test_sliced_exact_p4[[]*": "test_sliced_exact_p2, test_sliced_exact_p3",
    "tests/test_redistribution_runtime.py::test_redistribution_exact_p4_k8": "test_redistribution_exact_p3_k8",
    "tests/test_redistribution_runtime.py::test_redistribution_evens_out_the_attention_across_ranks_p4_k8": (
        "the p = 4 launch; exact at p = 2, 3 here; test_redistribution::test_plan_evens_out_the_attention_of_each_slot"
    ),
    # schedule shapes at p = 16: p up to 12 stay quick
    "tests/test_schedule_fidelity.py::*[[]16-*": "p = 16",
}

# Files whose tests take longest, scheduled first so that the two workers end together
# (``--dist loadfile`` hands files out in collection order).
RUN_FIRST = (
    "tests/test_bad_inputs.py",
    "tests/test_faults.py",
    "tests/test_train_cli.py",
    "tests/test_pretrain_gpt.py",
    "tests/test_checkpoint.py",
    "tests/test_train_data.py",
    "tests/test_planner_pins.py",
    "tests/test_nccl_emulation.py",
    "tests/test_bench.py",
    "tests/test_slurm_scripts.py",
)
