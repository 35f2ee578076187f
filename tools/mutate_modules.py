"""The modules `tools/mutate.py` mutates: each one's files and the tests that judge its mutants
(docs/mutation/README.md has the table and why some tests are left out)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Module:
    files: tuple[str, ...]  # globs, relative to the repository
    tests: tuple[str, ...]  # pytest paths or node ids (file::test)
    # the functions in scope, "path.py::function" or "path.py::Class.method", where a module is
    # a few functions of larger files: only their mutants are run and reported (empty: all)
    functions: tuple[str, ...] = ()
    # environment for the test runs: TRITON_INTERPRET=1 for Triton kernels' launchers (the
    # interpreter must be chosen before anything imports triton)
    env: tuple[tuple[str, str], ...] = ()

    def mutant_globs(self) -> list[str]:
        """mutmut's names of the in-scope functions' mutants, as globs
        (`mxrl.models.layers.xǁSparseMoeBlockǁroute__mutmut_*`)."""
        out = []
        for entry in self.functions:
            path, _, function = entry.partition("::")
            module = path.removesuffix(".py").replace("/", ".")
            cls, _, name = function.rpartition(".")
            mangled = f"x\u01c1{cls}\u01c1{name}" if cls else f"x_{name}"
            out.append(f"{module}.{mangled}__mutmut_*")
        return out


# The contract's critical paths (the issue on mutation testing). Dotted names are one file of a
# module with its own tests: quicker runs while working on that file.
MODULES = {
    "formats": Module(("mxrl/formats/*.py",), ("tests/formats",)),
    # the NVFP4 reference quantizer (TE order, 4over6, torchao, caller amaxes, non-finite
    # blocks): its own test files (19 s plain on two shared cores, 2 s more for the edges)
    "formats.nvfp4": Module(
        ("mxrl/formats/nvfp4.py",),
        ("tests/formats/test_nvfp4.py", "tests/formats/test_nvfp4_4over6.py",
         "tests/formats/test_nvfp4_edges.py"),
    ),
    # the MXFP8 reference quantizer (RCEIL and FLOOR scales, the column-wise copy, the top
    # scale's 240 cap, non-finite elements): its own test files
    "formats.mxfp8": Module(
        ("mxrl/formats/mxfp8.py",),
        ("tests/formats/test_mxfp8.py", "tests/formats/test_mxfp8_edges.py"),
    ),
    # DeepSeek-style block FP8 ((128, 128) and (1, 128) blocks, fp32 and ue8m0 scales, partial
    # row blocks, the square-block transpose): its own test files
    "formats.fp8_block": Module(
        ("mxrl/formats/fp8_block.py",),
        ("tests/formats/test_fp8_block.py", "tests/formats/test_fp8_block_edges.py"),
    ),
    # the element and scale codecs (E4M3 with its top-scale cap, E2M1 and its nibbles, E8M0
    # RCEIL/FLOOR codes and their values, fdiv): their own test files
    "formats.codecs": Module(
        ("mxrl/formats/codecs.py",),
        ("tests/formats/test_codecs.py", "tests/formats/test_codecs_edges.py"),
    ),
    "recipe": Module(
        ("mxrl/recipe/plan.py", "mxrl/recipe/schema.py", "mxrl/recipe/layers.py",
         "mxrl/arch/names.py", "mxrl/recipe/quantize.py", "mxrl/arch/hf.py"),
        ("tests/recipe", "tests/arch", "tests/test_cli.py"),
    ),
    "nn": Module(
        ("mxrl/nn/qlinear.py", "mxrl/nn/paths/reference.py", "mxrl/nn/gemm.py",
         "mxrl/nn/paths/grouped.py", "mxrl/nn/experts.py", "mxrl/nn/apply.py",
         "mxrl/nn/paths/__init__.py", "mxrl/nn/moe.py"),
        ("tests/nn",),
    ),
    "weights": Module(("mxrl/weights/*.py",), ("tests/weights",)),
    "sync": Module(("mxrl/sync/*.py",), ("tests/sync",)),
    # the wire format (pack/unpack, record views, the meta, the layout); node ids:
    # test_broadcast.py's pack/unpack tests, not its gloo runs (spawned ranks, which mutmut's
    # per-function test selection does not see, a minute each on two shared cores)
    "sync.wire": Module(
        ("mxrl/sync/wire.py",),
        ("tests/sync/test_wire_edges.py",
         "tests/sync/test_broadcast.py::test_pack_unpack_round_trips_every_record_bit_for_bit",
         "tests/sync/test_broadcast.py::test_unpack_refuses_a_header_that_does_not_fit_the_payload"),
    ),
    # the in-process transport (the bucket checks, the tally, apply_update, send): its edges on a
    # stand-in engine, and by node id one real engine's load (the other engine runs of
    # test_transport.py and test_tampering.py: 4-16 s each on two shared cores)
    "sync.transport": Module(
        ("mxrl/sync/transport.py",),
        ("tests/sync/test_transport_edges.py",
         "tests/sync/test_transport.py::test_engine_holds_the_trainers_fresh_export_byte_for_byte[mxfp8]"),
    ),
    # the torch.distributed sync, one module per end (the receiver: the verification, both
    # modes' receives, the all-or-nothing agreement; the sender: packing, the layout agreement,
    # the scheduled mode's checks and aborts): the edges, every rank a thread on a stand-in
    # torch.distributed (tests/sync/fake_dist.py); not test_broadcast.py's gloo runs, whose
    # spawned ranks mutmut's per-function test selection cannot see
    "sync.broadcast_receive": Module(
        ("mxrl/sync/broadcast_receive.py",), ("tests/sync/test_broadcast_edges.py",)
    ),
    "sync.broadcast": Module(("mxrl/sync/broadcast.py",), ("tests/sync/test_broadcast_edges.py",)),
    "engine": Module(
        ("mxrl/engine/block_manager.py", "mxrl/engine/scheduler.py", "mxrl/engine/sampler.py",
         "mxrl/engine/graph.py", "mxrl/engine/loading.py"),
        ("tests/engine",),
    ),
    # node ids: test_scheduler.py's block-manager tests, not its engine runs (minutes each on
    # two shared cores, run on every mutant they reach; `make test` runs them)
    "engine.block_manager": Module(
        ("mxrl/engine/block_manager.py",),
        ("tests/engine/test_block_manager.py",
         "tests/engine/test_scheduler.py::test_blocks_are_counted_shared_and_reused_until_handed_out_again",
         "tests/engine/test_scheduler.py::test_a_cached_block_taken_back_leaves_the_free_order_of_the_rest_alone",
         "tests/engine/test_scheduler.py::test_taking_back_cached_blocks_does_not_scan_the_free_list",
         "tests/engine/test_block_manager_edges.py"),
    ),
    # node ids: the file's tests but the 4000-request frequency test (48 s on two shared cores,
    # row by row on the CPU; the race test holds each draw to the spec, request by request)
    "engine.sampler": Module(
        ("mxrl/engine/sampler.py",),
        ("tests/engine/test_sampler.py::test_noise_is_exact_integer_arithmetic",
         "tests/engine/test_sampler.py::test_noise_is_uniform_and_rows_differ",
         "tests/engine/test_sampler.py::test_each_draw_is_the_race_of_its_own_noise",
         "tests/engine/test_sampler.py::test_top_k_and_top_p_keep_the_hand_computed_sets",
         "tests/engine/test_sampler.py::test_filters_on_random_rows_keep_the_spec_sets",
         "tests/engine/test_sampler.py::test_a_row_does_not_depend_on_its_batch",
         "tests/engine/test_sampler.py::test_top_k_keeps_the_k_largest",
         "tests/engine/test_sampler_edges.py",
         "tests/engine/test_sampler_fused_edges.py"),
    ),
    # node ids: test_scheduler.py's engine runs that reach the scheduler quickly (a refused
    # request, preemption, the prefill of next_token_logits) and one overlapped run
    # (schedule_ahead across block boundaries); not the slower runs (5-15 s each on two shared
    # cores, run on every mutant they reach; `make test` runs them): the edges hold each step
    "engine.scheduler": Module(
        ("mxrl/engine/scheduler.py",),
        ("tests/engine/test_scheduler_edges.py",
         "tests/engine/test_scheduler.py::test_a_request_larger_than_the_cache_is_refused_before_any_work",
         "tests/engine/test_scheduler.py::test_preemption_recomputes_the_same_bytes",
         "tests/engine/test_scheduler.py::test_next_token_logits_are_the_first_samples_logits",
         "tests/engine/test_overlap.py::test_every_decode_step_but_the_first_is_queued_ahead_across_block_boundaries",
         "tests/engine/test_overlap.py::test_requests_ending_by_length_do_not_stop_the_step_after_from_being_queued_ahead"),
    ),
    # the CUDA-graph decode's host side (buckets, metadata rows, turns, lazy capture, the
    # fall-back, table widths); capture and replay need CUDA: test_gpu.py's graph tests
    "engine.graph": Module(
        ("mxrl/engine/graph.py",),
        ("tests/engine/test_graph.py", "tests/engine/test_graph_edges.py"),
    ),
    # the engine's verified weight loading: its edges and its order on a stand-in engine (no model
    # built), and by node id one engine run (the tiny MoE's first load and a reload with a changed
    # layout: RolloutExperts' branches); not the reloads per preset, the refused forged updates, the
    # prefix-cache reset or test_engine.py's refusals (9-25 s each on two shared cores)
    "engine.loading": Module(
        ("mxrl/engine/loading.py",),
        ("tests/engine/test_loading_edges.py", "tests/engine/test_loading_order.py",
         "tests/engine/test_load_cache.py",
         "tests/engine/test_load_in_place.py::test_a_changed_layout_installs_new_buffers_and_drops_the_graphs"),
    ),
    "parallel": Module(("mxrl/parallel/export.py", "mxrl/parallel/dcp.py"),
                       ("tests/parallel",)),
    # the export from FSDP2 shards and the DCP checkpoints, in one process: every rank a thread
    # and the DTensor stood in for (tests/parallel/fake_ranks.py), DCP on a one-rank gloo group;
    # not test_export.py's and test_train.py's torchrun runs (spawned ranks, which mutmut's
    # per-function test selection cannot see; a minute each on two shared cores)
    "parallel.export": Module(
        ("mxrl/parallel/export.py", "mxrl/parallel/dcp.py"),
        ("tests/parallel/test_export_edges.py", "tests/parallel/test_export_refusals.py",
         "tests/parallel/test_dcp_edges.py"),
    ),
    "rl": Module(
        ("mxrl/rl/grpo.py", "mxrl/rl/mismatch.py", "mxrl/rl/stability.py", "mxrl/rl/logprobs.py"),
        ("tests/rl",),
    ),
    "rl.grpo": Module(("mxrl/rl/grpo.py",), ("tests/rl/test_grpo.py", "tests/rl/test_grpo_edges.py")),
    # the memory estimate's assembly and rl.hold_bf16_weights auto (which estimate a run gets),
    # and the line a run prints; not the refusals' wording (check) nor the terms (memory_terms)
    "rl.memory": Module(
        ("mxrl/rl/memory.py",),
        ("tests/rl/test_memory.py", "tests/rl/test_memory_assembly.py"),
        functions=(
            "mxrl/rl/memory.py::estimate_memory",
            "mxrl/rl/memory.py::_estimate",
            "mxrl/rl/memory.py::MemoryEstimate.lines",
        ),
    ),
    "rl.logprobs": Module(
        ("mxrl/rl/logprobs.py",), ("tests/rl/test_logprobs.py", "tests/rl/test_logprobs_edges.py")
    ),
    # node ids: the file's tests but its trainer step (a minute a mutant) and its GPU test
    "rl.micro_batch": Module(
        ("mxrl/rl/micro_batch.py",),
        ("tests/rl/test_micro_batch.py::test_split_cuts_longest_first_by_padded_tokens",
         "tests/rl/test_micro_batch.py::test_like_lengths_together_pad_less_than_request_order",
         "tests/rl/test_micro_batch.py::test_every_rank_runs_as_many_forwards",
         "tests/rl/test_micro_batch.py::test_combine_sums_maxima_and_token_weighted_means",
         "tests/rl/test_micro_batch.py::test_policy_loss_of_micro_batches_adds_up_to_the_whole_batch",
         "tests/rl/test_micro_batch_edges.py"),
    ),
    # the train-rollout mismatch metrics (k1, k3, |d|) and the gradient-spike detector
    "rl.mismatch": Module(
        ("mxrl/rl/mismatch.py",), ("tests/rl/test_mismatch.py", "tests/rl/test_mismatch_edges.py")
    ),
    # a step's metrics, the collector's clock (time/gc_s), the frozen heap, the progress line
    "rl.metrics": Module(("mxrl/rl/metrics.py",), ("tests/rl/test_metrics.py",)),
    "rl.stability": Module(
        ("mxrl/rl/stability.py",),
        ("tests/rl/test_stability.py", "tests/rl/test_stability_edges.py"),
    ),
    # the served-checkpoint export (`mxrl convert --to hf`) and its config.json
    "weights.served": Module(
        ("mxrl/weights/served.py", "mxrl/weights/served_config.py"),
        ("tests/weights/test_served.py", "tests/weights/test_served_edges.py",
         "tests/weights/test_served_config.py"),
    ),
    # the record checksum (name, header, every field's digest) and the weights digest; node ids:
    # test_digest.py but its export test (a tiny model exported, 3 s a mutant: export.py's use
    # of checksum, not the checksum) and its GPU tests (skipped on the CPU)
    "weights.digest": Module(
        ("mxrl/weights/digest.py", "mxrl/weights/host.py"),
        ("tests/weights/test_digest.py::test_any_flipped_bit_changes_the_checksum",
         "tests/weights/test_digest.py::test_reordered_rows_bytes_and_experts_change_it",
         "tests/weights/test_digest.py::test_dtype_shape_and_length_are_bound",
         "tests/weights/test_digest.py::test_every_byte_of_every_field_of_every_format_counts",
         "tests/weights/test_digest.py::test_the_name_is_bound",
         "tests/weights/test_digest.py::test_the_gemm_and_the_elementwise_path_give_the_same_integers",
         "tests/weights/test_digest.py::test_checksums_of_many_equal_one_by_one",
         "tests/weights/test_digest_edges.py"),
    ),
    # the bucketed live export (boundaries, exact fits, oversize records, the event, the
    # sampled SQNR's wiring)
    "weights.buckets": Module(
        ("mxrl/weights/buckets.py",),
        ("tests/weights/test_buckets.py", "tests/sync/test_export.py",
         "tests/weights/test_buckets_edges.py", "tests/weights/test_sqnr_sample.py",
         "tests/weights/test_finite.py", "tests/weights/test_export_amax.py"),
    ),
    # the one export path (names and NaN/Inf checks before anything is quantized, read at once
    # or queued (finite.py), the NVFP4 global amax from the check's read, fuse partners, the backend per device) and the
    # quantization event (its dict, the sampled per-layer SQNR): the tiny MoE exported per
    # preset (test_export.py, test_export_amax.py, the buckets' tests: 14 s plain on two shared
    # cores) and hand-made tensors and plans (test_export_edges.py)
    "weights.export": Module(
        ("mxrl/weights/export.py", "mxrl/weights/finite.py", "mxrl/weights/event.py"),
        ("tests/sync/test_export.py", "tests/weights/test_sqnr_sample.py",
         "tests/weights/test_export_amax.py", "tests/weights/test_buckets.py",
         "tests/weights/test_buckets_edges.py", "tests/weights/test_export_edges.py",
         "tests/weights/test_finite.py"),
    ),
    # the quantized checkpoint (`mxrl convert`'s directory: shards filled to the byte, the
    # manifest, the refusals when read); node ids: test_quantized_checkpoint.py but its engine
    # runs and CLI conversions (3-9 s each on two shared cores); the edges write hand-made
    # records and a two-layer Qwen3's random weights (no model built)
    "weights.quantized_checkpoint": Module(
        ("mxrl/weights/quantized_checkpoint.py",),
        ("tests/weights/test_quantized_checkpoint_edges.py",
         "tests/weights/test_quantized_checkpoint_read_edges.py",
         "tests/weights/test_checkpoint_checks.py",
         "tests/sync/test_quantized_checkpoint.py::test_layout_manifest_and_shards",
         "tests/sync/test_quantized_checkpoint.py::test_plan_json_round_trips",
         "tests/sync/test_quantized_checkpoint.py::test_a_truncated_shard_is_caught_naming_the_file",
         "tests/sync/test_quantized_checkpoint.py::test_an_edited_manifest_hash_is_caught_by_the_engine",
         "tests/sync/test_quantized_checkpoint.py::test_a_failed_write_leaves_nothing"),
    ),
    # the checks of a record against the plan (fields, global scales, a checkpoint's config);
    # not test_checkpoint_checks.py (a converted checkpoint and an engine loading it, seconds a
    # mutant): check_config's refusals are called directly by test_check_edges.py
    "weights.check": Module(
        ("mxrl/weights/check.py",),
        ("tests/weights/test_check.py", "tests/weights/test_check_edges.py"),
    ),
    # the plan, its hash (plan.py) and the resolution of a recipe into it; node ids: test_plan.py
    # but its two-subprocess hash-seed test (4 s a mutant: sha256 of sorted JSON, which the pinned
    # hashes hold), and test_plan_hash.py but the docs' printed hashes (the CLI and a model build
    # per documented command, 3 s a mutant: the hash they print is the pinned one's)
    "recipe.plan": Module(
        ("mxrl/recipe/plan.py", "mxrl/recipe/resolver.py"),
        ("tests/recipe/test_plan.py::test_hash_does_not_depend_on_tensor_order",
         "tests/recipe/test_plan.py::test_json_round_trip",
         "tests/recipe/test_plan.py::test_from_json_rejects_tampering_and_other_schemas",
         "tests/recipe/test_plan.py::test_hash_ignores_provenance_and_backward_but_not_formats",
         "tests/recipe/test_plan.py::test_mapping_interface",
         "tests/recipe/test_plan.py::test_table_groups_experts_and_summarises",
         "tests/recipe/test_plan.py::test_table_spells_out_split_expert_groups",
         "tests/recipe/test_plan.py::test_table_bytes",
         "tests/recipe/test_plan.py::test_tensor_spec_validation",
         "tests/recipe/test_plan.py::test_a_name_glob_that_matches_nothing_is_a_problem_even_for_bf16",
         "tests/recipe/test_plan.py::test_every_glob_of_a_name_list_must_match_something",
         "tests/recipe/test_plan.py::test_low_precision_rules_that_take_nothing_are_problems",
         "tests/recipe/test_plan.py::test_bf16_exceptions_for_kinds_a_model_lacks_are_fine",
         "tests/recipe/test_plan.py::test_an_nvfp4_preset_on_a_dense_model_quantizes_nothing",
         "tests/recipe/test_plan.py::test_4over6_round_trips_shows_and_reaches_the_quantizer",
         "tests/recipe/test_plan.py::test_4over6_is_nvfp4_only_in_a_spec_and_fuse_partners_must_agree",
         "tests/recipe/test_plan_hash.py::test_every_preset_has_a_pinned_family",
         "tests/recipe/test_plan_hash.py::test_plan_hashes_are_pinned",
         "tests/recipe/test_plan_hash.py::test_every_hashed_field_changes_the_hash",
         "tests/recipe/test_plan_hash.py::test_provenance_name_and_backward_do_not_change_the_hash",
         "tests/recipe/test_resolve.py", "tests/recipe/test_plan_edges.py",
         "tests/recipe/test_resolver_edges.py"),
    ),
    # the reference quantized GEMM (the forward's emulated GEMM, the three backward modes'
    # operands through the table of operands.py, the column-wise copies' zero padding): the
    # reference path's own test files; the tensor-core and grouped paths (paths/tensor_core.py,
    # paths/grouped.py) need CUDA or Triton for what they add and are not mutated here
    "nn.paths.reference": Module(
        ("mxrl/nn/paths/reference.py", "mxrl/nn/operands.py"),
        ("tests/nn/test_qmatmul.py", "tests/nn/test_operands.py",
         "tests/nn/test_fp8_block_backward.py", "tests/nn/test_qmatmul_edges.py",
         "tests/nn/test_paths.py"),
    ),
    # the routed experts' one dispatch (the loop form, the grouped form and its two combine
    # orders) and the engine's batch-invariant tiles: their own tests, the paths' (a QExperts
    # through each path against the Functions, a projection's tiles) and the engine's grouped
    # form against the loop
    "nn.moe": Module(
        ("mxrl/nn/moe.py", "mxrl/nn/paths/tiles.py"),
        ("tests/nn/test_moe.py", "tests/nn/test_tiles.py", "tests/nn/test_paths.py"),
    ),
    # bf16 experts over fp32 masters: the held bf16 copy (GroupedExperts.set_hold_bf16 /
    # bf16_weight / _grouped_proj) and the grouped form's bf16 rows and their gradient's sum
    # (ExpertLayout.build, _GatherTokens, grouped_experts_forward, GroupedLinear's dgrad weight):
    # the functions this touches, on the CPU's grouped GEMMs
    "nn.experts": Module(
        ("mxrl/nn/experts.py", "mxrl/nn/paths/grouped.py", "mxrl/nn/paths/permute.py"),
        ("tests/nn/test_hold_bf16.py", "tests/nn/test_gather_rows.py", "tests/nn/test_moe.py",
         "tests/nn/test_fast.py::test_layouts",
         "tests/nn/test_fast.py::test_gather_tokens_backward_sums_each_tokens_rows",
         "tests/nn/test_fast.py::test_grouped_experts_module_runs_and_routes_like_the_loop",
         "tests/kernels/test_moe_train.py"),
        functions=(
            "mxrl/nn/experts.py::GroupedExperts.set_hold_bf16",
            "mxrl/nn/experts.py::GroupedExperts.bf16_weight",
            "mxrl/nn/experts.py::GroupedExperts._grouped_proj",
            "mxrl/nn/paths/permute.py::ExpertLayout.build",
            "mxrl/nn/paths/permute.py::ExpertLayout.combine",
            "mxrl/nn/paths/permute.py::_GatherTokens.forward",
            "mxrl/nn/paths/permute.py::_GatherTokens.backward",
            "mxrl/nn/paths/permute.py::ExpertLayout.sum_rows",
            "mxrl/nn/paths/permute.py::_Unpermute.forward",
            "mxrl/nn/paths/permute.py::_Unpermute.backward",
            "mxrl/nn/paths/grouped.py::_hp_weight",
            "mxrl/nn/paths/grouped.py::grouped_experts_forward",
        ),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # the trainer's fused RoPE: its launcher, its checks and its autograd Function, under
    # Triton's interpreter
    "kernels.rope_train": Module(
        ("mxrl/kernels/rope_train.py",),
        ("tests/kernels/test_rope_train.py",),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # the trainer's fused RMSNorm: its reference, launchers, split and autograd Function, under
    # Triton's interpreter
    "kernels.norm_train": Module(
        ("mxrl/kernels/norm_train.py",),
        ("tests/kernels/test_norm_train.py",),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # the fused SwiGLU (the trainer's and the engine's): its checks, launchers and autograd
    # Function, under Triton's interpreter
    "kernels.swiglu": Module(
        ("mxrl/kernels/swiglu.py",),
        ("tests/kernels/test_swiglu.py",),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # the FP8 KV cache's numbers (quantize, dequantize, the trainer's straight-through fake
    # quantization) and the paged attention's tiles and launchers (its checks, what it reads of
    # an FP8 cache, the split-keys launcher), under Triton's interpreter
    # the engine's paged KV cache (sizing, allocation, the FP8 writes and reads) and its
    # reference attention, under Triton's interpreter (the kernel path of PagedAttention)
    "engine.kv_cache": Module(
        ("mxrl/engine/kv_cache.py",),
        ("tests/engine/test_kv_cache.py", "tests/engine/test_kv_fp8.py",
         "tests/kernels/test_attention.py", "tests/kernels/test_attention_launch.py",
         "tests/engine/test_config.py", "tests/kernels/test_kv_write.py"),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    "kv": Module(
        ("mxrl/nn/kv_quant.py", "mxrl/kernels/attention.py", "mxrl/kernels/attention_split.py"),
        ("tests/engine/test_kv_fp8.py", "tests/kernels/test_attention.py",
         "tests/kernels/test_attention_launch.py", "tests/kernels/test_attention_split.py"),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # the trainer's MoE permutation: its references, launchers and checks, under Triton's
    # interpreter
    "kernels.moe_train": Module(
        ("mxrl/kernels/moe_train.py",),
        ("tests/kernels/test_moe_train.py",),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # one quantized weight (QWeight's operands, holds, column-wise copy, experts' views), its
    # per-step cache and the layers that build it per GEMM path (path_weight, QLinear, QExperts);
    # node ids: test_fast.py's CPU tests of the held bytes, the column copy's refusal and the
    # grouped projections, not its tiny-model training runs (40 s each on two shared cores);
    # not test_apply_plan.py (tiny-model runs, 30-90 s each per preset)
    "nn.weight": Module(
        ("mxrl/nn/weight.py", "mxrl/nn/qlinear.py"),
        ("tests/nn/test_qweight.py", "tests/nn/test_weight_cache.py", "tests/nn/test_qmatmul.py",
         "tests/nn/test_fast.py::test_cached_weight_keeps_only_the_packed_bytes",
         "tests/nn/test_fast.py::test_column_copy_is_built_by_the_backward_and_refused_after_an_optimizer_step",
         "tests/nn/test_fast.py::test_an_optimizer_stepping_inside_the_backward_is_not_refused",
         "tests/nn/test_fast.py::test_grouped_projection_matches_the_loop_within_the_bound",
         "tests/nn/test_weight_edges.py", "tests/nn/test_qlinear_edges.py"),
    ),
    # the quantized experts' kept bf16 operands (rl.hold_bf16_weights), NVFP4's one-pass
    # global scales (scale_bf16), MXFP8's padded copies from one read (quantize_mxfp8_padded)
    # and the gate/up projection on x's tokens (GroupedLinear's tokens): the functions they
    # touch, under Triton's interpreter for the kernels' launchers
    "nn.kept": Module(
        ("mxrl/nn/weight.py", "mxrl/nn/qlinear.py", "mxrl/nn/paths/grouped.py",
         "mxrl/nn/paths/permute.py", "mxrl/rl/memory_terms.py", "mxrl/kernels/api.py"),
        ("tests/nn/test_hold_bf16.py", "tests/nn/test_weight_edges.py", "tests/nn/test_qweight.py",
         "tests/rl/test_memory.py", "tests/kernels/test_mxfp8_padded.py",
         "tests/kernels/test_dequantize.py", "tests/nn/test_backends.py",
         "tests/nn/test_gate_up_tokens.py", "tests/nn/test_paths.py", "tests/nn/test_gather_rows.py",
         "tests/nn/test_fast.py::test_grouped_projection_matches_the_loop_within_the_bound",
         "tests/nn/test_fast.py::test_grouped_experts_module_runs_and_routes_like_the_loop",
         "tests/nn/test_fast.py::test_gather_tokens_backward_sums_each_tokens_rows",
         "tests/nn/test_fast_fp8_block.py", "tests/nn/test_fp8_block_backward.py",
         "tests/kernels/test_moe_train.py", "tests/nn/test_qlinear_edges.py"),
        functions=(
            "mxrl/nn/weight.py::QWeight.operand",
            "mxrl/nn/weight.py::QWeight.master_operand",
            "mxrl/nn/weight.py::QWeight.keep_operands",
            "mxrl/nn/weight.py::QWeight._resolved",
            "mxrl/nn/weight.py::QWeight._operand",
            "mxrl/nn/qlinear.py::kept_forms",
            "mxrl/nn/qlinear.py::QExperts.qweight",
            "mxrl/nn/qlinear.py::QExperts.set_hold_bf16",
            "mxrl/nn/paths/permute.py::PaddedLayout.src",
            "mxrl/nn/paths/permute.py::ExpertLayout.sum_rows",
            "mxrl/nn/paths/grouped.py::GroupedLinear.backward",
            "mxrl/nn/paths/grouped.py::_lp_rows",
            "mxrl/nn/paths/grouped.py::_rows",
            "mxrl/nn/paths/grouped.py::_rows_q",
            "mxrl/nn/paths/grouped.py::_padded_tokens",
            "mxrl/nn/paths/grouped.py::_padded_rows",
            "mxrl/nn/paths/grouped.py::grouped_experts_forward",
            "mxrl/nn/qlinear.py::QExperts._grouped_proj",
            "mxrl/nn/paths/grouped.py::_hp_weight",
            "mxrl/rl/memory_terms.py::_kept_bytes",
            "mxrl/kernels/api.py::scale_bf16",
            "mxrl/kernels/api.py::quantize_mxfp8_padded",
        ),
        env=(("TRITON_INTERPRET", "1"),),
    ),
    # session 28: the memory estimate's routed-expert inputs as the grouped GEMMs keep them
    # (x's tokens, codes under dequantized) and the layer's one padded layout; not
    # activation_bytes, whose other terms are tested within 10% (67 survivors in scope)
    "rl.expert_inputs": Module(
        ("mxrl/rl/memory_terms.py", "mxrl/nn/paths/permute.py"),
        ("tests/rl/test_memory_experts.py", "tests/rl/test_memory_assembly.py",
         "tests/nn/test_gate_up_tokens.py"),
        functions=(
            "mxrl/rl/memory_terms.py::expert_input_bytes",
            "mxrl/rl/memory_terms.py::_activation_bytes",
            "mxrl/rl/memory_terms.py::_layout_bytes",
            "mxrl/nn/paths/permute.py::ExpertLayout.padded",
        ),
    ),
    # routing replay lives in the model code (forward under checkpointing, the router)
    "models": Module(("mxrl/models/model.py", "mxrl/models/layers.py"), ("tests/models",)),
    # routing replay only: the functions that record, pass on and replay the routers' choices
    # (the routers' replay branch, the block's reshapes, the decoder layer, the model's replay
    # list and its checkpointed layers); node ids: the bf16 replay-under-checkpointing test, not
    # its nvfp4-dequantized twin (19 s on two shared cores; the replay code does not see the
    # format), and test_model.py's forward runs that reach the masks, positions and kv cache
    "models.replay": Module(
        ("mxrl/models/layers.py", "mxrl/models/mla.py", "mxrl/models/model.py"),
        ("tests/models/test_routing_replay_edges.py",
         "tests/models/test_routing_replay.py::test_replayed_routing_is_used_in_the_recomputed_forward[bf16]",
         "tests/models/test_model.py::test_routing_replay",
         "tests/models/test_model.py::test_left_padding_gives_the_unpadded_logits",
         "tests/models/test_model.py::test_kv_cache_hook_prefill_then_decode_matches_full_forward[qwen3_moe-norm-dense1]",
         "tests/models/test_model.py::test_dense_model_returns_empty_routing"),
        ("mxrl/models/layers.py::RoutedBlock.forward", "mxrl/models/layers.py::SparseMoeBlock.route",
         "mxrl/models/layers.py::DecoderLayer.forward", "mxrl/models/mla.py::DeepseekMoE.route",
         "mxrl/models/model.py::DecoderModel.forward"),
    ),
}  # fmt: skip
