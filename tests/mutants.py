"""`make mutants`: apply each critical one-line breakage to a copy of the checkout and run the tests
that guard it; every mutant must be caught (its tests fail). Prints a table; exits 1 if one survives.

    python tests/mutants.py [--only NAME ...] [--list]

A mutant is (name, file, the exact text it replaces, the replacement, the tests to run). The text
must occur exactly once in the file: `tests/test_mutants.py` checks that in `make test`, so a
refactor that moves a line fails there and the mutant is updated with it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


HARDENING = "tests/gateway/test_hardening.py"
BATCH = "tests/gateway/test_batch.py"
DECODE_KERNEL = "tests/gateway/test_decode_kernel.py"
VECTOR_PRODUCTS = "tests/gateway/test_vector_products.py"
GUARDS = "tests/semantic/test_guards.py::test_lookalikes_are_refused_with_the_right_reason"
FAMILIES = "tests/gateway/test_families.py"
BREADTH = "tests/gateway/test_api_breadth.py"
VERIFIER = "tests/semantic/test_verifier.py"
ROUND_TWO = "tests/gateway/test_hardening_round_two.py"
SAMPLING = "tests/gateway/test_sampling.py"
ROWS = "tests/gateway/test_rows_kv.py"
SHARED_KV = "tests/gateway/test_shared_kv.py"
LIVE_HARDENING = "tests/gateway/test_live_hardening.py"
VERIFY = "tests/gateway/test_verify.py"
AT_REST = "tests/gateway/test_at_rest.py"
SYSTEM_TURNS = "tests/gateway/test_system_turns.py"
AGENT_API = "tests/gateway/test_agent_api.py"
# semantic/guards.py's GUARDS, in order: each mutant takes one out
GUARD_NAMES = (
    "numbers",
    "arithmetic",
    "negation",
    "antonym",
    "dates",
    "units",
    "billing",
    "entities",
    "direction",
    "entity_order",
    "comparatives",
    "quantifiers",
)

MUTANTS = (
    Mutant(
        "tenant out of the exact key",  # both of its guards: the key's scope and its keyed digest
        "gateway/serving/responses.py",
        'key = at_rest(self.sealer, caller.tenant, "exact", exact_key(scope, messages, decoding))',
        'key = at_rest(self.sealer, "", "exact", exact_key(Scope("", scope.model), messages, decoding))',
        (f"{HARDENING}::test_tenants_never_share_response_layers",),
    ),
    Mutant(
        "tenant out of the semantic partition",
        "semantic/scope.py",
        '{**asdict(self), "context": context_fingerprint}',
        '{**asdict(self), "tenant": "", "context": context_fingerprint}',
        (
            "tests/semantic/test_semantic_cache.py::test_other_scope_or_context_never_sees_the_entry",
            f"{HARDENING}::test_tenants_never_share_response_layers",
        ),
    ),
    Mutant(
        "tenant out of the KV chain root",
        "kvcache/keys.py",
        'b"strata-kv-root-v1|" + salt + b"|"',
        'b"strata-kv-root-v1|" + b"|"',
        (
            "tests/kvcache/test_chain.py::test_tenant_salt_changes_the_whole_chain",
            "tests/gateway/test_engine_caches.py::test_other_tenant_reuses_nothing",
        ),
    ),
    Mutant(
        "tenant out of the vision key",
        "vision/cache.py",
        "(pixel_hash.encode(), processor.encode(), model.encode(), scope)",
        "(pixel_hash.encode(), processor.encode(), model.encode())",
        ("tests/gateway/test_engine_caches.py::test_other_tenant_reuses_nothing",),
    ),
    Mutant(
        "end user out of personal keys",
        "gateway/serving/responses.py",
        'output["end_user"] = end_user',
        "pass",
        (f"{HARDENING}::test_personal_questions_are_scoped_to_the_named_end_user",),
    ),
    Mutant(
        "SSD checksum skipped (read and reindex)",
        "kvcache/segment.py",
        'described[hex_hash]["checksum"] != tensor_checksum(mine)',
        "False",
        (
            "tests/kvcache/test_ssd.py::test_damaged_file_is_quarantined_on_read",
            "tests/kvcache/test_ssd.py::test_reconcile_verifies_checksums_of_files_the_index_lacks",
        ),
    ),
    Mutant(
        "SSD bad segment kept on read",
        "kvcache/ssd.py",
        "if problem:\n            self._quarantine(name, problem)",
        "if False:\n            self._quarantine(name, problem)",
        ("tests/kvcache/test_ssd.py::test_damaged_file_is_quarantined_on_read",),
    ),
    Mutant(
        "SSD bad file indexed on reindex",
        "kvcache/ssd.py",
        "if problem:\n            self._move_to_quarantine(path, problem)",
        "if False:\n            self._move_to_quarantine(path, problem)",
        ("tests/kvcache/test_ssd.py::test_reconcile_verifies_checksums_of_files_the_index_lacks",),
    ),
    Mutant(
        "SSD writes in place",
        "kvcache/segment.py",
        'temp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}")',
        "temp = path",
        ("tests/kvcache/test_ssd.py::test_segment_names_appear_only_once_the_file_is_complete",),
    ),
    Mutant(
        "file:// folder containment",
        "gateway/requests/images.py",
        "if not path.is_relative_to(Path(root).resolve()) or not path.is_file():",
        "if not path.is_file():",
        ("tests/gateway/test_api.py::test_file_image_urls_work_only_below_the_allowed_folder",),
    ),
    Mutant(
        "remote images: any address",
        "gateway/requests/fetch.py",
        "return ip.is_global and not (ip.is_multicast",
        "return True or not (ip.is_multicast",
        ("tests/gateway/test_fetch.py",),
    ),
    Mutant(
        "exact layer stores no-store answers",
        "semantic/exact.py",
        "if control.no_store or not self.eligible(deterministic):",
        "if not self.eligible(deterministic):",
        ("tests/gateway/test_response_caches.py::test_cache_control_no_store_no_cache_and_max_age",),
    ),
    Mutant(
        "semantic layer stores no-store answers",
        "gateway/serving/responses.py",
        "or ctx.control.no_store or not ctx.greedy:",
        "or not ctx.greedy:",
        (f"{HARDENING}::test_no_store_answers_reach_neither_layer",),
    ),
    Mutant(
        "exact layer caches sampled answers",
        "semantic/exact.py",
        "return deterministic or self.cache_nondeterministic",
        "return True",
        ("tests/gateway/test_response_caches.py::test_nondeterministic_requests_bypass_both_layers",),
    ),
    Mutant(
        "semantic layer serves sampled answers",
        "gateway/serving/responses.py",
        'if not ctx.greedy:\n        return "sampled"',
        'if False:\n        return "sampled"',
        (f"{HARDENING}::test_a_sampled_answer_never_serves_greedy_requests",),
    ),
    Mutant(
        "decoding out of the semantic partition",
        "gateway/serving/responses.py",
        "context_fingerprint(messages[:-1] + [decoding], image_keys)",
        "context_fingerprint(messages[:-1], image_keys)",
        (
            f"{HARDENING}::test_max_tokens_is_part_of_the_semantic_key",
            f"{HARDENING}::test_an_answer_cut_by_stop_serves_only_requests_with_the_same_stop",
        ),
    ),
    Mutant(
        "control tokens across parts",
        "gateway/engine/prompt.py",
        "cuts.add(at + 1)",
        "pass",
        (f"{HARDENING}::test_special_tokens_split_across_parts_are_not_control_tokens",),
    ),
    *(
        Mutant(
            f"guard removed: {guard}",
            "semantic/guards.py",
            "GUARDS = (\n" + "".join(f"    {name},\n" for name in GUARD_NAMES) + ")",
            "GUARDS = " + repr(tuple(g for g in GUARD_NAMES if g != guard)).replace("'", ""),
            (GUARDS,),
        )
        for guard in GUARD_NAMES
    ),
    Mutant(
        "guard removed: substitution",
        "semantic/guards.py",
        "if not reasons and (r := substitution(a, b, similar)):",
        "if False:",
        (GUARDS,),
    ),
    Mutant(
        "sliding window cuts one visible key",
        "gateway/engine/attention.py",
        "return int(visible.argmax()) if visible.any() else 0",
        "return int(visible.argmax()) + 1 if visible.any() else 0",
        (f"{FAMILIES}::test_chunked_cold_prefill_equals_the_library_one_shot_forward[gemma3]",),
    ),
    Mutant(
        "a running sequence's stored blocks held beside its own KV (its bytes counted twice)",
        "gateway/engine/runner.py",
        "self.plan.session.let_go()  # cached copies",
        "pass  # cached copies",
        (
            "tests/gateway/test_memory_budget.py::test_admission_waits_for_memory_instead_of_overcommitting",
            "tests/gateway/test_memory_budget.py::test_a_decoding_sequences_cached_prompt_gives_way_to_the_next",
        ),
    ),
    Mutant(
        "let_go releases nothing",
        "kvcache/prefix.py",
        "        for block in reversed(self.held):\n            self.pool.release(block)\n        self.held = []\n\n    def close",
        "        pass\n\n    def close",
        (
            "tests/kvcache/test_prefix.py::test_blocks_let_go_give_way_and_the_next_store_leaves_the_chain_without_a_gap",
        ),
    ),
    Mutant(
        "a batch's first row's mask used for every row",
        "gateway/engine/attention.py",
        "scores += bias[:, :, None] if bias.ndim == 4 else bias",
        "scores += bias[:1, :, None] if bias.ndim == 4 else bias",
        ("tests/gateway/test_attention.py",),
    ),
    Mutant(
        "deepstack rows not passed to the chunk",
        "gateway/engine/runner.py",
        "if inputs.deepstack is None or visual is None or not visual[begin:end].any():",
        "if True:",
        (f"{FAMILIES}::test_image_prompt_equals_the_library_one_shot_forward[qwen3_vl]",),
    ),
    Mutant(
        "bfloat16 read back by value, not by bits",
        "kvcache/quant.py",
        "return mx.array(tensors[name + BF16_SUFFIX]).view(mx.bfloat16)",
        "return mx.array(tensors[name + BF16_SUFFIX]).astype(mx.bfloat16)",
        (f"{FAMILIES}::test_bfloat16_blocks_go_to_ssd_and_come_back_equal_after_a_restart[llama]",),
    ),
    Mutant(
        "running sequences' KV outside the budget",
        "kvcache/pool.py",
        "        self.reserved_bytes += nbytes\n",
        "        pass\n",
        (
            "tests/kvcache/test_pool.py",
            "tests/gateway/test_memory_budget.py::test_admission_waits_for_memory_instead_of_overcommitting",
        ),
    ),
    Mutant(
        "a flooding tenant takes the batch's last place",
        "gateway/engine/scheduler.py",
        "return self._num_running(tenant) == 0",
        "return True",
        (
            "tests/gateway/test_batch.py::test_the_last_place_in_the_batch_is_kept_for_another_tenant",
            "tests/gateway/test_scheduler.py::test_the_last_place_is_kept_for_a_tenant_with_nothing_running",
        ),
    ),
    Mutant(
        "a row samples another row's logits",
        "gateway/engine/decoding.py",
        "sequence.logits = logits[fed]",
        "sequence.logits = logits[0 : width + 1]",
        ("tests/gateway/test_batch.py::test_the_server_runs_requests_together_and_each_gets_its_lone_answer",),
    ),
    Mutant(
        "a biased or penalised row drawn by the rows' shared argmax",
        "gateway/engine/sampling.py",
        "untouched = not self._adjusts(generated) and self.matcher is None",
        "untouched = self.matcher is None",
        (f"{BATCH}::test_greedy_rows_draw_with_one_argmax_and_keep_their_lone_tokens",),
    ),
    Mutant(
        "a greedy row takes another row's argmax",
        "gateway/engine/decoding.py",
        "return {index: tokens[index] for index in plain}",
        "return {index: tokens[0] for index in plain}",
        (f"{BATCH}::test_greedy_rows_draw_with_one_argmax_and_keep_their_lone_tokens",),
    ),
    Mutant(
        "the decode kernel ignores a row's left padding",
        "gateway/engine/decode_attention.c",
        "scores[g * num_keys + t] = visible[t] ? sum8(acc) * scale_log2e : -INFINITY;",
        "scores[g * num_keys + t] = sum8(acc) * scale_log2e;",
        (DECODE_KERNEL, f"{BATCH}::test_greedy_rows_draw_with_one_argmax_and_keep_their_lone_tokens"),
    ),
    Mutant(
        "the decode kernel reads the first KV head for every query head",
        "gateway/engine/decode_attention.c",
        "const float *k = keys + row * key_row_stride + kv * key_head_stride;",
        "const float *k = keys + row * key_row_stride;",
        (DECODE_KERNEL,),
    ),
    Mutant(
        "a prompt chunk's causal softmax lets each query see the next key",
        "gateway/engine/decode_attention.c",
        "long end = first_visible + i % block_queries;",
        "long end = first_visible + i % block_queries + (i % block_queries + 1 < block_queries);",
        (DECODE_KERNEL,),
    ),
    Mutant(
        "a prompt chunk's block of queries is attended as if it started the chunk",
        "gateway/engine/attention.py",
        "visible = num_keys - num_queries + start + 1",
        "visible = num_keys - num_queries + 1",
        (DECODE_KERNEL,),
    ),
    Mutant(
        "a Mamba-2 scan's exponentials on numpy are taken in base 2",
        "gateway/engine/recurrent.py",
        "return mx.array(np.exp(values)).astype(x.dtype)",
        "return mx.array(np.exp2(values)).astype(x.dtype)",
        (
            "tests/gateway/test_recurrent.py::test_a_mamba_model_s_scan_exponentials_on_numpy_give_the_library_s_outputs",
        ),
    ),
    Mutant(
        "a one-row product reads the weight the wrong way round",
        "gateway/engine/vector_products.c",
        "    if (trans_b == NO_TRANS)\n        next_sgemv(ROW_MAJOR, TRANS, k, n",
        "    if (trans_b != NO_TRANS)\n        next_sgemv(ROW_MAJOR, TRANS, k, n",
        (VECTOR_PRODUCTS,),
    ),
    Mutant(
        "every one of a few rows' products reads the first row",
        "gateway/engine/vector_products.c",
        "const float *a_row = trans_a == NO_TRANS ? a + (size_t)r * lda : a + r;",
        "const float *a_row = a;",
        (VECTOR_PRODUCTS,),
    ),
    Mutant(
        "one-column products go to sgemv with the rows' stride of the wrong operand",
        "gateway/engine/vector_products.c",
        "int stride_b = trans_b == NO_TRANS ? ldb : 1;",
        "int stride_b = trans_b == NO_TRANS ? 1 : ldb;",
        (VECTOR_PRODUCTS,),
    ),
    Mutant(
        "OpenBLAS's own kernels kept when the CPU's flags allow wider ones",
        "gateway/blas.py",
        "for wider, core, needs in LEVEL_CORES if wider > level and needs <= features",
        "for wider, core, needs in LEVEL_CORES if wider < level and needs <= features",
        ("tests/gateway/test_blas.py",),
    ),
    Mutant(
        "prompts under way share the step's budget by age alone, a flooding tenant's before another's",
        "gateway/engine/scheduler.py",
        "prompts.sort(key=lambda s: (load[s.tenant], s.order))",
        "prompts.sort(key=lambda s: s.order)",
        ("tests/gateway/test_scheduler.py",),
    ),
    Mutant(
        "a packed row's logits taken at another row's position",
        "gateway/engine/runner.py",
        "keep += [cursor + row * tokens + tokens - k for row in range(rows) for k in range(part.keep, 0, -1)]",
        "keep += [cursor + tokens - k for row in range(rows) for k in range(part.keep, 0, -1)]",
        ("tests/gateway/test_batch.py::test_mixed_steps_and_batched_admissions_give_each_sequence_its_lone_tokens",),
    ),
    Mutant(
        "a packed call attends with another segment's mask",
        "gateway/engine/mixed.py",
        'own["mask"] = mask.masks[index] if isinstance(mask, SegmentMasks)',
        'own["mask"] = mask.masks[0] if isinstance(mask, SegmentMasks)',
        ("tests/gateway/test_batch.py::test_mixed_steps_and_batched_admissions_give_each_sequence_its_lone_tokens",),
    ),
    Mutant(
        "a preempted sequence's blocks lost",
        "gateway/engine/steps.py",
        "        self.store(prefill, sequence, to_ssd=True)\n",
        "        self.runner.finish(prefill, [])\n",
        ("tests/gateway/test_preemption.py::test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_drawn",),
    ),
    Mutant(
        "a preempted sequence resumes without the tokens it generated",
        "gateway/engine/steps.py",
        "prompt = dataclasses.replace(prompt, token_ids=prompt.token_ids + tuple(sequence.generated))",
        "prompt = prompt",
        ("tests/gateway/test_preemption.py::test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_drawn",),
    ),
    Mutant(
        "a sequence grows past the memory budget",
        "gateway/engine/scheduler.py",
        "        while not self.memory.reserve(extra * self.limits.kv_bytes_per_token):\n",
        "        while False:\n",
        (
            "tests/gateway/test_scheduler.py",
            "tests/gateway/test_preemption.py::test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_drawn",
        ),
    ),
    Mutant(
        "a request waiting for memory dropped when a preempted one resumes",
        "gateway/engine/scheduler.py",
        "            if sequence is self.memory_wait:\n",
        "            if True:\n",
        ("tests/gateway/test_scheduler.py",),
    ),
    Mutant(
        "a prompt chunk past the step's token budget",
        "gateway/engine/scheduler.py",
        "return min(pending, max(block, budget // block * block))",
        "return pending",
        ("tests/gateway/test_scheduler.py",),
    ),
    Mutant(
        "rejected draft tokens left in a row's KV",
        "gateway/engine/decoding.py",
        "            self.batch.trim(rejected)\n",
        "            pass\n",
        (f"{VERIFY}::test_drafts_right_wrong_or_half_right_leave_every_answer_as_plain_decoding[llama]",),
    ),
    Mutant(
        "drafts verified against the wrong position's logits",
        "gateway/engine/decoding.py",
        "Draw(sequence.sampler, sequence.logits[position], sequence.generated + sequence.drafts[:position])",
        "Draw(sequence.sampler, sequence.logits[0], sequence.generated + sequence.drafts[:position])",
        (f"{VERIFY}::test_drafts_right_wrong_or_half_right_leave_every_answer_as_plain_decoding[llama]",),
    ),
    Mutant(
        "every draft kept, whatever the model draws",
        "gateway/engine/decoding.py",
        "and tokens[accepted][0] == sequence.drafts[accepted]:",
        "and True:",
        (f"{VERIFY}::test_sampled_rows_with_drafts_draw_from_the_model_distribution_and_seeded_rows_draw_the_same",),
    ),
    Mutant(
        "the MTP heads keep their draft steps' cache entries",
        "gateway/engine/mtp.py",
        "                layer.trim(self.num_speculative)",
        "                pass",
        ("tests/gateway/test_mtp.py::test_heads_fed_step_by_step_draft_what_heads_fed_at_once_draft[qwen3_next]",),
    ),
    Mutant(
        "the MTP heads fed the hidden state of the position after",
        "gateway/engine/decoding.py",
        "heads.follow(hidden[: len(tokens)],",
        "heads.follow(hidden[1 : len(tokens) + 1],",
        (
            "tests/gateway/test_mtp.py::test_a_lone_hybrid_row_drafts_with_the_heads_and_answers_as_plain_decoding[qwen3_5]",
        ),
    ),
    Mutant(
        "an isolated end user's prefix cached under the tenant's salt (another end user reuses it)",
        "gateway/engine/steps.py",
        "prompt, job.cache_salt or job.salt, job.owner, job.pins, job.tenant",
        "prompt, job.salt, job.owner, job.pins, job.tenant",
        ("tests/gateway/test_end_users_apart.py::test_end_users_of_an_isolating_tenant_share_no_prefix_and_no_answer",),
    ),
    Mutant(
        "an isolated end user's answers keyed without the end user",
        "gateway/serving/responses.py",
        '            output["end_user"] = apart  # the tenant keeps its end users apart',
        "            pass",
        ("tests/gateway/test_end_users_apart.py::test_end_users_of_an_isolating_tenant_share_no_prefix_and_no_answer",),
    ),
    Mutant(
        "a tenant's KV blocks sealed under another's key (a shared one: its purge leaves them readable)",
        "gateway/engine/worker.py",
        "owner, pins, references, cache_salt, tenant)",
        'owner, pins, references, cache_salt, "default")',
        (f"{AT_REST}::test_a_tenant_purge_shreds_its_key_at_once_and_reclaims_the_files_later",),
    ),
    Mutant(
        "a tenant purge that leaves the tenant's data key in the key store",
        "gateway/operations/admin.py",
        "shredded = (_shreds(selector, layers) if shred is None else shred) and _shred(services, selector.tenant)",
        "shredded = _shreds(selector, layers) if shred is None else shred",
        (f"{AT_REST}::test_a_tenant_purge_shreds_its_key_at_once_and_reclaims_the_files_later",),
    ),
    Mutant(
        "the public salt applied past the declared text (a tenant's own blocks shared)",
        "kvcache/chain.py",
        "public = hash_blocks(token_ids[: self.num_public * block_size], block_size, self.public)",
        "public = hash_blocks(token_ids, block_size, self.public)",
        (
            "tests/kvcache/test_sealing.py::test_public_blocks_are_shared_and_what_follows_them_stays_the_tenants",
            f"{AT_REST}::test_a_public_prefix_is_shared_across_tenants_and_nothing_after_it_is",
        ),
    ),
    Mutant(
        "an emptied key store taken for a shred (a Redis restart gives every tenant a new key)",
        "kvcache/sealing.py",
        "return check != seen_check and (check is None or _opens(self.wrapper, check))",
        "return False",
        (
            "tests/kvcache/test_sealing.py::test_a_store_emptied_under_a_running_keyring_is_new_again_but_for_the_keys_it_holds",
        ),
    ),
    Mutant(
        "a shredded key written back (the check record not compared)",
        "kvcache/sealing.py",
        "return check != seen_check and (check is None or _opens(self.wrapper, check))",
        "return check is None or _opens(self.wrapper, check)",
        (
            "tests/kvcache/test_sealing.py::test_a_shredded_key_is_not_written_back_while_the_store_keeps_its_check_record",
        ),
    ),
    Mutant(
        "the pool evicts reused blocks before one-off ones (a scan pushes the hot prompt out)",
        "kvcache/pool.py",
        "victim = self.probation.oldest() or self.protected.oldest()",
        "victim = self.protected.oldest() or self.probation.oldest()",
        (
            "tests/evals/test_cache_sim.py::test_a_scan_evicts_the_hot_prompt_from_one_lru_queue_but_not_from_the_segmented_pool",
        ),
    ),
    Mutant(
        "the SSD tier evicts the most recently read segment first",
        "kvcache/ssd.py",
        "for name, segment in index.least_recently_used():",
        "for name, segment in reversed(index.least_recently_used()):",
        (
            "tests/kvcache/test_ssd.py::test_capacity_evicts_least_recently_used_files_and_retention_expires_them",
            "tests/evals/test_cache_sim.py::test_the_ssd_model_drops_whole_segments_by_their_last_read_as_the_tier_does",
        ),
    ),
    Mutant(
        "the model pool unloads a model with requests running",
        "gateway/engine/model_pool.py",
        'return self.state == "loaded" and idle and not self.spec.pinned',
        'return self.state == "loaded" and not self.spec.pinned',
        (
            "tests/gateway/test_model_pool.py::test_a_pinned_model_is_never_unloaded_and_a_busy_one_only_after_its_requests_end",
            "tests/gateway/test_model_pool.py::test_a_waiting_request_gets_its_turn_when_a_running_request_ends",
            "tests/gateway/test_model_pool.py::test_idle_models_expire_after_their_ttl_but_not_pinned_or_running_ones",
            "tests/gateway/test_model_pool.py::test_a_model_whose_engine_still_runs_jobs_is_not_unloaded_until_they_end",
        ),
    ),
    Mutant(
        "the model pool unloads a model whose engine still runs a stream (only requests starting count)",
        "gateway/engine/model_pool.py",
        "idle = not self.running and not (self.model is not None and self.model.busy)",
        "idle = not self.running",
        ("tests/gateway/test_model_pool.py::test_a_model_whose_engine_still_runs_jobs_is_not_unloaded_until_they_end",),
    ),
    Mutant(
        "the response layers' scope without the serving model (one model answered from another's entries)",
        "gateway/serving/responses.py",
        "scope = Scope(caller.tenant, model_fingerprint, **_versions(request.metadata, headers))",
        'scope = Scope(caller.tenant, "", **_versions(request.metadata, headers))',
        ("tests/gateway/test_several_models.py::test_a_model_never_gets_another_models_answer_or_kv_blocks",),
    ),
    Mutant(
        "engine caches keyed without the model (one model reads another's KV blocks from the SSD tier)",
        "gateway/engine/__init__.py",
        "self.runner = ModelRunner(model_path, config.caches, fingerprint)",
        'self.runner = ModelRunner(model_path, config.caches, "one-for-all")',
        (
            "tests/gateway/test_model_pool_engines.py::test_a_model_never_restores_another_models_blocks_even_with_the_same_tokens",
        ),
    ),
    Mutant(
        "a prompt chunk's queries split across the cores (and in blocks) each take the mask's first lines",
        "gateway/engine/attention.py",
        "own = None if mask is None else mask[..., start:end, :]",
        "own = None if mask is None else mask[..., : end - start, :]",
        ("tests/gateway/test_split_attention.py",),
    ),
    Mutant(
        "each block of a long prompt's queries takes the causal mask's first lines",
        "gateway/engine/attention.py",
        "part = None if causal is None else causal[start:end]",
        "part = None if causal is None else causal[: end - start]",
        ("tests/gateway/test_split_attention.py",),
    ),
    Mutant(
        "a lone row's KV heads in parts all read the first KV head's keys",
        "gateway/engine/decode_kernel.py",
        "            keys[first:, kv_first:].ctypes.data,",
        "            keys[first:].ctypes.data,",
        ("tests/gateway/test_split_attention.py",),
    ),
    Mutant(
        "a lone row takes the C kernel whatever its mask (a sliding window's or a padded row's ignored)",
        "gateway/engine/attention.py",
        "        and mask is None\n        and isinstance(keys, mx.array)",
        "        and isinstance(keys, mx.array)",
        ("tests/gateway/test_split_attention.py",),
    ),
    Mutant(
        "a split call's last part left undone (the engine's thread runs the first part again)",
        "gateway/engine/threads.py",
        "        work(bounds[-2], bounds[-1])",
        "        work(bounds[0], bounds[1])",
        ("tests/gateway/test_split_attention.py",),
    ),
    Mutant(
        "every part of the decode rows' kernel writes its results over the first rows and heads",
        "gateway/engine/decode_kernel.py",
        "            out[first:, kv_first * group :].ctypes.data,",
        "            out.ctypes.data,",
        ("tests/gateway/test_split_attention.py",),
    ),
    Mutant(
        "a step beside decode rows ignores its latency budget (the configured chunk length always)",
        "gateway/engine/scheduler.py",
        "return self.costs.prompt_tokens(decode_tokens) if self.costs is not None else self.limits.step_tokens",
        "return self.limits.step_tokens",
        ("tests/gateway/test_scheduler.py::test_with_decode_rows_a_step_carries_what_their_latency_budget_leaves",),
    ),
    Mutant(
        "the step budget forgets what the decode rows cost",
        "gateway/engine/step_costs.py",
        "tokens = int((self.budget_ms - fixed - per_row * decode_tokens) / per_token)",
        "tokens = int((self.budget_ms - fixed) / per_token)",
        ("tests/gateway/test_step_costs.py",),
    ),
    Mutant(
        "the worker times its steps with the decode and prompt tokens swapped",
        "gateway/engine/worker.py",
        "self.costs.record(decode_tokens, prompt_tokens, (time.perf_counter() - start) * 1000)",
        "self.costs.record(prompt_tokens, decode_tokens, (time.perf_counter() - start) * 1000)",
        (f"{BATCH}::test_the_worker_times_each_step_with_its_shape_for_the_step_budget",),
    ),
    Mutant(
        "SQLite writes queued behind a locked file commit one by one",
        "semantic/store.py",
        "group, self.queued = self.queued, []",
        "group, self.queued = [item], [queued for queued in self.queued if queued is not item]",
        ("tests/semantic/test_sqlite_writes.py",),
    ),
    Mutant(
        "SQLite lookups (exact and semantic) read through the writing connection (behind a write waiting on the file)",
        "semantic/store.py",
        "        with self.read_lock:\n            return self.reader.execute(sql, args).fetchall()",
        "        with self.lock:\n            return self.db.execute(sql, args).fetchall()",
        (
            "tests/semantic/test_sqlite_writes.py::test_a_lookup_does_not_wait_for_a_write_waiting_on_the_file",
            "tests/semantic/test_sqlite_writes.py::test_a_semantic_lookup_does_not_wait_for_an_insert_waiting_on_the_file",
        ),
    ),
    Mutant(
        "the engine's idle thread keeps its last worker (an unloaded model's memory is never freed)",
        "gateway/engine/threads.py",
        "            del worker\n            with self.lock:",
        "            with self.lock:",
        (
            "tests/gateway/test_model_pool_engines.py::test_two_families_take_turns_under_a_limit_for_one_and_a_reloaded_model_restores_from_ssd",
        ),
    ),
    Mutant(
        "the semantic false-hit bound ignored (every candidate past the fact guards served)",
        "semantic/calibration.py",
        "return self.cut is not None and (self.calibrated(group, probability), probability) >= self.cut",
        "return True",
        (
            "tests/semantic/test_calibration.py::test_the_share_of_lookalikes_served_stays_under_the_bound_on_fresh_draws",
            "tests/semantic/test_calibration.py::test_too_few_lookalikes_is_uncalibrated_and_serves_nothing",
        ),
    ),
    Mutant(
        "one tenant's review verdicts calibrating another's bound",
        "semantic/calibration.py",
        '"SELECT grp, probability, right FROM evidence WHERE tenant = ?", (tenant,)',
        '"SELECT grp, probability, right FROM evidence WHERE ? = ?", (tenant, tenant)',
        ("tests/semantic/test_calibration.py::test_review_verdicts_move_their_own_tenant_and_their_own_entry",),
    ),
    Mutant(
        "a tenant purge keeps the tenant's calibration evidence",
        "semantic/cache.py",
        "self.calibrator.forget(ids, selector.tenant if selector.whole_tenant else None)",
        "self.calibrator.forget(ids, None)",
        ("tests/semantic/test_calibration.py::test_the_layer_purges_its_calibration_with_the_tenant",),
    ),
    Mutant(
        "the model pool unloads a pinned model",
        "gateway/engine/model_pool.py",
        'return self.state == "loaded" and idle and not self.spec.pinned',
        'return self.state == "loaded" and idle',
        (
            "tests/gateway/test_model_pool.py::test_a_pinned_model_is_never_unloaded_and_a_busy_one_only_after_its_requests_end",
        ),
    ),
    Mutant(
        "a draft kept under a key without the tenant (another tenant drafts from it)",
        "semantic/exact.py",
        'return digest("draft", {"scope": scope.as_dict(), "messages": messages, "output": output})',
        'return digest("draft", {"scope": {}, "messages": messages, "output": output})',
        (
            "tests/semantic/test_exact_drafts.py",
            "tests/gateway/test_speculative_api.py::test_the_same_question_under_another_max_tokens_drafts_its_kept_answer_within_the_tenant",
        ),
    ),
    Mutant(
        "the grammar's mask left off the logits",
        "gateway/engine/sampling.py",
        "logits = self.matcher.mask(logits, closing=self._closing(len(generated)))",
        "logits = logits",
        ("tests/gateway/test_tools.py::test_a_forced_call_on_a_model_without_a_tools_template",),
    ),
    Mutant(
        "a grammar's output never closed before the budget ends",
        "gateway/engine/sampling.py",
        "self.closing = left <= self.tokens_to_close + CLOSING_CHECK_TOKENS",
        "self.closing = False",
        (
            "tests/gateway/test_tools.py::test_walks_that_never_close_a_string_still_end_valid_within_the_budget",
            f"{BREADTH}::test_open_ended_schemas_still_close_within_max_tokens",
        ),
    ),
    Mutant(
        "a session purge deletes what other sessions still own",
        "semantic/owners.py",
        "return [key for key in keys if not self.owned(key)]",
        "return keys",
        (
            "tests/semantic/test_store_contract.py::test_a_session_purge_keeps_what_another_session_of_the_tenant_still_owns",
            "tests/gateway/test_retention.py::test_purging_a_session_misses_its_answers_and_keeps_what_another_session_shares",
        ),
    ),
    Mutant(
        "a hit does not make the entry the hitting session's",
        "gateway/serving/responses.py",
        '_guarded(self.store_errors, "exact", self.cache.own, ctx.exact_key, ctx.owner)',
        "pass",
        (
            "tests/gateway/test_retention.py::test_purging_a_session_misses_its_answers_and_keeps_what_another_session_shares",
        ),
    ),
    Mutant(
        "a removed block is forgotten: every miss reads cold",
        "kvcache/prefix.py",
        "        self.ghosts.remember(block.block_hash, Ghost(how, time.monotonic() - block.stored_at, time.time()))\n",
        "        return\n",
        ("tests/gateway/test_engine_caches.py::test_every_prefix_miss_says_why",),
    ),
    Mutant(
        "a purge deletes shared KV blocks with their first owner",
        "kvcache/pool.py",
        "            block.owners -= selected\n            if block.owners:\n                continue\n",
        "            block.owners.clear()\n",
        ("tests/kvcache/test_prefix.py::test_purging_a_session_keeps_the_blocks_another_session_shares",),
    ),
    Mutant(
        "a purged block in use goes back to the free queue",
        "kvcache/pool.py",
        "if block.ref_count == 0 and block.purged:",
        "if False:",
        ("tests/kvcache/test_prefix.py::test_a_block_in_use_outlives_its_purge_until_released",),
    ),
    Mutant(
        "a purged SSD segment is not doomed: a crash revives it",
        "kvcache/ssd_index.py",
        'self.db.execute("INSERT OR IGNORE INTO doomed VALUES (?)", (name,))',
        "pass",
        ("tests/kvcache/test_ssd.py::test_a_crash_between_doom_and_unlink_still_deletes_the_purged_file",),
    ),
    Mutant(
        "reusing image features does not make the reuser an owner",
        "vision/cache.py",
        "        if owner is not None:\n            self.owners[key].add(owner)",
        "        pass",
        ("tests/vision/test_cache.py::test_purge_deletes_features_only_once_no_owner_is_left",),
    ),
    Mutant(
        "a diverged system prompt is called the latest message",
        "gateway/serving/chat.py",
        'messages[index].role in ("system", "developer")',
        "False",
        ("tests/gateway/test_diagnosis.py::test_a_system_prompt_that_changes_every_request_is_named",),
    ),
    Mutant(
        "sessions never end by their TTL",
        "gateway/tenancy/sessions.py",
        "self.last_seen[(tenant, session)] = now",
        "pass",
        ("tests/gateway/test_purge_engine.py::test_a_session_idle_past_its_ttl_ends_by_itself",),
    ),
    Mutant(
        "a stuck engine reported healthy",
        "gateway/engine/worker.py",
        "if pending and idle_s > stuck_after_s and self.warmed_up.is_set():",
        "if False:",
        ("tests/gateway/test_health.py::test_a_step_that_never_ends_is_reported_stuck_then_recovers",),
    ),
    Mutant(
        "the client's request id replaced",
        "gateway/observability/requestlog.py",
        'state["request_id"] = sent if PLAIN_ID.fullmatch(sent) else uuid.uuid4().hex',
        'state["request_id"] = uuid.uuid4().hex',
        ("tests/gateway/test_observability.py::test_every_response_carries_a_request_id",),
    ),
    Mutant(
        "prefix cache queries counted in requests, not tokens",
        "gateway/observability/metrics.py",
        ".inc(facts.num_prompt_tokens)",
        ".inc()",
        ("tests/gateway/test_observability.py::test_metrics_count_the_traffic_sent",),
    ),
    Mutant(
        "tools out of the exact key",
        "gateway/serving/responses.py",
        "output = _output_shape(request)",
        "output = {}",
        (f"{BREADTH}::test_tools_are_in_the_exact_key_and_a_replay_parses_the_call_again",),
    ),
    Mutant(
        "logprobs replayed from a stored answer",
        "gateway/serving/responses.py",
        'return "logprobs"  #',
        "return None  #",
        (f"{BREADTH}::test_logprobs_bypass_the_response_caches",),
    ),
    Mutant(
        "a tool result without its call accepted",
        "gateway/requests/schemas.py",
        "    _check_tool_results(request.messages)\n",
        "",
        (f"{BREADTH}::test_hostile_tool_and_format_requests_are_400s_naming_the_field",),
    ),
    Mutant(
        "a stored conversation continued by another tenant",
        "gateway/serving/conversations.py",
        'BY_ID = "id = ? AND tenant = ?"',
        'BY_ID = "id = ? AND ? IS NOT NULL"',
        (
            f"{BREADTH}::test_a_three_turn_responses_conversation_reuses_the_earlier_turns",
            # with encryption at rest on, the sealing's tenant-bound data also refuses another tenant's
            # turns; the row filter is the guard where it is off
            "tests/gateway/test_conversations.py::test_a_conversation_is_its_tenants_until_it_expires",
        ),
    ),
    Mutant(
        "semantic candidate from another partition served",
        "semantic/cache.py",
        "if entry.partition == partition]",
        "]",
        ("tests/semantic/test_entry_contract.py::test_an_index_entry_naming_another_partitions_entry_is_never_served",),
    ),
    Mutant(
        "replicas' semantic deletes not followed",
        "semantic/cache.py",
        "            self.index.remove(change[1])",
        "            pass",
        ("tests/semantic/test_entry_contract.py::test_replicas_on_one_redis_follow_each_others_changes",),
    ),
    Mutant(
        "KV blocks not written through to a shared tier",
        "kvcache/prefix.py",
        "        if self.cache.write_through and ssd is not None:",
        "        if False:",
        (
            "tests/kvcache/test_prefix.py::test_write_through_leaves_a_conversation_on_a_shared_tier_for_another_replica",
        ),
    ),
    Mutant(
        "other writers' segments never taken in",
        "kvcache/prefix.py",
        "and ssd.refresh():",
        "and False:",
        (
            "tests/kvcache/test_prefix.py::test_write_through_leaves_a_conversation_on_a_shared_tier_for_another_replica",
        ),
    ),
    Mutant(
        "another writer's deletions ignored",
        "kvcache/ssd.py",
        "                        self.index.forget(line[1:])",
        "                        pass",
        ("tests/kvcache/test_ssd.py::test_a_segment_deleted_by_one_writer_is_forgotten_by_the_other",),
    ),
    Mutant(
        "purges announced by other replicas ignored",
        "gateway/operations/purge_feed.py",
        'if purge["origin"] == self.origin:',
        "if True:",
        ("tests/gateway/test_purge_feed.py::test_an_announced_purge_runs_on_every_other_replica_once",),
    ),
    Mutant(
        "removes during a semantic index rebuild lost",
        "semantic/index.py",
        "                    index.remove_ids(np.asarray([change[1]], dtype=np.int64))",
        "                    pass",
        ("tests/semantic/test_index.py::test_adds_and_removes_during_a_rebuild_are_kept",),
    ),
    Mutant(
        "the verifier overrules a guard that names a fact",
        "semantic/verifier.py",
        'return "below_threshold" not in objections and objections <= OVERRULABLE',
        'return "below_threshold" not in objections',
        (VERIFIER + "::test_pairs_below_the_threshold_or_refused_for_a_fact_are_never_scored",),
    ),
    Mutant(
        "the verifier overrules word-order guards at its lower bar",
        "semantic/verifier.py",
        "return self.overrule if objected else self.accept",
        "return self.accept",
        (VERIFIER + "::test_word_order_objections_are_overruled_only_at_the_higher_bar",),
    ),
    Mutant(
        "the semantic cache never asks its verifier",
        "semantic/cache.py",
        "return verdict if self.verifier is None else self.verifier.review(query, entry.prompt, verdict)",
        "return verdict",
        (VERIFIER + "::test_the_cache_asks_the_verifier_about_candidates_and_reports_its_verdict",),
    ),
    Mutant(
        "another writer's temp file deleted mid-write",
        "kvcache/ssd.py",
        "                if self._stale_temp(path):",
        "                if True:",
        ("tests/kvcache/test_ssd.py::test_a_restarted_writer_keeps_others_temp_files_and_journals_afresh",),
    ),
    Mutant(
        "exact lookups back on the event loop",
        "gateway/serving/responses.py",
        "result = await self.lane.run(self._looked_up, ctx, time.time())",
        "result = self._looked_up(ctx, time.time())",
        ("tests/gateway/test_slow_stores.py::test_a_slow_redis_stalls_neither_streams_nor_health",),
    ),
    Mutant(
        "exact stores back on the event loop",
        "gateway/serving/responses.py",
        "        await self.lane.run(self._stored, ctx, response, draft)",
        "        self._stored(ctx, response, draft)",
        ("tests/gateway/test_slow_stores.py::test_slow_sqlite_writes_stall_neither_streams_nor_health",),
    ),
    Mutant(
        "a grammar admitted without its probe",
        "gateway/engine/constraint.py",
        "Matcher(start.deep_copy(), self).probe()",
        "pass",
        (f"{ROUND_TWO}::test_schemas_past_the_grammar_engines_limits_are_a_400",),
    ),
    Mutant(
        "grammars compiled on the engine thread again",
        "gateway/serving/chat.py",
        "return self.engine.compile_grammar(grammar)",
        "return grammar",
        (
            f"{ROUND_TWO}::test_forced_tool_calls_reach_the_engine_compiled",
            f"{ROUND_TWO}::test_compiling_big_grammars_never_stalls_a_running_sequence",
        ),
    ),
    Mutant(
        "a failed stream ends without [DONE]",
        "gateway/formats/openai_format.py",
        'return [_sse(error.body()), b"data: [DONE]\\n\\n"]',
        "return [_sse(error.body())]",
        (f"{ROUND_TWO}::test_a_stream_that_fails_after_its_first_byte_ends_with_an_error_and_done",),
    ),
    Mutant(
        "a stored turn keeps the whole conversation again",
        "gateway/http/app.py",
        "added = conversation[len(history or []) :]",
        "added = conversation",
        (f"{ROUND_TWO}::test_a_chain_with_an_image_per_turn_is_stored_about_once",),
    ),
    Mutant(
        "no storage quota",
        "gateway/http/app.py",
        "if used + num_bytes > quota:",
        "if False:",
        (f"{ROUND_TWO}::test_a_tenant_past_its_storage_quota_gets_a_clear_413",),
    ),
    Mutant(
        "echoed values not cut",
        "gateway/requests/errors.py",
        'return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."',
        "return text",
        (f"{ROUND_TWO}::test_errors_quote_at_most_a_cut_of_what_was_sent",),
    ),
    Mutant(
        "$defs of a tool left where the call schema moved them from",
        "gateway/engine/tools.py",
        "if not _has_refs(parameters):",
        "if True:",
        (f"{ROUND_TWO}::test_defs_in_a_named_tools_parameters_are_resolved",),
    ),
    Mutant(
        "unscoped personal questions exact-cached for the tenant",
        "gateway/serving/responses.py",
        'exact_bypass="personal_unscoped" if category == PERSONAL_DATA and end_user is None else None,',
        "exact_bypass=None,",
        (f"{ROUND_TWO}::test_personal_questions_without_an_end_user_bypass_the_exact_layer_too",),
    ),
    Mutant(
        "requests queue while the engine is stuck",
        "gateway/serving/chat.py",
        "        refuse_unless_serving(self.engine, self.settings.stuck_after_s)\n        references",
        "        references",
        (f"{ROUND_TWO}::test_new_requests_fail_fast_while_the_engine_is_stuck",),
    ),
    Mutant(
        "logprob buffers unbounded",
        "gateway/requests/schemas.py",
        "if entries > limits.max_logprob_entries:",
        "if False:",
        (f"{LIVE_HARDENING}::test_logprob_buffers_are_bounded",),
    ),
    Mutant(
        "a client leaving while its choices start goes unnoticed",
        "gateway/http/app.py",
        "await asyncio.wait({task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)",
        "await asyncio.wait({task}, timeout=timeout_s)",
        (f"{LIVE_HARDENING}::test_abandoned_requests_for_several_choices_cancel_every_job",),
    ),
    Mutant(
        "no per-client connection cap",
        "gateway/http/server.py",
        "self.counted = not self.max_per_client or self.per_client[self.host] < self.max_per_client",
        "self.counted = True",
        (f"{LIVE_HARDENING}::test_slow_header_connections_cannot_lock_out_other_clients",),
    ),
    Mutant(
        "headers get the whole read timeout",
        "gateway/http/server.py",
        "self.request_started + min(self.header_timeout_s, self.read_timeout_s)",
        "self.request_started + self.read_timeout_s",
        (f"{LIVE_HARDENING}::test_slow_header_connections_cannot_lock_out_other_clients",),
    ),
    Mutant(
        "health checks refused at the connection cap",
        "gateway/http/server.py",
        'return None if scope is not None and scope.get("path") in HEALTH_PATHS else self._limit_concurrency',
        "return self._limit_concurrency",
        (f"{LIVE_HARDENING}::test_connections_over_the_limit_are_refused_but_health_checks",),
    ),
    Mutant(
        "bulk embeddings in one chunk",
        "gateway/serving/embeddings.py",
        "CHUNK_TEXTS = 8  #",
        "CHUNK_TEXTS = 100_000  #",
        (f"{LIVE_HARDENING}::test_bulk_embeddings_stall_no_other_tenant",),
    ),
    Mutant(
        "the fair lane serves one tenant's flood first",
        "gateway/serving/embeddings.py",
        "self.waiting[tenant] = queue  # to the back of the line of tenants",
        "self.waiting[tenant] = queue\n                self.waiting.move_to_end(tenant, last=False)",
        ("tests/gateway/test_units.py::test_the_fair_lane_takes_tenants_in_turn",),
    ),
    Mutant(
        "pins never expire",
        "kvcache/pool.py",
        "ended = [block_hash for block_hash, until in self.pins.items() if until <= now]",
        "ended = []",
        (
            "tests/kvcache/test_pool.py::test_a_pin_past_its_ttl_is_an_ordinary_block_again",
            "tests/gateway/test_engine_caches.py::test_a_pinned_prefix_survives_a_storm_of_other_prompts_then_expires",
        ),
    ),
    Mutant(
        "a pin spends another tenant's budget",
        "kvcache/pool.py",
        "pinned = self.pinned_bytes.get(block.tenant, 0)",
        "pinned = sum(self.pinned_bytes.values())",
        ("tests/kvcache/test_pool.py::test_each_tenant_pins_within_its_own_budget",),
    ),
    Mutant(
        "a snapshot kept by a block it does not end (restored at the wrong block)",
        "kvcache/prefix.py",
        "if snapshot is not None and snapshot[0] == end else ()",
        "if snapshot is not None and snapshot[0] >= end else ()",
        (
            f"{FAMILIES}::test_a_snapshot_stored_under_another_block_is_never_restored",
            "tests/kvcache/test_prefix.py::test_a_hybrid_prefix_is_reused_up_to_the_deepest_block_with_a_snapshot",
        ),
    ),
    Mutant(
        "a purged block's snapshot bytes stay held",
        "kvcache/pool.py",
        "        block.state = state\n        block.nbytes += nbytes\n",
        "        block.state = state\n",
        ("tests/kvcache/test_prefix.py::test_a_snapshot_joins_a_block_cached_without_one_and_counts_in_the_budget",),
    ),
    Mutant(
        "a batched row's snapshot taken from another row's state (another sequence, another tenant)",
        "gateway/engine/batch.py",
        "state = recurrent_state(self.cache, self.runner.recurrent, index if self.batched else None)",
        "state = recurrent_state(self.cache, self.runner.recurrent, 0 if self.batched else None)",
        ("tests/gateway/test_batch.py::test_a_hybrid_model_batches_rows_that_resume_from_snapshots",),
    ),
    Mutant(
        "a chunked gated-delta scan off by one position (a token does not see its own key)",
        "gateway/engine/recurrent.py",
        "    below = mx.tril(mx.ones((size, size), dtype=mx.bool_))  # j <= t",
        "    below = mx.tril(mx.ones((size, size), dtype=mx.bool_), k=-1)",
        (
            "tests/gateway/test_recurrent.py::test_chunks_equal_the_token_by_token_recurrence",
            "tests/gateway/test_recurrent.py::test_a_hybrid_model_prefills_in_chunks_with_the_library_s_outputs",
        ),
    ),
    Mutant(
        "a snapshot point inside a packed chunk stored with the state at the chunk's end",
        "gateway/engine/runner.py",
        "snapshot = (end, tuple(states[i] for i in self.recurrent))",
        "snapshot = self._snapshot(end)",
        ("tests/gateway/test_families.py::test_a_chunk_takes_its_snapshots_inside_one_model_call",),
    ),
    Mutant(
        "a piece run in a call of its own (a model that cannot pack) keeps no state for its snapshot",
        "gateway/engine/runner.py",
        "                part.states.update(zip(recurrent, recurrent_state(part.cache, recurrent)))",
        "                pass",
        ("tests/gateway/test_families.py::test_a_chunk_takes_its_snapshots_inside_one_model_call",),
    ),
    Mutant(
        "a later segment on a shared cache masked as the cache stands before the call",
        "gateway/engine/mixed.py",
        "                cache = _Ahead(cache, ahead[id(cache)])",
        "                pass",
        (
            "tests/gateway/test_batch.py::test_a_later_segment_on_the_same_cache_gets_the_mask_of_the_cache_it_will_find",
        ),
    ),
    Mutant(
        "the response layers look up and write under digests made while the key store was down",
        "gateway/serving/responses.py",
        '    return "store_unavailable" if any(unkeyed(digest) for digest in digests) else None',
        "    return None",
        (
            "tests/gateway/test_response_caches.py::test_a_key_made_while_the_key_store_is_down_is_neither_looked_up_nor_written",
        ),
    ),
    Mutant(
        "a purge by session while the key store is down answers 200 having matched nothing",
        "gateway/operations/admin.py",
        "    if any(value is not None and unkeyed(value) for value in (session, user)):",
        "    if False:",
        ("tests/gateway/test_purge_engine.py::test_a_purge_while_the_key_store_is_down_says_so_and_purges_nothing",),
    ),
    Mutant(
        "a hybrid request keeps the passing snapshots it resumed past",
        "kvcache/prefix.py",
        "        self._drop_passing_before(cached // size - 1)",
        "        self._drop_passing_before(0)",
        (
            "tests/kvcache/test_prefix.py::test_a_later_request_drops_the_passing_snapshots_it_resumed_past",
            "tests/gateway/test_families_api.py::test_a_hybrid_conversation_drops_the_snapshots_it_moved_past_and_counts_them",
        ),
    ),
    Mutant(
        "a pinned block's passing snapshot is dropped with its pin's bytes counted",
        "kvcache/prefix.py",
        "            if block.passing and block.block_hash not in self.pool.pins:",
        "            if block.passing:",
        ("tests/kvcache/test_prefix.py::test_another_branch_and_a_pinned_block_keep_their_passing_snapshots",),
    ),
    Mutant(
        "a hybrid's matched tokens recomputed for want of a state go unreported",
        "kvcache/prefix.py",
        "        without_state = min(matched, num_prompt_tokens - 1) - cached",
        "        without_state = 0",
        (
            "tests/kvcache/test_prefix.py::test_a_hybrid_prefix_is_reused_up_to_the_deepest_block_with_a_snapshot",
            "tests/gateway/test_families.py::test_a_long_shared_document_is_reused_by_a_different_question",
        ),
    ),
    Mutant(
        "no lasting snapshot where a hybrid prompt's instructions end",
        "gateway/engine/runner.py",
        "        lasting |= {self._instructions_end(prompt, salt) // block * block}",
        "",
        ("tests/gateway/test_families.py::test_a_hybrid_prompt_snapshots_where_its_instructions_end",),
    ),
    Mutant(
        "lasting snapshots spaced by a snapshot's bytes alone, not a quarter of the KV",
        "gateway/engine/runner.py",
        "max(fewest, -(-SNAPSHOT_SHARE * self.state_bytes // (self.kv_bytes_per_token * block)))",
        "max(fewest, -(-self.state_bytes // (self.kv_bytes_per_token * block)))",
        (
            "tests/gateway/test_families.py::test_a_conversation_keeps_its_lasting_snapshots_and_the_ends_it_has_not_moved_past",
        ),
    ),
    Mutant(
        "gpt-oss's clamped SwiGLU on numpy forgets the +1 on its linear half",
        "gateway/engine/activations.py",
        "        linear += 1\n",
        "",
        ("tests/gateway/test_activations.py::test_gpt_oss_s_clamped_swiglu_equals_the_library_one",),
    ),
    Mutant(
        "an expert's sorted rows multiplied by the next expert's weights",
        "gateway/engine/experts.py",
        "parts.append(_expert_product(self, rows[start:end], int(expert)))",
        "parts.append(_expert_product(self, rows[start:end], (int(expert) + 1) % self.num_experts))",
        (
            "tests/gateway/test_experts.py::test_per_expert_products_equal_the_library_s_layers",
            "tests/gateway/test_experts.py::test_a_mixture_of_experts_model_keeps_the_library_s_outputs",
        ),
    ),
    Mutant(
        "a hybrid's prefill chunks not cut at its snapshot points (no snapshot inside a chunk)",
        "gateway/engine/runner.py",
        "        cuts = sorted(point for point in admission.snapshot_points if begin < point < end)",
        "        cuts = []",
        (
            f"{FAMILIES}::test_a_snapshot_stored_under_another_block_is_never_restored",
            f"{FAMILIES}::test_a_chunk_takes_its_snapshots_inside_one_model_call",
        ),
    ),
    Mutant(
        "anthropic usage fields do not add up",
        "gateway/formats/anthropic_api.py",
        '"input_tokens": prompt - read - creation,',
        '"input_tokens": prompt - read,',
        (
            "tests/gateway/test_anthropic.py::test_a_shared_breakpoint_is_read_from_cache_and_the_fields_add_up",
            "tests/gateway/test_anthropic.py::test_create_and_stream_give_the_same_answer",
        ),
    ),
    Mutant(
        "no bounded load in the proxy",
        "deploy/haproxy/haproxy.cfg",
        "    hash-balance-factor 150\n",
        "",
        ("tests/gateway/test_cluster.py::test_a_cache_key_sticks_and_a_hot_key_spills_under_bounded_load",),
    ),
    Mutant(
        "a kept-alive request's deadline counts from the connection's first",
        "gateway/http/server.py",
        "        if self.waiting_for is None:  # no deadline runs: these are a new request's first bytes\n"
        "            self.request_started = time.monotonic()\n",
        "",
        (
            f"{LIVE_HARDENING}::test_a_kept_alive_connection_older_than_the_read_deadline_still_takes_a_request_in_pieces",
        ),
    ),
    Mutant(
        "a late system message hoisted into the system prompt",
        "gateway/engine/system_turns.py",
        "                out[-1] = _with_text(out[-1], wrapped, before=False)",
        "                out[0] = _with_text(out[0], wrapped, before=False)",
        (f"{SYSTEM_TURNS}::test_a_template_that_cannot_gets_them_folded_into_the_user_turn_beside",),
    ),
    Mutant(
        "any template taken to render late system turns in place",
        "gateway/engine/system_turns.py",
        '        self.in_place = _renders_in_order(render, ["u", _ROLE, "a", "v"]) and _renders_in_order(render, ["u", _ROLE])',
        "        self.in_place = True",
        (f"{SYSTEM_TURNS}::test_a_template_that_cannot_gets_them_folded_into_the_user_turn_beside",),
    ),
    Mutant(
        "max_tokens not lowered to the context left",
        "gateway/serving/chat.py",
        "        max_tokens = min(request.sampling.max_tokens, limit - prompt.num_tokens)",
        "        max_tokens = request.sampling.max_tokens",
        (f"{AGENT_API}::test_max_tokens_past_the_context_is_lowered_to_what_is_left_and_the_answer_ends_there",),
    ),
    Mutant(
        "a deferred tool rendered in the tool list",
        "gateway/formats/anthropic_api.py",
        '        (deferred if item.get("defer_loading") is True else offered).append(tool)',
        "        offered.append(tool)",
        (f"{AGENT_API}::test_a_deferred_tool_stays_out_of_the_prompt_until_a_reference_loads_it",),
    ),
    Mutant(
        "cache diagnostics read another tenant's message",
        "gateway/serving/cache_diagnostics.py",
        "            return self.prints.get((tenant, message_id))",
        "            return next((p for (_, m), p in self.prints.items() if m == message_id), None)",
        (f"{AGENT_API}::test_cache_diagnostics_name_each_reason",),
    ),
    Mutant(
        "a client's field name echoed into a header",
        "gateway/requests/schemas.py",
        "    if isinstance(name, str) and FIELD_NAME.fullmatch(name):",
        "    if isinstance(name, str):",
        (f"{AGENT_API}::test_an_odd_field_name_is_shown_as_a_digest_never_echoed_into_a_header",),
    ),
    Mutant(
        "every model name served by the first alias",
        "gateway/serving/models.py",
        "        return next((model for alias, model in self.aliases if fnmatch.fnmatchcase(name, alias)), name)",
        "        return next((model for alias, model in self.aliases), name)",
        (f"{AGENT_API}::test_a_one_model_server_answers_the_agents_default_names",),
    ),
    Mutant(
        "images of tool results left in the tool turn",
        "gateway/requests/schemas.py",
        "    request = replace(request, messages=_tool_images_out(request.messages))",
        "    request = replace(request, messages=request.messages)",
        (f"{AGENT_API}::test_an_image_in_a_tool_result_reaches_the_model",),
    ),
    Mutant(
        "stray bytes held until a whole character",
        "gateway/engine/text.py",
        "            self._settle_stray_bytes()",
        "            pass",
        ("tests/gateway/test_text.py",),
    ),
    Mutant(
        "the nucleus keeps the token that reaches top_p and the next one",
        "gateway/engine/sampling.py",
        "inside = int(np.count_nonzero(before < needed))",
        "inside = int(np.count_nonzero(before <= needed)) + 1",
        (f"{SAMPLING}::test_the_weights_keep_the_tokens_the_mlx_filters_keep_at_their_probabilities",),
    ),
    Mutant(
        "the nucleus looked for among the first candidates only",
        "gateway/engine/sampling.py",
        "        if inside < count or count == size:",
        "        if True:",
        (f"{SAMPLING}::test_a_flat_distribution_finds_its_nucleus_past_the_first_candidates",),
    ),
    Mutant(
        "u compared with the whole sum inside the block it falls in",
        "gateway/engine/sampling.py",
        "target - (block_ends[block - 1] if block else 0.0)",
        "target",
        (f"{SAMPLING}::test_quantiles_of_u_land_on_each_token_in_proportion_to_its_weight",),
    ),
    Mutant(
        "every token of a reply drawn with the same u",
        "gateway/engine/sampling.py",
        "uniform(self.seed + index * KEY_STRIDE)",
        "uniform(self.seed)",
        (f"{SAMPLING}::test_a_seeded_sampler_draws_the_same_tokens_and_another_seed_others",),
    ),
    Mutant(
        "a step's new tokens all visible to each other (no causal mask among drafts)",
        "gateway/engine/decode_attention.c",
        "if (t > length && t > length + line % L) {",
        "if (t > length + L) {",
        (f"{ROWS}::test_rows_attend_over_their_segments_across_blocks_joins_and_drafts",),
    ),
    Mutant(
        "no room made for a step's tokens past a row's last block",
        "gateway/engine/rows_kv.py",
        "            if missing > 0:",
        "            if False:",
        (f"{ROWS}::test_rows_attend_over_their_segments_across_blocks_joins_and_drafts",),
    ),
    Mutant(
        "a row leaving after a failed step keeps the step's half-written KV (stored as blocks)",
        "gateway/engine/rows_kv.py",
        "self.lengths.pop(index) - self.unconfirmed",
        "self.lengths.pop(index)",
        (f"{ROWS}::test_a_row_leaving_after_its_step_failed_leaves_without_that_steps_tokens",),
    ),
    Mutant(
        "a leaving row's KV cut one token short",
        "gateway/engine/rows_kv.py",
        "row, length = self.rows.pop(index), self.lengths.pop(index) - self.unconfirmed",
        "row, length = self.rows.pop(index), self.lengths.pop(index) - self.unconfirmed - 1",
        (f"{ROWS}::test_a_leaving_row_gets_exactly_its_tokens_back_as_plain_caches",),
    ),
    Mutant(
        "segments used without the runner's check that attention came through them",
        "gateway/engine/runner.py",
        "agree = rows.num_attended == len(caches[0]) and",
        "agree = True or",
        (f"{ROWS}::test_a_family_whose_attention_does_not_come_through_the_segments_keeps_the_library_cache",),
    ),
    Mutant(
        "a lone row's second KV head reads the first one's keys (tables not shifted to its heads)",
        "gateway/engine/rows_kv.py",
        "keys_at = keys_at + kv_first * tables.key_strides[layer] * 4",
        "keys_at = keys_at + 0 * tables.key_strides[layer] * 4",
        (f"{ROWS}::test_a_lone_row_over_a_long_context_splits_its_kv_heads_across_the_cores",),
    ),
    Mutant(
        "a preemption's freed memory taken back by a copy for the row it left alone",
        "gateway/engine/steps.py",
        "self.decoding.rows.index(sequence), pressed=True)",
        "self.decoding.rows.index(sequence), pressed=False)",
        (f"{SHARED_KV}::test_a_row_left_alone_by_a_preemption_keeps_reading_its_cached_blocks",),
    ),
    Mutant(
        "a cached block freed while a row still reads it (mapped without a reference)",
        "kvcache/prefix.py",
        "            self.pool.acquire(block)\n",
        "            pass\n",
        (f"{SHARED_KV}::test_rows_of_two_tenants_share_their_own_blocks_counted_once_and_freed_once",),
    ),
    Mutant(
        "a row's table points at any cached block with its positions (another tenant's chain)",
        "kvcache/prefix.py",
        "for block_hash in self.hashes[len(self.mapped) : num_tokens // self.cache.block_size]:",
        "for block_hash in sorted(self.pool.by_hash, key=lambda h: self.pool.by_hash[h].end_token)[len(self.mapped) : num_tokens // self.cache.block_size]:",
        (f"{SHARED_KV}::test_rows_of_two_tenants_share_their_own_blocks_counted_once_and_freed_once",),
    ),
    Mutant(
        "a shared byte counted twice (the row's reservation keeps what the pool holds)",
        "gateway/engine/scheduler.py",
        "        self.memory.release(num_tokens * self.limits.kv_bytes_per_token)\n",
        "        pass\n",
        (f"{SHARED_KV}::test_rows_of_two_tenants_share_their_own_blocks_counted_once_and_freed_once",),
    ),
    Mutant(
        "a lone row reading cached blocks copied back without room reserved for the copy (counted once, held twice)",
        "gateway/engine/decoding.py",
        "self.batch.shared_tokens(0) and self.unshare(self.rows[0])",
        "self.batch.shared_tokens(0)",
        (f"{SHARED_KV}::test_rows_of_two_tenants_share_their_own_blocks_counted_once_and_freed_once",),
    ),
    Mutant(
        "a row leaving the segments copies its cached blocks out too, behind those blocks",
        "gateway/engine/batch.py",
        "caches = self.segments.remove(index, num_shared)",
        "caches = self.segments.remove(index, 0)",
        (f"{SHARED_KV}::test_rows_of_two_tenants_share_their_own_blocks_counted_once_and_freed_once",),
    ),
    Mutant(
        "a leaving row's own tokens cut from its first token, not from the first it owns",
        "gateway/engine/rows_kv.py",
        "begin, end = max(first - start, 0), min(size, length - start)",
        "begin, end = max(-start, 0), min(size, length - first - start)",
        (f"{SHARED_KV}::test_a_row_reads_its_cached_blocks_in_place_and_never_writes_them",),
    ),
    Mutant(
        "a lone prompt's copy of its own drops its own tokens past the blocks it read",
        "gateway/engine/mapped_kv.py",
        "            mx.concatenate([v for _, v in layer.blocks] + [layer.own.values[:, :, :num_own]], axis=2),",
        "            mx.concatenate([v for _, v in layer.blocks] + [layer.own.values[:, :, :0]], axis=2),",
        (f"{SHARED_KV}::test_a_prompt_reads_its_cached_prefix_in_place_as_it_comes_in",),
    ),
    Mutant(
        "a prompt waiting for memory hashes its chain again at every step",
        "gateway/engine/steps.py",
        "if sequence.lookup is None or sequence.lookup[0] != sequence.num_tokens:",
        "if True:",
        (f"{SHARED_KV}::test_a_prompt_waiting_for_memory_hashes_its_chain_once",),
    ),
    Mutant(
        "a prompt's mapped prefix not counted as shared (its reservation and the pool both hold it)",
        "gateway/engine/steps.py",
        "sequence.num_shared_tokens = sequence.admission.num_mapped_tokens",
        "sequence.num_shared_tokens = 0",
        (f"{SHARED_KV}::test_a_prompt_reads_its_cached_prefix_in_place_as_it_comes_in",),
    ),
    Mutant(
        "a prompt's first reservation holds the blocks it will read in place",
        "gateway/engine/scheduler.py",
        "in_use = self.executor.num_tokens_in_use(sequence)",
        "in_use = 0",
        (f"{SHARED_KV}::test_prompts_coming_in_together_hold_only_their_own_tokens",),
    ),
    Mutant(
        "a prompt's chunk attends without its mapped blocks",
        "gateway/engine/mapped_kv.py",
        "mx.concatenate([k for k, _ in self.blocks] + [own_keys], axis=2)",
        "own_keys",
        (f"{SHARED_KV}::test_a_prompt_reads_its_cached_prefix_in_place_as_it_comes_in",),
    ),
    Mutant(
        "a mapped prefix's partly filled last block not copied into the prompt's own cache",
        "gateway/engine/runner.py",
        "        if num_tokens > start:\n            for layer, (keys, values) in zip(cache, session.gather(num_tokens, start)):",
        "        if False:\n            for layer, (keys, values) in zip(cache, session.gather(num_tokens, start)):",
        (f"{SHARED_KV}::test_a_prompt_reads_its_cached_prefix_in_place_as_it_comes_in",),
    ),
    Mutant(
        "a prompt's blocks stored from its own KV at the prompt's positions (not from its first own token)",
        "kvcache/prefix.py",
        "cut = slice(end - self.cache.block_size - first, end - first)",
        "cut = slice(end - self.cache.block_size, end)",
        ("tests/kvcache/test_prefix.py::test_a_session_maps_its_prefix_as_it_comes_in_then_on_past_what_it_stored",),
    ),
    Mutant(
        "an admitted prompt that shared less than looked up runs its chunk past its reservation",
        "gateway/engine/scheduler.py",
        "if not self._grow(sequence, num_tokens, plan, others=False):",
        "if False:",
        (
            "tests/gateway/test_scheduler.py::test_a_prompt_that_shared_less_than_looked_up_steps_back_when_memory_is_short",
        ),
    ),
    Mutant(
        "a prompt that shared more than looked up keeps those tokens reserved too",
        "gateway/engine/scheduler.py",
        "if (extra := sequence.num_shared_tokens - in_use) > 0:",
        "if (extra := sequence.num_shared_tokens - in_use) > 10**9:",
        ("tests/gateway/test_scheduler.py::test_a_prompt_reading_its_prefix_in_place_reserves_only_its_own_tokens",),
    ),
    Mutant(
        "a hybrid row that rejected drafts keeps the recurrent state after all it was fed",
        "gateway/engine/batch.py",
        "kept = [self.num_fed - n for n in rejected]",
        "kept = [self.num_fed for n in rejected]",
        (f"{VERIFY}::test_drafts_right_wrong_or_half_right_leave_every_answer_as_plain_decoding[qwen3_5]",),
    ),
    Mutant(
        "a hybrid model whose layers keep no state per token is taken to keep them",
        "gateway/engine/runner.py",
        "generations = [layer.start_speculation(2) for layer in layers]",
        "return True\n        generations = [layer.start_speculation(2) for layer in layers]",
        (f"{VERIFY}::test_a_hybrid_row_that_rejects_drafts_runs_its_kept_tokens_again_only_without_states_per_token",),
    ),
    Mutant(
        "a hybrid batch's drafted step runs through the library's batched call",
        "gateway/engine/runner.py",
        "return bool(self.recurrent) and part.admission is None and part.ids.shape[0] > 1",
        "return False and part.admission is None and part.ids.shape[0] > 1",
        (f"{VERIFY}::test_drafts_right_wrong_or_half_right_leave_every_answer_as_plain_decoding[qwen3_5]",),
    ),
    Mutant(
        "a sliding window's mask that hides keys is taken as the plain causal one",
        "gateway/engine/attention.py",
        "return window if window and np.array_equal(lines, _band_mask(num_queries, num_keys, window)) else None",
        "return num_keys if window and np.array_equal(lines, _band_mask(num_queries, num_keys, window)) else None",
        ("tests/gateway/test_attention.py",),
    ),
    Mutant(
        "Gemma 4's MLP keeps the library's GELU for prompt chunks (its geglu not swapped)",
        "gateway/engine/activations.py",
        "if \"geglu\" in module:  # Gemma 4's MLP calls its module's geglu(gate, x)",
        "if False:",
        (f"{FAMILIES}::test_every_mlp_of_every_family_prefills_on_the_numpy_activation_path[gemma4]",),
    ),
    Mutant(
        "a chunk's gated activation (SwiGLU, Gemma 4's geglu) adds the up projection instead of multiplying",
        "gateway/engine/activations.py",
        "        out = activation(gate_values)\n        out *= up",
        "        out = activation(gate_values)\n        out += up",
        ("tests/gateway/test_activations.py",),
    ),
    Mutant(
        "a prompt chunk's sinks in C: every query head takes the first head's sink",
        "gateway/engine/decode_attention.c",
        "float sink = sinks ? sinks[i / block_queries] : -INFINITY;",
        "float sink = sinks ? sinks[0] : -INFINITY;",
        ("tests/gateway/test_attention.py",),
    ),
    Mutant(
        "a prompt chunk's sink raises the maximum but is left out of the sum",
        "gateway/engine/decode_attention.c",
        "float total = sinks ? exp2_nonpositive(sink - top) : 0.0f;",
        "float total = 0.0f;",
        ("tests/gateway/test_attention.py",),
    ),
    Mutant(
        "a prompt chunk's window lets each query see one key more than the window",
        "gateway/engine/decode_attention.c",
        "long start = end > window ? end - window : 0;",
        "long start = end > window + 1 ? end - window - 1 : 0;",
        (
            "tests/gateway/test_attention.py",
            f"{FAMILIES}::test_chunked_cold_prefill_equals_the_library_one_shot_forward[gemma3]",
        ),
    ),
)


def copy_checkout(target: Path) -> None:
    """The working tree as git sees it (tracked and new files, nothing ignored)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def apply(mutant: Mutant, checkout: Path) -> None:
    path = checkout / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise ValueError(f"{mutant.name}: the text to replace occurs {text.count(mutant.old)} times in {mutant.path}")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(checkout: Path, tests: tuple[str, ...]) -> int:
    env = {**os.environ, "STRATA_TEST_MODELS": str(ROOT / ".strata" / "test-models"), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, timeout=TIMEOUT_S)
    return done.returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tests/mutants.py")
    parser.add_argument("--only", nargs="*", help="run only mutants whose name contains one of these words")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(word in m.name for word in args.only)]
    if args.list:
        print("\n".join(m.name for m in chosen))
        return 0
    with tempfile.TemporaryDirectory(prefix="strata-mutants-") as folder:
        pristine = Path(folder) / "pristine"
        copy_checkout(pristine)
        baseline = sorted({t for m in chosen for t in m.tests})
        if run_tests(pristine, tuple(baseline)) != 0:
            print("the guarding tests fail without any mutation: fix them first", file=sys.stderr)
            return 2
        rows = [_run_one(mutant, pristine, Path(folder) / f"m{i}") for i, mutant in enumerate(chosen)]
    print(f"\n{'mutant':<46} {'verdict':<9} {'seconds':>7}  tests")
    for name, verdict, seconds, tests in rows:
        print(f"{name:<46} {verdict:<9} {seconds:>7.1f}  {', '.join(t.rsplit('::', 1)[-1] for t in tests)}")
    survived = [row for row in rows if row[1] != "caught"]
    print(f"\n{len(rows) - len(survived)} of {len(rows)} mutants caught")
    return 1 if survived else 0


def _run_one(mutant: Mutant, pristine: Path, checkout: Path) -> tuple[str, str, float, tuple[str, ...]]:
    shutil.copytree(pristine, checkout)
    apply(mutant, checkout)
    started = time.monotonic()
    code = run_tests(checkout, mutant.tests)
    verdict = "caught" if code == 1 else ("SURVIVED" if code == 0 else f"error {code}")
    print(f"{mutant.name}: {verdict}", flush=True)
    shutil.rmtree(checkout, ignore_errors=True)
    return mutant.name, verdict, time.monotonic() - started, mutant.tests


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
